// The TOML config file: read into the key table; the effective configuration written back.

#include <algorithm>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>
#include <tuple>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "hostd/config_internal.h"
#include "model/job_spec.h"
#include "toml++/toml.h"

namespace slidedp::hostd::config_internal {
namespace {

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

}  // namespace

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

namespace {

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

}  // namespace

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

}  // namespace slidedp::hostd::config_internal

namespace slidedp::hostd {

using config_internal::FindKey;
using config_internal::TomlValue;

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

}  // namespace slidedp::hostd
