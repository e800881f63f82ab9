// libFuzzer target: hostd's configuration (hostd/config.h): the TOML file, the environment and
// the command line through LoadConfig.
//
// Input: up to three sections separated by a line "%%":
//   1. the TOML config file (written to a file and named with --config),
//   2. environment lines NAME=VALUE (NAME without "SLIDEDP_" gets it prepended),
//   3. command-line arguments, one per line.
// --config and SLIDEDP_CONFIG from the input are dropped (the harness names the file; a fuzzed
// path could name /dev/zero).
// Oracles besides the sanitizers: an error is INVALID_ARGUMENT (the file exists), with a
// message; an accepted configuration passes ValidateConfig, and ConfigToToml of it loads back
// (as a file alone) to the same entries -- what `hostd --print-config > f; hostd --config f`
// relies on.
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "hostd/config.h"

namespace slidedp::hostd {
namespace {

#define FUZZ_CHECK(cond)                                                                     \
  do {                                                                                       \
    if (!(cond)) {                                                                           \
      fprintf(stderr, "fuzz_config: check failed: %s (%s:%d)\n", #cond, __FILE__, __LINE__); \
      abort();                                                                               \
    }                                                                                        \
  } while (0)

std::string TempPath(const char* name) {
  return (std::filesystem::temp_directory_path() /
          ("slidedp-fuzz-cfg-" + std::to_string(getpid()) + "-" + name))
      .string();
}

void WriteFile(const std::string& path, std::string_view bytes) {
  FILE* f = fopen(path.c_str(), "wb");
  FUZZ_CHECK(f != nullptr);
  if (!bytes.empty()) FUZZ_CHECK(fwrite(bytes.data(), 1, bytes.size(), f) == bytes.size());
  FUZZ_CHECK(fclose(f) == 0);
}

std::vector<std::string_view> Split(std::string_view s, std::string_view sep) {
  std::vector<std::string_view> out;
  for (;;) {
    const size_t p = s.find(sep);
    out.push_back(s.substr(0, p));
    if (p == std::string_view::npos) return out;
    s.remove_prefix(p + sep.size());
  }
}

absl::StatusOr<LoadedConfig> Load(const std::vector<std::string>& args,
                                  const std::map<std::string, std::string>& env) {
  std::vector<const char*> argv;
  for (const std::string& a : args) argv.push_back(a.c_str());
  return LoadConfig(static_cast<int>(argv.size()), argv.data(), env);
}

}  // namespace
}  // namespace slidedp::hostd

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace slidedp::hostd;
  static const std::string file = TempPath("in.toml");
  static const std::string round_trip = TempPath("rt.toml");
  const std::string_view in(reinterpret_cast<const char*>(data), size);
  const std::vector<std::string_view> sections = Split(in, "\n%%\n");
  WriteFile(file, sections[0]);
  std::map<std::string, std::string> env;
  if (sections.size() > 1) {
    for (std::string_view line : Split(sections[1], "\n")) {
      const size_t eq = line.find('=');
      if (eq == std::string_view::npos) continue;
      std::string name(line.substr(0, eq));
      if (!name.starts_with("SLIDEDP_")) name = "SLIDEDP_" + name;
      if (name == "SLIDEDP_CONFIG") continue;
      env[name] = std::string(line.substr(eq + 1));
    }
  }
  std::vector<std::string> args = {"hostd", "--config", file};
  if (sections.size() > 2) {
    for (std::string_view line : Split(sections[2], "\n")) {
      if (line.find("config") != std::string_view::npos) continue;
      args.emplace_back(line);
    }
  }
  absl::StatusOr<LoadedConfig> loaded = Load(args, env);
  if (!loaded.ok()) {
    FUZZ_CHECK(loaded.status().code() == absl::StatusCode::kInvalidArgument);
    FUZZ_CHECK(!loaded.status().message().empty());
    return 0;
  }
  if (loaded->show_help) return 0;
  FUZZ_CHECK(ValidateConfig(loaded->config).ok());
  const std::string toml = ConfigToToml(loaded->entries);
  WriteFile(round_trip, toml);
  absl::StatusOr<LoadedConfig> again = Load({"hostd", "--config", round_trip}, {});
  if (!again.ok()) {
    fprintf(stderr, "round trip failed: %s\n--- toml:\n%s\n", again.status().ToString().c_str(),
            toml.c_str());
  }
  FUZZ_CHECK(again.ok());
  FUZZ_CHECK(again->entries.size() == loaded->entries.size());
  for (size_t i = 0; i < again->entries.size(); ++i) {
    if (again->entries[i].value != loaded->entries[i].value) {
      fprintf(stderr, "round trip changed %s: '%s' -> '%s'\n", loaded->entries[i].key.c_str(),
              loaded->entries[i].value.c_str(), again->entries[i].value.c_str());
    }
    FUZZ_CHECK(again->entries[i].key == loaded->entries[i].key);
    FUZZ_CHECK(again->entries[i].value == loaded->entries[i].value);
  }
  return 0;
}
