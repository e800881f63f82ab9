// The config key table and the pieces of hostd's configuration that share it, split by job:
//   config_keys.cc      the key table (parsers, formatters, one KeyDescriptor per key), lookup
//   config_validate.cc  setting a key from text (UTF-8, its parser) and the cross-key checks
//   config_toml.cc      the TOML file: reading it into the table, writing the effective config
//   config_help.cc      `hostd --help`, generated from the table
//   config.cc           the public API of config.h: the sources in precedence order
// Internal to hostd's config library; nothing outside hostd/config*.cc includes it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "hostd/config.h"

namespace slidedp::hostd::config_internal {

// Debian's abseil builds absl::string_view as its own class, not an alias of std::string_view.
inline absl::string_view Av(std::string_view s) { return absl::string_view(s.data(), s.size()); }

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

// The one table of keys: flags, environment, file, help, --print-config and GetConfig all
// derive from it.
const std::vector<KeyDescriptor>& Keys();
// The key named `name`, or nullptr.
const KeyDescriptor* FindKey(std::string_view name);
// " (did you mean 'lr'?)" when a key is close to `name`, else "".
std::string Suggestion(std::string_view name, std::string_view prefix);

// Where a key's current value came from.
struct Origin {
  std::string source = "default";  // default|file|env|flag
  std::string detail = "default";  // "flag --lr", "env SLIDEDP_LR", "file /x.toml:3"
};

// INVALID_ARGUMENT "key (detail): msg", or "key: msg" when detail is empty.
absl::Status KeyError(std::string_view key, std::string_view detail, std::string_view msg);
// Parses `text` (well-formed UTF-8) into `c` through `d`; errors name the key and `detail`.
absl::Status SetFrom(const KeyDescriptor& d, HostdConfig& c, std::string_view text,
                     std::string_view detail);

// For a key, where its value came from ("flag --lr"), for messages; "" when unknown.
using WhereFn = std::function<std::string(std::string_view key)>;

// The checks across keys, each error naming the key and where(key).
absl::Status Validate(const HostdConfig& c, const WhereFn& where);

// Applies the TOML file at `path` to `c`, recording each key's origin.
absl::Status ApplyFile(const std::string& path, HostdConfig& c, std::vector<Origin>& origins);
// `value` written as a TOML value of `d`'s kind (a quoted string when d is null).
std::string TomlValue(const KeyDescriptor* d, const std::string& value);

// The --help text for `program`.
std::string HelpText(std::string_view program);

}  // namespace slidedp::hostd::config_internal
