#include "kernels/cpu/kernels_capi.h"

#include <cstddef>
#include <optional>
#include <type_traits>

#include "kernels/cpu/adamw.h"

namespace {

using slidedp::kernels::AdamWScalars;
using slidedp::kernels::GradType;
using slidedp::kernels::Isa;

static_assert(sizeof(SlidedpAdamWScalars) == sizeof(AdamWScalars));
static_assert(std::is_standard_layout_v<AdamWScalars> &&
              std::is_trivially_copyable_v<AdamWScalars>);
static_assert(offsetof(SlidedpAdamWScalars, beta1) == offsetof(AdamWScalars, beta1));
static_assert(offsetof(SlidedpAdamWScalars, beta2) == offsetof(AdamWScalars, beta2));
static_assert(offsetof(SlidedpAdamWScalars, one_minus_beta1) ==
              offsetof(AdamWScalars, one_minus_beta1));
static_assert(offsetof(SlidedpAdamWScalars, one_minus_beta2) ==
              offsetof(AdamWScalars, one_minus_beta2));
static_assert(offsetof(SlidedpAdamWScalars, eps) == offsetof(AdamWScalars, eps));
static_assert(offsetof(SlidedpAdamWScalars, decay_factor) == offsetof(AdamWScalars, decay_factor));
static_assert(offsetof(SlidedpAdamWScalars, step_size) == offsetof(AdamWScalars, step_size));
static_assert(offsetof(SlidedpAdamWScalars, inv_sqrt_bias_correction2) ==
              offsetof(AdamWScalars, inv_sqrt_bias_correction2));
static_assert(offsetof(SlidedpAdamWScalars, grad_scale) == offsetof(AdamWScalars, grad_scale));

std::optional<Isa> ToIsa(int isa) {
  if (isa < 0 || isa > static_cast<int>(Isa::kAvx512Bf16)) return std::nullopt;
  return static_cast<Isa>(isa);
}

std::optional<GradType> ToGradType(int grad_type) {
  if (grad_type == 0) return GradType::kFp32;
  if (grad_type == 1) return GradType::kBf16;
  return std::nullopt;
}

AdamWScalars FromC(const SlidedpAdamWScalars& c) {
  return AdamWScalars{c.beta1,     c.beta2,        c.one_minus_beta1, c.one_minus_beta2,
                      c.eps,       c.decay_factor, c.step_size,       c.inv_sqrt_bias_correction2,
                      c.grad_scale};
}

}  // namespace

extern "C" {

int slidedp_best_isa(void) { return static_cast<int>(slidedp::kernels::BestIsa()); }

int slidedp_isa_supported(int isa) {
  const std::optional<Isa> parsed = ToIsa(isa);
  return parsed.has_value() && slidedp::kernels::IsaSupported(*parsed) ? 1 : 0;
}

int slidedp_make_adamw_scalars(double lr, double beta1, double beta2, double eps,
                               double weight_decay, double grad_scale, uint64_t step,
                               SlidedpAdamWScalars* out) {
  if (out == nullptr || step == 0) return -1;
  const AdamWScalars s =
      slidedp::kernels::MakeAdamWScalars(lr, beta1, beta2, eps, weight_decay, grad_scale, step);
  *out = SlidedpAdamWScalars{
      s.beta1,        s.beta2,     s.one_minus_beta1,           s.one_minus_beta2, s.eps,
      s.decay_factor, s.step_size, s.inv_sqrt_bias_correction2, s.grad_scale};
  return 0;
}

int slidedp_adamw_update(int isa, const SlidedpAdamWScalars* s, const void* grad, int grad_type,
                         float* master, float* m, float* v, uint16_t* param_bf16, size_t n) {
  const std::optional<Isa> parsed_isa = ToIsa(isa);
  const std::optional<GradType> parsed_type = ToGradType(grad_type);
  if (!parsed_isa || !parsed_type || s == nullptr) return -1;
  if (n > 0 && (grad == nullptr || master == nullptr || m == nullptr || v == nullptr)) return -1;
  slidedp::kernels::AdamWUpdate(*parsed_isa, FromC(*s), grad, *parsed_type, master, m, v,
                                param_bf16, n);
  return 0;
}

int slidedp_adamw_step(int isa, double lr, double beta1, double beta2, double eps,
                       double weight_decay, double grad_scale, uint64_t step, const void* grad,
                       int grad_type, float* master, float* m, float* v, uint16_t* param_bf16,
                       size_t n) {
  SlidedpAdamWScalars s;
  if (slidedp_make_adamw_scalars(lr, beta1, beta2, eps, weight_decay, grad_scale, step, &s) != 0) {
    return -1;
  }
  return slidedp_adamw_update(isa, &s, grad, grad_type, master, m, v, param_bf16, n);
}

int slidedp_grad_stats(int isa, const void* grad, int grad_type, size_t n, double* sum_squares,
                       uint64_t* nonfinite) {
  const std::optional<Isa> parsed_isa = ToIsa(isa);
  const std::optional<GradType> parsed_type = ToGradType(grad_type);
  if (!parsed_isa || !parsed_type || sum_squares == nullptr || nonfinite == nullptr) return -1;
  if (n > 0 && grad == nullptr) return -1;
  const slidedp::kernels::GradStats stats =
      slidedp::kernels::ComputeGradStats(*parsed_isa, grad, *parsed_type, n);
  *sum_squares = stats.sum_squares;
  *nonfinite = stats.nonfinite;
  return 0;
}

int slidedp_cast_fp32_to_bf16(int isa, const float* in, uint16_t* out, size_t n) {
  const std::optional<Isa> parsed_isa = ToIsa(isa);
  if (!parsed_isa || (n > 0 && (in == nullptr || out == nullptr))) return -1;
  slidedp::kernels::CastFp32ToBf16(*parsed_isa, in, out, n);
  return 0;
}

int slidedp_cast_bf16_to_fp32(int isa, const uint16_t* in, float* out, size_t n) {
  const std::optional<Isa> parsed_isa = ToIsa(isa);
  if (!parsed_isa || (n > 0 && (in == nullptr || out == nullptr))) return -1;
  slidedp::kernels::CastBf16ToFp32(*parsed_isa, in, out, n);
  return 0;
}

}  // extern "C"
