// Human-readable renderings of sizes, durations, counts and proto enums for slidedpctl's tables.
// JSON output never goes through these: it carries exact integers and proto enum names.
// All functions are pure and thread-safe.
#pragma once

#include <cstdint>
#include <string>

#include "google/protobuf/descriptor.h"

namespace slidedp::ctl {

// Binary units with one decimal: 512 -> "512 B", 1536 -> "1.5 KiB", 12582912 -> "12.0 MiB".
std::string FormatBytes(uint64_t bytes);

// Compact duration: 450 -> "450ms", 3200 -> "3.2s", 3723000 -> "1h02m03s", days as "2d03h04m".
std::string FormatDurationMs(uint64_t ms);

// Decimal suffixes with one decimal: 999 -> "999", 1234567 -> "1.2M", 7e9 -> "7.0G".
std::string FormatCount(uint64_t count);

// "-" for a negative (unbound) NUMA node or GPU index, else the number.
std::string FormatIndexOrDash(int32_t index);

// Short lower-case name of an enum value with the enum's value prefix removed:
// (LayerKind, LAYER_KIND_LM_HEAD) -> "lm_head"; (LrScheduleKind, LR_SCHEDULE_COSINE) -> "cosine".
// Values the descriptor does not know print as their number.
std::string ShortEnumName(const google::protobuf::EnumDescriptor* descriptor, int value);

// The prefix every value name of the enum shares, up to and including its last '_':
// LayerKind -> "LAYER_KIND_", DType -> "DTYPE_". Empty when the names share no such prefix.
std::string EnumValuePrefix(const google::protobuf::EnumDescriptor* descriptor);

}  // namespace slidedp::ctl
