// Scalar reference: defines the results every SIMD path must reproduce bit for bit. Compiled with
// -ffp-contract=off so that no multiply-add is fused except the explicit std::fma calls.

#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "kernels/cpu/adamw.h"
#include "kernels/cpu/adamw_internal.h"
#include "kernels/cpu/bf16.h"

namespace slidedp::kernels::internal {
namespace {

inline bool IsFiniteBits(uint32_t bits) { return (bits & 0x7F800000u) != 0x7F800000u; }

template <GradType kGradType>
inline float LoadGrad(const void* grad, size_t i) {
  if constexpr (kGradType == GradType::kBf16) {
    return Bf16ToFp32(static_cast<const uint16_t*>(grad)[i]);
  } else {
    return static_cast<const float*>(grad)[i];
  }
}

template <GradType kGradType>
void AdamWLoop(const AdamWScalars& s, const void* grad, float* master, float* m, float* v,
               uint16_t* param_bf16, size_t n) {
  const float neg_step_size = -s.step_size;
  for (size_t i = 0; i < n; ++i) {
    const float g = LoadGrad<kGradType>(grad, i) * s.grad_scale;
    const float p = master[i] * s.decay_factor;
    const float m_new = std::fma(s.one_minus_beta1, g, s.beta1 * m[i]);
    const float v_new = std::fma(s.one_minus_beta2 * g, g, s.beta2 * v[i]);
    const float denom = std::fma(std::sqrt(v_new), s.inv_sqrt_bias_correction2, s.eps);
    const float master_new = std::fma(neg_step_size, m_new / denom, p);
    master[i] = master_new;
    m[i] = m_new;
    v[i] = v_new;
    if (param_bf16 != nullptr) param_bf16[i] = RoundToBf16(master_new);
  }
}

void AdamWUpdateScalar(const AdamWScalars& s, const void* grad, GradType grad_type, float* master,
                       float* m, float* v, uint16_t* param_bf16, size_t n) {
  if (grad_type == GradType::kBf16) {
    AdamWLoop<GradType::kBf16>(s, grad, master, m, v, param_bf16, n);
  } else {
    AdamWLoop<GradType::kFp32>(s, grad, master, m, v, param_bf16, n);
  }
}

// The fixed pairwise tree of the contract: lane j + lane j+8, then j + j+4, then j + j+2, then
// 0 + 1. SIMD paths reduce their accumulators in exactly this order.
inline double ReduceLanes(const double (&lanes)[16]) {
  double s8[8];
  for (int j = 0; j < 8; ++j) s8[j] = lanes[j] + lanes[j + 8];
  double s4[4];
  for (int j = 0; j < 4; ++j) s4[j] = s8[j] + s8[j + 4];
  double s2[2];
  for (int j = 0; j < 2; ++j) s2[j] = s4[j] + s4[j + 2];
  return s2[0] + s2[1];
}

template <GradType kGradType>
GradStats GradStatsLoop(const void* grad, size_t n) {
  double sum_squares = 0;
  uint64_t nonfinite = 0;
  for (size_t block = 0; block < n; block += kStatsBlock) {
    const size_t block_end = n - block < kStatsBlock ? n : block + kStatsBlock;
    double lanes[16] = {};
    for (size_t i = block; i < block_end; ++i) {
      const float x = LoadGrad<kGradType>(grad, i);
      if (!IsFiniteBits(std::bit_cast<uint32_t>(x))) {
        ++nonfinite;
        continue;
      }
      const double d = x;
      lanes[(i - block) % 16] += d * d;  // d * d is exact: 24-bit significands fit in 53 bits
    }
    sum_squares += ReduceLanes(lanes);
  }
  return GradStats{sum_squares, nonfinite};
}

GradStats GradStatsScalar(const void* grad, GradType grad_type, size_t n) {
  return grad_type == GradType::kBf16 ? GradStatsLoop<GradType::kBf16>(grad, n)
                                      : GradStatsLoop<GradType::kFp32>(grad, n);
}

void CastFp32ToBf16Scalar(const float* in, uint16_t* out, size_t n) {
  for (size_t i = 0; i < n; ++i) out[i] = RoundToBf16(in[i]);
}

void CastBf16ToFp32Scalar(const uint16_t* in, float* out, size_t n) {
  for (size_t i = 0; i < n; ++i) out[i] = Bf16ToFp32(in[i]);
}

}  // namespace

const KernelTable kScalarKernels = {
    .adamw_update = AdamWUpdateScalar,
    .grad_stats = GradStatsScalar,
    .cast_fp32_to_bf16 = CastFp32ToBf16Scalar,
    .cast_bf16_to_fp32 = CastBf16ToFp32Scalar,
};

}  // namespace slidedp::kernels::internal
