#include "hostd/config.h"

#include <unistd.h>

#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "common/status_macros.h"
#include "hostd/config_internal.h"

extern char** environ;

namespace slidedp::hostd {

using config_internal::ApplyFile;
using config_internal::Av;
using config_internal::HelpText;
using config_internal::KeyDescriptor;
using config_internal::Keys;
using config_internal::Origin;
using config_internal::SetFrom;
using config_internal::Suggestion;
using config_internal::Validate;

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
