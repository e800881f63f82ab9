// The key table: one KeyDescriptor per key binds a parser/formatter pair to a HostdConfig field.

#include <algorithm>
#include <charconv>
#include <cmath>
#include <limits>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/status_macros.h"
#include "common/tcp_auth.h"
#include "hostd/config_internal.h"
#include "model/hyper_params.h"
#include "model/job_spec.h"

namespace slidedp::hostd::config_internal {
using ::slidedp::v1::OptimizerConfig;
using ::slidedp::v1::Routes;

namespace {

constexpr uint64_t kKiB = uint64_t{1} << 10;
constexpr uint64_t kMiB = uint64_t{1} << 20;
constexpr uint64_t kGiB = uint64_t{1} << 30;

// ---------------------------------------------------------------------------------------------
// Value parsing and formatting shared by all sources.

absl::Status BadValue(std::string_view text, std::string_view expected) {
  return absl::InvalidArgumentError(absl::StrCat("'", Av(text), "' is not ", Av(expected)));
}

absl::StatusOr<bool> ParseBool(std::string_view text) {
  const std::string t = absl::AsciiStrToLower(Av(text));
  if (t == "true" || t == "1") return true;
  if (t == "false" || t == "0") return false;
  return BadValue(text, "a boolean; expected true or false");
}

absl::StatusOr<uint64_t> ParseUint(std::string_view text, uint64_t max) {
  uint64_t v = 0;
  const char* end = text.data() + text.size();
  auto [p, ec] = std::from_chars(text.data(), end, v);
  if (text.empty() || ec == std::errc::invalid_argument || p != end) {
    return BadValue(text, "an unsigned integer");
  }
  if (ec == std::errc::result_out_of_range || v > max) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", Av(text), "' is out of range; expected at most ", max));
  }
  return v;
}

absl::StatusOr<int> ParseInt(std::string_view text) {
  int64_t v = 0;
  const char* end = text.data() + text.size();
  auto [p, ec] = std::from_chars(text.data(), end, v);
  if (text.empty() || ec == std::errc::invalid_argument || p != end) {
    return BadValue(text, "an integer");
  }
  if (ec == std::errc::result_out_of_range || v < std::numeric_limits<int>::min() ||
      v > std::numeric_limits<int>::max()) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", Av(text), "' is out of range for a 32-bit integer"));
  }
  return static_cast<int>(v);
}

absl::StatusOr<double> ParseDouble(std::string_view text) {
  double v = 0;
  if (!absl::SimpleAtod(Av(text), &v)) return BadValue(text, "a number");
  return v;
}

// "4096", "4096B", "64K", "64KiB", "16M", "16MiB", "1G", "1GiB" (binary units, any case).
absl::StatusOr<uint64_t> ParseSize(std::string_view text) {
  constexpr std::string_view kExpected =
      "a size; expected bytes or an integer with a binary unit K/KiB, M/MiB or G/GiB, e.g. 16MiB";
  const std::string t = absl::AsciiStrToLower(Av(text));
  size_t digits = 0;
  while (digits < t.size() && absl::ascii_isdigit(static_cast<unsigned char>(t[digits]))) {
    ++digits;
  }
  if (digits == 0) return BadValue(text, kExpected);
  uint64_t n = 0;
  auto [p, ec] = std::from_chars(t.data(), t.data() + digits, n);
  if (ec != std::errc()) return BadValue(text, kExpected);
  std::string_view unit = std::string_view(t).substr(digits);
  while (!unit.empty() && unit.front() == ' ') unit.remove_prefix(1);
  uint64_t mult = 0;
  if (unit.empty() || unit == "b") {
    mult = 1;
  } else if (unit == "k" || unit == "ki" || unit == "kib") {
    mult = kKiB;
  } else if (unit == "m" || unit == "mi" || unit == "mib") {
    mult = kMiB;
  } else if (unit == "g" || unit == "gi" || unit == "gib") {
    mult = kGiB;
  } else {
    return BadValue(text, kExpected);
  }
  uint64_t bytes = 0;
  if (__builtin_mul_overflow(n, mult, &bytes)) {
    return absl::InvalidArgumentError(absl::StrCat("'", Av(text), "' is too large"));
  }
  return bytes;
}

std::string FormatSize(uint64_t bytes) {
  if (bytes != 0 && bytes % kGiB == 0) return absl::StrCat(bytes / kGiB, "GiB");
  if (bytes != 0 && bytes % kMiB == 0) return absl::StrCat(bytes / kMiB, "MiB");
  if (bytes != 0 && bytes % kKiB == 0) return absl::StrCat(bytes / kKiB, "KiB");
  return absl::StrCat(bytes);
}

// ---------------------------------------------------------------------------------------------
// Key factories: each binds a parser/formatter pair to a field.

using StrGet = std::function<std::string(const HostdConfig&)>;

KeyDescriptor StringKey(std::string name, std::string section, std::string help,
                        std::string HostdConfig::*field) {
  return {std::move(name),
          std::move(section),
          std::move(help),
          ValueKind::kString,
          {},
          [field](HostdConfig& c, std::string_view text) {
            c.*field = std::string(text);
            return absl::OkStatus();
          },
          [field](const HostdConfig& c) { return c.*field; }};
}

KeyDescriptor StringFnKey(std::string name, std::string section, std::string help,
                          std::function<std::string(const HostdConfig&)> get,
                          std::function<void(HostdConfig&, std::string_view)> set) {
  return {std::move(name),
          std::move(section),
          std::move(help),
          ValueKind::kString,
          {},
          [set](HostdConfig& c, std::string_view text) {
            set(c, text);
            return absl::OkStatus();
          },
          std::move(get)};
}

KeyDescriptor EnumKey(std::string name, std::string section, std::string help,
                      std::vector<std::string> choices, StrGet get,
                      std::function<void(HostdConfig&, std::string_view)> set) {
  KeyDescriptor d{std::move(name),  std::move(section), std::move(help),
                  ValueKind::kEnum, std::move(choices), nullptr,
                  std::move(get)};
  d.set = [choices = d.choices, set = std::move(set)](HostdConfig& c, std::string_view text) {
    if (std::find(choices.begin(), choices.end(), text) == choices.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("'", Av(text), "' is not one of ", absl::StrJoin(choices, ", ")));
    }
    set(c, text);
    return absl::OkStatus();
  };
  return d;
}

KeyDescriptor StringEnumKey(std::string name, std::string section, std::string help,
                            std::vector<std::string> choices, std::string HostdConfig::*field) {
  return EnumKey(
      std::move(name), std::move(section), std::move(help), std::move(choices),
      [field](const HostdConfig& c) { return c.*field; },
      [field](HostdConfig& c, std::string_view v) { c.*field = std::string(v); });
}

// A proto enum exposed as lower-case names; `names[i]` maps to `values[i]`. A field holding a
// value outside the table (e.g. UNSPECIFIED) prints as `unset_name`.
template <typename E>
KeyDescriptor ProtoEnumKey(std::string name, std::string section, std::string help,
                           std::vector<std::pair<std::string, E>> table, std::string unset_name,
                           std::function<E(const HostdConfig&)> get,
                           std::function<void(HostdConfig&, E)> set) {
  std::vector<std::string> choices;
  for (const auto& [n, v] : table) choices.push_back(n);
  return EnumKey(
      std::move(name), std::move(section), std::move(help), std::move(choices),
      [table, unset_name, get](const HostdConfig& c) {
        const E e = get(c);
        for (const auto& [n, v] : table) {
          if (v == e) return n;
        }
        return unset_name;
      },
      [table, set](HostdConfig& c, std::string_view text) {
        for (const auto& [n, v] : table) {
          if (n == text) set(c, v);
        }
      });
}

KeyDescriptor BoolKey(std::string name, std::string section, std::string help,
                      std::function<bool(const HostdConfig&)> get,
                      std::function<void(HostdConfig&, bool)> set) {
  return {std::move(name),
          std::move(section),
          std::move(help),
          ValueKind::kBool,
          {},
          [set](HostdConfig& c, std::string_view text) -> absl::Status {
            ASSIGN_OR_RETURN(const bool v, ParseBool(text));
            set(c, v);
            return absl::OkStatus();
          },
          [get](const HostdConfig& c) { return std::string(get(c) ? "true" : "false"); }};
}

KeyDescriptor UintKey(std::string name, std::string section, std::string help, uint64_t max,
                      std::function<uint64_t(const HostdConfig&)> get,
                      std::function<void(HostdConfig&, uint64_t)> set) {
  return {std::move(name),
          std::move(section),
          std::move(help),
          ValueKind::kUint,
          {},
          [set, max](HostdConfig& c, std::string_view text) -> absl::Status {
            ASSIGN_OR_RETURN(const uint64_t v, ParseUint(text, max));
            set(c, v);
            return absl::OkStatus();
          },
          [get](const HostdConfig& c) { return absl::StrCat(get(c)); }};
}

KeyDescriptor IntKey(std::string name, std::string section, std::string help,
                     int HostdConfig::*field) {
  return {std::move(name),
          std::move(section),
          std::move(help),
          ValueKind::kInt,
          {},
          [field](HostdConfig& c, std::string_view text) -> absl::Status {
            ASSIGN_OR_RETURN(c.*field, ParseInt(text));
            return absl::OkStatus();
          },
          [field](const HostdConfig& c) { return absl::StrCat(c.*field); }};
}

KeyDescriptor DoubleKey(std::string name, std::string section, std::string help,
                        std::function<double(const HostdConfig&)> get,
                        std::function<void(HostdConfig&, double)> set) {
  return {std::move(name),
          std::move(section),
          std::move(help),
          ValueKind::kDouble,
          {},
          [set](HostdConfig& c, std::string_view text) -> absl::Status {
            ASSIGN_OR_RETURN(const double v, ParseDouble(text));
            set(c, v);
            return absl::OkStatus();
          },
          [get](const HostdConfig& c) { return model::FormatSetting(get(c)); }};
}

KeyDescriptor SizeKey(std::string name, std::string section, std::string help,
                      std::function<uint64_t(const HostdConfig&)> get,
                      std::function<void(HostdConfig&, uint64_t)> set) {
  return {std::move(name),
          std::move(section),
          std::move(help),
          ValueKind::kSize,
          {},
          [set](HostdConfig& c, std::string_view text) -> absl::Status {
            ASSIGN_OR_RETURN(const uint64_t v, ParseSize(text));
            set(c, v);
            return absl::OkStatus();
          },
          [get](const HostdConfig& c) { return FormatSize(get(c)); }};
}

// An optimizer key from its row of the hyperparameter table; the row lives as long as the
// process (model::HyperParams()).
KeyDescriptor HyperParamKey(const model::HyperParam& p, std::string section) {
  const model::HyperParam* row = &p;
  switch (p.type) {
    case model::HyperParamType::kDouble:
      return DoubleKey(
          p.name, std::move(section), p.help,
          [row](const HostdConfig& c) { return row->get_double(c.optimizer); },
          [row](HostdConfig& c, double v) { row->set_double(&c.optimizer, v); });
    case model::HyperParamType::kUint:
      return UintKey(
          p.name, std::move(section), p.help, std::numeric_limits<uint64_t>::max(),
          [row](const HostdConfig& c) { return row->get_uint(c.optimizer); },
          [row](HostdConfig& c, uint64_t v) { row->set_uint(&c.optimizer, v); });
    case model::HyperParamType::kBool:
      return BoolKey(
          p.name, std::move(section), p.help,
          [row](const HostdConfig& c) { return row->get_bool(c.optimizer); },
          [row](HostdConfig& c, bool v) { row->set_bool(&c.optimizer, v); });
    case model::HyperParamType::kEnum:
      return ProtoEnumKey<int>(
          p.name, std::move(section), p.help, p.choices, p.unset_name,
          [row](const HostdConfig& c) { return row->get_enum(c.optimizer); },
          [row](HostdConfig& c, int v) { row->set_enum(&c.optimizer, v); });
  }
  __builtin_unreachable();  // every HyperParamType is handled above
}

// ---------------------------------------------------------------------------------------------
// The one table of keys: flags, environment, file, help, --print-config and GetConfig all
// derive from it.

std::vector<KeyDescriptor> BuildKeys() {
  constexpr uint64_t kU32 = std::numeric_limits<uint32_t>::max();
  constexpr uint64_t kU64 = std::numeric_limits<uint64_t>::max();
  std::vector<KeyDescriptor> k;

  const std::string daemon = "Daemon";
  k.push_back(StringKey(
      "instance", daemon,
      "Instance name; scopes shared-memory segment names so several daemons can share a host. "
      "1 to 32 of [A-Za-z0-9_-].",
      &HostdConfig::instance));
  k.push_back(StringKey("socket", daemon,
                        "Unix socket path of the control service (at most 107 bytes).",
                        &HostdConfig::socket));
  k.push_back(StringKey("listen_tcp", daemon,
                        "Also serve on a loopback TCP address: 127.0.0.1:PORT, [::1]:PORT or "
                        "localhost:PORT (PORT 0 picks a free port). Empty: off.",
                        &HostdConfig::listen_tcp));
  k.push_back(StringKey("auth_token_file", daemon,
                        "A file holding the service token (a first line of 32 to 4096 printable "
                        "characters) that every call over listen_tcp must carry as metadata "
                        "'authorization: Bearer TOKEN'; owned by hostd's user, nothing for "
                        "others (0600 or 0640). Required with listen_tcp; clients read it "
                        "through SLIDEDP_TOKEN_FILE.",
                        &HostdConfig::auth_token_file));
  k.push_back(StringEnumKey("log_level", daemon, "Log verbosity.",
                            {"trace", "debug", "info", "warn", "error"}, &HostdConfig::log_level));
  k.push_back(StringFnKey(
      "output_roots", daemon,
      "Comma-separated absolute directories under which a Checkpoint request's dir and an "
      "ExportHF's out_dir (slidedpctl checkpoint --dir, export --out) may lie; a checkpoint may "
      "also go to checkpoint.dir or below it. \"/\" allows any directory. Empty: exports are "
      "refused and checkpoints go only to checkpoint.dir.",
      [](const HostdConfig& c) { return absl::StrJoin(c.output_roots, ","); },
      [](HostdConfig& c, std::string_view v) {
        c.output_roots.clear();
        for (absl::string_view root : absl::StrSplit(Av(v), ',', absl::SkipWhitespace())) {
          c.output_roots.emplace_back(absl::StripAsciiWhitespace(root));
        }
      }));

  const std::string job = "Model and job";
  k.push_back(StringKey("model", job,
                        "Model: tiny or tiny-tied (built-in test models), a directory containing "
                        "an HF config.json, or the path of a config.json; none starts without a "
                        "job (one is created over RPC).",
                        &HostdConfig::model));
  k.push_back(UintKey(
      "seed", job, "Seed of the deterministic weight initialisation.", kU64,
      [](const HostdConfig& c) { return c.seed; }, [](HostdConfig& c, uint64_t v) { c.seed = v; }));
  k.push_back(UintKey(
      "world_size", job, "Number of rank processes in the job, 1 to 64.", kU32,
      [](const HostdConfig& c) { return c.world_size; },
      [](HostdConfig& c, uint64_t v) { c.world_size = static_cast<uint32_t>(v); }));
  k.push_back(StringKey(
      "init", job,
      "Initial weights: auto (import the HF safetensors weights of the model directory when "
      "--model is a directory holding model.safetensors or model.safetensors.index.json, else "
      "random), random (from seed, HF scheme: norms 1, biases 0, others N(0, "
      "initializer_range)), zeros (every normally-initialised tensor 0; for tests), or a path: a "
      ".safetensors file, a model.safetensors.index.json, or a directory holding one (a path "
      "contains '/' or ends in .safetensors; write ./NAME for a directory in the current one).",
      &HostdConfig::init));

  // The optimizer's keys are the rows of model/hyper_params.h, in its order.
  const std::string opt = "Optimizer (AdamW)";
  for (const model::HyperParam& p : model::HyperParams()) k.push_back(HyperParamKey(p, opt));

  const std::string routes = "Routes";
  k.push_back(ProtoEnumKey<slidedp::v1::ParamRoute>(
      "param_route", routes,
      "How ranks get parameters: replicated (every rank reads every layer) or sharded.",
      {{"replicated", slidedp::v1::PARAM_ROUTE_REPLICATED},
       {"sharded", slidedp::v1::PARAM_ROUTE_SHARDED}},
      "replicated", [](const HostdConfig& c) { return c.routes.param_route(); },
      [](HostdConfig& c, slidedp::v1::ParamRoute v) { c.routes.set_param_route(v); }));
  k.push_back(ProtoEnumKey<slidedp::v1::GradRoute>(
      "grad_route", routes,
      "How gradients are reduced: cpu_reduction (hostd sums the ranks' pushes), gpu_reduction "
      "(NCCL all-reduce, one rank pushes), reduce_scatter (each rank pushes its shard) or auto "
      "(chosen when the first rank attaches: GPU ranks gpu_reduction, CPU ranks cpu_reduction).",
      {{"cpu_reduction", slidedp::v1::GRAD_ROUTE_CPU_REDUCTION},
       {"gpu_reduction", slidedp::v1::GRAD_ROUTE_GPU_REDUCTION},
       {"reduce_scatter", slidedp::v1::GRAD_ROUTE_REDUCE_SCATTER},
       {"auto", slidedp::v1::GRAD_ROUTE_AUTO}},
      "cpu_reduction", [](const HostdConfig& c) { return c.routes.grad_route(); },
      [](HostdConfig& c, slidedp::v1::GradRoute v) { c.routes.set_grad_route(v); }));
  k.push_back(SizeKey(
      "chunk_bytes", routes,
      "Granularity of gradient chunks signalled through shared memory: bytes or K/KiB, M/MiB, "
      "G/GiB; a multiple of 4096 from 4KiB to 1GiB.",
      [](const HostdConfig& c) { return c.routes.chunk_bytes(); },
      [](HostdConfig& c, uint64_t v) { c.routes.set_chunk_bytes(v); }));

  const std::string engine = "Update engine";
  k.push_back(IntKey("numa_node", engine,
                     "NUMA node holding the state and running the updates; -1: auto (the node "
                     "closest to the GPUs).",
                     &HostdConfig::numa_node));
  k.push_back(IntKey("update_threads", engine,
                     "Optimizer worker threads, >= 0; 0: auto, the cores of the state's NUMA "
                     "node less 2 per rank of world_size and 2 for hostd's own threads (at "
                     "least 1).",
                     &HostdConfig::update_threads));
  k.push_back(StringEnumKey("isa", engine, "Adam kernel; auto picks the best the CPU supports.",
                            {"auto", "scalar", "avx2", "avx512", "avx512bf16"}, &HostdConfig::isa));
  k.push_back(StringEnumKey(
      "update_granularity", engine,
      "How the gpu_reduction and reduce_scatter routes apply AdamW: chunk (each gradient chunk is "
      "updated as soon as it arrives, read in place from shared memory, so the update of chunk k "
      "overlaps the transfer of chunk k+1; needs the ranks to send each layer's norm with its "
      "first chunk and clip none or per_layer, else the layer is updated whole and a warning is "
      "logged), auto (chunk when possible, silently whole layers otherwise) or layer (always "
      "whole layers). Cost of chunk granularity: a step aborted while a layer is half updated "
      "leaves that layer torn (part of it at the new version, part at the old), and hostd "
      "refuses further steps until the state is restored from a checkpoint; layer granularity "
      "never tears. cpu_reduction always updates whole layers.",
      {"auto", "layer", "chunk"}, &HostdConfig::update_granularity));

  const std::string metrics = "Metrics";
  k.push_back(StringKey("metrics.listen", metrics,
                        "Prometheus endpoint ([metrics] listen): HOST:PORT serving /metrics, e.g. "
                        "127.0.0.1:9464 (PORT 0 picks a free port, logged); empty or off: "
                        "disabled. Loopback only unless metrics.allow_remote.",
                        &HostdConfig::metrics_listen));
  k.push_back(BoolKey(
      "metrics.allow_remote", metrics,
      "Allow a non-loopback metrics.listen address (the endpoint has no authentication).",
      [](const HostdConfig& c) { return c.metrics_allow_remote; },
      [](HostdConfig& c, bool v) { c.metrics_allow_remote = v; }));

  const std::string shm = "Shared memory";
  k.push_back(StringEnumKey("mlock", shm,
                            "Lock the state in RAM: required (fail if it cannot be locked), "
                            "best_effort (warn) or off.",
                            {"required", "best_effort", "off"}, &HostdConfig::mlock));
  k.push_back(StringEnumKey("shm_mode", shm,
                            "Permissions of the segments ranks map: 0600 (owner only) or 0660 "
                            "(with shm_group).",
                            {"0600", "0660"}, &HostdConfig::shm_mode));
  k.push_back(StringKey("shm_group", shm,
                        "Group owning the segments; only with shm_mode 0660. Empty: the "
                        "daemon's group.",
                        &HostdConfig::shm_group));

  const std::string ckpt = "Checkpoints ([checkpoint] table in the file)";
  k.push_back(StringFnKey(
      "checkpoint.dir", ckpt,
      "Directory of the job's checkpoints (step-<t>.<instance>.<job>/ subdirectories; instances "
      "and jobs may share it); empty: no checkpoints unless a Checkpoint request names a "
      "directory.",
      [](const HostdConfig& c) { return c.checkpoint.dir; },
      [](HostdConfig& c, std::string_view v) { c.checkpoint.dir = std::string(v); }));
  k.push_back(UintKey(
      "checkpoint.every_steps", ckpt,
      "Write a checkpoint every N completed steps, while training continues; 0: off.",
      std::numeric_limits<uint64_t>::max(),
      [](const HostdConfig& c) { return c.checkpoint.every_steps; },
      [](HostdConfig& c, uint64_t v) { c.checkpoint.every_steps = v; }));
  k.push_back(UintKey(
      "checkpoint.keep_last", ckpt,
      "Keep the newest N committed checkpoints, deleting older ones after each commit; 0: keep "
      "all.",
      kU32, [](const HostdConfig& c) { return c.checkpoint.keep_last; },
      [](HostdConfig& c, uint64_t v) { c.checkpoint.keep_last = static_cast<uint32_t>(v); }));
  k.push_back(UintKey(
      "checkpoint.client_upload_timeout_s", ckpt,
      "Seconds a checkpoint waits for rank 0 to upload the layers the ranks update themselves "
      "(client_updated_layers, e.g. python_client's resident embeddings) before it fails.",
      86400, [](const HostdConfig& c) { return c.checkpoint.client_upload_timeout_s; },
      [](HostdConfig& c, uint64_t v) { c.checkpoint.client_upload_timeout_s = v; }));
  k.push_back(UintKey(
      "checkpoint.capture_timeout_s", ckpt,
      "Seconds an optimizer update waits for the checkpoint in flight to capture its layer (the "
      "snapshot pool full, or the layer being written from the live state) before that "
      "checkpoint fails and the update goes on (a hung disk must not stall training); the "
      "committed checkpoints stay. 0: no limit.",
      86400, [](const HostdConfig& c) { return c.checkpoint.capture_timeout_s; },
      [](HostdConfig& c, uint64_t v) { c.checkpoint.capture_timeout_s = v; }));
  k.push_back(UintKey(
      "checkpoint.max_write_mb_per_s", ckpt,
      "Megabytes (10^6 B) per second a checkpoint taken while training runs writes at most; 0: "
      "no limit. The write competes with the optimizer update for host memory bandwidth: a "
      "slower write spreads that cost over more steps (the 4B H200 run: see README). A stop's "
      "checkpoints and a layer an update waits for are written at full speed.",
      1000000, [](const HostdConfig& c) { return c.checkpoint.max_write_mb_per_s; },
      [](HostdConfig& c, uint64_t v) { c.checkpoint.max_write_mb_per_s = v; }));
  k.push_back(BoolKey(
      "checkpoint.direct_io", ckpt,
      "Write the layers' snapshot buffers with O_DIRECT where the file system takes it (no "
      "page-cache copy, no dirty pages to write back); false: through the page cache.",
      [](const HostdConfig& c) { return c.checkpoint.direct_io; },
      [](HostdConfig& c, bool v) { c.checkpoint.direct_io = v; }));
  k.push_back(BoolKey(
      "checkpoint.on_stop", ckpt,
      "On a clean stop (SIGTERM/SIGINT) write a final checkpoint before removing the state "
      "(needs checkpoint.dir).",
      [](const HostdConfig& c) { return c.checkpoint.on_stop; },
      [](HostdConfig& c, bool v) { c.checkpoint.on_stop = v; }));
  k.push_back(SizeKey(
      "checkpoint.snapshot_pool_bytes", ckpt,
      "Host memory for copies of layers whose next update starts before the checkpoint has "
      "written them; when it is full, updates wait (the checkpoint stall). 0: auto, the "
      "state's size when MemAvailable at the checkpoint's start allows (keeping an eighth of it, "
      "at "
      "least 4 GiB, free), else that much.",
      [](const HostdConfig& c) { return c.checkpoint.snapshot_pool_bytes; },
      [](HostdConfig& c, uint64_t v) { c.checkpoint.snapshot_pool_bytes = v; }));
  k.push_back(BoolKey(
      "checkpoint.keep_snapshot_pool", ckpt,
      "Keep the snapshot pool's buffers allocated between checkpoints (up to the next one's pool "
      "size): the next checkpoint copies into pages already faulted in, about 3x faster (the "
      "stall of the step after its start). false: give them back after each checkpoint.",
      [](const HostdConfig& c) { return c.checkpoint.keep_snapshot_pool; },
      [](HostdConfig& c, bool v) { c.checkpoint.keep_snapshot_pool = v; }));
  k.push_back(BoolKey(
      "checkpoint.prepare_snapshot_pool", ckpt,
      "With checkpoint.dir set and keep_snapshot_pool on: allocate and fault in the snapshot "
      "pool in the background after the job's first step (its size as the next checkpoint would "
      "compute it then), so that the first checkpoint copies into warm pages too (fresh pages "
      "made the step after the capture point wait for the page faults). false: the first "
      "checkpoint allocates it.",
      [](const HostdConfig& c) { return c.checkpoint.prepare_snapshot_pool; },
      [](HostdConfig& c, bool v) { c.checkpoint.prepare_snapshot_pool = v; }));
  k.push_back(StringFnKey(
      "checkpoint.resume", ckpt,
      "Start the job from this checkpoint (a step directory, or a checkpoint directory holding "
      "one job's checkpoints: its newest committed step): master, m, v, step and LR schedule "
      "position; with model none the model comes from the checkpoint, else it must match. Also "
      "--resume.",
      [](const HostdConfig& c) { return c.checkpoint.resume; },
      [](HostdConfig& c, std::string_view v) { c.checkpoint.resume = std::string(v); }));

  const std::string liveness = "Liveness";
  k.push_back(UintKey(
      "heartbeat_interval_ms", liveness, "Interval at which ranks send heartbeats, >= 1.", kU32,
      [](const HostdConfig& c) { return c.heartbeat_interval_ms; },
      [](HostdConfig& c, uint64_t v) { c.heartbeat_interval_ms = static_cast<uint32_t>(v); }));
  k.push_back(UintKey(
      "heartbeat_deadline_ms", liveness,
      "A rank silent for this long is declared dead and its step aborted; > "
      "heartbeat_interval_ms.",
      kU32, [](const HostdConfig& c) { return c.heartbeat_deadline_ms; },
      [](HostdConfig& c, uint64_t v) { c.heartbeat_deadline_ms = static_cast<uint32_t>(v); }));

  const std::string recovery = "Recovery";
  k.push_back(StringEnumKey(
      "recovery_on_inconsistent", recovery,
      "What a starting hostd does when a crashed hostd of its instance left shared-memory state "
      "it cannot re-adopt (a layer mid-update, layers at different versions, another model's "
      "state): checkpoint (restore the latest checkpoint; start fresh when there is none), fresh "
      "(remove it and start the job at step 0) or refuse (fail startup naming the layers and "
      "versions). Consistent state (every layer at the same committed version) is always "
      "re-adopted; a live hostd's state is never touched.",
      {"checkpoint", "fresh", "refuse"}, &HostdConfig::recovery_on_inconsistent));
  return k;
}

}  // namespace

const std::vector<KeyDescriptor>& Keys() {
  static const std::vector<KeyDescriptor>* const keys = new std::vector<KeyDescriptor>(BuildKeys());
  return *keys;
}

const KeyDescriptor* FindKey(std::string_view name) {
  for (const KeyDescriptor& d : Keys()) {
    if (d.name == name) return &d;
  }
  return nullptr;
}

namespace {

size_t EditDistance(std::string_view a, std::string_view b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diag = up;
    }
  }
  return row[b.size()];
}

}  // namespace

std::string Suggestion(std::string_view name, std::string_view prefix) {
  std::string normalized(name);
  std::replace(normalized.begin(), normalized.end(), '-', '_');
  const KeyDescriptor* best = nullptr;
  // Allow about one edit per three characters, so "lrr" suggests "lr" but "a" suggests nothing.
  size_t best_distance = std::max<size_t>(1, std::min<size_t>(3, normalized.size() / 3)) + 1;
  for (const KeyDescriptor& d : Keys()) {
    const size_t dist = EditDistance(normalized, d.name);
    if (dist < best_distance) {
      best = &d;
      best_distance = dist;
    }
  }
  if (best == nullptr) return "";
  return absl::StrCat(" (did you mean '", Av(prefix), best->name, "'?)");
}

}  // namespace slidedp::hostd::config_internal
