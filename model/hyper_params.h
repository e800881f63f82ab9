// The optimizer's hyperparameters as one table: a row per OptimizerConfig field that hostd's
// configuration exposes as a key (lr, beta1, ..., scale_by_world_size), in the configuration's
// order, with its type, its help text, its bounds and its accessors. hostd's config key table
// (hostd/config.h) builds its optimizer keys from these rows, CheckOptimizer (job_spec.h) checks
// their bounds row by row, and ApplyHyperParams (UpdateHyperParams) copies the fields a client
// names through them; a field added here is a config key, checked, and settable at run time
// (when `updatable`) at once.
//
// Immutable after first use; thread-safe.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/strings/string_view.h"
#include "slidedp/v1/control.pb.h"

namespace slidedp::model {

enum class HyperParamType {
  kDouble,
  kUint,
  kBool,
  kEnum,  // a proto enum, written as the lower-case names of `choices`
};

struct HyperParam {
  std::string name;  // the config key and the OptimizerConfig field ("lr", "beta1")
  HyperParamType type;
  std::string help;  // the config's help text
  // UpdateHyperParams may change it (grad_dtype and the booleans are fixed by the job).
  bool updatable = false;
  // kEnum: the names and the values they stand for, and the name shown for a value outside
  // them (UNSPECIFIED).
  std::vector<std::pair<std::string, int>> choices;
  std::string unset_name;
  // The bounds: what is wrong with the field's value in `o` ("must be in [0, 1), got 1.5"),
  // std::nullopt when it is within them. Null: any value is.
  std::optional<std::string> (*check)(const slidedp::v1::OptimizerConfig& o) = nullptr;
  // The accessors of the type's pair (the others are null).
  double (*get_double)(const slidedp::v1::OptimizerConfig&) = nullptr;
  void (*set_double)(slidedp::v1::OptimizerConfig*, double) = nullptr;
  uint64_t (*get_uint)(const slidedp::v1::OptimizerConfig&) = nullptr;
  void (*set_uint)(slidedp::v1::OptimizerConfig*, uint64_t) = nullptr;
  bool (*get_bool)(const slidedp::v1::OptimizerConfig&) = nullptr;
  void (*set_bool)(slidedp::v1::OptimizerConfig*, bool) = nullptr;
  int (*get_enum)(const slidedp::v1::OptimizerConfig&) = nullptr;
  void (*set_enum)(slidedp::v1::OptimizerConfig*, int) = nullptr;

  // Sets this field of `to` to its value in `from`.
  void Copy(const slidedp::v1::OptimizerConfig& from, slidedp::v1::OptimizerConfig* to) const;
};

// A double as the configuration writes it: the shortest text that reads back the same value,
// always with '.', 'e', "inf" or "nan" (0.0001, 1.0, 1e-08).
std::string FormatSetting(double d);

// Every row, in the configuration's order.
const std::vector<HyperParam>& HyperParams();
// The row named `name`; null when there is none.
const HyperParam* FindHyperParam(absl::string_view name);
// The names of the updatable rows in table order, joined by ", " (for messages).
const std::string& UpdatableHyperParamNames();

}  // namespace slidedp::model
