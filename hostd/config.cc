#include "hostd/config.h"

#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <sstream>
#include <tuple>
#include <utility>

#include "CLI/CLI.hpp"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "common/status_macros.h"
#include "common/tcp_auth.h"
#include "model/hyper_params.h"
#include "model/job_spec.h"
#include "toml++/toml.h"

extern char** environ;

namespace slidedp::hostd {
namespace {

using ::slidedp::v1::OptimizerConfig;
using ::slidedp::v1::Routes;

// Debian's abseil builds absl::string_view as its own class, not an alias of std::string_view.
absl::string_view Av(std::string_view s) { return absl::string_view(s.data(), s.size()); }

constexpr uint64_t kKiB = uint64_t{1} << 10;
constexpr uint64_t kMiB = uint64_t{1} << 20;
constexpr uint64_t kGiB = uint64_t{1} << 30;
// sockaddr_un::sun_path holds 108 bytes including the terminating NUL.
constexpr size_t kMaxSocketPathBytes = 107;
constexpr size_t kMaxInstanceChars = 32;

// How a key's value is written in TOML and which TOML types the file may use for it.
enum class ValueKind { kString, kEnum, kBool, kInt, kUint, kDouble, kSize };

struct KeyDescriptor {
  std::string name;
  std::string section;
  std::string help;
  ValueKind kind;
  std::vector<std::string> choices;  // kEnum only
  // Parses `text` and stores it; the error message names neither key nor source (the caller
  // prefixes both).
  std::function<absl::Status(HostdConfig&, std::string_view text)> set;
  std::function<std::string(const HostdConfig&)> get;
};

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
      "(NCCL all-reduce, one rank pushes) or reduce_scatter (each rank pushes its shard).",
      {{"cpu_reduction", slidedp::v1::GRAD_ROUTE_CPU_REDUCTION},
       {"gpu_reduction", slidedp::v1::GRAD_ROUTE_GPU_REDUCTION},
       {"reduce_scatter", slidedp::v1::GRAD_ROUTE_REDUCE_SCATTER}},
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
                     "Optimizer worker threads, >= 0; 0: all cores of the state's NUMA node.",
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

// " (did you mean 'lr'?)" when a key is close to `name`, else "".
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

// Where a key's current value came from.
struct Origin {
  std::string source = "default";  // default|file|env|flag
  std::string detail = "default";  // "flag --lr", "env SLIDEDP_LR", "file /x.toml:3"
};

absl::Status KeyError(std::string_view key, std::string_view detail, std::string_view msg) {
  if (detail.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(Av(key), ": ", Av(msg)));
  }
  return absl::InvalidArgumentError(absl::StrCat(Av(key), " (", Av(detail), "): ", Av(msg)));
}

// Well-formed UTF-8 (RFC 3629: no overlongs, surrogates or code points above U+10FFFF).
bool IsUtf8(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    const auto b = static_cast<unsigned char>(s[i]);
    size_t n = 0;
    uint32_t cp = 0;
    if (b < 0x80) {
      ++i;
      continue;
    } else if ((b & 0xE0) == 0xC0) {
      n = 1, cp = b & 0x1F;
    } else if ((b & 0xF0) == 0xE0) {
      n = 2, cp = b & 0x0F;
    } else if ((b & 0xF8) == 0xF0) {
      n = 3, cp = b & 0x07;
    } else {
      return false;
    }
    if (i + n >= s.size()) return false;  // truncated sequence
    for (size_t k = 1; k <= n; ++k) {
      const auto c = static_cast<unsigned char>(s[i + k]);
      if ((c & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (c & 0x3F);
    }
    static constexpr uint32_t kMin[] = {0, 0x80, 0x800, 0x10000};
    if (cp < kMin[n] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return false;
    i += n + 1;
  }
  return true;
}

absl::Status SetFrom(const KeyDescriptor& d, HostdConfig& c, std::string_view text,
                     std::string_view detail) {
  // The effective config is shown and saved as TOML, which is UTF-8.
  if (!IsUtf8(text)) return KeyError(d.name, detail, "is not valid UTF-8 text");
  absl::Status s = d.set(c, text);
  if (!s.ok()) return KeyError(d.name, detail, std::string(s.message()));
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------------------
// Validation, with each key's origin for the message.

using WhereFn = std::function<std::string(std::string_view key)>;

absl::Status Validate(const HostdConfig& c, const WhereFn& where) {
  auto fail = [&where](std::string_view key, std::string_view msg) {
    return KeyError(key, where(key), msg);
  };
  auto in_choices = [](std::string_view key, const std::string& v) {
    const std::vector<std::string>& ch = FindKey(key)->choices;
    return std::find(ch.begin(), ch.end(), v) != ch.end();
  };
  auto not_one_of = [](std::string_view key, const std::string& v) {
    return absl::StrCat("'", v, "' is not one of ", absl::StrJoin(FindKey(key)->choices, ", "));
  };

  if (c.instance.empty() || c.instance.size() > kMaxInstanceChars ||
      !std::all_of(c.instance.begin(), c.instance.end(), [](char ch) {
        return absl::ascii_isalnum(static_cast<unsigned char>(ch)) || ch == '_' || ch == '-';
      })) {
    return fail("instance", absl::StrCat("'", c.instance,
                                         "' is not a valid instance name; expected 1 to 32 "
                                         "characters of [A-Za-z0-9_-]"));
  }
  if (c.socket.empty() || c.socket.size() > kMaxSocketPathBytes ||
      c.socket.find('\0') != std::string::npos) {
    return fail("socket", absl::StrCat("'", c.socket, "' must be a non-empty path of at most ",
                                       kMaxSocketPathBytes, " bytes"));
  }
  if (!c.listen_tcp.empty() && !IsLoopbackHostPort(c.listen_tcp, /*allow_port_zero=*/true)) {
    return fail("listen_tcp",
                absl::StrCat("'", c.listen_tcp,
                             "' is not a loopback address; expected 127.0.0.1:PORT, [::1]:PORT or "
                             "localhost:PORT with PORT 0..65535, or empty (hostd serves only "
                             "local clients)"));
  }
  if (!c.listen_tcp.empty() && c.auth_token_file.empty()) {
    return fail("listen_tcp",
                absl::StrCat("'", c.listen_tcp,
                             "' needs auth_token_file: every local user can reach a TCP port, so "
                             "calls over it must carry the token of a file only hostd's user and "
                             "group can read (e.g. `openssl rand -hex 32 > FILE; chmod 0640 "
                             "FILE`)"));
  }
  if (!c.auth_token_file.empty() && c.auth_token_file.front() != '/') {
    return fail("auth_token_file",
                absl::StrCat("'", c.auth_token_file, "' must be an absolute path"));
  }
  if (!c.metrics_listen.empty() && c.metrics_listen != "off") {
    const size_t colon = c.metrics_listen.rfind(':');
    uint32_t port = 0;
    const std::string_view port_text = colon == std::string::npos
                                           ? std::string_view()
                                           : std::string_view(c.metrics_listen).substr(colon + 1);
    auto [end, ec] = std::from_chars(port_text.data(), port_text.data() + port_text.size(), port);
    if (colon == std::string::npos || colon == 0 || port_text.empty() || ec != std::errc() ||
        end != port_text.data() + port_text.size() || port > 65535) {
      return fail("metrics.listen",
                  absl::StrCat("'", c.metrics_listen,
                               "' is not HOST:PORT with PORT 0..65535; expected e.g. "
                               "127.0.0.1:9464, or empty/off to disable"));
    }
    if (!c.metrics_allow_remote &&
        !IsLoopbackHostPort(c.metrics_listen, /*allow_port_zero=*/true)) {
      return fail("metrics.listen",
                  absl::StrCat("'", c.metrics_listen,
                               "' is not a loopback address (127.0.0.1, [::1], localhost) and the "
                               "endpoint has no authentication; set metrics.allow_remote = true "
                               "to serve it anyway"));
    }
  }
  if (!in_choices("log_level", c.log_level)) {
    return fail("log_level", not_one_of("log_level", c.log_level));
  }
  if (c.model.empty()) {
    return fail("model",
                "must not be empty; expected tiny, tiny-tied, a directory containing "
                "config.json, or a path to a config.json");
  }
  if (std::optional<model::SettingError> e = model::CheckWorldSize(c.world_size)) {
    return fail(e->field, e->message);
  }
  if (c.init != "auto" && c.init != "random" && c.init != "zeros" &&
      (c.init.find('/') == std::string::npos && !c.init.ends_with(".safetensors"))) {
    return fail("init", absl::StrCat("'", c.init,
                                     "' is not one of auto, random, zeros, or a path (a path "
                                     "contains '/' or ends in .safetensors, e.g. ./",
                                     c.init, ")"));
  }
  if (c.init.find('\0') != std::string::npos) return fail("init", "must not contain NUL");

  if (std::optional<model::SettingError> e = model::CheckOptimizer(c.optimizer)) {
    return fail(e->field, e->message);
  }
  if (std::optional<model::SettingError> e = model::CheckRoutes(c.routes))
    return fail(e->field, e->message);

  if (c.numa_node < -1) {
    return fail("numa_node", absl::StrCat("must be >= -1 (-1: auto), got ", c.numa_node));
  }
  if (c.update_threads < 0) {
    return fail("update_threads",
                absl::StrCat("must be >= 0 (0: all cores of the node), got ", c.update_threads));
  }
  if (!in_choices("isa", c.isa)) return fail("isa", not_one_of("isa", c.isa));
  if (!in_choices("update_granularity", c.update_granularity)) {
    return fail("update_granularity", not_one_of("update_granularity", c.update_granularity));
  }
  for (const std::string& root : c.output_roots) {
    if (root.empty() || root.front() != '/') {
      return fail("output_roots",
                  absl::StrCat("'", root,
                               "' is not an absolute directory; expected a comma-separated list "
                               "of absolute directories (\"/\" allows any)"));
    }
  }
  if (c.checkpoint.every_steps > 0 && c.checkpoint.dir.empty()) {
    return fail(
        "checkpoint.every_steps",
        absl::StrCat("is ", c.checkpoint.every_steps,
                     " but checkpoint.dir is empty; set checkpoint.dir (or every_steps 0)"));
  }
  if (!in_choices("mlock", c.mlock)) return fail("mlock", not_one_of("mlock", c.mlock));
  if (!in_choices("recovery_on_inconsistent", c.recovery_on_inconsistent)) {
    return fail("recovery_on_inconsistent",
                not_one_of("recovery_on_inconsistent", c.recovery_on_inconsistent));
  }
  if (!in_choices("shm_mode", c.shm_mode)) {
    return fail("shm_mode", not_one_of("shm_mode", c.shm_mode));
  }
  if (!c.shm_group.empty() && c.shm_mode != "0660") {
    return fail("shm_group", absl::StrCat("'", c.shm_group, "' is set but shm_mode is ", c.shm_mode,
                                          "; a group needs shm_mode 0660"));
  }
  if (c.heartbeat_interval_ms < 1) {
    return fail("heartbeat_interval_ms", "must be >= 1");
  }
  if (c.heartbeat_deadline_ms <= c.heartbeat_interval_ms) {
    return fail(
        "heartbeat_deadline_ms",
        absl::StrCat(c.heartbeat_deadline_ms, " must be greater than heartbeat_interval_ms (",
                     c.heartbeat_interval_ms, ")"));
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------------------
// Sources.

std::string Placeholder(const KeyDescriptor& d) {
  switch (d.kind) {
    case ValueKind::kString:
      return "TEXT";
    case ValueKind::kEnum:
      return absl::StrCat("{", absl::StrJoin(d.choices, "|"), "}");
    case ValueKind::kBool:
      return "{true|false}";
    case ValueKind::kInt:
      return "INT";
    case ValueKind::kUint:
      return "UINT";
    case ValueKind::kDouble:
      return "NUMBER";
    case ValueKind::kSize:
      return "SIZE";
  }
  return "VALUE";
}

// Greedy word wrap of `text` into lines of at most `width` columns, each prefixed by `indent`.
std::string Wrap(std::string_view text, std::string_view indent, size_t width = 80) {
  std::string out;
  size_t col = 0;
  for (absl::string_view word : absl::StrSplit(Av(text), ' ', absl::SkipEmpty())) {
    if (col > 0 && col + 1 + word.size() > width) {
      out += '\n';
      col = 0;
    }
    if (col == 0) {
      absl::StrAppend(&out, Av(indent), word);
      col = indent.size() + word.size();
    } else {
      absl::StrAppend(&out, " ", word);
      col += 1 + word.size();
    }
  }
  out += '\n';
  return out;
}

std::string HelpText(std::string_view program) {
  const HostdConfig defaults;
  std::string out = absl::StrCat(
      "Usage: ", Av(program), " [--config FILE] [--print-config] [--KEY VALUE]...\n\n",
      "SlideDP host daemon: owns the FP32 master weights and Adam state of a model in shared\n"
      "memory and serves rank processes over a unix socket.\n\n",
      "Configuration, highest precedence first:\n"
      "  flags        --KEY VALUE or --KEY=VALUE\n"
      "  environment  SLIDEDP_<KEY in upper case>, e.g. SLIDEDP_LR=3e-4\n"
      "  TOML file    flat `key = value` lines with the same names, e.g. lr = 3e-4,\n"
      "               grad_route = \"cpu_reduction\"; named by --config or SLIDEDP_CONFIG\n"
      "  defaults     shown below\n\n"
      "Options:\n"
      "  -h, --help\n      Print this help and exit.\n"
      "  --config FILE\n      TOML config file to read.\n      env: SLIDEDP_CONFIG\n"
      "  --print-config\n      Print the effective configuration as TOML, each value commented "
      "with its\n      source (default, file, env, flag), and exit.\n"
      "  --resume PATH\n      Alias of --checkpoint.resume.\n");
  std::string section;
  for (const KeyDescriptor& d : Keys()) {
    if (d.section != section) {
      section = d.section;
      absl::StrAppend(&out, "\n", section, ":\n");
    }
    std::string def = d.get(defaults);
    if (def.empty()) def = "(empty)";
    absl::StrAppend(&out, "  --", d.name, " ", Placeholder(d), "\n", Wrap(d.help, "      "),
                    "      default: ", def, "   env: ", ConfigEnvName(d.name), "\n");
  }
  return out;
}

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::NotFoundError(
        absl::StrCat("config file ", path, ": cannot open: ", std::strerror(errno)));
  }
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) return absl::NotFoundError(absl::StrCat("config file ", path, ": read failed"));
  return ss.str();
}

std::string_view TomlTypeName(const toml::node& n) {
  switch (n.type()) {
    case toml::node_type::string:
      return "a string";
    case toml::node_type::integer:
      return "an integer";
    case toml::node_type::floating_point:
      return "a float";
    case toml::node_type::boolean:
      return "a boolean";
    case toml::node_type::table:
      return "a table";
    case toml::node_type::array:
      return "an array";
    default:
      return "a date/time";
  }
}

// The text form of a TOML value for `d`'s parser, or an error naming the expected TOML type.
absl::StatusOr<std::string> TomlValueText(const KeyDescriptor& d, const toml::node& n) {
  auto expected = [&n](std::string_view what) {
    return absl::InvalidArgumentError(
        absl::StrCat("expected ", Av(what), ", got ", Av(TomlTypeName(n))));
  };
  switch (d.kind) {
    case ValueKind::kString:
      if (n.is_string()) return n.as_string()->get();
      return expected("a string");
    case ValueKind::kEnum:
      if (n.is_string()) return n.as_string()->get();
      return expected(absl::StrCat("a string, one of ", absl::StrJoin(d.choices, ", ")));
    case ValueKind::kBool:
      if (n.is_boolean()) return std::string(n.as_boolean()->get() ? "true" : "false");
      return expected("a boolean (true or false)");
    case ValueKind::kInt:
      if (n.is_integer()) return absl::StrCat(n.as_integer()->get());
      return expected("an integer");
    case ValueKind::kUint:
      if (n.is_integer()) return absl::StrCat(n.as_integer()->get());
      // TOML integers stop at 2^63-1; larger values are written as strings.
      if (n.is_string()) return n.as_string()->get();
      return expected("an unsigned integer");
    case ValueKind::kDouble:
      if (n.is_floating_point()) return model::FormatSetting(n.as_floating_point()->get());
      if (n.is_integer()) return absl::StrCat(n.as_integer()->get());
      return expected("a number");
    case ValueKind::kSize:
      if (n.is_integer()) return absl::StrCat(n.as_integer()->get());
      if (n.is_string()) return n.as_string()->get();
      return expected("an integer or a size string such as \"16MiB\"");
  }
  return expected("a value");
}

absl::Status ApplyFile(const std::string& path, HostdConfig& c, std::vector<Origin>& origins) {
  ASSIGN_OR_RETURN(const std::string text, ReadFile(path));
  toml::table table;
  try {
    table = toml::parse(text, path);
  } catch (const toml::parse_error& e) {
    return absl::InvalidArgumentError(absl::StrCat("config file ", path, ":", e.source().begin.line,
                                                   ":", e.source().begin.column, ": ",
                                                   Av(e.description())));
  }
  // Report problems in file order rather than the table's key order.
  // A table whose keys are dotted keys of the table ([metrics] listen = metrics.listen) is
  // flattened into them.
  std::vector<std::pair<const toml::key*, const toml::node*>> items;
  std::map<const toml::key*, std::string> prefixes;
  const std::vector<KeyDescriptor>& all_keys = Keys();
  for (const auto& [key, node] : table) {
    const std::string prefix = absl::StrCat(Av(key.str()), ".");
    const bool is_section =
        node.is_table() && std::any_of(all_keys.begin(), all_keys.end(), [&](const auto& d) {
          return absl::StartsWith(d.name, prefix);
        });
    if (!is_section) {
      items.emplace_back(&key, &node);
      continue;
    }
    for (const auto& [sub_key, sub_node] : *node.as_table()) {
      items.emplace_back(&sub_key, &sub_node);
      prefixes[&sub_key] = prefix;
    }
  }
  std::sort(items.begin(), items.end(), [](const auto& a, const auto& b) {
    return std::get<1>(a)->source().begin.line < std::get<1>(b)->source().begin.line;
  });
  const std::vector<KeyDescriptor>& keys = Keys();
  for (const auto& [key, node] : items) {
    const auto prefix = prefixes.find(key);
    const std::string name =
        absl::StrCat(prefix == prefixes.end() ? "" : prefix->second, Av(key->str()));
    const std::string detail = absl::StrCat("file ", path, ":", key->source().begin.line);
    const auto it = std::find_if(keys.begin(), keys.end(),
                                 [&name](const KeyDescriptor& d) { return d.name == name; });
    if (it == keys.end()) {
      if (node->is_table()) {
        return KeyError(name, detail,
                        "is a table; hostd's config file has flat keys and the tables [metrics] "
                        "and [checkpoint]");
      }
      return KeyError(name, detail,
                      absl::StrCat("unknown key", Suggestion(name, ""), "; see hostd --help"));
    }
    absl::StatusOr<std::string> value = TomlValueText(*it, *node);
    if (!value.ok()) return KeyError(name, detail, std::string(value.status().message()));
    RETURN_IF_ERROR(SetFrom(*it, c, *value, detail));
    origins[static_cast<size_t>(it - keys.begin())] = {"file", detail};
  }
  return absl::OkStatus();
}

std::string TomlQuote(std::string_view s) {
  std::string out = "\"";
  for (const char ch : s) {
    const auto u = static_cast<unsigned char>(ch);
    if (ch == '"' || ch == '\\') {
      out += '\\';
      out += ch;
    } else if (u < 0x20 || u == 0x7f) {
      absl::StrAppend(&out, "\\u00", absl::Hex(u, absl::kZeroPad2));
    } else {
      out += ch;
    }
  }
  out += '"';
  return out;
}

std::string TomlValue(const KeyDescriptor* d, const std::string& value) {
  if (d == nullptr) return TomlQuote(value);
  switch (d->kind) {
    case ValueKind::kBool:
    case ValueKind::kInt:
    case ValueKind::kDouble:
      return value;
    case ValueKind::kUint: {
      uint64_t v = 0;
      if (absl::SimpleAtoi(value, &v) && v <= static_cast<uint64_t>(INT64_MAX)) return value;
      return TomlQuote(value);
    }
    case ValueKind::kString:
    case ValueKind::kEnum:
    case ValueKind::kSize:
      return TomlQuote(value);
  }
  return TomlQuote(value);
}

}  // namespace

std::vector<std::string> ConfigKeys() {
  std::vector<std::string> out;
  for (const KeyDescriptor& d : Keys()) out.push_back(d.name);
  return out;
}

std::string ConfigEnvName(std::string_view key) {
  return absl::StrReplaceAll(absl::StrCat("SLIDEDP_", absl::AsciiStrToUpper(Av(key))),
                             {{".", "_"}});
}

std::map<std::string, std::string> ProcessEnvironment() {
  std::map<std::string, std::string> env;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    const std::string_view kv(*e);
    if (!kv.starts_with("SLIDEDP_")) continue;
    const size_t eq = kv.find('=');
    if (eq == std::string_view::npos) continue;
    env.emplace(std::string(kv.substr(0, eq)), std::string(kv.substr(eq + 1)));
  }
  return env;
}

std::vector<ConfigEntry> ConfigEntries(const HostdConfig& config, std::string_view source) {
  std::vector<ConfigEntry> out;
  for (const KeyDescriptor& d : Keys()) {
    out.push_back({d.name, d.get(config), std::string(source)});
  }
  return out;
}

absl::Status ValidateConfig(const HostdConfig& config) {
  return Validate(config, [](std::string_view) { return std::string(); });
}

std::string ConfigToToml(const std::vector<ConfigEntry>& entries) {
  std::vector<std::string> lines;
  size_t width = 0;
  for (const ConfigEntry& e : entries) {
    lines.push_back(absl::StrCat(e.key, " = ", TomlValue(FindKey(e.key), e.value)));
    width = std::max(width, lines.back().size());
  }
  width = std::min<size_t>(width, 48);
  std::string out =
      "# hostd effective configuration; each value is commented with its source\n"
      "# (default, file, env SLIDEDP_<KEY>, flag --KEY).\n";
  for (size_t i = 0; i < entries.size(); ++i) {
    absl::StrAppend(&out, lines[i], std::string(width + 2 - std::min(width, lines[i].size()), ' '),
                    "# ", entries[i].source, "\n");
  }
  return out;
}

absl::StatusOr<LoadedConfig> LoadConfig(int argc, const char* const* argv,
                                        const std::map<std::string, std::string>& env) {
  const std::vector<KeyDescriptor>& keys = Keys();
  const std::string program = argc > 0 && argv[0] != nullptr && argv[0][0] != '\0'
                                  ? std::filesystem::path(argv[0]).filename().string()
                                  : std::string("hostd");

  LoadedConfig out;
  out.help_text = HelpText(program);

  // Command line. Values are kept as text and parsed below by the same functions as env and file.
  CLI::App app{"SlideDP host daemon", program};
  app.set_help_flag();  // our own --help prints the key table
  app.allow_extras();   // reported below with a suggestion
  std::vector<std::string> flag_values(keys.size());
  std::vector<CLI::Option*> flag_options(keys.size());
  for (size_t i = 0; i < keys.size(); ++i) {
    flag_options[i] = app.add_option("--" + keys[i].name, flag_values[i], keys[i].help)
                          ->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  }
  std::string config_flag;
  CLI::Option* config_option = app.add_option("--config", config_flag, "TOML config file")
                                   ->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  app.add_flag("--print-config", out.print_config, "Print the effective configuration");
  std::string resume_flag;
  CLI::Option* resume_option =
      app.add_option("--resume", resume_flag, "Alias of --checkpoint.resume")
          ->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  app.add_flag("-h,--help", out.show_help, "Print help");
  if (argc > 0) {
    try {
      app.parse(argc, argv);
    } catch (const CLI::ParseError& e) {
      return absl::InvalidArgumentError(absl::StrCat("command line: ", e.what()));
    }
  }
  const std::vector<std::string> extras = app.remaining();
  if (!extras.empty()) {
    const std::string& first = extras.front();
    if (first.starts_with("-") && first != "--") {
      const std::string flag = first.substr(0, first.find('='));
      const size_t dashes = flag.starts_with("--") ? 2 : 1;
      return absl::InvalidArgumentError(absl::StrCat(
          "command line: unknown flag '", flag, "'",
          Suggestion(std::string_view(flag).substr(dashes), "--"), "; see --help for the keys"));
    }
    return absl::InvalidArgumentError(absl::StrCat("command line: unexpected argument '", first,
                                                   "'; hostd takes only --KEY VALUE flags"));
  }
  if (out.show_help) {
    out.entries = ConfigEntries(out.config, "default");
    return out;
  }

  HostdConfig& c = out.config;
  std::vector<Origin> origins(keys.size());

  // File: --config, else SLIDEDP_CONFIG (empty means none).
  if (config_option->count() > 0) {
    if (config_flag.empty()) {
      return absl::InvalidArgumentError("config (flag --config): empty path; expected a file");
    }
    c.config_file = config_flag;
  } else if (auto it = env.find("SLIDEDP_CONFIG"); it != env.end() && !it->second.empty()) {
    c.config_file = it->second;
  }
  if (!c.config_file.empty()) RETURN_IF_ERROR(ApplyFile(c.config_file, c, origins));

  for (size_t i = 0; i < keys.size(); ++i) {
    const std::string env_name = ConfigEnvName(keys[i].name);
    const auto it = env.find(env_name);
    if (it == env.end()) continue;
    const std::string detail = absl::StrCat("env ", env_name);
    RETURN_IF_ERROR(SetFrom(keys[i], c, it->second, detail));
    origins[i] = {"env", detail};
  }

  for (size_t i = 0; i < keys.size(); ++i) {
    if (flag_options[i]->count() == 0) continue;
    const std::string detail = absl::StrCat("flag --", keys[i].name);
    RETURN_IF_ERROR(SetFrom(keys[i], c, flag_values[i], detail));
    origins[i] = {"flag", detail};
  }

  if (resume_option->count() > 0) {
    for (size_t i = 0; i < keys.size(); ++i) {
      if (keys[i].name != "checkpoint.resume") continue;
      if (flag_options[i]->count() > 0) {
        return absl::InvalidArgumentError(
            "command line: --resume and --checkpoint.resume both given; use one");
      }
      RETURN_IF_ERROR(SetFrom(keys[i], c, resume_flag, "flag --resume"));
      origins[i] = {"flag", "flag --resume"};
    }
  }

  RETURN_IF_ERROR(Validate(c, [&](std::string_view key) {
    for (size_t i = 0; i < keys.size(); ++i) {
      if (keys[i].name == key) return origins[i].detail;
    }
    return std::string();
  }));

  out.entries.reserve(keys.size());
  for (size_t i = 0; i < keys.size(); ++i) {
    out.entries.push_back({keys[i].name, keys[i].get(c), origins[i].source});
  }
  return out;
}

}  // namespace slidedp::hostd
