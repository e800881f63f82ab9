// `hostd --help`, generated from the key table.

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "hostd/config_internal.h"

namespace slidedp::hostd::config_internal {
namespace {

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

}  // namespace

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

}  // namespace slidedp::hostd::config_internal
