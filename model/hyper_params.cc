#include "model/hyper_params.h"

#include <charconv>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace slidedp::model {
namespace {

using slidedp::v1::OptimizerConfig;
using Check = std::optional<std::string>;

std::string Got(double v) { return absl::StrCat(", got ", FormatSetting(v)); }

Check FiniteAtLeastZero(double v) {
  if (std::isfinite(v) && v >= 0) return std::nullopt;
  return absl::StrCat("must be a finite number >= 0", Got(v));
}
Check FinitePositive(double v) {
  if (std::isfinite(v) && v > 0) return std::nullopt;
  return absl::StrCat("must be a finite number > 0", Got(v));
}
// [0, 1) and [0, 1]; NaN is outside both.
Check UnitOpen(double v) {
  if (v >= 0 && v < 1) return std::nullopt;
  return absl::StrCat("must be in [0, 1)", Got(v));
}
Check UnitClosed(double v) {
  if (v >= 0 && v <= 1) return std::nullopt;
  return absl::StrCat("must be in [0, 1]", Got(v));
}
Check EnumValue(bool valid, int v, const char* expected) {
  if (valid) return std::nullopt;
  return absl::StrCat("invalid value ", v, "; expected one of ", expected);
}

HyperParam Double(std::string name, std::string help, bool updatable,
                  Check (*check)(const OptimizerConfig&), double (*get)(const OptimizerConfig&),
                  void (*set)(OptimizerConfig*, double)) {
  HyperParam p{std::move(name), HyperParamType::kDouble, std::move(help), updatable};
  p.check = check;
  p.get_double = get;
  p.set_double = set;
  return p;
}

HyperParam Uint(std::string name, std::string help, bool updatable,
                Check (*check)(const OptimizerConfig&), uint64_t (*get)(const OptimizerConfig&),
                void (*set)(OptimizerConfig*, uint64_t)) {
  HyperParam p{std::move(name), HyperParamType::kUint, std::move(help), updatable};
  p.check = check;
  p.get_uint = get;
  p.set_uint = set;
  return p;
}

HyperParam Bool(std::string name, std::string help, bool (*get)(const OptimizerConfig&),
                void (*set)(OptimizerConfig*, bool)) {
  HyperParam p{std::move(name), HyperParamType::kBool, std::move(help), /*updatable=*/false};
  p.get_bool = get;
  p.set_bool = set;
  return p;
}

HyperParam Enum(std::string name, std::string help, bool updatable,
                std::vector<std::pair<std::string, int>> choices, std::string unset_name,
                Check (*check)(const OptimizerConfig&), int (*get)(const OptimizerConfig&),
                void (*set)(OptimizerConfig*, int)) {
  HyperParam p{std::move(name), HyperParamType::kEnum, std::move(help),
               updatable,       std::move(choices),    std::move(unset_name)};
  p.check = check;
  p.get_enum = get;
  p.set_enum = set;
  return p;
}

std::vector<HyperParam> BuildHyperParams() {
  namespace v1 = slidedp::v1;
  std::vector<HyperParam> t;
  t.push_back(Double(
      "lr", "Peak learning rate, >= 0.", true,
      [](const OptimizerConfig& o) { return FiniteAtLeastZero(o.lr()); },
      [](const OptimizerConfig& o) { return o.lr(); },
      [](OptimizerConfig* o, double v) { o->set_lr(v); }));
  t.push_back(Double(
      "beta1", "Adam beta1, in [0, 1).", true,
      [](const OptimizerConfig& o) { return UnitOpen(o.beta1()); },
      [](const OptimizerConfig& o) { return o.beta1(); },
      [](OptimizerConfig* o, double v) { o->set_beta1(v); }));
  t.push_back(Double(
      "beta2", "Adam beta2, in [0, 1).", true,
      [](const OptimizerConfig& o) { return UnitOpen(o.beta2()); },
      [](const OptimizerConfig& o) { return o.beta2(); },
      [](OptimizerConfig* o, double v) { o->set_beta2(v); }));
  t.push_back(Double(
      "eps", "Adam epsilon, > 0.", true,
      [](const OptimizerConfig& o) { return FinitePositive(o.eps()); },
      [](const OptimizerConfig& o) { return o.eps(); },
      [](OptimizerConfig* o, double v) { o->set_eps(v); }));
  t.push_back(Double(
      "weight_decay", "Decoupled weight decay, >= 0.", true,
      [](const OptimizerConfig& o) { return FiniteAtLeastZero(o.weight_decay()); },
      [](const OptimizerConfig& o) { return o.weight_decay(); },
      [](OptimizerConfig* o, double v) { o->set_weight_decay(v); }));
  t.push_back(Bool(
      "no_decay_norms_and_biases", "Exclude norm weights and biases from weight decay.",
      [](const OptimizerConfig& o) { return o.no_decay_norms_and_biases(); },
      [](OptimizerConfig* o, bool v) { o->set_no_decay_norms_and_biases(v); }));
  t.push_back(Enum(
      "schedule",
      "Learning-rate schedule after warmup: constant, linear or cosine decay to "
      "min_lr_ratio * lr at total_steps.",
      true,
      {{"constant", v1::LR_SCHEDULE_CONSTANT},
       {"linear", v1::LR_SCHEDULE_LINEAR},
       {"cosine", v1::LR_SCHEDULE_COSINE}},
      "constant",
      [](const OptimizerConfig& o) {
        return EnumValue(v1::LrScheduleKind_IsValid(o.schedule()), o.schedule(),
                         "constant, linear, cosine");
      },
      [](const OptimizerConfig& o) { return static_cast<int>(o.schedule()); },
      [](OptimizerConfig* o, int v) { o->set_schedule(static_cast<v1::LrScheduleKind>(v)); }));
  t.push_back(Uint(
      "warmup_steps", "Linear warmup steps from 0 to lr.", true,
      [](const OptimizerConfig& o) -> Check {
        const bool decays =
            o.schedule() == v1::LR_SCHEDULE_LINEAR || o.schedule() == v1::LR_SCHEDULE_COSINE;
        if (!decays || o.total_steps() == 0 || o.warmup_steps() <= o.total_steps()) {
          return std::nullopt;
        }
        return absl::StrCat(o.warmup_steps(), " exceeds total_steps (", o.total_steps(),
                            "); with a decaying schedule warmup_steps must be <= total_steps");
      },
      [](const OptimizerConfig& o) { return o.warmup_steps(); },
      [](OptimizerConfig* o, uint64_t v) { o->set_warmup_steps(v); }));
  t.push_back(Uint(
      "total_steps", "Step at which linear/cosine decay reaches its floor; 0: no decay.", true,
      nullptr, [](const OptimizerConfig& o) { return o.total_steps(); },
      [](OptimizerConfig* o, uint64_t v) { o->set_total_steps(v); }));
  t.push_back(Double(
      "min_lr_ratio", "Floor of the decay as a fraction of lr, in [0, 1].", true,
      [](const OptimizerConfig& o) { return UnitClosed(o.min_lr_ratio()); },
      [](const OptimizerConfig& o) { return o.min_lr_ratio(); },
      [](OptimizerConfig* o, double v) { o->set_min_lr_ratio(v); }));
  t.push_back(Enum(
      "clip",
      "Gradient clipping: none, per_layer (each layer to max_grad_norm by itself) or global "
      "(exact global norm; updates wait for every layer's gradient).",
      true,
      {{"none", v1::CLIP_POLICY_NONE},
       {"per_layer", v1::CLIP_POLICY_PER_LAYER},
       {"global", v1::CLIP_POLICY_GLOBAL}},
      "none",
      [](const OptimizerConfig& o) {
        return EnumValue(v1::ClipPolicy_IsValid(o.clip()), o.clip(), "none, per_layer, global");
      },
      [](const OptimizerConfig& o) { return static_cast<int>(o.clip()); },
      [](OptimizerConfig* o, int v) { o->set_clip(static_cast<v1::ClipPolicy>(v)); }));
  t.push_back(Double(
      "max_grad_norm", "Clipping threshold, > 0.", true,
      [](const OptimizerConfig& o) { return FinitePositive(o.max_grad_norm()); },
      [](const OptimizerConfig& o) { return o.max_grad_norm(); },
      [](OptimizerConfig* o, double v) { o->set_max_grad_norm(v); }));
  t.push_back(Enum(
      "grad_dtype", "dtype of the gradients ranks push.", false,
      {{"bf16", v1::DTYPE_BF16}, {"fp32", v1::DTYPE_FP32}}, "unspecified",
      [](const OptimizerConfig& o) {
        return EnumValue(o.grad_dtype() == v1::DTYPE_BF16 || o.grad_dtype() == v1::DTYPE_FP32,
                         o.grad_dtype(), "bf16, fp32");
      },
      [](const OptimizerConfig& o) { return static_cast<int>(o.grad_dtype()); },
      [](OptimizerConfig* o, int v) { o->set_grad_dtype(static_cast<v1::DType>(v)); }));
  t.push_back(Bool(
      "scale_by_world_size", "Multiply the aggregated gradient by 1/world_size.",
      [](const OptimizerConfig& o) { return o.scale_by_world_size(); },
      [](OptimizerConfig* o, bool v) { o->set_scale_by_world_size(v); }));
  return t;
}

}  // namespace

std::string FormatSetting(double d) {
  char buf[64];
  auto [p, ec] = std::to_chars(buf, buf + sizeof(buf), d, std::chars_format::general);
  std::string s(buf, ec == std::errc() ? p : buf);
  if (s.find_first_of(".en") == std::string::npos) s += ".0";
  return s;
}

void HyperParam::Copy(const OptimizerConfig& from, OptimizerConfig* to) const {
  switch (type) {
    case HyperParamType::kDouble:
      set_double(to, get_double(from));
      return;
    case HyperParamType::kUint:
      set_uint(to, get_uint(from));
      return;
    case HyperParamType::kBool:
      set_bool(to, get_bool(from));
      return;
    case HyperParamType::kEnum:
      set_enum(to, get_enum(from));
      return;
  }
}

const std::vector<HyperParam>& HyperParams() {
  static const std::vector<HyperParam>* const table =
      new std::vector<HyperParam>(BuildHyperParams());
  return *table;
}

const HyperParam* FindHyperParam(absl::string_view name) {
  for (const HyperParam& p : HyperParams()) {
    if (p.name == name) return &p;
  }
  return nullptr;
}

const std::string& UpdatableHyperParamNames() {
  static const std::string* const names = [] {
    std::vector<std::string> v;
    for (const HyperParam& p : HyperParams()) {
      if (p.updatable) v.push_back(p.name);
    }
    return new std::string(absl::StrJoin(v, ", "));
  }();
  return *names;
}

}  // namespace slidedp::model
