// End-to-end tests of slidedpctl's commands: RunCtl against FakeDaemon on a temp unix socket.
#include "slidedpctl/ctl.h"

#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/shm_segment.h"
#include "common/version.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "slidedpctl/fake_control_service.h"
#include "slidedpctl/machine.h"

namespace slidedp::ctl {
namespace {

using ::testing::AllOf;
using testing::FakeDaemon;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::StartsWith;
using Json = nlohmann::json;

struct CtlResult {
  int code;
  std::string out;
  std::string err;
};

CtlResult Ctl(const std::vector<std::string>& args) {
  std::ostringstream out, err;
  const int code = RunCtl(args, out, err);
  return {code, out.str(), err.str()};
}

// Sets an environment variable for the scope, restoring the previous value after.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const std::string& value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    ::setenv(name, value.c_str(), 1);
  }
  ~ScopedEnv() {
    if (old_) {
      ::setenv(name_, old_->c_str(), 1);
    } else {
      ::unsetenv(name_);
    }
  }

 private:
  const char* name_;
  std::optional<std::string> old_;
};

// One cell of a printed table line: [start, end) offsets and text.
struct Cell {
  size_t start;
  size_t end;
  std::string text;
};

// Splits a table line into cells. Columns are separated by at least two blanks and cells never
// contain two blanks in a row ("12.0 MiB" stays one cell).
std::vector<Cell> SplitCells(const std::string& line) {
  std::vector<Cell> cells;
  size_t i = 0;
  while (i < line.size()) {
    while (i < line.size() && line[i] == ' ') ++i;
    if (i >= line.size()) break;
    size_t end = i;
    while (end < line.size() &&
           !(line[end] == ' ' && (end + 1 >= line.size() || line[end + 1] == ' '))) {
      ++end;
    }
    cells.push_back({i, end, line.substr(i, end - i)});
    i = end;
  }
  return cells;
}

std::vector<std::string> Lines(const std::string& text) {
  return absl::StrSplit(text, '\n', absl::SkipEmpty());
}

class CtlTest : public ::testing::Test {
 protected:
  // `args` prefixed with --socket pointing at the fake daemon.
  std::vector<std::string> At(std::vector<std::string> args) {
    args.insert(args.begin(), {"--socket", daemon_.socket_path()});
    return args;
  }

  FakeDaemon daemon_;
};

TEST_F(CtlTest, StatusJsonHasEveryLayerWithRequiredNumericKeys) {
  const CtlResult r = Ctl(At({"status", "--json"}));
  ASSERT_EQ(r.code, kExitOk) << r.err;
  EXPECT_THAT(r.err, IsEmpty());
  const Json json = Json::parse(r.out);
  for (const char* key : {"daemon", "instance", "socket", "uptime_ms", "job", "layers", "ranks",
                          "segments", "topology", "shm_bytes", "locked_bytes"}) {
    EXPECT_TRUE(json.contains(key)) << key;
  }
  EXPECT_TRUE(json["uptime_ms"].is_number_unsigned());
  EXPECT_EQ(json["uptime_ms"].get<uint64_t>(), 3'723'000u);
  EXPECT_EQ(json["shm_bytes"].get<uint64_t>(), 12'589'056'000u);
  EXPECT_EQ(json["job"]["job_id"], "job-7");
  EXPECT_EQ(json["job"]["total_params"].get<uint64_t>(), 4'300'000'000u);
  EXPECT_EQ(json["daemon"]["component"], "hostd");

  const v1::GetStatusResponse canned = testing::CannedStatus();
  ASSERT_TRUE(json["layers"].is_array());
  ASSERT_EQ(json["layers"].size(), static_cast<size_t>(canned.layers_size()));
  for (size_t i = 0; i < json["layers"].size(); ++i) {
    const Json& layer = json["layers"][i];
    const v1::LayerStatus& want = canned.layers(static_cast<int>(i));
    SCOPED_TRACE(want.name());
    for (const char* key : {"layer", "numel", "version", "bytes", "state_bytes", "param_bytes",
                            "numa_node", "skipped_steps"}) {
      ASSERT_TRUE(layer.contains(key)) << key;
      EXPECT_TRUE(layer[key].is_number_integer()) << key << " = " << layer[key].dump();
    }
    EXPECT_EQ(layer["name"], want.name());
    EXPECT_TRUE(layer["kind"].is_string());
    EXPECT_EQ(layer["layer"].get<uint32_t>(), want.layer());
    EXPECT_EQ(layer["numel"].get<uint64_t>(), want.numel());
    EXPECT_EQ(layer["state_bytes"].get<uint64_t>(), want.state_bytes());
    EXPECT_EQ(layer["param_bytes"].get<uint64_t>(), want.param_bytes());
    EXPECT_EQ(layer["bytes"].get<uint64_t>(), want.state_bytes() + want.param_bytes());
    EXPECT_EQ(layer["numa_node"].get<int32_t>(), want.numa_node());
    EXPECT_EQ(layer["skipped_steps"].get<uint64_t>(), want.skipped_steps());
  }
  // Above 2^32: the exact value survives as a JSON number.
  EXPECT_EQ(json["layers"][0]["state_bytes"].get<uint64_t>(), 12'582'912'000u);
}

TEST_F(CtlTest, StatusJsonWithoutJobHasNullJobAndEmptyLayers) {
  daemon_.service().set_no_job(true);
  const CtlResult r = Ctl(At({"status", "--json"}));
  ASSERT_EQ(r.code, kExitOk) << r.err;
  const Json json = Json::parse(r.out);
  ASSERT_TRUE(json.contains("job"));
  EXPECT_TRUE(json["job"].is_null());
  EXPECT_EQ(json["layers"], Json::array());
}

TEST_F(CtlTest, StatusHumanPrintsSummaryAndLayerTable) {
  const CtlResult r = Ctl(At({"status"}));
  ASSERT_EQ(r.code, kExitOk) << r.err;
  EXPECT_THAT(r.out, HasSubstr(absl::StrCat("hostd 0.1.0 (git abc1234, protocol ", kProtocolVersion,
                                            ", shm abi 1)")));
  EXPECT_THAT(r.out, HasSubstr("job-7: tiny-llama (llama), world size 2, step 42 (idle)"));
  EXPECT_THAT(r.out, HasSubstr("1h02m03s"));
  EXPECT_THAT(r.out, HasSubstr("2 of 2 attached, 1 connected"));
  EXPECT_THAT(r.out, HasSubstr("11.7 GiB in 1 segment, 11.7 GiB locked"));
  EXPECT_THAT(r.out, HasSubstr("LAYER  NAME"));
  EXPECT_THAT(r.out, HasSubstr("model.embed_tokens"));
}

TEST_F(CtlTest, LayersTableColumnsAlign) {
  const CtlResult r = Ctl(At({"layers"}));
  ASSERT_EQ(r.code, kExitOk) << r.err;
  const std::vector<std::string> lines = Lines(r.out);
  ASSERT_EQ(lines.size(), 4u) << r.out;
  const std::vector<Cell> header = SplitCells(lines[0]);
  std::vector<std::string> names;
  for (const Cell& c : header) names.push_back(c.text);
  ASSERT_THAT(names, ::testing::ElementsAre("LAYER", "NAME", "KIND", "PARAMS", "VERSION", "BYTES",
                                            "NUMA", "SKIPPED"));
  // NAME and KIND are text (left-aligned: same start); the rest are numbers (right-aligned:
  // same end).
  const std::vector<bool> left = {false, true, true, false, false, false, false, false};
  for (size_t row = 1; row < lines.size(); ++row) {
    SCOPED_TRACE(lines[row]);
    const std::vector<Cell> cells = SplitCells(lines[row]);
    ASSERT_EQ(cells.size(), header.size());
    for (size_t c = 0; c < header.size(); ++c) {
      if (left[c]) {
        EXPECT_EQ(cells[c].start, header[c].start) << names[c];
      } else {
        EXPECT_EQ(cells[c].end, header[c].end) << names[c];
      }
    }
  }
  // Every line has the same length because the last column is right-aligned.
  for (const std::string& line : lines) EXPECT_EQ(line.size(), lines[0].size()) << line;
  // Human sizes in the table, exact numbers in the PARAMS column.
  EXPECT_EQ(SplitCells(lines[1])[5].text, "13.7 GiB");
  EXPECT_EQ(SplitCells(lines[2])[5].text, "28.0 KiB");
  EXPECT_EQ(SplitCells(lines[3])[5].text, "7.0 MiB");
  EXPECT_EQ(SplitCells(lines[1])[3].text, "1048576000");
  EXPECT_EQ(SplitCells(lines[1])[2].text, "embedding");
  EXPECT_EQ(SplitCells(lines[3])[6].text, "-");
}

TEST_F(CtlTest, LayersJsonIsArrayWithExactBytes) {
  const CtlResult r = Ctl(At({"layers", "--json"}));
  ASSERT_EQ(r.code, kExitOk) << r.err;
  const Json json = Json::parse(r.out);
  ASSERT_TRUE(json.is_array());
  ASSERT_EQ(json.size(), 3u);
  EXPECT_EQ(json[1]["bytes"].get<uint64_t>(), 2048u * 14);
  EXPECT_EQ(json[2]["kind"], "LAYER_KIND_LM_HEAD");
}

TEST_F(CtlTest, JsonAcceptedBeforeAndAfterSubcommand) {
  const CtlResult before = Ctl(At({"--json", "layers"}));
  const CtlResult after = Ctl(At({"layers", "--json"}));
  ASSERT_EQ(before.code, kExitOk) << before.err;
  ASSERT_EQ(after.code, kExitOk) << after.err;
  EXPECT_EQ(before.out, after.out);
  EXPECT_NO_THROW({ [[maybe_unused]] const Json parsed = Json::parse(after.out); });
}

TEST_F(CtlTest, GlobalOptionsAcceptedAfterSubcommand) {
  const CtlResult r = Ctl({"layers", "--socket", daemon_.socket_path(), "--timeout-ms", "2000"});
  EXPECT_EQ(r.code, kExitOk) << r.err;
}

TEST_F(CtlTest, EveryCommandHandshakesWithClientBuildInfo) {
  ASSERT_EQ(Ctl(At({"stats"})).code, kExitOk);
  ASSERT_EQ(Ctl(At({"config", "show"})).code, kExitOk);
  EXPECT_EQ(daemon_.service().handshake_count(), 2);
  const v1::BuildInfo client = daemon_.service().last_handshake().client();
  EXPECT_EQ(client.component(), "slidedpctl");
  EXPECT_EQ(client.version(), kVersion);
  EXPECT_EQ(client.git_revision(), kGitRevision);
  EXPECT_EQ(client.protocol_version(), kProtocolVersion);
  EXPECT_EQ(client.shm_abi_version(), kShmAbiVersion);
}

TEST_F(CtlTest, RejectedRequestExits4WithDaemonMessage) {
  const CtlResult r = Ctl(At({"stats", "--job", "nope"}));
  EXPECT_EQ(r.code, kExitRejected);
  EXPECT_THAT(r.out, IsEmpty());
  EXPECT_EQ(r.err,
            "slidedpctl: hostd rejected GetStats: INVALID_ARGUMENT: job_id: unknown job \"nope\"; "
            "expected \"job-7\" or empty for the daemon's job\n");
}

TEST_F(CtlTest, VersionSkewAtHandshakeExits4AndPrintsDaemonMessage) {
  daemon_.service().set_refuse_handshake(true);
  const CtlResult r = Ctl(At({"layers"}));
  EXPECT_EQ(r.code, kExitRejected);
  EXPECT_THAT(r.out, IsEmpty());
  EXPECT_THAT(r.err, StartsWith(absl::StrCat(
                         "slidedpctl: hostd rejected Handshake: FAILED_PRECONDITION: "
                         "client protocol_version ",
                         kProtocolVersion, " is not supported; hostd 9.0.0 speaks protocol 9\n")));
  EXPECT_THAT(r.err, HasSubstr("slidedpctl: version skew: this slidedpctl is"));
}

TEST_F(CtlTest, VersionWithDaemonPrintsBoth) {
  const CtlResult human = Ctl(At({"version"}));
  ASSERT_EQ(human.code, kExitOk) << human.err;
  const std::vector<std::string> lines = Lines(human.out);
  ASSERT_EQ(lines.size(), 3u) << human.out;
  EXPECT_THAT(lines[0], StartsWith("ROLE"));
  EXPECT_THAT(lines[1], AllOf(StartsWith("client"), HasSubstr("slidedpctl"), HasSubstr(kVersion)));
  EXPECT_THAT(lines[2], AllOf(StartsWith("daemon"), HasSubstr("hostd"),
                              HasSubstr("cpu_reduction,global_clip")));

  const CtlResult json_result = Ctl(At({"version", "--json"}));
  ASSERT_EQ(json_result.code, kExitOk) << json_result.err;
  const Json json = Json::parse(json_result.out);
  EXPECT_EQ(json["client"]["component"], "slidedpctl");
  EXPECT_EQ(json["client"]["version"], kVersion);
  EXPECT_EQ(json["client"]["protocol_version"].get<unsigned>(), kProtocolVersion);
  EXPECT_EQ(json["daemon"]["component"], "hostd");
  EXPECT_EQ(json["daemon"]["git_revision"], "abc1234");
  EXPECT_TRUE(json["error"].is_null());
}

TEST(CtlNoDaemonTest, VersionWithoutDaemonPrintsClientAndExits3) {
  const std::string dir = testing::MakeTempDir();
  const std::string socket = dir + "/absent.sock";
  const CtlResult human = Ctl({"--socket", socket, "version"});
  EXPECT_EQ(human.code, kExitUnreachable);
  const std::vector<std::string> lines = Lines(human.out);
  ASSERT_EQ(lines.size(), 2u) << human.out;
  EXPECT_THAT(lines[1], AllOf(StartsWith("client"), HasSubstr("slidedpctl")));
  EXPECT_THAT(human.err, StartsWith("slidedpctl: cannot reach hostd at unix:" + socket));

  const CtlResult json_result = Ctl({"--socket", socket, "version", "--json"});
  EXPECT_EQ(json_result.code, kExitUnreachable);
  const Json json = Json::parse(json_result.out);
  EXPECT_EQ(json["client"]["component"], "slidedpctl");
  EXPECT_TRUE(json["daemon"].is_null());
  ASSERT_TRUE(json["error"].is_string());
  EXPECT_THAT(json["error"].get<std::string>(), StartsWith("cannot reach hostd at unix:"));
  std::filesystem::remove_all(dir);
}

TEST(CtlNoDaemonTest, MissingSocketExits3WithHint) {
  const std::string dir = testing::MakeTempDir();
  const std::string socket = dir + "/absent.sock";
  const CtlResult r = Ctl({"--socket", socket, "status"});
  EXPECT_EQ(r.code, kExitUnreachable);
  EXPECT_THAT(r.out, IsEmpty());
  EXPECT_EQ(r.err,
            absl::StrCat("slidedpctl: cannot reach hostd at unix:", socket, ": no socket at ",
                         socket, "; is hostd running? (set --socket or SLIDEDP_SOCKET)\n"));
  std::filesystem::remove_all(dir);
}

TEST(CtlNoDaemonTest, StaleSocketExits3) {
  // A socket file nobody listens on (hostd died without unlinking it): connection refused.
  const std::string dir = testing::MakeTempDir();
  const std::string socket = dir + "/stale.sock";
  const int fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  socket.copy(addr.sun_path, sizeof(addr.sun_path) - 1);
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ::close(fd);
  const CtlResult r = Ctl({"--socket", socket, "--timeout-ms", "2000", "layers"});
  EXPECT_EQ(r.code, kExitUnreachable);
  EXPECT_THAT(r.err, AllOf(StartsWith("slidedpctl: cannot reach hostd at unix:" + socket + ": "),
                           HasSubstr("; is hostd running? (set --socket or SLIDEDP_SOCKET)")));
  std::filesystem::remove_all(dir);
}

TEST(CtlNoDaemonTest, RegularFileInsteadOfSocketExits3) {
  const std::string dir = testing::MakeTempDir();
  const std::string path = dir + "/not_a_socket";
  { std::ofstream(path) << "x"; }
  const CtlResult r = Ctl({"--socket", path, "status"});
  EXPECT_EQ(r.code, kExitUnreachable);
  EXPECT_THAT(r.err, HasSubstr("exists but is not a socket"));
  std::filesystem::remove_all(dir);
}

TEST_F(CtlTest, SlowDaemonExits3AfterTimeout) {
  daemon_.service().set_status_delay_ms(1000);
  const CtlResult r = Ctl(At({"--timeout-ms", "100", "status"}));
  EXPECT_EQ(r.code, kExitUnreachable);
  EXPECT_THAT(r.err, HasSubstr("no answer to GetStatus within 100 ms"));
}

TEST_F(CtlTest, SlidedpSocketEnvIsHonored) {
  {
    ScopedEnv env(kSocketEnv, daemon_.socket_path());
    const CtlResult r = Ctl({"layers"});
    EXPECT_EQ(r.code, kExitOk) << r.err;
    EXPECT_THAT(r.out, HasSubstr("model.embed_tokens"));
    // --socket beats the environment.
    const CtlResult flag = Ctl({"--socket", daemon_.socket_path() + ".other", "layers"});
    EXPECT_EQ(flag.code, kExitUnreachable);
    EXPECT_THAT(flag.err, HasSubstr(daemon_.socket_path() + ".other"));
  }
  {
    ScopedEnv env(kSocketEnv, daemon_.socket_path() + ".absent");
    const CtlResult r = Ctl({"layers"});
    EXPECT_EQ(r.code, kExitUnreachable);
    EXPECT_THAT(r.err, HasSubstr("unix:" + daemon_.socket_path() + ".absent"));
  }
}

TEST(CtlTcpTest, LoopbackTcpEndpointWorks) {
  FakeDaemon daemon(/*tcp=*/true);
  ASSERT_GT(daemon.tcp_port(), 0);
  const CtlResult r = Ctl({"--tcp", absl::StrCat("127.0.0.1:", daemon.tcp_port()), "ranks"});
  EXPECT_EQ(r.code, kExitOk) << r.err;
  EXPECT_THAT(r.out, HasSubstr("node-a"));
}

TEST_F(CtlTest, ConfigShowListsSources) {
  const CtlResult r = Ctl(At({"config", "show"}));
  ASSERT_EQ(r.code, kExitOk) << r.err;
  const std::vector<std::string> lines = Lines(r.out);
  ASSERT_EQ(lines.size(), 5u) << r.out;
  EXPECT_THAT(lines[0], ::testing::MatchesRegex("KEY +VALUE +SOURCE"));
  std::vector<std::string> sources;
  for (size_t i = 1; i < lines.size(); ++i) sources.push_back(SplitCells(lines[i]).back().text);
  EXPECT_THAT(sources, ::testing::ElementsAre("default", "file", "env", "flag"));
  EXPECT_THAT(lines[4], ::testing::MatchesRegex("update_threads +16 +flag"));

  const CtlResult json_result = Ctl(At({"config", "show", "--json"}));
  ASSERT_EQ(json_result.code, kExitOk) << json_result.err;
  const Json json = Json::parse(json_result.out);
  ASSERT_TRUE(json.is_array());
  ASSERT_EQ(json.size(), 4u);
  EXPECT_EQ(json[2], Json({{"key", "numa.state_node"}, {"value", "0"}, {"source", "env"}}));

  const CtlResult toml = Ctl(At({"config", "show", "--toml"}));
  ASSERT_EQ(toml.code, kExitOk) << toml.err;
  EXPECT_EQ(toml.out, testing::CannedConfig().toml());
}

TEST_F(CtlTest, RanksTableAndJson) {
  const CtlResult r = Ctl(At({"ranks"}));
  ASSERT_EQ(r.code, kExitOk) << r.err;
  const std::vector<std::string> lines = Lines(r.out);
  ASSERT_EQ(lines.size(), 3u) << r.out;
  EXPECT_THAT(lines[0],
              ::testing::MatchesRegex("RANK +PID +HOST +GPU +CONNECTED +LAST_STEP +HEARTBEAT"));
  EXPECT_THAT(lines[2], ::testing::MatchesRegex(" +1 +4243 +node-a +cpu +no +41 +1m15s ago"));

  const CtlResult json_result = Ctl(At({"ranks", "--json"}));
  ASSERT_EQ(json_result.code, kExitOk) << json_result.err;
  const Json json = Json::parse(json_result.out);
  ASSERT_EQ(json.size(), 2u);
  EXPECT_EQ(json[1]["ms_since_heartbeat"].get<uint64_t>(), 75'000u);
  EXPECT_EQ(json[1]["connected"], false);
  EXPECT_EQ(json[1]["gpu"], -1);
}

// hostd answers one entry per slot of the world size; a slot no rank holds is no rank.
TEST_F(CtlTest, RanksWithNoneAttachedPrintNoPhantomRow) {
  daemon_.service().set_no_rank_attached(true);
  const CtlResult r = Ctl(At({"ranks"}));
  ASSERT_EQ(r.code, kExitOk) << r.err;
  EXPECT_EQ(r.out, "no rank attached (world size 1)\n");
  const CtlResult json_result = Ctl(At({"ranks", "--json"}));
  ASSERT_EQ(json_result.code, kExitOk) << json_result.err;
  EXPECT_EQ(Json::parse(json_result.out), Json::array()) << json_result.out;
}

// An export that outlives --export-timeout-s: the message names that deadline (not
// --timeout-ms's) and says the export goes on in hostd; the exit code is its own.
TEST_F(CtlTest, ExportTimeoutNamesTheDeadlineItHadAndSaysTheExportGoesOn) {
  daemon_.service().set_operation_delay_ms(30'000);
  const CtlResult r = Ctl(At({"export", "--out", "/tmp/x", "--export-timeout-s", "1"}));
  EXPECT_EQ(r.code, kExitTimedOut) << r.err;
  EXPECT_THAT(r.err, HasSubstr("slidedpctl: the export to /tmp/x did not finish within 1 s "
                               "(--export-timeout-s 1); slidedpctl stopped waiting, but it goes "
                               "on in hostd"));
  EXPECT_THAT(r.err, ::testing::Not(HasSubstr("5000 ms")));
  EXPECT_THAT(r.err, ::testing::Not(HasSubstr("cannot reach hostd")));
  // The same for a checkpoint that is not committed within --wait-s.
  const CtlResult c = Ctl(At({"checkpoint", "--wait-s", "1"}));
  EXPECT_EQ(c.code, kExitTimedOut) << c.err;
  EXPECT_THAT(c.err, HasSubstr("the checkpoint did not finish within 1 s (--wait-s 1)"));
  // A query's own deadline is still "no answer" (exit 3), naming --timeout-ms's value.
  daemon_.service().set_status_delay_ms(1000);
  const CtlResult q = Ctl(At({"--timeout-ms", "300", "status"}));
  EXPECT_EQ(q.code, kExitUnreachable);
  EXPECT_THAT(q.err, HasSubstr("no answer to GetStatus within 300 ms"));
}

// hostd's own DEADLINE_EXCEEDED (the export waited 10 minutes for a step boundary) is its answer,
// not "no answer": exit 4 with hostd's message.
TEST_F(CtlTest, HostdsDeadlineExceededIsARejection) {
  daemon_.service().set_export_status(grpc::Status(
      grpc::StatusCode::DEADLINE_EXCEEDED,
      "step 3 did not complete within 10 minutes; the export waits for a step boundary"));
  const CtlResult r = Ctl(At({"export", "--out", "/tmp/x"}));
  EXPECT_EQ(r.code, kExitRejected) << r.err;
  EXPECT_THAT(r.err, HasSubstr("hostd rejected ExportHF: DEADLINE_EXCEEDED: step 3 did not "
                               "complete within 10 minutes"));
  EXPECT_THAT(r.err, ::testing::Not(HasSubstr("no answer")));
}

// hostd refuses relative directories (it has its own working directory): slidedpctl sends
// --dir made absolute against its own.
TEST_F(CtlTest, CheckpointDirIsSentAbsolute) {
  const CtlResult r = Ctl(At({"checkpoint", "--dir", "rel/ckpt", "--json"}));
  ASSERT_EQ(r.code, kExitOk) << r.err;
  const std::string expected = (std::filesystem::current_path() / "rel/ckpt").string();
  EXPECT_EQ(daemon_.service().last_checkpoint().dir(), expected);
  EXPECT_EQ(Json::parse(r.out)["path"], expected + "/step-42");
  ASSERT_EQ(Ctl(At({"checkpoint", "--dir", "/abs/ckpt"})).code, kExitOk);
  EXPECT_EQ(daemon_.service().last_checkpoint().dir(), "/abs/ckpt");
  ASSERT_EQ(Ctl(At({"checkpoint"})).code, kExitOk);
  EXPECT_EQ(daemon_.service().last_checkpoint().dir(), "");  // hostd's checkpoint.dir
  // export --out likewise (it did already).
  ASSERT_EQ(Ctl(At({"export", "--out", "rel/out", "--overwrite"})).code, kExitOk);
  EXPECT_EQ(daemon_.service().last_export().out_dir(),
            (std::filesystem::current_path() / "rel/out").string());
  EXPECT_TRUE(daemon_.service().last_export().overwrite());
}

TEST_F(CtlTest, StatsTableAndJson) {
  const CtlResult r = Ctl(At({"stats"}));
  ASSERT_EQ(r.code, kExitOk) << r.err;
  EXPECT_THAT(r.out, ::testing::ContainsRegex("\nupdate_params_total +44048449536\n"));
  EXPECT_THAT(r.out, ::testing::ContainsRegex("\nupdate_seconds_total +12.3457\n"));
  EXPECT_THAT(r.out, ::testing::ContainsRegex("\nisa +avx512\n"));

  const CtlResult json_result = Ctl(At({"--json", "stats"}));
  ASSERT_EQ(json_result.code, kExitOk) << json_result.err;
  const Json json = Json::parse(json_result.out);
  EXPECT_EQ(json["update_params_total"].get<uint64_t>(), 44'048'449'536u);
  EXPECT_DOUBLE_EQ(json["update_seconds_total"].get<double>(), 12.3456789);
  EXPECT_EQ(json["isa"], "avx512");
}

// estimate and doctor judge memlock as hostd does (common/shm_segment.h ReadHostMemoryInfo:
// CAP_IPC_LOCK or an unlimited RLIMIT_MEMLOCK): with the capability (root) a small rlimit does
// not make hostd's pinned memory TOO LARGE.
TEST(CtlMachineTest, MemlockIsJudgedAsHostdJudgesIt) {
  rlimit before{};
  ASSERT_EQ(getrlimit(RLIMIT_MEMLOCK, &before), 0);
  rlimit low = before;
  low.rlim_cur = std::min<rlim_t>(64 << 10, before.rlim_max);
  ASSERT_EQ(setrlimit(RLIMIT_MEMLOCK, &low), 0);
  absl::StatusOr<HostMemoryInfo> hostd_view = ReadHostMemoryInfo();
  const MachineInfo m = ProbeMachine();
  const CtlResult r = Ctl({"estimate", "--model", "tiny", "--gpus", "1", "--batch", "1", "--seq",
                           "8", "--gpu-memory", "80GiB", "--json"});
  ASSERT_EQ(setrlimit(RLIMIT_MEMLOCK, &before), 0);
  ASSERT_TRUE(hostd_view.ok()) << hostd_view.status();
  const bool hostd_unlimited =
      hostd_view->memlock_limit_bytes == std::numeric_limits<uint64_t>::max();
  if (!hostd_unlimited) std::cout << "no CAP_IPC_LOCK here: the limited case is checked\n";
  ASSERT_TRUE(m.have_memlock);
  EXPECT_EQ(m.memlock_unlimited, hostd_unlimited);
  EXPECT_EQ(m.memlock_by_capability, hostd_unlimited);  // the rlimit itself is 64 KiB
  const Json estimate = Json::parse(r.out);
  const Json& pinned = estimate["figures"]["pinned_bytes"];
  EXPECT_GT(pinned["value"].get<uint64_t>(), uint64_t{64} << 10);
  EXPECT_EQ(pinned["verdict"], hostd_unlimited ? "OK" : "TOO LARGE") << pinned.dump();
  if (hostd_unlimited) {
    EXPECT_THAT(pinned["against"].get<std::string>(), HasSubstr("CAP_IPC_LOCK"));
  }
}

// plan needs no hostd: the step-time model of model/step_model.h over a layout and a profile.
TEST(CtlPlanTest, JsonHasEveryFigureInputsAndProfile) {
  const CtlResult r = Ctl({"plan", "--model", "tiny", "--gpus", "2", "--batch", "4", "--seq", "64",
                           "--layout", "1RF 2F-r0.5 1N", "--json"});
  ASSERT_EQ(r.code, kExitOk) << r.err;
  const Json j = Json::parse(r.out);
  EXPECT_EQ(j["inputs"]["gpus"], 2);
  EXPECT_EQ(j["inputs"]["batch"], 4);
  EXPECT_EQ(j["inputs"]["seq"], 64);
  EXPECT_EQ(j["inputs"]["layout"], "1RF 2F-r0.5 1N");
  EXPECT_EQ(j["inputs"]["grad_route"], "gpu_reduction");
  EXPECT_EQ(j["model"]["decoder_layers"], 4);
  EXPECT_EQ(j["profile"]["name"], "builtin:h200");
  EXPECT_GT(j["profile"]["h2d_gb_per_s"].get<double>(), 0);
  for (const char* key : {"h2d", "d2h", "host_adam"}) {
    EXPECT_GT(j["host"]["resources"][key]["seconds"].get<double>(), 0) << key;
  }
  const double c = j["compute"]["c_s"].get<double>();
  const double h = j["host"]["h_s"].get<double>();
  const double e = j["exposure"]["e_s"].get<double>();
  EXPECT_DOUBLE_EQ(j["step_s"].get<double>(), std::max(c, h) + e);
  EXPECT_EQ(j["regime"], h > c ? "host-bound" : "GPU-bound");
  EXPECT_DOUBLE_EQ(j["tokens_per_s"].get<double>(), 2 * 4 * 64 / j["step_s"].get<double>());
  EXPECT_GT(j["memory"]["peak_gpu_bytes"].get<double>(), 0);
  EXPECT_TRUE(j["memory"]["estimate"].get<bool>());
  EXPECT_GT(j["pcie"]["offloaded_bytes_per_rank"].get<double>(), 0);
  EXPECT_GT(j["pcie"]["gb_per_step"].get<double>(), 0);
  EXPECT_DOUBLE_EQ(j["r_cross"]["r_cross"].get<double>(),
                   j["r_cross"]["c1_s"].get<double>() / j["r_cross"]["h1_s"].get<double>());
  ASSERT_EQ(j["scaling"].size(), 4u);
  EXPECT_EQ(j["scaling"][3]["gpus"], 8);
  EXPECT_EQ(j["scaling"][3]["strong"]["batch_per_rank"], 1);
  EXPECT_EQ(j["scaling"][3]["weak"]["batch_per_rank"], 4);
}

TEST(CtlPlanTest, DefaultLayoutAndHumanTable) {
  const CtlResult j =
      Ctl({"plan", "--model", "tiny", "--gpus", "1", "--batch", "1", "--seq", "16", "--json"});
  ASSERT_EQ(j.code, kExitOk) << j.err;
  EXPECT_EQ(Json::parse(j.out)["inputs"]["layout"], "4F-r0");
  const CtlResult r =
      Ctl({"plan", "--model", "tiny", "--gpus", "1", "--batch", "1", "--seq", "16"});
  ASSERT_EQ(r.code, kExitOk) << r.err;
  for (const char* row :
       {"C  GPU compute", "H  host/transfer bottleneck", "E  exposure", "T  step = max(C, H) + E",
        "tokens/s", "peak GPU memory", "PCIe", "R_cross", "STRONG TOK/S"}) {
    EXPECT_THAT(r.out, HasSubstr(row));
  }
}

TEST(CtlPlanTest, ProfileFileOverridesKeys) {
  const std::string dir = testing::MakeTempDir();
  const std::string file = dir + "/profile.json";
  std::ofstream(file) << R"({"name": "measured", "h2d_gb_per_s": 1.5, "host_adam_gb_per_s": 1})";
  const CtlResult r = Ctl({"plan", "--model", "tiny", "--gpus", "1", "--batch", "1", "--seq", "16",
                           "--profile", file, "--json", "--grad-route", "cpu_reduction"});
  ASSERT_EQ(r.code, kExitOk) << r.err;
  const Json j = Json::parse(r.out);
  EXPECT_EQ(j["profile"]["name"], "measured");
  EXPECT_EQ(j["profile"]["h2d_gb_per_s"], 1.5);
  EXPECT_GT(j["host"]["resources"]["cpu_reduce"]["seconds"].get<double>(), 0);

  std::ofstream(file) << R"({"h2d_gbps": 1})";
  const CtlResult unknown = Ctl(
      {"plan", "--model", "tiny", "--gpus", "1", "--batch", "1", "--seq", "16", "--profile", file});
  EXPECT_EQ(unknown.code, kExitUsage);
  EXPECT_THAT(unknown.err, HasSubstr("slidedpctl: --profile: " + file +
                                     ": unknown key 'h2d_gbps'; expected one of name, "));
  const CtlResult missing = Ctl({"plan", "--model", "tiny", "--gpus", "1", "--batch", "1", "--seq",
                                 "16", "--profile", dir + "/absent.json"});
  EXPECT_EQ(missing.code, kExitUsage);
  EXPECT_THAT(missing.err,
              HasSubstr("slidedpctl: --profile: " + dir + "/absent.json: cannot read"));
}

TEST(CtlPlanTest, BadInputExits2NamingTheFlag) {
  const auto plan = [](std::vector<std::string> extra) {
    std::vector<std::string> args = {"plan", "--model", "tiny"};
    args.insert(args.end(), extra.begin(), extra.end());
    return Ctl(args);
  };
  const CtlResult gpus = plan({"--gpus", "0", "--batch", "1", "--seq", "8"});
  EXPECT_EQ(gpus.code, kExitUsage);
  EXPECT_THAT(gpus.err, HasSubstr("--gpus"));
  const CtlResult batch = plan({"--gpus", "1", "--batch", "0", "--seq", "8"});
  EXPECT_EQ(batch.code, kExitUsage);
  EXPECT_THAT(batch.err, HasSubstr("--batch"));
  const CtlResult seq = plan({"--gpus", "1", "--batch", "1", "--seq", "0"});
  EXPECT_EQ(seq.code, kExitUsage);
  EXPECT_THAT(seq.err, HasSubstr("--seq"));
  const CtlResult layout = plan({"--gpus", "1", "--batch", "1", "--seq", "8", "--layout", "36F"});
  EXPECT_EQ(layout.code, kExitUsage);
  EXPECT_EQ(layout.err,
            "slidedpctl: --layout: policy: '36F' lists 36 decoder layers, the model has 4\n");
  const CtlResult group = plan({"--gpus", "1", "--batch", "1", "--seq", "8", "--layout", "4Q"});
  EXPECT_EQ(group.code, kExitUsage);
  EXPECT_THAT(group.err, HasSubstr("--layout: policy: group '4Q': expected <count><kind>"));
  const CtlResult model =
      Ctl({"plan", "--model", "/nope", "--gpus", "1", "--batch", "1", "--seq", "8"});
  EXPECT_EQ(model.code, kExitUsage);
  EXPECT_THAT(model.err, HasSubstr("--model"));
}

TEST(CtlUsageTest, UnknownSubcommandExits2) {
  const CtlResult r = Ctl({"frobnicate"});
  EXPECT_EQ(r.code, kExitUsage);
  EXPECT_THAT(r.out, IsEmpty());
  EXPECT_EQ(r.err,
            "slidedpctl: unknown command \"frobnicate\"; expected one of: version, status, layers, "
            "ranks, stats, config, estimate, plan, export, watch, checkpoint, checkpoints, "
            "cleanup, doctor\nRun "
            "'slidedpctl --help' for usage.\n");
  const CtlResult nested = Ctl({"config", "frobnicate"});
  EXPECT_EQ(nested.code, kExitUsage);
  EXPECT_THAT(nested.err, StartsWith("slidedpctl: unknown command \"frobnicate\"; expected one of: "
                                     "show\n"));
}

// export and watch check their own options before contacting hostd.
TEST(CtlUsageTest, ExportAndWatchBadOptionsExit2) {
  struct Case {
    std::vector<std::string> args;
    std::string message;
  };
  for (const Case& c : std::vector<Case>{
           {{"export"}, "--out is required"},
           {{"export", "--out", "/tmp/x", "--dtype", "fp16"},
            "--dtype: 'fp16', expected bf16 or fp32"},
           {{"export", "--out", "/tmp/x", "--max-shard-size", "lots"},
            "--max-shard-size: 'lots' is not a positive size"},
           {{"export", "--out", "/tmp/x", "--max-shard-size", "0"}, "is not a positive size"},
           {{"export", "--out", "/tmp/x", "--config", "/nonexistent/config.json"},
            "--config: cannot read '/nonexistent/config.json'"},
           {{"watch", "--interval", "0"}, "--interval"},
       }) {
    const CtlResult r = Ctl(c.args);
    EXPECT_EQ(r.code, kExitUsage) << absl::StrJoin(c.args, " ") << ": " << r.err;
    EXPECT_THAT(r.err, HasSubstr(c.message)) << absl::StrJoin(c.args, " ");
  }
}

TEST(CtlUsageTest, MalformedInvocationsExit2) {
  for (const std::vector<std::string>& args : std::vector<std::vector<std::string>>{
           {},
           {"config"},
           {"status", "extra"},
           {"--bogus", "status"},
           {"--timeout-ms", "0", "status"},
           {"--timeout-ms", "soon", "status"},
           {"--socket", "/tmp/a.sock", "--tcp", "127.0.0.1:7070", "status"},
           {"--tcp", "example.com:7070", "status"},
           {"--tcp", "127.0.0.1", "status"},
           {"--tcp", "127.0.0.1:99999", "status"},
       }) {
    const CtlResult r = Ctl(args);
    EXPECT_EQ(r.code, kExitUsage) << absl::StrJoin(args, " ") << "\n" << r.err;
    EXPECT_THAT(r.err, StartsWith("slidedpctl: "));
  }
}

TEST(CtlUsageTest, HelpExits0AndDocumentsExitCodes) {
  const CtlResult r = Ctl({"--help"});
  EXPECT_EQ(r.code, kExitOk);
  EXPECT_THAT(r.out, AllOf(HasSubstr("Exit codes:"), HasSubstr("3  hostd unreachable"),
                           HasSubstr("4  hostd rejected"), HasSubstr("6  export / checkpoint"),
                           HasSubstr("SLIDEDP_SOCKET"), HasSubstr("status"), HasSubstr("layers"),
                           HasSubstr("--json")));
  const CtlResult sub = Ctl({"layers", "--help"});
  EXPECT_EQ(sub.code, kExitOk);
  EXPECT_THAT(sub.out, HasSubstr("--job"));
}

}  // namespace
}  // namespace slidedp::ctl
