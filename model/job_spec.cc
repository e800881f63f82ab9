#include "model/job_spec.h"

#include <algorithm>
#include <charconv>
#include <cmath>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"

namespace slidedp::model {
namespace {

using slidedp::v1::OptimizerConfig;
using slidedp::v1::Routes;

SettingError Err(std::string field, std::string message) {
  return SettingError{std::move(field), std::move(message)};
}

std::string SizeText(uint64_t bytes) {
  constexpr uint64_t kKiB = 1024, kMiB = kKiB << 10, kGiB = kMiB << 10;
  if (bytes != 0 && bytes % kGiB == 0) return absl::StrCat(bytes / kGiB, "GiB");
  if (bytes != 0 && bytes % kMiB == 0) return absl::StrCat(bytes / kMiB, "MiB");
  if (bytes != 0 && bytes % kKiB == 0) return absl::StrCat(bytes / kKiB, "KiB");
  return absl::StrCat(bytes);
}

}  // namespace

std::string ShownText(absl::string_view text, size_t max_bytes) {
  std::string shown(text.substr(0, max_bytes));
  for (char& c : shown) {
    if (!absl::ascii_isprint(static_cast<unsigned char>(c))) c = '?';
  }
  if (text.size() > max_bytes) absl::StrAppend(&shown, "... (", text.size(), " bytes)");
  return shown;
}

std::optional<SettingError> CheckOptimizer(const OptimizerConfig& o) {
  for (const HyperParam& p : HyperParams()) {
    if (p.check == nullptr) continue;
    if (std::optional<std::string> message = p.check(o)) return Err(p.name, *std::move(message));
  }
  return std::nullopt;
}

std::optional<SettingError> CheckRoutes(const Routes& r) {
  if (!slidedp::v1::ParamRoute_IsValid(r.param_route())) {
    return Err("param_route", absl::StrCat("invalid value ", static_cast<int>(r.param_route()),
                                           "; expected one of replicated, sharded"));
  }
  if (!slidedp::v1::GradRoute_IsValid(r.grad_route())) {
    return Err(
        "grad_route",
        absl::StrCat("invalid value ", static_cast<int>(r.grad_route()),
                     "; expected one of cpu_reduction, gpu_reduction, reduce_scatter, auto"));
  }
  const uint64_t chunk = r.chunk_bytes();
  if (chunk < kMinChunkBytes || chunk > kMaxChunkBytes || chunk % 4096 != 0) {
    return Err("chunk_bytes", absl::StrCat("must be a multiple of 4096 from 4KiB to 1GiB, got ",
                                           chunk, " (", SizeText(chunk), ")"));
  }
  return std::nullopt;
}

std::optional<SettingError> CheckWorldSize(uint32_t world_size) {
  if (world_size < 1 || world_size > kMaxWorldSize) {
    return Err("world_size", absl::StrCat("must be in 1..", kMaxWorldSize, ", got ", world_size));
  }
  return std::nullopt;
}

std::optional<SettingError> CheckJobId(absl::string_view job_id) {
  const bool chars_ok = std::all_of(job_id.begin(), job_id.end(), [](char c) {
    return absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-' || c == '.';
  });
  if (job_id.empty() || job_id.size() > kMaxJobIdChars || !chars_ok) {
    return Err("job_id", absl::StrCat("'", ShownText(job_id), "' is not 1 to ", kMaxJobIdChars,
                                      " characters of [A-Za-z0-9_.-]"));
  }
  return std::nullopt;
}

absl::Status SettingStatus(const SettingError& e, absl::string_view prefix) {
  return absl::InvalidArgumentError(absl::StrCat(prefix, e.field, ": ", e.message));
}

absl::StatusOr<OptimizerConfig> NormalizeOptimizerConfig(const OptimizerConfig& in) {
  OptimizerConfig c = in;
  if (c.beta1() == 0 && c.beta2() == 0 && c.eps() == 0) {
    // A message with no betas/eps set: the defaults of torch.optim.AdamW.
    c.set_beta1(0.9);
    c.set_beta2(0.999);
    c.set_eps(1e-8);
  }
  if (c.schedule() == slidedp::v1::LR_SCHEDULE_UNSPECIFIED) {
    c.set_schedule(slidedp::v1::LR_SCHEDULE_CONSTANT);
  }
  if (c.clip() == slidedp::v1::CLIP_POLICY_UNSPECIFIED) c.set_clip(slidedp::v1::CLIP_POLICY_NONE);
  // Unused while clipping is off; a policy that clips must name its threshold.
  if (c.clip() == slidedp::v1::CLIP_POLICY_NONE && c.max_grad_norm() == 0) {
    c.set_max_grad_norm(1.0);
  }
  if (c.grad_dtype() == slidedp::v1::DTYPE_UNSPECIFIED) c.set_grad_dtype(slidedp::v1::DTYPE_BF16);
  if (std::optional<SettingError> e = CheckOptimizer(c)) return SettingStatus(*e, "optimizer.");
  return c;
}

absl::StatusOr<OptimizerConfig> ApplyHyperParams(
    const OptimizerConfig& current, const OptimizerConfig& in,
    const google::protobuf::RepeatedPtrField<std::string>& fields) {
  const std::string& settable = UpdatableHyperParamNames();
  if (fields.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("fields: expected at least one of ", settable));
  }
  OptimizerConfig next = current;
  for (const std::string& f : fields) {
    const HyperParam* p = FindHyperParam(f);
    if (p == nullptr || !p->updatable) {
      return absl::InvalidArgumentError(absl::StrCat(
          "fields: '", ShownText(f), "' cannot be changed; expected one of ", settable));
    }
    p->Copy(in, &next);
  }
  // What the proto names these zeros; every other zero is the value it says.
  if (next.schedule() == slidedp::v1::LR_SCHEDULE_UNSPECIFIED) {
    next.set_schedule(slidedp::v1::LR_SCHEDULE_CONSTANT);
  }
  if (next.clip() == slidedp::v1::CLIP_POLICY_UNSPECIFIED) {
    next.set_clip(slidedp::v1::CLIP_POLICY_NONE);
  }
  if (std::optional<SettingError> e = CheckOptimizer(next)) return SettingStatus(*e, "optimizer.");
  return next;
}

absl::StatusOr<slidedp::v1::JobSpec> NormalizeJobSpec(slidedp::v1::JobSpec spec,
                                                      const Routes& default_routes) {
  if (spec.world_size() == 0) spec.set_world_size(1);
  if (spec.job_id().empty()) spec.set_job_id("default");
  Routes* routes = spec.mutable_routes();
  if (routes->param_route() == slidedp::v1::PARAM_ROUTE_UNSPECIFIED) {
    routes->set_param_route(default_routes.param_route());
  }
  if (routes->grad_route() == slidedp::v1::GRAD_ROUTE_UNSPECIFIED) {
    routes->set_grad_route(default_routes.grad_route());
  }
  if (routes->chunk_bytes() == 0) routes->set_chunk_bytes(default_routes.chunk_bytes());
  // Defaults that are themselves unset mean what the proto says they mean.
  if (routes->param_route() == slidedp::v1::PARAM_ROUTE_UNSPECIFIED) {
    routes->set_param_route(slidedp::v1::PARAM_ROUTE_REPLICATED);
  }
  if (routes->grad_route() == slidedp::v1::GRAD_ROUTE_UNSPECIFIED) {
    routes->set_grad_route(slidedp::v1::GRAD_ROUTE_CPU_REDUCTION);
  }
  if (std::optional<SettingError> e = CheckJobId(spec.job_id())) {
    return SettingStatus(*e, "spec.");
  }
  if (std::optional<SettingError> e = CheckWorldSize(spec.world_size())) {
    return SettingStatus(*e, "spec.");
  }
  if (std::optional<SettingError> e = CheckRoutes(*routes)) {
    return SettingStatus(*e, "spec.routes.");
  }
  absl::StatusOr<OptimizerConfig> opt = NormalizeOptimizerConfig(spec.optimizer());
  if (!opt.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("spec.", opt.status().message()));
  }
  *spec.mutable_optimizer() = *std::move(opt);
  return spec;
}

}  // namespace slidedp::model
