#include "hostd/config.h"

#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace slidedp::hostd {
namespace {

using ::testing::HasSubstr;

using Env = std::map<std::string, std::string>;

// A temporary directory removed with its contents at scope exit.
class TempDir {
 public:
  TempDir() {
    std::string tmpl = (std::filesystem::path(::testing::TempDir()) / "config_test.XXXXXX");
    char* made = mkdtemp(tmpl.data());
    EXPECT_NE(made, nullptr);
    path_ = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  std::string Write(const std::string& name, const std::string& text) const {
    const std::filesystem::path p = path_ / name;
    std::ofstream(p) << text;
    return p.string();
  }
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

absl::StatusOr<LoadedConfig> Load(std::vector<std::string> args, const Env& env = {}) {
  args.insert(args.begin(), "/usr/bin/hostd");
  std::vector<const char*> argv;
  for (const std::string& a : args) argv.push_back(a.c_str());
  return LoadConfig(static_cast<int>(argv.size()), argv.data(), env);
}

LoadedConfig MustLoad(std::vector<std::string> args, const Env& env = {}) {
  absl::StatusOr<LoadedConfig> c = Load(std::move(args), env);
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? *std::move(c) : LoadedConfig{};
}

const ConfigEntry& Entry(const LoadedConfig& c, const std::string& key) {
  for (const ConfigEntry& e : c.entries) {
    if (e.key == key) return e;
  }
  ADD_FAILURE() << "no entry " << key;
  static const ConfigEntry kNone;
  return kNone;
}

std::string Msg(const absl::Status& s) { return std::string(s.message()); }

// ---------------------------------------------------------------------------------------------
// Defaults.

TEST(ConfigTest, Defaults) {
  const LoadedConfig c = MustLoad({});
  EXPECT_FALSE(c.show_help);
  EXPECT_FALSE(c.print_config);
  EXPECT_EQ(c.config.instance, "default");
  EXPECT_EQ(c.config.socket, "/run/slidedp/hostd.sock");
  EXPECT_EQ(c.config.listen_tcp, "");
  EXPECT_EQ(c.config.model, "tiny");
  EXPECT_EQ(c.config.seed, 0u);
  EXPECT_EQ(c.config.world_size, 1u);
  const auto& o = c.config.optimizer;
  EXPECT_DOUBLE_EQ(o.lr(), 1e-4);
  EXPECT_DOUBLE_EQ(o.beta1(), 0.9);
  EXPECT_DOUBLE_EQ(o.beta2(), 0.999);
  EXPECT_DOUBLE_EQ(o.eps(), 1e-8);
  EXPECT_DOUBLE_EQ(o.weight_decay(), 0.01);
  EXPECT_TRUE(o.no_decay_norms_and_biases());
  EXPECT_EQ(o.schedule(), slidedp::v1::LR_SCHEDULE_CONSTANT);
  EXPECT_EQ(o.warmup_steps(), 0u);
  EXPECT_EQ(o.total_steps(), 0u);
  EXPECT_DOUBLE_EQ(o.min_lr_ratio(), 0.0);
  EXPECT_EQ(o.clip(), slidedp::v1::CLIP_POLICY_NONE);
  EXPECT_DOUBLE_EQ(o.max_grad_norm(), 1.0);
  EXPECT_EQ(o.grad_dtype(), slidedp::v1::DTYPE_BF16);
  EXPECT_TRUE(o.scale_by_world_size());
  EXPECT_EQ(c.config.routes.param_route(), slidedp::v1::PARAM_ROUTE_REPLICATED);
  EXPECT_EQ(c.config.routes.grad_route(), slidedp::v1::GRAD_ROUTE_AUTO);
  EXPECT_EQ(c.config.routes.chunk_bytes(), 16u << 20);
  EXPECT_EQ(c.config.numa_node, -1);
  EXPECT_EQ(c.config.update_threads, 0);
  EXPECT_EQ(c.config.isa, "auto");
  EXPECT_EQ(c.config.update_granularity, "auto");
  EXPECT_EQ(c.config.mlock, "required");
  EXPECT_EQ(c.config.shm_mode, "0600");
  EXPECT_EQ(c.config.shm_group, "");
  EXPECT_EQ(c.config.init, "auto");
  EXPECT_EQ(c.config.log_level, "info");
  EXPECT_EQ(c.config.heartbeat_interval_ms, 500u);
  EXPECT_EQ(c.config.heartbeat_deadline_ms, 5000u);
  EXPECT_EQ(c.config.config_file, "");

  ASSERT_EQ(c.entries.size(), ConfigKeys().size());
  for (size_t i = 0; i < c.entries.size(); ++i) {
    EXPECT_EQ(c.entries[i].key, ConfigKeys()[i]);
    EXPECT_EQ(c.entries[i].source, "default") << c.entries[i].key;
  }
  EXPECT_EQ(Entry(c, "lr").value, "0.0001");
  EXPECT_EQ(Entry(c, "eps").value, "1e-08");
  EXPECT_EQ(Entry(c, "max_grad_norm").value, "1.0");
  EXPECT_EQ(Entry(c, "chunk_bytes").value, "16MiB");
  EXPECT_EQ(Entry(c, "grad_route").value, "auto");
  EXPECT_EQ(Entry(c, "schedule").value, "constant");
  EXPECT_EQ(Entry(c, "no_decay_norms_and_biases").value, "true");
  EXPECT_EQ(Entry(c, "numa_node").value, "-1");
}

TEST(ConfigTest, DefaultStructIsValidAndMatchesLoadedDefaults) {
  const HostdConfig def;
  EXPECT_TRUE(ValidateConfig(def).ok()) << ValidateConfig(def);
  const LoadedConfig c = MustLoad({});
  const std::vector<ConfigEntry> entries = ConfigEntries(def, "default");
  ASSERT_EQ(entries.size(), c.entries.size());
  for (size_t i = 0; i < entries.size(); ++i) EXPECT_EQ(entries[i].value, c.entries[i].value);
}

// ---------------------------------------------------------------------------------------------
// Each source alone.

TEST(ConfigTest, FlagsAlone) {
  const LoadedConfig c = MustLoad({"--instance",
                                   "job-7",
                                   "--lr",
                                   "3e-4",
                                   "--grad_route=gpu_reduction",
                                   "--chunk_bytes",
                                   "4M",
                                   "--world_size",
                                   "8",
                                   "--numa_node",
                                   "-1",
                                   "--numa_node",
                                   "1",
                                   "--no_decay_norms_and_biases",
                                   "false",
                                   "--listen_tcp",
                                   "[::1]:7000",
                                   "--auth_token_file",
                                   "/etc/slidedp/token",
                                   "--shm_mode",
                                   "0660",
                                   "--shm_group",
                                   "slidedp",
                                   "--seed",
                                   "18446744073709551615"});
  EXPECT_EQ(c.config.instance, "job-7");
  EXPECT_DOUBLE_EQ(c.config.optimizer.lr(), 3e-4);
  EXPECT_EQ(c.config.routes.grad_route(), slidedp::v1::GRAD_ROUTE_GPU_REDUCTION);
  EXPECT_EQ(c.config.routes.chunk_bytes(), 4u << 20);
  EXPECT_EQ(c.config.world_size, 8u);
  EXPECT_EQ(c.config.numa_node, 1);  // the last occurrence wins
  EXPECT_FALSE(c.config.optimizer.no_decay_norms_and_biases());
  EXPECT_EQ(c.config.listen_tcp, "[::1]:7000");
  EXPECT_EQ(c.config.shm_group, "slidedp");
  EXPECT_EQ(c.config.seed, UINT64_MAX);
  for (const char* k : {"instance", "lr", "grad_route", "chunk_bytes", "world_size", "numa_node",
                        "no_decay_norms_and_biases", "listen_tcp", "shm_mode", "shm_group"}) {
    EXPECT_EQ(Entry(c, k).source, "flag") << k;
  }
  EXPECT_EQ(Entry(c, "beta1").source, "default");
  EXPECT_EQ(Entry(c, "chunk_bytes").value, "4MiB");
}

TEST(ConfigTest, EnvAlone) {
  const LoadedConfig c = MustLoad({}, {{"SLIDEDP_LR", "0.001"},
                                       {"SLIDEDP_WORLD_SIZE", "4"},
                                       {"SLIDEDP_CLIP", "global"},
                                       {"SLIDEDP_SCHEDULE", "cosine"},
                                       {"SLIDEDP_WARMUP_STEPS", "100"},
                                       {"SLIDEDP_TOTAL_STEPS", "1000"},
                                       {"SLIDEDP_GRAD_DTYPE", "fp32"},
                                       {"SLIDEDP_ISA", "avx512bf16"},
                                       {"SLIDEDP_UNRELATED", "ignored"},
                                       {"PATH", "/bin"}});
  EXPECT_DOUBLE_EQ(c.config.optimizer.lr(), 1e-3);
  EXPECT_EQ(c.config.world_size, 4u);
  EXPECT_EQ(c.config.optimizer.clip(), slidedp::v1::CLIP_POLICY_GLOBAL);
  EXPECT_EQ(c.config.optimizer.schedule(), slidedp::v1::LR_SCHEDULE_COSINE);
  EXPECT_EQ(c.config.optimizer.warmup_steps(), 100u);
  EXPECT_EQ(c.config.optimizer.total_steps(), 1000u);
  EXPECT_EQ(c.config.optimizer.grad_dtype(), slidedp::v1::DTYPE_FP32);
  EXPECT_EQ(c.config.isa, "avx512bf16");
  for (const char* k : {"lr", "world_size", "clip", "schedule", "warmup_steps", "total_steps",
                        "grad_dtype", "isa"}) {
    EXPECT_EQ(Entry(c, k).source, "env") << k;
  }
  EXPECT_EQ(Entry(c, "eps").source, "default");
}

TEST(ConfigTest, FileAlone) {
  TempDir tmp;
  const std::string file = tmp.Write("hostd.toml", R"(# hostd config
instance = "prod"
lr = 3e-4
beta2 = 0.95
weight_decay = 0          # integers are fine for numbers
grad_route = "reduce_scatter"
param_route = "sharded"
chunk_bytes = "64KiB"
scale_by_world_size = false
heartbeat_deadline_ms = 10000
update_threads = 12
update_granularity = "layer"
log_level = "debug"
)");
  for (const bool via_env : {false, true}) {
    const LoadedConfig c =
        via_env ? MustLoad({}, {{"SLIDEDP_CONFIG", file}}) : MustLoad({"--config", file});
    EXPECT_EQ(c.config.config_file, file);
    EXPECT_EQ(c.config.instance, "prod");
    EXPECT_DOUBLE_EQ(c.config.optimizer.lr(), 3e-4);
    EXPECT_DOUBLE_EQ(c.config.optimizer.beta2(), 0.95);
    EXPECT_DOUBLE_EQ(c.config.optimizer.weight_decay(), 0.0);
    EXPECT_EQ(c.config.routes.grad_route(), slidedp::v1::GRAD_ROUTE_REDUCE_SCATTER);
    EXPECT_EQ(c.config.routes.param_route(), slidedp::v1::PARAM_ROUTE_SHARDED);
    EXPECT_EQ(c.config.routes.chunk_bytes(), 64u << 10);
    EXPECT_FALSE(c.config.optimizer.scale_by_world_size());
    EXPECT_EQ(c.config.heartbeat_deadline_ms, 10000u);
    EXPECT_EQ(c.config.update_threads, 12);
    EXPECT_EQ(c.config.update_granularity, "layer");
    EXPECT_EQ(c.config.log_level, "debug");
    EXPECT_EQ(Entry(c, "lr").source, "file");
    EXPECT_EQ(Entry(c, "update_threads").source, "file");
    EXPECT_EQ(Entry(c, "beta1").source, "default");
  }
}

TEST(ConfigTest, MetricsTableFlagsEnvAndLoopbackCheck) {
  TempDir tmp;
  // [metrics] in a file, or its dotted keys: both are the keys metrics.*.
  for (const char* text : {"lr = 1e-3\n[metrics]\nlisten = \"127.0.0.1:9464\"\n",
                           "metrics.listen = \"127.0.0.1:9464\"\nlr = 1e-3\n"}) {
    const LoadedConfig c = MustLoad({"--config", tmp.Write("m.toml", text)});
    EXPECT_EQ(c.config.metrics_listen, "127.0.0.1:9464") << text;
    EXPECT_FALSE(c.config.metrics_allow_remote);
  }
  EXPECT_EQ(MustLoad({}, {{"SLIDEDP_METRICS_LISTEN", "[::1]:1"}}).config.metrics_listen, "[::1]:1");
  EXPECT_EQ(MustLoad({"--metrics.listen", "off"}).config.metrics_listen, "off");
  EXPECT_EQ(MustLoad({}).config.metrics_listen, "");  // off by default
  auto remote = Load({"--metrics.listen", "0.0.0.0:9464"});
  ASSERT_FALSE(remote.ok());
  EXPECT_NE(remote.status().message().find("metrics.listen (flag --metrics.listen): '0.0.0.0:9464' "
                                           "is not a loopback address"),
            std::string::npos)
      << remote.status();
  EXPECT_TRUE(Load({"--metrics.listen", "0.0.0.0:9464", "--metrics.allow_remote", "true"}).ok());
  for (const char* bad : {"9464", "127.0.0.1:", "127.0.0.1:70000", ":9464", "127.0.0.1:x"}) {
    auto r = Load({"--metrics.listen", bad});
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_NE(r.status().message().find("is not HOST:PORT"), std::string::npos) << r.status();
  }
  auto unknown = Load({"--config", tmp.Write("u.toml", "[metrics]\nport = 1\n")});
  ASSERT_FALSE(unknown.ok());
  EXPECT_NE(unknown.status().message().find("metrics.port"), std::string::npos) << unknown.status();
  // A table that holds no keys of hostd's is still refused as before.
  auto table = Load({"--config", tmp.Write("t.toml", "[other]\nx = 1\n")});
  ASSERT_FALSE(table.ok());
  EXPECT_NE(table.status().message().find("is a table"), std::string::npos) << table.status();
}

TEST(ConfigTest, SizeForms) {
  TempDir tmp;
  struct Case {
    std::string text;
    uint64_t bytes;
  };
  for (const Case& c : std::vector<Case>{{"4096", 4096},
                                         {"8192B", 8192},
                                         {"4k", 4096},
                                         {"64KiB", 64 << 10},
                                         {"4M", 4 << 20},
                                         {"16MiB", 16 << 20},
                                         {"2 mi", 2 << 20},
                                         {"1G", 1 << 30},
                                         {"1GiB", 1 << 30}}) {
    EXPECT_EQ(MustLoad({"--chunk_bytes", c.text}).config.routes.chunk_bytes(), c.bytes) << c.text;
  }
  const std::string file = tmp.Write("c.toml", "chunk_bytes = 8192\n");
  EXPECT_EQ(MustLoad({"--config", file}).config.routes.chunk_bytes(), 8192u);
}

TEST(ConfigTest, InitTakesKeywordsAndPaths) {
  for (const std::string v : {"auto", "random", "zeros", "/models/q/model.safetensors", "./ckpt",
                              "ckpt/", "w.safetensors", "/m/model.safetensors.index.json"}) {
    const LoadedConfig c = MustLoad({"--init", v});
    EXPECT_EQ(c.config.init, v);
    EXPECT_EQ(Entry(c, "init").source, "flag");
  }
  EXPECT_EQ(MustLoad({}, {{"SLIDEDP_INIT", "random"}}).config.init, "random");
  for (const std::string v : {"", "normal", "ckpt", "model.bin"}) {
    const auto c = Load({"--init", v}, {});
    ASSERT_FALSE(c.ok()) << v;
    EXPECT_THAT(std::string(c.status().message()),
                HasSubstr("is not one of auto, random, zeros, or a path"));
  }
}

TEST(ConfigTest, EmptySlidedpConfigMeansNoFile) {
  const LoadedConfig c = MustLoad({}, {{"SLIDEDP_CONFIG", ""}});
  EXPECT_EQ(c.config.config_file, "");
}

// ---------------------------------------------------------------------------------------------
// Precedence: flag > env > file > default, for every combination and several value kinds.

struct PrecedenceKey {
  std::string key;
  std::string file_toml;  // right-hand side in TOML syntax
  std::string env;
  std::string flag;
  std::string default_value;  // entry text
  std::string file_value, env_value, flag_value;
};

void PrintTo(const PrecedenceKey& k, std::ostream* os) { *os << k.key; }

class PrecedenceTest : public ::testing::TestWithParam<PrecedenceKey> {};

TEST_P(PrecedenceTest, HighestSourceWins) {
  const PrecedenceKey& k = GetParam();
  TempDir tmp;
  const std::string file = tmp.Write("p.toml", k.key + " = " + k.file_toml + "\n");
  const std::string env_name = ConfigEnvName(k.key);
  for (int mask = 0; mask < 8; ++mask) {
    const bool use_file = mask & 1, use_env = mask & 2, use_flag = mask & 4;
    std::vector<std::string> args;
    Env env;
    if (use_file) args = {"--config", file};
    if (use_env) env[env_name] = k.env;
    if (use_flag) {
      args.push_back("--" + k.key);
      args.push_back(k.flag);
    }
    const LoadedConfig c = MustLoad(args, env);
    const ConfigEntry& e = Entry(c, k.key);
    const std::string expect_source = use_flag   ? "flag"
                                      : use_env  ? "env"
                                      : use_file ? "file"
                                                 : "default";
    const std::string expect_value = use_flag   ? k.flag_value
                                     : use_env  ? k.env_value
                                     : use_file ? k.file_value
                                                : k.default_value;
    EXPECT_EQ(e.source, expect_source) << k.key << " mask " << mask;
    EXPECT_EQ(e.value, expect_value) << k.key << " mask " << mask;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Keys, PrecedenceTest,
    ::testing::Values(
        PrecedenceKey{"lr", "0.1", "0.2", "0.3", "0.0001", "0.1", "0.2", "0.3"},
        PrecedenceKey{"grad_route", "\"gpu_reduction\"", "reduce_scatter", "cpu_reduction", "auto",
                      "gpu_reduction", "reduce_scatter", "cpu_reduction"},
        PrecedenceKey{"chunk_bytes", "\"8KiB\"", "16384", "1G", "16MiB", "8KiB", "16KiB", "1GiB"},
        PrecedenceKey{"world_size", "2", "3", "4", "1", "2", "3", "4"},
        PrecedenceKey{"scale_by_world_size", "false", "true", "false", "true", "false", "true",
                      "false"},
        PrecedenceKey{"instance", "\"from-file\"", "from_env", "fromFlag", "default", "from-file",
                      "from_env", "fromFlag"},
        PrecedenceKey{"numa_node", "0", "1", "-1", "-1", "0", "1", "-1"}),
    [](const ::testing::TestParamInfo<PrecedenceKey>& info) { return info.param.key; });

TEST(ConfigTest, EverySourceIsCheckedEvenWhenOverridden) {
  absl::StatusOr<LoadedConfig> c = Load({"--lr", "0.1"}, {{"SLIDEDP_LR", "fast"}});
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Msg(c.status()), "lr (env SLIDEDP_LR): 'fast' is not a number");
}

TEST(ConfigTest, RangeChecksApplyToTheEffectiveValue) {
  // A bad value in a lower source that a higher one replaces passes the range check; the
  // effective value is what matters.
  EXPECT_TRUE(Load({"--world_size", "2"}, {{"SLIDEDP_WORLD_SIZE", "100"}}).ok());
}

// ---------------------------------------------------------------------------------------------
// TOML round trip.

TEST(ConfigTest, TomlRoundTrip) {
  TempDir tmp;
  const std::string file = tmp.Write("in.toml", R"(
beta1 = 0.8
schedule = "linear"
total_steps = 5000
socket = "/tmp/we\"ird\\path.sock"
)");
  const LoadedConfig first = MustLoad(
      {"--config",
       file,
       "--lr",
       "0.00012345678901234567",
       "--eps",
       "1e-12",
       "--seed",
       "18446744073709551615",
       "--warmup_steps",
       "100",
       "--shm_mode",
       "0660",
       "--shm_group",
       "grp",
       "--chunk_bytes",
       "12288",
       "--numa_node",
       "3",
       "--min_lr_ratio",
       "0.1",
       "--listen_tcp",
       "localhost:0",
       "--auth_token_file",
       "/etc/slidedp/token"},
      {{"SLIDEDP_CLIP", "per_layer"}, {"SLIDEDP_MAX_GRAD_NORM", "0.5"}, {"SLIDEDP_INIT", "zeros"}});
  const std::string toml = ConfigToToml(first.entries);
  EXPECT_THAT(toml, HasSubstr("# flag"));
  EXPECT_THAT(toml, HasSubstr("# env"));
  EXPECT_THAT(toml, HasSubstr("# file"));
  EXPECT_THAT(toml, HasSubstr("# default"));

  const std::string again = tmp.Write("out.toml", toml);
  const LoadedConfig second = MustLoad({"--config", again});
  ASSERT_EQ(second.entries.size(), first.entries.size());
  for (size_t i = 0; i < first.entries.size(); ++i) {
    EXPECT_EQ(second.entries[i].key, first.entries[i].key);
    EXPECT_EQ(second.entries[i].value, first.entries[i].value) << first.entries[i].key;
    EXPECT_EQ(second.entries[i].source, "file") << first.entries[i].key;
  }
  EXPECT_EQ(second.config.optimizer.SerializeAsString(),
            first.config.optimizer.SerializeAsString());
  EXPECT_EQ(second.config.routes.SerializeAsString(), first.config.routes.SerializeAsString());
  EXPECT_EQ(second.config.socket, "/tmp/we\"ird\\path.sock");
  EXPECT_EQ(second.config.seed, UINT64_MAX);
  EXPECT_EQ(second.config.routes.chunk_bytes(), 12288u);
  EXPECT_DOUBLE_EQ(second.config.optimizer.lr(), 0.00012345678901234567);
}

TEST(ConfigTest, TomlRoundTripOfDefaults) {
  TempDir tmp;
  const LoadedConfig first = MustLoad({});
  const LoadedConfig second =
      MustLoad({"--config", tmp.Write("d.toml", ConfigToToml(first.entries))});
  for (size_t i = 0; i < first.entries.size(); ++i) {
    EXPECT_EQ(second.entries[i].value, first.entries[i].value) << first.entries[i].key;
  }
}

TEST(ConfigTest, ConfigToTomlFormat) {
  const std::string toml =
      ConfigToToml({{"lr", "0.0001", "default"}, {"grad_route", "cpu_reduction", "flag"}});
  EXPECT_THAT(toml, HasSubstr("lr = 0.0001"));
  EXPECT_THAT(toml, HasSubstr("grad_route = \"cpu_reduction\"  # flag\n"));
}

// ---------------------------------------------------------------------------------------------
// Bad inputs: code and a message naming the key, the source and the expectation.

struct BadCase {
  std::string label;
  std::vector<std::string> args;
  Env env;
  std::string file;  // TOML written to a temp file and passed with --config when non-empty
  std::vector<std::string> expect;  // substrings of the message; "{file}" is the file's path
  absl::StatusCode code = absl::StatusCode::kInvalidArgument;
};

void PrintTo(const BadCase& c, std::ostream* os) { *os << c.label; }

class BadConfigInputTest : public ::testing::TestWithParam<BadCase> {};

TEST_P(BadConfigInputTest, Rejected) {
  const BadCase& bc = GetParam();
  TempDir tmp;
  std::vector<std::string> args = bc.args;
  std::string path;
  if (!bc.file.empty()) {
    path = tmp.Write("bad.toml", bc.file);
    args.insert(args.begin(), {"--config", path});
  }
  absl::StatusOr<LoadedConfig> c = Load(args, bc.env);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), bc.code) << c.status();
  for (std::string s : bc.expect) {
    if (const size_t p = s.find("{file}"); p != std::string::npos) s.replace(p, 6, path);
    EXPECT_THAT(Msg(c.status()), HasSubstr(s));
  }
}

INSTANTIATE_TEST_SUITE_P(
    All, BadConfigInputTest,
    ::testing::Values(
        BadCase{"clip_env",
                {},
                {{"SLIDEDP_CLIP", "foo"}},
                "",
                {"clip (env SLIDEDP_CLIP): 'foo' is not one of none, per_layer, global"}},
        BadCase{
            "lr_not_number", {"--lr", "abc"}, {}, "", {"lr (flag --lr): 'abc' is not a number"}},
        BadCase{
            "lr_negative", {"--lr=-1"}, {}, "", {"lr (flag --lr): must be a finite number >= 0"}},
        BadCase{"lr_nan", {"--lr", "nan"}, {}, "", {"lr (flag --lr)", "finite"}},
        BadCase{"beta1_one", {"--beta1", "1"}, {}, "", {"beta1 (flag --beta1): must be in [0, 1)"}},
        BadCase{
            "beta2_negative", {}, {{"SLIDEDP_BETA2", "-0.1"}}, "", {"beta2 (env SLIDEDP_BETA2)"}},
        BadCase{"eps_zero",
                {},
                {},
                "eps = 0.0\n",
                {"eps (file {file}:1): must be a finite number > 0"}},
        BadCase{
            "weight_decay_negative", {"--weight_decay", "-0.01"}, {}, "", {"weight_decay (flag"}},
        BadCase{"world_size_zero",
                {"--world_size", "0"},
                {},
                "",
                {"world_size (flag --world_size): must be in 1..64, got 0"}},
        BadCase{"world_size_65",
                {},
                {{"SLIDEDP_WORLD_SIZE", "65"}},
                "",
                {"world_size (env SLIDEDP_WORLD_SIZE): must be in 1..64"}},
        BadCase{"world_size_negative",
                {"--world_size", "-1"},
                {},
                "",
                {"world_size (flag --world_size): '-1' is not an unsigned integer"}},
        BadCase{"world_size_overflow",
                {"--world_size", "5000000000"},
                {},
                "",
                {"world_size", "out of range"}},
        BadCase{"seed_text",
                {},
                {{"SLIDEDP_SEED", "0x10"}},
                "",
                {"seed (env SLIDEDP_SEED): '0x10' is not an unsigned integer"}},
        BadCase{"chunk_not_multiple",
                {"--chunk_bytes", "5000"},
                {},
                "",
                {"chunk_bytes (flag --chunk_bytes): must be a multiple of 4096 from 4KiB to 1GiB, "
                 "got 5000"}},
        BadCase{"chunk_too_big",
                {},
                {},
                "chunk_bytes = \"2GiB\"\n",
                {"chunk_bytes (file {file}:1)", "2GiB"}},
        BadCase{"chunk_too_small", {"--chunk_bytes", "0"}, {}, "", {"chunk_bytes", "got 0"}},
        BadCase{"chunk_decimal_unit",
                {"--chunk_bytes", "16MB"},
                {},
                "",
                {"chunk_bytes (flag --chunk_bytes): '16MB' is not a size", "MiB"}},
        BadCase{"min_lr_ratio",
                {"--min_lr_ratio", "1.5"},
                {},
                "",
                {"min_lr_ratio (flag --min_lr_ratio): must be in [0, 1], got 1.5"}},
        BadCase{"warmup_exceeds_total",
                {"--schedule", "linear", "--total_steps", "10", "--warmup_steps", "20"},
                {},
                "",
                {"warmup_steps (flag --warmup_steps): 20 exceeds total_steps (10)"}},
        BadCase{"heartbeat_deadline",
                {"--heartbeat_interval_ms", "6000"},
                {},
                "",
                {"heartbeat_deadline_ms (default): 5000 must be greater than heartbeat_interval_ms "
                 "(6000)"}},
        BadCase{"heartbeat_interval_zero",
                {"--heartbeat_interval_ms", "0"},
                {},
                "",
                {"heartbeat_interval_ms (flag --heartbeat_interval_ms): must be >= 1"}},
        BadCase{"shm_mode",
                {"--shm_mode", "0644"},
                {},
                "",
                {"shm_mode (flag --shm_mode): '0644' is not one of 0600, 0660"}},
        BadCase{"shm_group_without_0660",
                {"--shm_group", "users"},
                {},
                "",
                {"shm_group (flag --shm_group)", "shm_mode 0660"}},
        BadCase{"numa_node",
                {"--numa_node", "-2"},
                {},
                "",
                {"numa_node (flag --numa_node): must be >= -1"}},
        BadCase{"update_threads",
                {},
                {{"SLIDEDP_UPDATE_THREADS", "-4"}},
                "",
                {"update_threads (env SLIDEDP_UPDATE_THREADS): must be >= 0"}},
        BadCase{"listen_any",
                {"--listen_tcp", "0.0.0.0:50051"},
                {},
                "",
                {"listen_tcp (flag --listen_tcp): '0.0.0.0:50051' is not a loopback address",
                 "127.0.0.1:PORT"}},
        BadCase{"listen_no_port", {"--listen_tcp", "127.0.0.1"}, {}, "", {"listen_tcp (flag"}},
        BadCase{
            "listen_bad_port", {"--listen_tcp", "localhost:70000"}, {}, "", {"listen_tcp (flag"}},
        BadCase{"listen_v6_any", {"--listen_tcp", "[::]:80"}, {}, "", {"listen_tcp (flag"}},
        BadCase{
            "instance_chars",
            {"--instance", "a/b"},
            {},
            "",
            {"instance (flag --instance): 'a/b' is not a valid instance name", "[A-Za-z0-9_-]"}},
        BadCase{"instance_long",
                {"--instance", std::string(33, 'x')},
                {},
                "",
                {"instance (flag --instance)"}},
        BadCase{"instance_empty",
                {},
                {{"SLIDEDP_INSTANCE", ""}},
                "",
                {"instance (env SLIDEDP_INSTANCE)"}},
        BadCase{"socket_long",
                {"--socket", "/" + std::string(120, 's')},
                {},
                "",
                {"socket (flag --socket)", "107 bytes"}},
        BadCase{
            "model_empty", {"--model", ""}, {}, "", {"model (flag --model): must not be empty"}},
        BadCase{"isa",
                {"--isa", "avx9"},
                {},
                "",
                {"isa (flag --isa): 'avx9' is not one of auto, scalar, avx2, avx512, avx512bf16"}},
        BadCase{"update_granularity",
                {"--update_granularity", "tensor"},
                {},
                "",
                {"update_granularity (flag --update_granularity): 'tensor' is not one of auto, "
                 "layer, chunk"}},
        BadCase{"mlock",
                {},
                {{"SLIDEDP_MLOCK", "maybe"}},
                "",
                {"mlock (env SLIDEDP_MLOCK): 'maybe' is not one of required, best_effort, off"}},
        BadCase{
            "init",
            {"--init", "ones"},
            {},
            "",
            {"init (flag --init): 'ones' is not one of auto, random, zeros, or a path", "./ones"}},
        BadCase{"log_level",
                {"--log_level", "verbose"},
                {},
                "",
                {"log_level (flag --log_level)", "trace, debug, info, warn, error"}},
        BadCase{"grad_dtype",
                {"--grad_dtype", "fp16"},
                {},
                "",
                {"grad_dtype (flag --grad_dtype): 'fp16' is not one of bf16, fp32"}},
        BadCase{"param_route",
                {"--param_route", "sharded2"},
                {},
                "",
                {"param_route (flag --param_route)", "replicated, sharded"}},
        BadCase{"bool_env",
                {},
                {{"SLIDEDP_SCALE_BY_WORLD_SIZE", "maybe"}},
                "",
                {"scale_by_world_size (env SLIDEDP_SCALE_BY_WORLD_SIZE): 'maybe' is not a boolean; "
                 "expected true or false"}},
        BadCase{"file_schedule",
                {},
                {},
                "\nschedule = \"exp\"\n",
                {"schedule (file {file}:2): 'exp' is not one of constant, linear, cosine"}},
        BadCase{"file_unknown_key",
                {},
                {},
                "lr = 1e-4\nlrr = 3e-4\n",
                {"lrr (file {file}:2): unknown key (did you mean 'lr'?)"}},
        BadCase{"file_unknown_key_no_suggestion",
                {},
                {},
                "frobnicate = 1\n",
                {"frobnicate (file {file}:1): unknown key; see hostd --help"}},
        BadCase{"file_table",
                {},
                {},
                "[optimizer]\nlr = 1e-4\n",
                {"optimizer (file {file}:1): is a table", "flat keys"}},
        BadCase{"file_lr_string",
                {},
                {},
                "lr = \"3e-4\"\n",
                {"lr (file {file}:1): expected a number, got a string"}},
        BadCase{"file_bool_string",
                {},
                {},
                "scale_by_world_size = \"yes\"\n",
                {"scale_by_world_size (file {file}:1): expected a boolean"}},
        BadCase{"file_enum_int",
                {},
                {},
                "grad_route = 1\n",
                {"grad_route (file {file}:1): expected a string, one of cpu_reduction"}},
        BadCase{"file_int_float",
                {},
                {},
                "world_size = 2.5\n",
                {"world_size (file {file}:1): expected an unsigned integer, got a float"}},
        BadCase{"file_syntax", {}, {}, "lr = \n", {"config file {file}:1:"}},
        BadCase{"file_missing",
                {"--config", "/nonexistent/hostd.toml"},
                {},
                "",
                {"/nonexistent/hostd.toml"},
                absl::StatusCode::kNotFound},
        BadCase{"file_missing_env",
                {},
                {{"SLIDEDP_CONFIG", "/nonexistent/e.toml"}},
                "",
                {"/nonexistent/e.toml"},
                absl::StatusCode::kNotFound},
        BadCase{"unknown_flag",
                {"--lrr", "3e-4"},
                {},
                "",
                {"unknown flag '--lrr' (did you mean '--lr'?)"}},
        BadCase{"unknown_flag_dashes",
                {"--world-size=4"},
                {},
                "",
                {"unknown flag '--world-size' (did you mean '--world_size'?)"}},
        BadCase{"positional", {"extra"}, {}, "", {"unexpected argument 'extra'"}},
        BadCase{"flag_without_value", {"--lr"}, {}, "", {"command line", "--lr"}},
        BadCase{
            "config_flag_empty", {"--config", ""}, {}, "", {"config (flag --config): empty path"}}),
    [](const ::testing::TestParamInfo<BadCase>& info) { return info.param.label; });

TEST(ConfigTest, ValidateConfigWithoutSources) {
  HostdConfig c;
  c.optimizer.set_beta1(1.5);
  EXPECT_EQ(ValidateConfig(c).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Msg(ValidateConfig(c)), "beta1: must be in [0, 1), got 1.5");

  HostdConfig d;
  d.optimizer.set_grad_dtype(slidedp::v1::DTYPE_UNSPECIFIED);
  EXPECT_THAT(Msg(ValidateConfig(d)), HasSubstr("grad_dtype"));

  HostdConfig e;  // UNSPECIFIED schedule/clip/routes mean the defaults, as in the proto
  e.optimizer.set_schedule(slidedp::v1::LR_SCHEDULE_UNSPECIFIED);
  e.optimizer.set_clip(slidedp::v1::CLIP_POLICY_UNSPECIFIED);
  e.routes.set_grad_route(slidedp::v1::GRAD_ROUTE_UNSPECIFIED);
  EXPECT_TRUE(ValidateConfig(e).ok());
  EXPECT_EQ(ConfigEntries(e, "default")[0].source, "default");

  HostdConfig f;
  f.optimizer.set_warmup_steps(100);
  f.optimizer.set_total_steps(10);
  EXPECT_TRUE(ValidateConfig(f).ok());  // constant schedule: warmup may exceed total_steps
  f.optimizer.set_schedule(slidedp::v1::LR_SCHEDULE_COSINE);
  EXPECT_THAT(Msg(ValidateConfig(f)), HasSubstr("warmup_steps"));
  f.optimizer.set_total_steps(0);
  EXPECT_TRUE(ValidateConfig(f).ok());  // total_steps 0: no decay

  for (const char* addr : {"127.0.0.1:1", "[::1]:65535", "localhost:50051", "127.0.0.9:1", ""}) {
    HostdConfig g;
    g.listen_tcp = addr;
    g.auth_token_file = "/etc/slidedp/token";
    EXPECT_TRUE(ValidateConfig(g).ok()) << addr;
  }
  // A TCP listener needs the service token (every local user reaches the port), from an
  // absolute path; "loopback" is exact, not a prefix.
  HostdConfig t;
  t.listen_tcp = "127.0.0.1:7070";
  EXPECT_THAT(Msg(ValidateConfig(t)), HasSubstr("'127.0.0.1:7070' needs auth_token_file"));
  t.auth_token_file = "token";
  EXPECT_THAT(Msg(ValidateConfig(t)), HasSubstr("auth_token_file: 'token' must be an absolute"));
  for (const char* prefix_only : {"127.0.0.1.nip.io:80", "localhost.example:80"}) {
    HostdConfig u;
    u.listen_tcp = prefix_only;
    u.auth_token_file = "/etc/slidedp/token";
    EXPECT_THAT(Msg(ValidateConfig(u)), HasSubstr("is not a loopback address")) << prefix_only;
  }
}

// ---------------------------------------------------------------------------------------------
// --help and --print-config.

TEST(ConfigTest, HelpListsEveryKeyWithDefaultAndEnv) {
  // Help short-circuits: a broken environment does not hide it.
  const LoadedConfig c = MustLoad({"--help"}, {{"SLIDEDP_LR", "broken"}});
  EXPECT_TRUE(c.show_help);
  const std::string& h = c.help_text;
  EXPECT_THAT(h, HasSubstr("Usage: hostd"));
  EXPECT_THAT(h, HasSubstr("--config FILE"));
  EXPECT_THAT(h, HasSubstr("SLIDEDP_CONFIG"));
  EXPECT_THAT(h, HasSubstr("--print-config"));
  const HostdConfig defaults;
  const std::vector<ConfigEntry> def = ConfigEntries(defaults, "default");
  ASSERT_EQ(def.size(), ConfigKeys().size());
  for (const ConfigEntry& e : def) {
    const size_t at = h.find("--" + e.key + " ");
    ASSERT_NE(at, std::string::npos) << e.key;
    const size_t next = h.find("\n  --", at + 1);
    const std::string block =
        h.substr(at, next == std::string::npos ? std::string::npos : next - at);
    EXPECT_THAT(block, HasSubstr("env: " + ConfigEnvName(e.key))) << e.key;
    EXPECT_THAT(block, HasSubstr("default: " + (e.value.empty() ? "(empty)" : e.value))) << e.key;
  }
  EXPECT_THAT(h, HasSubstr("{none|per_layer|global}"));
  EXPECT_EQ(MustLoad({"-h"}).show_help, true);
}

TEST(ConfigTest, PrintConfigFlag) {
  const LoadedConfig c = MustLoad({"--print-config", "--lr", "0.5"});
  EXPECT_TRUE(c.print_config);
  EXPECT_FALSE(c.show_help);
  EXPECT_THAT(ConfigToToml(c.entries), HasSubstr("lr = 0.5"));
}

TEST(ConfigTest, KeyListAndEnvNames) {
  const std::vector<std::string> keys = ConfigKeys();
  for (const char* k : {"instance",
                        "socket",
                        "listen_tcp",
                        "auth_token_file",
                        "model",
                        "seed",
                        "world_size",
                        "lr",
                        "beta1",
                        "beta2",
                        "eps",
                        "weight_decay",
                        "no_decay_norms_and_biases",
                        "schedule",
                        "warmup_steps",
                        "total_steps",
                        "min_lr_ratio",
                        "clip",
                        "max_grad_norm",
                        "grad_dtype",
                        "scale_by_world_size",
                        "param_route",
                        "grad_route",
                        "chunk_bytes",
                        "numa_node",
                        "update_threads",
                        "isa",
                        "update_granularity",
                        "mlock",
                        "shm_mode",
                        "shm_group",
                        "init",
                        "log_level",
                        "output_roots",
                        "heartbeat_interval_ms",
                        "heartbeat_deadline_ms",
                        "metrics.listen",
                        "metrics.allow_remote",
                        "checkpoint.dir",
                        "checkpoint.every_steps",
                        "checkpoint.keep_last",
                        "checkpoint.on_stop",
                        "checkpoint.client_upload_timeout_s",
                        "checkpoint.capture_timeout_s",
                        "checkpoint.max_write_mb_per_s",
                        "checkpoint.direct_io",
                        "checkpoint.snapshot_pool_bytes",
                        "checkpoint.resume",
                        "recovery_on_inconsistent"}) {
    EXPECT_NE(std::find(keys.begin(), keys.end(), k), keys.end()) << k;
  }
  EXPECT_EQ(keys.size(), 51u);
  EXPECT_EQ(ConfigEnvName("world_size"), "SLIDEDP_WORLD_SIZE");
  // A key of a TOML table: the dot becomes '_'.
  EXPECT_EQ(ConfigEnvName("metrics.listen"), "SLIDEDP_METRICS_LISTEN");
}

TEST(ConfigTest, ProcessEnvironmentKeepsSlidedpVariables) {
  ASSERT_EQ(setenv("SLIDEDP_CONFIG_TEST_VAR", "x=1", 1), 0);
  ASSERT_EQ(setenv("NOT_SLIDEDP_CONFIG_TEST_VAR", "y", 1), 0);
  const Env env = ProcessEnvironment();
  EXPECT_EQ(env.at("SLIDEDP_CONFIG_TEST_VAR"), "x=1");
  EXPECT_EQ(env.count("NOT_SLIDEDP_CONFIG_TEST_VAR"), 0u);
  unsetenv("SLIDEDP_CONFIG_TEST_VAR");
  unsetenv("NOT_SLIDEDP_CONFIG_TEST_VAR");
}

// output_roots: comma-separated absolute directories (hostd/output_roots.h).
TEST(ConfigTest, OutputRootsAreAListOfAbsoluteDirectories) {
  EXPECT_TRUE(MustLoad({}).config.output_roots.empty());
  const LoadedConfig c = MustLoad({"--output_roots", " /var/lib/slidedp , /scratch/exports,"});
  EXPECT_EQ(c.config.output_roots,
            (std::vector<std::string>{"/var/lib/slidedp", "/scratch/exports"}));
  EXPECT_EQ(Entry(c, "output_roots").value, "/var/lib/slidedp,/scratch/exports");
  EXPECT_EQ(MustLoad({}, {{"SLIDEDP_OUTPUT_ROOTS", "/"}}).config.output_roots,
            std::vector<std::string>{"/"});
  absl::StatusOr<LoadedConfig> bad = Load({"--output_roots", "/ok,relative/dir"});
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Msg(bad.status()), HasSubstr("output_roots"));
  EXPECT_THAT(Msg(bad.status()), HasSubstr("'relative/dir' is not an absolute directory"));
}

}  // namespace
}  // namespace slidedp::hostd

namespace slidedp::hostd {
namespace {

TEST(ConfigTest, CheckpointTableFlagsEnvAndResumeAlias) {
  TempDir dir;
  const std::string file = dir.Write("ck.toml",
                                     "lr = 0.001\n"
                                     "[checkpoint]\n"
                                     "dir = \"/var/lib/slidedp/ckpt\"\n"
                                     "every_steps = 100\n"
                                     "keep_last = 5\n"
                                     "on_stop = false\n"
                                     "snapshot_pool_bytes = \"2GiB\"\n");
  LoadedConfig c = MustLoad({"--config", file});
  EXPECT_EQ(c.config.checkpoint.dir, "/var/lib/slidedp/ckpt");
  EXPECT_EQ(c.config.checkpoint.every_steps, 100u);
  EXPECT_EQ(c.config.checkpoint.keep_last, 5u);
  EXPECT_FALSE(c.config.checkpoint.on_stop);
  EXPECT_EQ(c.config.checkpoint.snapshot_pool_bytes, uint64_t{2} << 30);
  EXPECT_EQ(Entry(c, "checkpoint.dir").source, "file");

  c = MustLoad({"--checkpoint.keep_last", "7", "--resume", "/ck/step-000000000004"},
               {{"SLIDEDP_CHECKPOINT_DIR", "/env/ck"}});
  EXPECT_EQ(c.config.checkpoint.dir, "/env/ck");
  EXPECT_EQ(Entry(c, "checkpoint.dir").source, "env");
  EXPECT_EQ(c.config.checkpoint.keep_last, 7u);
  EXPECT_EQ(c.config.checkpoint.resume, "/ck/step-000000000004");
  EXPECT_EQ(Entry(c, "checkpoint.resume").source, "flag");
  EXPECT_EQ(ConfigEnvName("checkpoint.every_steps"), "SLIDEDP_CHECKPOINT_EVERY_STEPS");

  // The printed config reads back (dotted keys are TOML's own syntax for the table).
  const std::string round = dir.Write("round.toml", ConfigToToml(c.entries));
  EXPECT_EQ(MustLoad({"--config", round}).config.checkpoint.keep_last, 7u);

  absl::StatusOr<LoadedConfig> bad = Load({"--checkpoint.every_steps", "10"});
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(bad.status().message(), HasSubstr("checkpoint.every_steps"));
  EXPECT_THAT(bad.status().message(), HasSubstr("checkpoint.dir"));
  bad = Load({"--config", dir.Write("bad.toml", "[checkpoint]\nkeep = 1\n")});
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(bad.status().message(), HasSubstr("checkpoint.keep"));
  bad = Load({"--resume", "/a", "--checkpoint.resume", "/b"});
  EXPECT_FALSE(bad.ok());
}

}  // namespace
// Text that is not UTF-8 (here from the environment) is refused: the effective config is shown
// and saved as TOML. Found by fuzz_config (the TOML of an accepted config did not load back).
TEST(ConfigTest, NonUtf8TextIsRefusedNamingTheKey) {
  const char* argv[] = {"hostd"};
  auto bad = LoadConfig(1, argv, {{"SLIDEDP_MODEL", std::string("dir\x94x")}});
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("model"), std::string::npos) << bad.status();
  EXPECT_NE(bad.status().message().find("not valid UTF-8"), std::string::npos) << bad.status();
  for (const std::string& s :
       {std::string("\xC0\x80"), std::string("\xED\xA0\x80"), std::string("\xE2\x82")}) {
    EXPECT_FALSE(LoadConfig(1, argv, {{"SLIDEDP_MODEL", s}}).ok()) << s.size();
  }
  auto good = LoadConfig(1, argv, {{"SLIDEDP_MODEL", "/data/mod\xC3\xA8le \xE2\x82\xAC"}});
  EXPECT_TRUE(good.ok()) << good.status();
}

}  // namespace slidedp::hostd
