#include "slidedpctl/format.h"

#include <array>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace slidedp::ctl {

std::string FormatBytes(uint64_t bytes) {
  static constexpr std::array<const char*, 7> kUnits = {"B",   "KiB", "MiB", "GiB",
                                                        "TiB", "PiB", "EiB"};
  if (bytes < 1024) return absl::StrCat(bytes, " B");
  double value = static_cast<double>(bytes);
  size_t unit = 0;
  // 1023.95 and above would round to "1024.0", so those move up a unit as well.
  while (value >= 1023.95 && unit + 1 < kUnits.size()) {
    value /= 1024.0;
    ++unit;
  }
  return absl::StrFormat("%.1f %s", value, kUnits[unit]);
}

std::string FormatDurationMs(uint64_t ms) {
  if (ms < 1000) return absl::StrCat(ms, "ms");
  if (ms < 60'000) return absl::StrFormat("%.1fs", static_cast<double>(ms) / 1000.0);
  const uint64_t s = ms / 1000;
  if (s < 3600) return absl::StrFormat("%dm%02ds", s / 60, s % 60);
  if (s < 86'400) return absl::StrFormat("%dh%02dm%02ds", s / 3600, s / 60 % 60, s % 60);
  return absl::StrFormat("%dd%02dh%02dm", s / 86'400, s / 3600 % 24, s / 60 % 60);
}

std::string FormatCount(uint64_t count) {
  static constexpr std::array<const char*, 6> kSuffixes = {"", "K", "M", "G", "T", "P"};
  if (count < 1000) return absl::StrCat(count);
  double value = static_cast<double>(count);
  size_t suffix = 0;
  while (value >= 999.95 && suffix + 1 < kSuffixes.size()) {
    value /= 1000.0;
    ++suffix;
  }
  return absl::StrFormat("%.1f%s", value, kSuffixes[suffix]);
}

std::string FormatIndexOrDash(int32_t index) { return index < 0 ? "-" : absl::StrCat(index); }

std::string EnumValuePrefix(const google::protobuf::EnumDescriptor* descriptor) {
  if (descriptor->value_count() == 0) return "";
  std::string prefix = descriptor->value(0)->name();
  for (int i = 1; i < descriptor->value_count(); ++i) {
    const std::string& name = descriptor->value(i)->name();
    size_t common = 0;
    while (common < prefix.size() && common < name.size() && prefix[common] == name[common]) {
      ++common;
    }
    prefix.resize(common);
  }
  // A single-value enum shares its whole name with itself; never strip a value to nothing.
  if (descriptor->value_count() == 1 && !prefix.empty()) prefix.pop_back();
  const size_t underscore = prefix.rfind('_');
  return underscore == std::string::npos ? "" : prefix.substr(0, underscore + 1);
}

std::string ShortEnumName(const google::protobuf::EnumDescriptor* descriptor, int value) {
  const google::protobuf::EnumValueDescriptor* v = descriptor->FindValueByNumber(value);
  if (v == nullptr) return absl::StrCat(value);
  std::string name = v->name();
  const std::string prefix = EnumValuePrefix(descriptor);
  if (absl::StartsWith(name, prefix) && name.size() > prefix.size()) {
    name.erase(0, prefix.size());
  }
  return absl::AsciiStrToLower(name);
}

}  // namespace slidedp::ctl
