// hostd configuration: one table of keys drives the command line, the environment and the TOML
// config file, so every key has the same name, parser, checks and help text in all three.
//
// Precedence: flags > environment > TOML file > defaults. Every source that sets a key is parsed
// and checked (a bad environment variable is an error even when a flag overrides it); the
// highest-precedence one wins and is recorded as the value's source.
//
//   flag   --KEY VALUE or --KEY=VALUE             e.g. --lr 3e-4, --grad_route=gpu_reduction
//   env    SLIDEDP_<KEY in upper case>            e.g. SLIDEDP_LR=3e-4, SLIDEDP_WORLD_SIZE=8
//   file   flat TOML keys with the same names     e.g. lr = 3e-4, grad_route = "cpu_reduction"
// Keys with a dot live in a TOML table: "metrics.listen" is `listen` in `[metrics]` (or the
// dotted key itself), the flag --metrics.listen and the variable SLIDEDP_METRICS_LISTEN.
// The file is named by --config FILE, else by SLIDEDP_CONFIG; without either no file is read.
// Strings, enums and sizes are TOML strings, numbers and booleans are bare; chunk_bytes accepts
// an integer or a size string ("16MiB", "4M", "64KiB"; binary units). Unknown keys in the file and
// unknown flags are errors; SLIDEDP_* variables that name no key are ignored (other SlideDP
// components read their own).
//
// All functions are pure (the environment is passed in) and thread-safe.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "model/defaults.h"
#include "slidedp/v1/control.pb.h"

namespace slidedp::hostd {

// The effective daemon configuration. Every field has a default; see the key table in config.cc
// (or `hostd --help`) for the key that sets each one.
struct HostdConfig {
  std::string instance = "default";                // scopes shm names: [A-Za-z0-9_-]{1,32}
  std::string socket = "/run/slidedp/hostd.sock";  // unix socket path
  std::string listen_tcp;       // "" (off) or 127.0.0.1:PORT, [::1]:PORT, localhost:PORT
  std::string auth_token_file;  // required with listen_tcp (common/tcp_auth.h)
  std::string model = "tiny";   // "tiny", "tiny-tied", a directory or a config.json (LoadModel)
  uint64_t seed = 0;
  uint32_t world_size = 1;  // 1..64
  slidedp::v1::OptimizerConfig optimizer = model::DefaultOptimizerConfig();
  slidedp::v1::Routes routes = model::DefaultRoutes();
  int numa_node = -1;              // -1: auto
  int update_threads = 0;          // 0: all cores of the state's NUMA node
  std::string isa = "auto";        // auto|scalar|avx2|avx512|avx512bf16
  std::string mlock = "required";  // required|best_effort|off
  std::string shm_mode = "0600";   // "0600" or "0660"
  std::string shm_group;           // only with 0660
  std::string init = "auto";       // auto|random|zeros|PATH (hostd/hf_import.h)
  std::string log_level = "info";  // trace|debug|info|warn|error
  // Absolute directories a Checkpoint request's dir and an ExportHF's out_dir may lie under
  // (hostd/output_roots.h); "/" allows any. Key output_roots, comma-separated; default none.
  std::vector<std::string> output_roots;
  uint32_t heartbeat_interval_ms = 500;
  uint32_t heartbeat_deadline_ms = 5000;
  // auto|layer|chunk: whether the GPU-reduction and reduce-scatter routes may update a layer
  // chunk by chunk as its gradient arrives (see the key's help in config.cc for the tear cost).
  std::string update_granularity = "auto";
  // [metrics]: the Prometheus endpoint (hostd/metrics.h). listen: "" or "off" (disabled) or
  // HOST:PORT, loopback unless allow_remote.
  std::string metrics_listen;
  bool metrics_allow_remote = false;
  // [checkpoint] table (keys checkpoint.<name>; env SLIDEDP_CHECKPOINT_<NAME>); hostd/checkpoint.h.
  struct Checkpoint {
    std::string dir;                         // where step directories go; "" : checkpoints off
    uint64_t every_steps = 0;                // 0: only on request (and on stop)
    uint32_t keep_last = 3;                  // 0: keep every checkpoint
    bool on_stop = true;                     // a clean stop writes a final checkpoint first
    bool keep_snapshot_pool = true;          // snapshot buffers stay for the next checkpoint
    bool prepare_snapshot_pool = true;       // allocate the pool after the first step (dir set)
    uint64_t client_upload_timeout_s = 300;  // wait for the ranks' client-updated layers
    uint64_t capture_timeout_s = 300;        // an update's wait for the checkpoint; 0: no limit
    uint64_t snapshot_pool_bytes = 0;        // 0: auto (the state's size when MemAvailable allows)
    uint64_t max_write_mb_per_s = 0;         // pace of a checkpoint written while training runs
    bool direct_io = true;                   // snapshot buffers to disk with O_DIRECT
    std::string resume;  // a checkpoint directory or step directory to start from
  } checkpoint;
  // checkpoint|fresh|refuse: see hostd/recovery.h.
  std::string recovery_on_inconsistent = "checkpoint";
  std::string config_file;  // the TOML file read, if any (not itself a key)
};

// One key of the effective configuration, as shown by --print-config and GetConfig.
struct ConfigEntry {
  std::string key;
  std::string value;   // canonical text: strings raw, numbers shortest round-trip, sizes "16MiB"
  std::string source;  // "default", "file", "env" or "flag"
};

struct LoadedConfig {
  HostdConfig config;
  std::vector<ConfigEntry> entries;  // every key, in table (help) order
  bool print_config = false;         // --print-config: print ConfigToToml(entries) and exit
  bool show_help = false;            // --help / -h: print help_text and exit; nothing else is read
  std::string help_text;             // always filled
};

// Builds the effective configuration from argv (argv[0] is the program name), `env` (the
// process environment, or a fake in tests; only SLIDEDP_* entries matter) and the TOML file named
// by --config or SLIDEDP_CONFIG, then runs ValidateConfig.
// Errors: INVALID_ARGUMENT naming the key, where it came from and what is expected, e.g.
// "clip (env SLIDEDP_CLIP): 'foo' is not one of none, per_layer, global" or
// "lr (file /etc/slidedp/hostd.toml:3): expected a number, got a string"; unknown flags and
// unknown file keys are INVALID_ARGUMENT naming them. NOT_FOUND when the config file cannot be
// read.
absl::StatusOr<LoadedConfig> LoadConfig(int argc, const char* const* argv,
                                        const std::map<std::string, std::string>& env);

// Range and consistency checks (beta in [0,1), eps > 0, world_size 1..64, chunk_bytes a multiple
// of 4096 in [4 KiB, 1 GiB], loopback-only listen_tcp, ...). INVALID_ARGUMENT naming the key.
absl::Status ValidateConfig(const HostdConfig& config);

// The effective configuration as a TOML document that LoadConfig reads back to the same config;
// each line is commented with the value's source.
std::string ConfigToToml(const std::vector<ConfigEntry>& entries);

// Entries for `config`, all with the given source (e.g. for a config built in code).
std::vector<ConfigEntry> ConfigEntries(const HostdConfig& config, std::string_view source);

// The keys, in table order, and the environment variable of a key ("lr" -> "SLIDEDP_LR").
std::vector<std::string> ConfigKeys();
std::string ConfigEnvName(std::string_view key);

// The SLIDEDP_* variables of this process's environment, for LoadConfig.
std::map<std::string, std::string> ProcessEnvironment();

}  // namespace slidedp::hostd
