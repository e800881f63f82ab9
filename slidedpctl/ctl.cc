#include "slidedpctl/ctl.h"

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <utility>

#include "CLI/CLI.hpp"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "common/tcp_auth.h"
#include "common/version.h"
#include "model/checkpoint_format.h"
#include "model/defaults.h"
#include "model/manifest.h"
#include "slidedpctl/cleanup.h"
#include "slidedpctl/client.h"
#include "slidedpctl/estimate.h"
#include "slidedpctl/format.h"
#include "slidedpctl/json_convert.h"
#include "slidedpctl/machine.h"
#include "slidedpctl/plan.h"
#include "slidedpctl/render.h"
#include "slidedpctl/watch.h"

namespace slidedp::ctl {
namespace {

constexpr char kFooter[] = R"(Environment:
  SLIDEDP_SOCKET      hostd's socket when --socket is not given (default /run/slidedp/hostd.sock)
  SLIDEDP_TOKEN_FILE  with --tcp: hostd's service token file when --token-file is not given

Exit codes:
  0  success
  1  internal error in slidedpctl
  2  usage error (unknown subcommand or flag, bad value)
  3  hostd unreachable (no socket, connection refused, or no answer within --timeout-ms)
  4  hostd rejected the request (e.g. version skew at handshake, unknown job); cleanup: the
     instance named is owned by a live hostd
  5  estimate: something does not fit this machine; doctor: a check FAILed
  6  export / checkpoint: not finished within --export-timeout-s / --wait-s; it goes on in hostd)";

struct GlobalOptions {
  std::string socket_path;
  std::string tcp;
  std::string token_file;
  int64_t timeout_ms = kDefaultTimeoutMs;
  bool json = false;
};

// What one command needs: where hostd is and where to print.
struct Context {
  GlobalOptions options;
  Endpoint endpoint;
  std::ostream& out;
  std::ostream& err;
};

struct Session {
  ControlClient client;
  v1::HandshakeResponse hello;
};

struct Failure {
  int exit_code;
  std::string message;  // one line, without the "slidedpctl: " prefix
  std::string hint;     // optional second line
};

Failure DescribeRpcFailure(const Context& ctx, absl::string_view rpc, const absl::Status& status) {
  if (IsUnreachable(status)) {
    std::string detail(status.message());
    if (std::optional<int64_t> deadline_ms = ClientDeadlineMs(status)) {
      detail = absl::StrCat("no answer to ", rpc, " within ", *deadline_ms, " ms (",
                            status.message(), ")");
    }
    const char* where =
        ctx.endpoint.socket_path.empty() ? "(check --tcp)" : "(set --socket or SLIDEDP_SOCKET)";
    return {kExitUnreachable,
            absl::StrCat("cannot reach hostd at ", ctx.endpoint.target, ": ", detail,
                         "; is hostd running? ", where),
            ""};
  }
  Failure failure{kExitRejected,
                  absl::StrCat("hostd rejected ", rpc, ": ",
                               absl::StatusCodeToString(status.code()), ": ", status.message()),
                  ""};
  if (rpc == "Handshake" && status.code() == absl::StatusCode::kFailedPrecondition) {
    failure.hint = absl::StrCat("version skew: this slidedpctl is ", kVersion, " (protocol ",
                                kProtocolVersion, ", shm abi ", kShmAbiVersion,
                                "); use the slidedpctl that ships with the running hostd");
  }
  return failure;
}

// A long operation that hostd accepted (the handshake answered) and did not finish within the
// deadline the user gave it: hostd goes on with it (a client's deadline cancels neither an
// export nor a checkpoint), so this is neither "unreachable" nor "rejected".
std::optional<Failure> DescribeTimeout(const absl::Status& status, absl::string_view what,
                                       absl::string_view flag, absl::string_view follow_up) {
  const std::optional<int64_t> deadline_ms = ClientDeadlineMs(status);
  if (!deadline_ms) return std::nullopt;
  const std::string deadline = *deadline_ms % 1000 == 0 ? absl::StrCat(*deadline_ms / 1000, " s")
                                                        : absl::StrCat(*deadline_ms, " ms");
  return Failure{kExitTimedOut,
                 absl::StrCat(what, " did not finish within ", deadline, " (", flag,
                              "); slidedpctl stopped waiting, but it goes on in hostd"),
                 std::string(follow_up)};
}

int Report(const Context& ctx, const Failure& failure) {
  ctx.err << "slidedpctl: " << failure.message << '\n';
  if (!failure.hint.empty()) ctx.err << "slidedpctl: " << failure.hint << '\n';
  return failure.exit_code;
}

// Connects and handshakes; every command starts here. Failures are Handshake's (a missing
// socket is UNAVAILABLE like a refused connection).
absl::StatusOr<Session> Open(const Context& ctx) {
  absl::StatusOr<ControlClient> client =
      ControlClient::Connect(ctx.endpoint, ctx.options.timeout_ms);
  if (!client.ok()) return client.status();
  absl::StatusOr<v1::HandshakeResponse> hello = client->Handshake();
  if (!hello.ok()) return hello.status();
  const uint32_t daemon_protocol = hello->daemon().protocol_version();
  if (daemon_protocol != 0 && daemon_protocol != kProtocolVersion) {
    // hostd accepted us, so it considers the versions compatible; still worth knowing.
    ctx.err << "slidedpctl: warning: hostd speaks protocol " << daemon_protocol
            << ", slidedpctl speaks " << kProtocolVersion << '\n';
  }
  return Session{*std::move(client), *std::move(hello)};
}

// The common shape of a query command: open, call `rpc`, print the response.
template <typename Fetch, typename Print>
int Query(const Context& ctx, absl::string_view rpc, Fetch fetch, Print print) {
  absl::StatusOr<Session> session = Open(ctx);
  if (!session.ok()) return Report(ctx, DescribeRpcFailure(ctx, "Handshake", session.status()));
  auto response = fetch(session->client);
  if (!response.ok()) return Report(ctx, DescribeRpcFailure(ctx, rpc, response.status()));
  print(*response);
  return kExitOk;
}

int RunVersion(const Context& ctx) {
  const v1::BuildInfo client = ClientBuildInfo();
  absl::StatusOr<Session> session = Open(ctx);
  const v1::BuildInfo* daemon = session.ok() ? &session->hello.daemon() : nullptr;
  Failure failure{kExitOk, "", ""};
  if (!session.ok()) failure = DescribeRpcFailure(ctx, "Handshake", session.status());
  if (ctx.options.json) {
    PrintJson(VersionToJson(client, daemon, failure.message), ctx.out);
  } else {
    VersionTable(client, daemon).Print(ctx.out);
  }
  return failure.exit_code == kExitOk ? kExitOk : Report(ctx, failure);
}

int RunStatus(const Context& ctx) {
  return Query(
      ctx, "GetStatus", [](ControlClient& c) { return c.GetStatus(); },
      [&ctx](const v1::GetStatusResponse& r) {
        if (ctx.options.json) {
          PrintJson(StatusToJson(r), ctx.out);
        } else {
          PrintStatus(r, ctx.out);
        }
      });
}

int RunLayers(const Context& ctx, const std::string& job_id, bool checksums) {
  return Query(
      ctx, "ListLayers",
      [&job_id, checksums](ControlClient& c) { return c.ListLayers(job_id, checksums); },
      [&ctx](const v1::ListLayersResponse& r) {
        if (ctx.options.json) {
          PrintJson(LayersToJson(r.layers()), ctx.out);
        } else {
          LayersTable(r.layers()).Print(ctx.out);
        }
      });
}

int RunRanks(const Context& ctx, const std::string& job_id) {
  return Query(
      ctx, "ListRanks", [&job_id](ControlClient& c) { return c.ListRanks(job_id); },
      [&ctx](const v1::ListRanksResponse& r) {
        if (ctx.options.json) {
          PrintJson(ProtoToJsonArray(AttachedRanks(r.ranks())), ctx.out);
        } else {
          PrintRanks(r.ranks(), ctx.out);
        }
      });
}

int RunStats(const Context& ctx, const std::string& job_id) {
  return Query(
      ctx, "GetStats", [&job_id](ControlClient& c) { return c.GetStats(job_id); },
      [&ctx](const v1::GetStatsResponse& r) {
        if (ctx.options.json) {
          PrintJson(ProtoToJson(r), ctx.out);
        } else {
          StatsTable(r).Print(ctx.out);
        }
      });
}

int RunConfigShow(const Context& ctx, bool toml) {
  return Query(
      ctx, "GetConfig", [](ControlClient& c) { return c.GetConfig(); },
      [&ctx, toml](const v1::GetConfigResponse& r) {
        if (toml && ctx.options.json) {
          PrintJson(nlohmann::ordered_json{{"toml", r.toml()}}, ctx.out);
        } else if (toml) {
          ctx.out << r.toml();
          if (!r.toml().empty() && r.toml().back() != '\n') ctx.out << '\n';
        } else if (ctx.options.json) {
          PrintJson(ProtoToJsonArray(r.entries()), ctx.out);
        } else {
          ConfigTable(r).Print(ctx.out);
        }
      });
}

struct ExportOptions {
  std::string out;
  std::string dtype = "bf16";
  std::string max_shard_size;
  std::string config;
  bool overwrite = false;
  int64_t timeout_s = 3600;
};

// The export runs in hostd (it owns the state); this only names the directory and waits.
int RunExport(const Context& ctx, const std::string& job_id, const ExportOptions& o) {
  v1::ExportHFRequest request;
  request.set_job_id(job_id);
  std::error_code ec;
  // hostd has its own working directory: send an absolute path.
  request.set_out_dir(std::filesystem::absolute(o.out, ec).lexically_normal().string());
  if (o.dtype == "bf16") {
    request.set_dtype(v1::DTYPE_BF16);
  } else if (o.dtype == "fp32") {
    request.set_dtype(v1::DTYPE_FP32);
  } else {
    ctx.err << "slidedpctl: --dtype: '" << o.dtype << "', expected bf16 or fp32\n";
    return kExitUsage;
  }
  if (!o.max_shard_size.empty()) {
    std::optional<uint64_t> bytes = ParseByteSize(o.max_shard_size);
    if (!bytes || *bytes == 0) {
      ctx.err << "slidedpctl: --max-shard-size: '" << o.max_shard_size
              << "' is not a positive size (e.g. 5GiB, 500M, 1000000)\n";
      return kExitUsage;
    }
    request.set_max_shard_bytes(*bytes);
  }
  if (!o.config.empty()) {
    std::ifstream f(o.config);
    std::stringstream text;
    text << f.rdbuf();
    if (!f) {
      ctx.err << "slidedpctl: --config: cannot read '" << o.config << "'\n";
      return kExitUsage;
    }
    request.set_config_json(text.str());
  }
  request.set_overwrite(o.overwrite);
  absl::StatusOr<Session> session = Open(ctx);
  if (!session.ok()) return Report(ctx, DescribeRpcFailure(ctx, "Handshake", session.status()));
  session->client.set_timeout_ms(o.timeout_s * 1000);
  absl::StatusOr<v1::ExportHFResponse> r = session->client.ExportHF(request);
  if (!r.ok()) {
    if (std::optional<Failure> timeout = DescribeTimeout(
            r.status(), absl::StrCat("the export to ", request.out_dir()),
            absl::StrCat("--export-timeout-s ", o.timeout_s),
            "it holds the next training step until its files are written; hostd logs its end, "
            "'slidedpctl stats' counts it in exports_completed; wait longer with "
            "--export-timeout-s")) {
      return Report(ctx, *timeout);
    }
    return Report(ctx, DescribeRpcFailure(ctx, "ExportHF", r.status()));
  }
  if (ctx.options.json) {
    PrintJson(ProtoToJson(*r), ctx.out);
  } else {
    ctx.out << "exported version " << r->version() << " (" << r->tensors() << " tensors, "
            << absl::StrFormat("%.1f MiB", static_cast<double>(r->tensor_bytes()) / (1 << 20))
            << ", " << (r->dtype() == v1::DTYPE_FP32 ? "fp32" : "bf16") << ") to " << r->out_dir()
            << " in " << absl::StrFormat("%.2f s", r->seconds()) << ": "
            << absl::StrJoin(r->files(), ", ") << '\n';
  }
  return kExitOk;
}

std::atomic<bool> g_interrupted{false};

int RunWatchCmd(const Context& ctx, const WatchOptions& o) {
  absl::StatusOr<Session> session = Open(ctx);
  if (!session.ok()) return Report(ctx, DescribeRpcFailure(ctx, "Handshake", session.status()));
  // Ctrl-C ends the watch cleanly (exit 0) instead of killing the process mid-line.
  g_interrupted.store(false);
  struct sigaction sa {};
  struct sigaction old_int {};
  sa.sa_handler = [](int) { g_interrupted.store(true); };
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, &old_int);
  WatchOptions with_json = o;
  with_json.json = ctx.options.json;
  const int rc =
      RunWatch(session->client, with_json, ctx.out, ctx.err, [] { return g_interrupted.load(); });
  sigaction(SIGINT, &old_int, nullptr);
  return rc;
}

int RunCheckpoint(const Context& ctx, const std::string& job_id, bool no_wait,
                  const std::string& dir, int64_t wait_s) {
  // hostd has its own working directory (and refuses relative paths): send an absolute one.
  std::string absolute_dir;
  if (!dir.empty()) {
    std::error_code ec;
    absolute_dir = std::filesystem::absolute(dir, ec).string();
    if (ec) {
      ctx.err << "slidedpctl: --dir: cannot make '" << dir << "' absolute: " << ec.message()
              << '\n';
      return kExitUsage;
    }
  }
  absl::StatusOr<Session> session = Open(ctx);
  if (!session.ok()) return Report(ctx, DescribeRpcFailure(ctx, "Handshake", session.status()));
  absl::StatusOr<v1::CheckpointResponse> r =
      session->client.Checkpoint(job_id, !no_wait, absolute_dir, no_wait ? 0 : wait_s * 1000);
  if (!r.ok()) {
    if (std::optional<Failure> timeout =
            DescribeTimeout(r.status(), "the checkpoint", absl::StrCat("--wait-s ", wait_s),
                            "'slidedpctl status' shows it in flight and, once committed, as the "
                            "last checkpoint; wait longer with --wait-s")) {
      return Report(ctx, *timeout);
    }
    return Report(ctx, DescribeRpcFailure(ctx, "Checkpoint", r.status()));
  }
  if (ctx.options.json) {
    PrintJson(ProtoToJson(*r), ctx.out);
    return kExitOk;
  }
  Table t = Table::KeyValue();
  t.AddRow({"step", absl::StrCat(r->step())});
  t.AddRow({"path", r->path()});
  t.AddRow({"state", r->committed() ? "committed" : "started (being written)"});
  if (r->committed()) {
    t.AddRow({"size", FormatBytes(r->bytes())});
    t.AddRow({"seconds", absl::StrFormat("%.2f", r->seconds())});
  }
  t.Print(ctx.out);
  return kExitOk;
}

// No hostd involved: reads the directory.
int RunCheckpoints(const std::string& dir, bool verify, bool json, std::ostream& out,
                   std::ostream& err) {
  absl::StatusOr<std::vector<model::CheckpointListing>> list = model::ListCheckpoints(dir, verify);
  if (!list.ok()) {
    err << "slidedpctl: --dir: " << list.status().message() << '\n';
    return kExitUsage;
  }
  if (json) {
    nlohmann::ordered_json a = nlohmann::ordered_json::array();
    for (const auto& l : *list) {
      a.push_back({{"step", l.step},
                   {"path", l.path},
                   {"valid", l.valid},
                   {"reason", l.reason},
                   {"size_bytes", l.size_bytes},
                   {"created_unix_ms", l.created_unix_ms},
                   {"temporary", l.temporary},
                   {"data_verified", verify && l.valid}});
    }
    PrintJson(a, out);
    return kExitOk;
  }
  Table t({{"STEP", Table::Align::kRight},
           {"SIZE", Table::Align::kRight},
           {"STATE"},
           {"NAME"},
           {"WHY"}});
  for (const auto& l : *list) {
    t.AddRow({absl::StrCat(l.step), FormatBytes(l.size_bytes),
              l.valid ? (verify ? "valid (data verified)" : "valid") : "invalid", l.name,
              l.reason});
  }
  t.Print(out);
  return kExitOk;
}

struct EstimateOptions {
  std::string model;
  uint32_t gpus = 0;
  uint64_t batch = 0;
  uint64_t seq = 0;
  uint32_t window_slots = 0;
  std::string nondecoder = "resident";
  std::string gpu_memory;
};

// No hostd involved: load the manifest, compute, compare with this machine.
int RunEstimate(const EstimateOptions& o, bool json, std::ostream& out, std::ostream& err) {
  EstimateInputs inputs;
  inputs.gpus = o.gpus;
  inputs.batch = o.batch;
  inputs.seq = o.seq;
  inputs.window_slots = o.window_slots;
  inputs.nondecoder =
      o.nondecoder == "streamed" ? NonDecoderPlacement::kStreamed : NonDecoderPlacement::kResident;
  inputs.chunk_bytes = model::DefaultRoutes().chunk_bytes();
  if (!o.gpu_memory.empty()) {
    std::optional<uint64_t> bytes = ParseByteSize(o.gpu_memory);
    if (!bytes) {
      err << "slidedpctl: --gpu-memory: '" << o.gpu_memory
          << "' is not a size (e.g. 80GiB, 141G, 85899345920)\n";
      return kExitUsage;
    }
    inputs.gpu_memory = bytes;
    inputs.gpu_memory_source = "--gpu-memory";
  } else if (std::optional<uint64_t> smi = QueryGpuMemory()) {
    inputs.gpu_memory = smi;
    inputs.gpu_memory_source = "nvidia-smi";
  }
  absl::StatusOr<model::LoadedModel> model = model::LoadModel(o.model);
  if (!model.ok()) {
    err << "slidedpctl: --model: " << model.status().message() << '\n';
    return kExitUsage;
  }
  const MachineInfo machine = ProbeMachine();
  absl::StatusOr<Estimate> estimate = ComputeEstimate(*model, inputs, machine);
  if (!estimate.ok()) {
    err << "slidedpctl: --model: " << estimate.status().message() << '\n';
    return kExitUsage;
  }
  if (json) {
    PrintJson(EstimateToJson(*estimate, machine), out);
  } else {
    PrintEstimate(*estimate, out);
  }
  return estimate->fits ? kExitOk : kExitNoFit;
}

int RunDoctorCmd(bool json, std::ostream& out) {
  const std::vector<DoctorCheck> checks = RunDoctor(ProbeMachine(), geteuid() == 0);
  if (json) {
    PrintJson(DoctorToJson(checks), out);
  } else {
    PrintDoctor(checks, out);
  }
  return DoctorFailed(checks) ? kExitNoFit : kExitOk;
}

int Run(const std::vector<std::string>& args, std::ostream& out, std::ostream& err) {
  GlobalOptions options;
  std::string job_id;
  bool toml = false;

  CLI::App app("slidedpctl: query the SlideDP host daemon (hostd) over its control socket.",
               "slidedpctl");
  // Set before the subcommands are added, which inherit them: the footer, and fallthrough so
  // that global options (--json, --socket, ...) are accepted after the subcommand too.
  app.footer(kFooter);
  app.fallthrough();
  app.require_subcommand(1);
  app.set_version_flag("--version",
                       absl::StrCat("slidedpctl ", kVersion, " (git ", kGitRevision, ", protocol ",
                                    kProtocolVersion, ", shm abi ", kShmAbiVersion, ")"));

  CLI::Option* socket_opt =
      app.add_option("--socket", options.socket_path,
                     "hostd's unix socket (default: $SLIDEDP_SOCKET, else /run/slidedp/hostd.sock)")
          ->type_name("PATH");
  CLI::Option* tcp_opt =
      app.add_option("--tcp", options.tcp, "reach hostd over loopback TCP instead of a unix socket")
          ->type_name("HOST:PORT")
          ->excludes(socket_opt);
  app.add_option("--token-file", options.token_file,
                 "with --tcp: the file holding hostd's service token (its auth_token_file; "
                 "default: $SLIDEDP_TOKEN_FILE)")
      ->type_name("PATH")
      ->needs(tcp_opt);
  app.add_option("--timeout-ms", options.timeout_ms, "deadline of each request to hostd")
      ->check(CLI::Range(int64_t{1}, int64_t{3'600'000}))
      ->capture_default_str();
  app.add_flag("--json", options.json,
               "print one JSON document instead of tables (also accepted after the subcommand)");

  CLI::App* version_cmd =
      app.add_subcommand("version", "slidedpctl's build info, and hostd's when it is reachable");
  CLI::App* status_cmd =
      app.add_subcommand("status", "daemon, job, shared memory and per-layer summary");
  CLI::App* layers_cmd = app.add_subcommand("layers", "per-layer table: size, version, NUMA node");
  bool checksums = false;
  layers_cmd->add_flag("--checksums", checksums,
                       "add each layer's xxh64 of master, m, v and params (reads all the state)");
  CLI::App* ranks_cmd = app.add_subcommand("ranks", "attached ranks and their liveness");
  CLI::App* stats_cmd = app.add_subcommand("stats", "optimizer throughput counters");
  for (CLI::App* cmd : {layers_cmd, ranks_cmd, stats_cmd}) {
    cmd->add_option("--job", job_id, "job id (default: the daemon's job)")->type_name("ID");
  }
  CLI::App* config_cmd = app.add_subcommand("config", "hostd's effective configuration");
  config_cmd->require_subcommand(1);
  CLI::App* config_show_cmd =
      config_cmd->add_subcommand("show", "every config key with its value and source");
  config_show_cmd->add_flag("--toml", toml, "print the effective config as a TOML document");

  EstimateOptions est;
  CLI::App* estimate_cmd = app.add_subcommand(
      "estimate",
      "memory a training run needs (hostd shared memory, pinned, per-GPU window and activations) "
      "vs this machine; no hostd needed");
  estimate_cmd
      ->add_option("--model", est.model, "\"tiny\", \"tiny-tied\", a directory or a config.json")
      ->type_name("SPEC")
      ->required();
  estimate_cmd->add_option("--gpus", est.gpus, "ranks (hostd world size)")
      ->check(CLI::Range(uint32_t{1}, uint32_t{64}))
      ->required();
  estimate_cmd->add_option("--batch", est.batch, "sequences per rank per micro-step")
      ->check(CLI::Range(uint64_t{1}, uint64_t{1} << 30))
      ->required();
  estimate_cmd->add_option("--seq", est.seq, "tokens per sequence")
      ->check(CLI::Range(uint64_t{1}, uint64_t{1} << 30))
      ->required();
  estimate_cmd
      ->add_option("--window-slots", est.window_slots,
                   "GPU window slots (default 6, as python_client; + the non-decoder layers "
                   "with --nondecoder streamed)")
      ->check(CLI::Range(uint32_t{1}, uint32_t{100000}));
  estimate_cmd
      ->add_option("--nondecoder", est.nondecoder,
                   "where embeddings, final norm and lm_head live: resident (on each GPU, "
                   "python_client's default on CUDA) or streamed (through the window: "
                   "nondecoder=\"host\", native ranks)")
      ->check(CLI::IsMember({"resident", "streamed"}))
      ->capture_default_str();
  estimate_cmd
      ->add_option("--gpu-memory", est.gpu_memory,
                   "memory of one GPU, e.g. 80GiB (default: nvidia-smi's smallest GPU, else the "
                   "GPU figures are unchecked)")
      ->type_name("SIZE");
  PlanOptions plan;
  CLI::App* plan_cmd = app.add_subcommand(
      "plan",
      "predicted step time T = max(C, H) + E (compute, host/transfer bottleneck, exposure), "
      "regime, tokens/s, GPU memory and scaling for a layout; no hostd needed");
  plan_cmd
      ->add_option("--model", plan.model, "\"tiny\", \"tiny-tied\", a directory or a config.json")
      ->type_name("SPEC")
      ->required();
  plan_cmd->add_option("--gpus", plan.gpus, "ranks (R)")
      ->check(CLI::Range(uint32_t{1}, uint32_t{64}))
      ->required();
  plan_cmd->add_option("--batch", plan.batch, "sequences per rank per step")
      ->check(CLI::Range(uint64_t{1}, uint64_t{1} << 30))
      ->required();
  plan_cmd->add_option("--seq", plan.seq, "tokens per sequence")
      ->check(CLI::Range(uint64_t{1}, uint64_t{1} << 30))
      ->required();
  plan_cmd
      ->add_option("--layout", plan.layout,
                   "per-layer layout, groups <count><kind>[-r<ratio>] with kinds F, Seg, SAC, N, "
                   "R, R<kind> (python_client's policy grammar; default: every layer F-r0)")
      ->type_name("LAYOUT");
  plan_cmd
      ->add_option("--profile", plan.profile,
                   "JSON file overriding keys of the built-in H200 profile (see --json's "
                   "\"profile\")")
      ->type_name("FILE");
  plan_cmd
      ->add_option("--window-slots", plan.window_slots,
                   "GPU window slots (python_client's default 6); the streamed layers beyond them "
                   "are fetched again in backward")
      ->check(CLI::Range(uint32_t{1}, uint32_t{100000}))
      ->capture_default_str();
  plan_cmd
      ->add_option("--grad-route", plan.grad_route,
                   "gpu_reduction (one reduced BF16 gradient per layer) or cpu_reduction (every "
                   "rank's FP32 gradient, reduced by the CPU)")
      ->check(CLI::IsMember({"gpu_reduction", "cpu_reduction"}))
      ->capture_default_str();
  ExportOptions exp;
  CLI::App* export_cmd = app.add_subcommand(
      "export",
      "write the job's weights as an HF model directory (safetensors + config.json) that "
      "transformers loads; hostd writes it at a step boundary");
  export_cmd
      ->add_option("--out", exp.out,
                   "output directory on hostd's machine, below one of hostd's output_roots")
      ->type_name("DIR")
      ->required();
  export_cmd
      ->add_option("--dtype", exp.dtype,
                   "bf16 (the weights the ranks train on) or fp32 "
                   "(the master)")
      ->capture_default_str();
  export_cmd
      ->add_option("--max-shard-size", exp.max_shard_size,
                   "largest shard, e.g. 2GiB (default 5GiB)")
      ->type_name("SIZE");
  export_cmd
      ->add_option("--config", exp.config,
                   "the model's config.json (only for a job created over RPC)")
      ->type_name("FILE");
  export_cmd->add_flag("--overwrite", exp.overwrite,
                       "replace an earlier export of hostd in the output directory (never other "
                       "files)");
  export_cmd->add_option("--export-timeout-s", exp.timeout_s, "how long to wait for the export")
      ->check(CLI::Range(int64_t{1}, int64_t{86400}))
      ->capture_default_str();
  export_cmd->add_option("--job", job_id, "job id (default: the daemon's job)")->type_name("ID");
  WatchOptions watch;
  CLI::App* watch_cmd = app.add_subcommand(
      "watch", "live per-step table (one line per poll with new steps) until Ctrl-C or --steps");
  watch_cmd->add_option("--interval", watch.interval_s, "seconds between polls")
      ->check(CLI::Range(0.05, 3600.0))
      ->capture_default_str();
  watch_cmd->add_option("--steps", watch.steps, "stop after this many new steps (0: never)")
      ->capture_default_str();
  bool no_wait = false;
  std::string ckpt_dir;
  int64_t wait_s = 3600;
  CLI::App* checkpoint_cmd = app.add_subcommand(
      "checkpoint", "write a checkpoint of the job now, while training continues");
  checkpoint_cmd->add_option("--job", job_id, "job id (default: the daemon's job)")
      ->type_name("ID");
  checkpoint_cmd->add_flag("--no-wait", no_wait, "return once started, not once committed");
  checkpoint_cmd
      ->add_option("--dir", ckpt_dir,
                   "directory on hostd's machine, relative to this working directory (default: "
                   "hostd's checkpoint.dir; others must lie under hostd's output_roots)")
      ->type_name("DIR");
  checkpoint_cmd->add_option("--wait-s", wait_s, "how long to wait for the commit")
      ->check(CLI::Range(int64_t{1}, int64_t{7} * 24 * 3600))
      ->capture_default_str();
  std::string list_dir;
  bool verify = false;
  CLI::App* checkpoints_cmd = app.add_subcommand(
      "checkpoints",
      "list the checkpoints of a directory: step, size, valid or why not; no hostd "
      "needed");
  checkpoints_cmd->add_option("--dir", list_dir, "checkpoint directory")
      ->type_name("DIR")
      ->required();
  checkpoints_cmd->add_flag("--verify", verify, "also verify every file's checksum (reads all)");
  std::string cleanup_instance;
  bool cleanup_dry_run = false;
  CLI::App* cleanup_cmd = app.add_subcommand(
      "cleanup",
      "remove /dev/shm segments and lock files of hostd instances with no live hostd (never a "
      "live one), printing what and how many bytes");
  cleanup_cmd->add_option("--instance", cleanup_instance, "only this instance (default: all)");
  cleanup_cmd->add_flag("--dry-run", cleanup_dry_run, "list what would be removed; remove nothing");
  CLI::App* doctor_cmd = app.add_subcommand(
      "doctor", "check host settings hostd depends on (memlock, /dev/shm, THP, NUMA, GPUs)");

  try {
    std::vector<std::string> reversed(args.rbegin(), args.rend());  // CLI11 consumes from back
    app.parse(reversed);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == static_cast<int>(CLI::ExitCodes::Success)) {
      app.exit(e, out, err);  // --help, --version
      return kExitOk;
    }
    // CLI11 checks "a subcommand is required" before it reports extras, which would hide the
    // likely cause: a misspelled command.
    std::string message = e.what();
    CLI::App* leaf = &app;
    while (!leaf->get_subcommands().empty()) leaf = leaf->get_subcommands().front();
    const std::vector<CLI::App*> choices = leaf->get_subcommands([](CLI::App*) { return true; });
    if (leaf->get_require_subcommand_min() > 0 && !choices.empty()) {
      for (const std::string& arg : app.remaining(/*recurse=*/true)) {
        if (!arg.empty() && arg.front() != '-') {
          message = absl::StrCat("unknown command \"", arg, "\"; expected one of: ",
                                 absl::StrJoin(choices, ", ", [](std::string* out, CLI::App* c) {
                                   out->append(c->get_name());
                                 }));
          break;
        }
      }
    }
    err << "slidedpctl: " << message << "\nRun 'slidedpctl --help' for usage.\n";
    return kExitUsage;
  }

  // These never talk to hostd.
  if (estimate_cmd->parsed()) return RunEstimate(est, options.json, out, err);
  if (doctor_cmd->parsed()) return RunDoctorCmd(options.json, out);
  if (plan_cmd->parsed()) return RunPlan(plan, options.json, out, err);
  if (checkpoints_cmd->parsed()) return RunCheckpoints(list_dir, verify, options.json, out, err);
  if (cleanup_cmd->parsed()) {
    return RunCleanup(cleanup_instance, cleanup_dry_run, options.json, out, err);
  }

  Endpoint endpoint;
  if (!options.tcp.empty()) {
    absl::StatusOr<Endpoint> tcp = MakeTcpEndpoint(options.tcp);
    if (!tcp.ok()) {
      err << "slidedpctl: " << tcp.status().message() << '\n';
      return kExitUsage;
    }
    endpoint = *std::move(tcp);
    std::string file = options.token_file;
    if (file.empty()) {
      const char* env = std::getenv(kTokenFileEnv);
      if (env != nullptr) file = env;
    }
    if (!file.empty()) {
      absl::StatusOr<std::string> token = ReadServiceToken(file, /*for_server=*/false);
      if (!token.ok()) {
        err << "slidedpctl: --token-file: " << token.status().message() << '\n';
        return kExitUsage;
      }
      endpoint.token = *std::move(token);
    }
  } else {
    std::string path = options.socket_path;
    if (path.empty()) {
      const char* env = std::getenv(kSocketEnv);
      path = (env != nullptr && *env != '\0') ? env : kDefaultSocket;
    }
    endpoint = MakeUnixEndpoint(path);
  }

  const Context ctx{std::move(options), std::move(endpoint), out, err};
  if (version_cmd->parsed()) return RunVersion(ctx);
  if (status_cmd->parsed()) return RunStatus(ctx);
  if (layers_cmd->parsed()) return RunLayers(ctx, job_id, checksums);
  if (ranks_cmd->parsed()) return RunRanks(ctx, job_id);
  if (stats_cmd->parsed()) return RunStats(ctx, job_id);
  if (config_show_cmd->parsed()) return RunConfigShow(ctx, toml);
  if (export_cmd->parsed()) return RunExport(ctx, job_id, exp);
  if (watch_cmd->parsed()) return RunWatchCmd(ctx, watch);
  if (checkpoint_cmd->parsed()) return RunCheckpoint(ctx, job_id, no_wait, ckpt_dir, wait_s);
  err << "slidedpctl: no command given\nRun 'slidedpctl --help' for usage.\n";
  return kExitUsage;
}

}  // namespace

int RunCtl(const std::vector<std::string>& args, std::ostream& out, std::ostream& err) {
  // Nothing may escape as an exception (a bug in slidedpctl or a library): report it as one.
  try {
    return Run(args, out, err);
  } catch (const std::exception& e) {
    err << "slidedpctl: internal error: " << e.what() << '\n';
    return kExitInternal;
  }
}

}  // namespace slidedp::ctl
