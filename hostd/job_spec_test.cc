// One set of bounds for every source of a job's settings: each out-of-bounds value is refused by
// hostd's configuration (ValidateConfig) and by the RPC path (NormalizeJobSpec, which CreateJob
// uses; ApplyHyperParams, for UpdateHyperParams) with the same message, and each
// value at a bound is accepted by all of them.
#include "model/job_spec.h"

#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "hostd/config.h"

namespace slidedp::hostd {
namespace {

namespace v1 = slidedp::v1;
using ::testing::HasSubstr;

constexpr double kNan = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();

struct Case {
  std::string label;
  std::string field;  // the setting's name
  std::string path;   // its path in a CreateJobRequest's spec
  std::function<void(HostdConfig&)> set;
};

void Opt(HostdConfig& c, const std::function<void(v1::OptimizerConfig&)>& f) { f(c.optimizer); }

std::vector<Case> OutOfBounds() {
  std::vector<Case> cases;
  auto opt = [&](std::string label, std::string field,
                 std::function<void(v1::OptimizerConfig&)> f) {
    cases.push_back(
        {std::move(label), field, "spec.optimizer." + field, [f](HostdConfig& c) { Opt(c, f); }});
  };
  auto route = [&](std::string label, std::string field, std::function<void(v1::Routes&)> f) {
    cases.push_back(
        {std::move(label), field, "spec.routes." + field, [f](HostdConfig& c) { f(c.routes); }});
  };
  opt("lr_negative", "lr", [](auto& o) { o.set_lr(-1); });
  opt("lr_nan", "lr", [](auto& o) { o.set_lr(kNan); });
  opt("lr_inf", "lr", [](auto& o) { o.set_lr(kInf); });
  opt("beta1_one", "beta1", [](auto& o) { o.set_beta1(1.0); });
  opt("beta1_negative", "beta1", [](auto& o) { o.set_beta1(-0.1); });
  opt("beta2_nan", "beta2", [](auto& o) { o.set_beta2(kNan); });
  opt("beta2_one", "beta2", [](auto& o) { o.set_beta2(1.0); });
  opt("eps_negative", "eps", [](auto& o) { o.set_eps(-1e-8); });
  opt("eps_inf", "eps", [](auto& o) { o.set_eps(kInf); });
  opt("weight_decay_negative", "weight_decay", [](auto& o) { o.set_weight_decay(-0.1); });
  opt("weight_decay_nan", "weight_decay", [](auto& o) { o.set_weight_decay(kNan); });
  opt("schedule_99", "schedule",
      [](auto& o) { o.set_schedule(static_cast<v1::LrScheduleKind>(99)); });
  opt("schedule_negative", "schedule",
      [](auto& o) { o.set_schedule(static_cast<v1::LrScheduleKind>(-1)); });
  opt("warmup_beyond_total", "warmup_steps", [](auto& o) {
    o.set_schedule(v1::LR_SCHEDULE_COSINE);
    o.set_total_steps(10);
    o.set_warmup_steps(11);
  });
  opt("min_lr_ratio_above_one", "min_lr_ratio", [](auto& o) { o.set_min_lr_ratio(1.5); });
  opt("min_lr_ratio_nan", "min_lr_ratio", [](auto& o) { o.set_min_lr_ratio(kNan); });
  opt("clip_99", "clip", [](auto& o) { o.set_clip(static_cast<v1::ClipPolicy>(99)); });
  opt("max_grad_norm_zero_with_clip", "max_grad_norm", [](auto& o) {
    o.set_clip(v1::CLIP_POLICY_GLOBAL);
    o.set_max_grad_norm(0);
  });
  opt("max_grad_norm_inf", "max_grad_norm", [](auto& o) { o.set_max_grad_norm(kInf); });
  opt("max_grad_norm_negative", "max_grad_norm", [](auto& o) { o.set_max_grad_norm(-1); });
  opt("grad_dtype_99", "grad_dtype", [](auto& o) { o.set_grad_dtype(static_cast<v1::DType>(99)); });
  route("param_route_99", "param_route",
        [](auto& r) { r.set_param_route(static_cast<v1::ParamRoute>(99)); });
  route("grad_route_99", "grad_route",
        [](auto& r) { r.set_grad_route(static_cast<v1::GradRoute>(99)); });
  route("chunk_bytes_2_62", "chunk_bytes", [](auto& r) { r.set_chunk_bytes(uint64_t{1} << 62); });
  route("chunk_bytes_max", "chunk_bytes",
        [](auto& r) { r.set_chunk_bytes(std::numeric_limits<uint64_t>::max()); });
  route("chunk_bytes_1GiB_plus_a_page", "chunk_bytes",
        [](auto& r) { r.set_chunk_bytes((uint64_t{1} << 30) + 4096); });
  route("chunk_bytes_not_a_page_multiple", "chunk_bytes", [](auto& r) { r.set_chunk_bytes(5000); });
  route("chunk_bytes_below_a_page", "chunk_bytes", [](auto& r) { r.set_chunk_bytes(2048); });
  cases.push_back({"world_size_65", "world_size", "spec.world_size",
                   [](HostdConfig& c) { c.world_size = 65; }});
  return cases;
}

v1::JobSpec SpecOf(const HostdConfig& c) {
  v1::JobSpec spec;
  spec.set_job_id("j");
  spec.set_world_size(c.world_size);
  *spec.mutable_optimizer() = c.optimizer;
  *spec.mutable_routes() = c.routes;
  return spec;
}

TEST(JobSpecTest, EveryPathRefusesTheSameValuesWithTheSameMessage) {
  for (const Case& c : OutOfBounds()) {
    SCOPED_TRACE(c.label);
    HostdConfig cfg;
    c.set(cfg);
    const absl::Status by_config = ValidateConfig(cfg);
    ASSERT_EQ(by_config.code(), absl::StatusCode::kInvalidArgument) << by_config;
    const std::string config_msg(by_config.message());
    const std::string prefix = c.field + ": ";
    ASSERT_EQ(config_msg.rfind(prefix, 0), 0u) << config_msg;
    const std::string what = config_msg.substr(prefix.size());

    absl::StatusOr<v1::JobSpec> by_rpc =
        model::NormalizeJobSpec(SpecOf(cfg), model::DefaultRoutes());
    ASSERT_FALSE(by_rpc.ok()) << "CreateJob accepted what the config refuses: " << config_msg;
    EXPECT_EQ(by_rpc.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(std::string(by_rpc.status().message()), c.path + ": " + what);

    if (c.path.rfind("spec.optimizer.", 0) == 0) {  // what UpdateHyperParams checks
      absl::StatusOr<v1::OptimizerConfig> opt = model::NormalizeOptimizerConfig(cfg.optimizer);
      ASSERT_FALSE(opt.ok());
      EXPECT_EQ(std::string(opt.status().message()), "optimizer." + c.field + ": " + what);
    }
  }
}

const char* const kSettable[] = {"lr",           "weight_decay", "max_grad_norm", "beta1",
                                 "beta2",        "eps",          "warmup_steps",  "total_steps",
                                 "min_lr_ratio", "schedule",     "clip"};

google::protobuf::RepeatedPtrField<std::string> Fields(std::vector<std::string> names) {
  google::protobuf::RepeatedPtrField<std::string> out;
  for (std::string& n : names) *out.Add() = std::move(n);
  return out;
}

v1::OptimizerConfig JobOptimizer() {
  return model::NormalizeOptimizerConfig(HostdConfig().optimizer).value();
}

TEST(JobSpecTest, UpdateHyperParamsRefusesWhatTheConfigRefusesInItsWords) {
  const std::vector<std::string> all(std::begin(kSettable), std::end(kSettable));
  for (const Case& c : OutOfBounds()) {
    if (c.path.rfind("spec.optimizer.", 0) != 0 || c.field == "grad_dtype") continue;
    SCOPED_TRACE(c.label);
    HostdConfig cfg;
    c.set(cfg);
    const std::string config_msg(ValidateConfig(cfg).message());
    const std::string what = config_msg.substr(c.field.size() + 2);
    absl::StatusOr<v1::OptimizerConfig> r =
        model::ApplyHyperParams(JobOptimizer(), cfg.optimizer, Fields(all));
    ASSERT_FALSE(r.ok()) << "UpdateHyperParams accepted what the config refuses: " << config_msg;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(std::string(r.status().message()), "optimizer." + c.field + ": " + what);
  }
}

TEST(JobSpecTest, UpdateHyperParamsTakesANamedZeroAsAValue) {
  v1::OptimizerConfig in;  // every field 0
  // The old path (NormalizeOptimizerConfig) filled 0.9, 0.999, 1e-8 for these and 1.0 for
  // max_grad_norm: the request was answered OK with values it did not ask for.
  absl::StatusOr<v1::OptimizerConfig> r =
      model::ApplyHyperParams(JobOptimizer(), in, Fields({"beta1", "beta2", "eps"}));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(std::string(r.status().message()),
            "optimizer.eps: must be a finite number > 0, got 0.0");
  r = model::ApplyHyperParams(JobOptimizer(), in, Fields({"max_grad_norm"}));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(std::string(r.status().message()),
            "optimizer.max_grad_norm: must be a finite number > 0, got 0.0");
  // In bounds: 0 it is.
  r = model::ApplyHyperParams(JobOptimizer(), in, Fields({"beta1", "lr", "weight_decay"}));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->beta1(), 0.0);
  EXPECT_EQ(r->lr(), 0.0);
  EXPECT_EQ(r->beta2(), JobOptimizer().beta2());
  // schedule and clip 0 are what the proto names them.
  v1::OptimizerConfig clipped = JobOptimizer();
  clipped.set_clip(v1::CLIP_POLICY_GLOBAL);
  clipped.set_schedule(v1::LR_SCHEDULE_COSINE);
  r = model::ApplyHyperParams(clipped, in, Fields({"clip", "schedule"}));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->clip(), v1::CLIP_POLICY_NONE);
  EXPECT_EQ(r->schedule(), v1::LR_SCHEDULE_CONSTANT);
}

TEST(JobSpecTest, UpdateHyperParamsNamesTheFieldsItCannotChange) {
  v1::OptimizerConfig in;
  absl::StatusOr<v1::OptimizerConfig> r = model::ApplyHyperParams(JobOptimizer(), in, Fields({}));
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("fields: expected at least one of lr"));
  for (const char* fixed :
       {"grad_dtype", "scale_by_world_size", "no_decay_norms_and_biases", "momentum", ""}) {
    r = model::ApplyHyperParams(JobOptimizer(), in, Fields({"lr", fixed}));
    ASSERT_FALSE(r.ok()) << fixed;
    EXPECT_THAT(std::string(r.status().message()),
                HasSubstr(absl::StrCat("fields: '", fixed, "' cannot be changed")));
  }
  // A client's 1 MiB name comes back bounded (gRPC clients take 8 KiB of trailers).
  r = model::ApplyHyperParams(JobOptimizer(), in, Fields({std::string(1 << 20, 'f')}));
  ASSERT_FALSE(r.ok());
  EXPECT_LT(r.status().message().size(), 400u);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("... (1048576 bytes)"));
}

TEST(JobSpecTest, ShownTextIsBoundedAndPrintable) {
  EXPECT_EQ(model::ShownText("a/b"), "a/b");
  EXPECT_EQ(model::ShownText("x\n\x01y"), "x??y");
  EXPECT_EQ(model::ShownText(std::string(80, 'a')), std::string(80, 'a'));
  EXPECT_EQ(model::ShownText(std::string(81, 'a')), std::string(80, 'a') + "... (81 bytes)");
  EXPECT_EQ(model::ShownText("abcdef", 3), "abc... (6 bytes)");
}

TEST(JobSpecTest, ValuesAtTheBoundsAreAcceptedEverywhere) {
  const std::vector<std::function<void(HostdConfig&)>> at_bounds = {
      [](HostdConfig& c) { c.optimizer.set_lr(0); },
      [](HostdConfig& c) { c.optimizer.set_beta1(0); },
      [](HostdConfig& c) { c.optimizer.set_beta2(0.999999); },
      [](HostdConfig& c) { c.optimizer.set_min_lr_ratio(1); },
      [](HostdConfig& c) {
        c.optimizer.set_schedule(v1::LR_SCHEDULE_LINEAR);
        c.optimizer.set_total_steps(10);
        c.optimizer.set_warmup_steps(10);
      },
      [](HostdConfig& c) { c.routes.set_chunk_bytes(4096); },
      [](HostdConfig& c) { c.routes.set_chunk_bytes(uint64_t{1} << 30); },
      [](HostdConfig& c) { c.world_size = 64; },
  };
  for (size_t i = 0; i < at_bounds.size(); ++i) {
    SCOPED_TRACE(i);
    HostdConfig cfg;
    at_bounds[i](cfg);
    EXPECT_TRUE(ValidateConfig(cfg).ok()) << ValidateConfig(cfg);
    absl::StatusOr<v1::JobSpec> spec = model::NormalizeJobSpec(SpecOf(cfg), model::DefaultRoutes());
    EXPECT_TRUE(spec.ok()) << spec.status();
    const absl::StatusOr<v1::OptimizerConfig> updated = model::ApplyHyperParams(
        JobOptimizer(), cfg.optimizer,
        Fields(std::vector<std::string>(std::begin(kSettable), std::end(kSettable))));
    EXPECT_TRUE(updated.ok()) << updated.status();
  }
}

TEST(JobSpecTest, UnsetFieldsOfAMessageTakeTheDefaults) {
  v1::Routes defaults = model::DefaultRoutes();
  defaults.set_grad_route(v1::GRAD_ROUTE_GPU_REDUCTION);
  absl::StatusOr<v1::JobSpec> spec = model::NormalizeJobSpec(v1::JobSpec(), defaults);
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->job_id(), "default");
  EXPECT_EQ(spec->world_size(), 1u);
  EXPECT_EQ(spec->routes().param_route(), v1::PARAM_ROUTE_REPLICATED);
  EXPECT_EQ(spec->routes().grad_route(), v1::GRAD_ROUTE_GPU_REDUCTION);  // hostd's configured one
  EXPECT_EQ(spec->routes().chunk_bytes(), defaults.chunk_bytes());
  EXPECT_EQ(spec->optimizer().beta2(), 0.999);
  EXPECT_EQ(spec->optimizer().clip(), v1::CLIP_POLICY_NONE);
  EXPECT_EQ(spec->optimizer().max_grad_norm(), 1.0);
  EXPECT_EQ(spec->optimizer().grad_dtype(), v1::DTYPE_BF16);
}

TEST(JobSpecTest, JobIdIsBoundedAndPrintable) {
  for (const std::string& id :
       {std::string(65, 'a'), std::string("a/b"), std::string("a b"), std::string("x\n\x01y")}) {
    v1::JobSpec spec;
    spec.set_job_id(id);
    absl::StatusOr<v1::JobSpec> r = model::NormalizeJobSpec(spec, model::DefaultRoutes());
    ASSERT_FALSE(r.ok()) << id;
    EXPECT_THAT(std::string(r.status().message()), HasSubstr("spec.job_id: '"));
    EXPECT_EQ(std::string(r.status().message()).find('\n'), std::string::npos);
  }
  v1::JobSpec ok;
  ok.set_job_id("qwen3-4b_run.2");
  EXPECT_TRUE(model::NormalizeJobSpec(ok, model::DefaultRoutes()).ok());
}

TEST(JobSpecTest, GradSegmentBytesRefusesLayoutsThatWrap) {
  uint64_t bytes = 0;
  ASSERT_TRUE(shm::GradSegmentBytes(2, 4, 4096, &bytes));
  EXPECT_EQ(bytes, shm::kHeaderBytes + 8 * 4096);
  EXPECT_FALSE(shm::GradSegmentBytes(64, 1024, uint64_t{1} << 62, &bytes));
  EXPECT_FALSE(shm::GradSegmentBytes(1, 1, std::numeric_limits<uint64_t>::max() - 100, &bytes));
  ASSERT_TRUE(shm::GradSegmentBytes(64, 1024, uint64_t{1} << 30, &bytes));
  EXPECT_EQ(bytes, shm::kHeaderBytes + (uint64_t{1} << 46));
}

}  // namespace
}  // namespace slidedp::hostd
