#include "model/hyper_params.h"

#include <cmath>
#include <limits>
#include <optional>
#include <string>

#include "gmock/gmock.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/message.h"
#include "gtest/gtest.h"
#include "model/job_spec.h"

namespace slidedp::model {
namespace {

namespace v1 = slidedp::v1;
using ::google::protobuf::FieldDescriptor;

const FieldDescriptor* Field(const HyperParam& p) {
  return v1::OptimizerConfig::descriptor()->FindFieldByName(p.name);
}

// Sets the row's field through its setter to a value no default has.
void SetDistinct(const HyperParam& p, v1::OptimizerConfig* o) {
  switch (p.type) {
    case HyperParamType::kDouble:
      p.set_double(o, 0.375);
      return;
    case HyperParamType::kUint:
      p.set_uint(o, 4242);
      return;
    case HyperParamType::kBool:
      p.set_bool(o, true);
      return;
    case HyperParamType::kEnum:
      p.set_enum(o, p.choices.back().second);
      return;
  }
}

// A config whose every field differs from the proto default.
v1::OptimizerConfig AllSet() {
  v1::OptimizerConfig o;
  for (const HyperParam& p : HyperParams()) SetDistinct(p, &o);
  return o;
}

TEST(HyperParamsTest, OneRowPerOptimizerConfigFieldInFieldOrder) {
  const auto* d = v1::OptimizerConfig::descriptor();
  ASSERT_EQ(HyperParams().size(), static_cast<size_t>(d->field_count()));
  for (int i = 0; i < d->field_count(); ++i) {
    EXPECT_EQ(HyperParams()[i].name, d->field(i)->name()) << i;
  }
  EXPECT_EQ(FindHyperParam("lr"), &HyperParams()[0]);
  EXPECT_EQ(FindHyperParam("momentum"), nullptr);
}

TEST(HyperParamsTest, TypesMatchTheProto) {
  for (const HyperParam& p : HyperParams()) {
    const FieldDescriptor* f = Field(p);
    ASSERT_NE(f, nullptr) << p.name;
    switch (p.type) {
      case HyperParamType::kDouble:
        EXPECT_EQ(f->cpp_type(), FieldDescriptor::CPPTYPE_DOUBLE) << p.name;
        break;
      case HyperParamType::kUint:
        EXPECT_EQ(f->cpp_type(), FieldDescriptor::CPPTYPE_UINT64) << p.name;
        break;
      case HyperParamType::kBool:
        EXPECT_EQ(f->cpp_type(), FieldDescriptor::CPPTYPE_BOOL) << p.name;
        break;
      case HyperParamType::kEnum:
        ASSERT_EQ(f->cpp_type(), FieldDescriptor::CPPTYPE_ENUM) << p.name;
        EXPECT_FALSE(p.choices.empty()) << p.name;
        for (const auto& [name, value] : p.choices) {
          EXPECT_NE(f->enum_type()->FindValueByNumber(value), nullptr) << p.name << " " << name;
        }
        break;
    }
  }
}

// Each setter writes its own field and no other, and the getter reads it back.
TEST(HyperParamsTest, AccessorsTouchOnlyTheirField) {
  for (const HyperParam& p : HyperParams()) {
    v1::OptimizerConfig o;
    SetDistinct(p, &o);
    const auto* r = o.GetReflection();
    std::vector<const FieldDescriptor*> set;
    r->ListFields(o, &set);
    ASSERT_EQ(set.size(), 1u) << p.name;
    EXPECT_EQ(set[0], Field(p)) << p.name;
    switch (p.type) {
      case HyperParamType::kDouble:
        EXPECT_EQ(p.get_double(o), 0.375) << p.name;
        break;
      case HyperParamType::kUint:
        EXPECT_EQ(p.get_uint(o), 4242u) << p.name;
        break;
      case HyperParamType::kBool:
        EXPECT_TRUE(p.get_bool(o)) << p.name;
        break;
      case HyperParamType::kEnum:
        EXPECT_EQ(p.get_enum(o), p.choices.back().second) << p.name;
        break;
    }
  }
}

TEST(HyperParamsTest, CopyTakesOneField) {
  const v1::OptimizerConfig from = AllSet();
  for (const HyperParam& p : HyperParams()) {
    v1::OptimizerConfig to;
    p.Copy(from, &to);
    std::vector<const FieldDescriptor*> set;
    to.GetReflection()->ListFields(to, &set);
    ASSERT_EQ(set.size(), 1u) << p.name;
    EXPECT_EQ(set[0], Field(p)) << p.name;
  }
}

TEST(HyperParamsTest, UpdatableRowsAreTheSettableFields) {
  EXPECT_EQ(UpdatableHyperParamNames(),
            "lr, beta1, beta2, eps, weight_decay, schedule, warmup_steps, total_steps, "
            "min_lr_ratio, clip, max_grad_norm");
  for (const char* fixed : {"grad_dtype", "no_decay_norms_and_biases", "scale_by_world_size"}) {
    ASSERT_NE(FindHyperParam(fixed), nullptr) << fixed;
    EXPECT_FALSE(FindHyperParam(fixed)->updatable) << fixed;
  }
}

std::optional<std::string> CheckOf(const char* name, const v1::OptimizerConfig& o) {
  const HyperParam* p = FindHyperParam(name);
  EXPECT_NE(p, nullptr) << name;
  if (p == nullptr || p->check == nullptr) return std::nullopt;
  return p->check(o);
}

v1::OptimizerConfig Valid() {
  absl::StatusOr<v1::OptimizerConfig> o = NormalizeOptimizerConfig(v1::OptimizerConfig());
  EXPECT_TRUE(o.ok()) << o.status();
  return o.ok() ? *o : v1::OptimizerConfig();
}

TEST(HyperParamsTest, BoundsSayWhatIsExpectedAndWhatCame) {
  const v1::OptimizerConfig valid = Valid();
  for (const HyperParam& p : HyperParams()) {
    if (p.check != nullptr) {
      EXPECT_EQ(p.check(valid), std::nullopt) << p.name;
    }
  }
  v1::OptimizerConfig o = valid;
  o.set_lr(-1);
  EXPECT_EQ(CheckOf("lr", o), "must be a finite number >= 0, got -1.0");
  o.set_lr(std::numeric_limits<double>::infinity());
  EXPECT_EQ(CheckOf("lr", o), "must be a finite number >= 0, got inf");
  o = valid;
  o.set_beta1(1);
  EXPECT_EQ(CheckOf("beta1", o), "must be in [0, 1), got 1.0");
  o.set_beta2(std::nan(""));
  EXPECT_EQ(CheckOf("beta2", o), "must be in [0, 1), got nan");
  o = valid;
  o.set_eps(0);
  EXPECT_EQ(CheckOf("eps", o), "must be a finite number > 0, got 0.0");
  o.set_min_lr_ratio(1);  // the closed end
  EXPECT_EQ(CheckOf("min_lr_ratio", o), std::nullopt);
  o.set_min_lr_ratio(1.5);
  EXPECT_EQ(CheckOf("min_lr_ratio", o), "must be in [0, 1], got 1.5");
  o = valid;
  o.set_schedule(static_cast<v1::LrScheduleKind>(7));
  EXPECT_EQ(CheckOf("schedule", o), "invalid value 7; expected one of constant, linear, cosine");
  o.set_schedule(v1::LR_SCHEDULE_UNSPECIFIED);  // the configuration's "constant"
  EXPECT_EQ(CheckOf("schedule", o), std::nullopt);
  o.set_grad_dtype(v1::DTYPE_UNSPECIFIED);  // no default: a job names its gradients' dtype
  EXPECT_EQ(CheckOf("grad_dtype", o), "invalid value 0; expected one of bf16, fp32");
  o = valid;
  o.set_schedule(v1::LR_SCHEDULE_COSINE);
  o.set_warmup_steps(11);
  o.set_total_steps(10);
  EXPECT_EQ(CheckOf("warmup_steps", o),
            "11 exceeds total_steps (10); with a decaying schedule warmup_steps must be <= "
            "total_steps");
  o.set_schedule(v1::LR_SCHEDULE_CONSTANT);  // no decay: warmup may run past total_steps
  EXPECT_EQ(CheckOf("warmup_steps", o), std::nullopt);
}

TEST(HyperParamsTest, CheckOptimizerNamesTheFirstRowOutOfBounds) {
  v1::OptimizerConfig o = Valid();
  o.set_eps(-1);
  o.set_max_grad_norm(0);
  const std::optional<SettingError> e = CheckOptimizer(o);
  ASSERT_TRUE(e.has_value());
  EXPECT_EQ(e->field, "eps");
  EXPECT_EQ(e->message, "must be a finite number > 0, got -1.0");
}

TEST(HyperParamsTest, FormatSettingReadsBack) {
  EXPECT_EQ(FormatSetting(0.0001), "0.0001");
  EXPECT_EQ(FormatSetting(1), "1.0");
  EXPECT_EQ(FormatSetting(1e-8), "1e-08");
}

}  // namespace
}  // namespace slidedp::model
