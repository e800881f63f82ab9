// CPU kernels of the update worker: AdamW fused with the BF16 cast, gradient statistics and the
// BF16 conversions, with a scalar reference and AVX2 / AVX-512 (+BF16) paths chosen at run time.
//
// Contract shared by every ISA path (the scalar path defines it; SIMD paths must be bit-identical
// to it, not merely close):
//   g      = grad[i] (FP32, or BF16 widened exactly) * s.grad_scale
//   p      = master[i] * s.decay_factor                 (decay_factor = 1 - lr * weight_decay)
//   m      = fma(s.one_minus_beta1, g, s.beta1 * m[i])
//   v      = fma(s.one_minus_beta2 * g, g, s.beta2 * v[i])
//   denom  = fma(sqrt(v), s.inv_sqrt_bias_correction2, s.eps)
//   master = fma(-s.step_size, m / denom, p)           (step_size = lr / (1 - beta1^t))
//   out    = RoundToBf16(master)                         (round-to-nearest-even, see bf16.h)
// Each element depends only on its own inputs, so results do not depend on how a range is split
// across threads.
//
// Thread safety: all functions are pure over the ranges they are given; callers split work into
// disjoint ranges.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

namespace slidedp::kernels {

enum class Isa : uint8_t {
  kScalar = 0,
  kAvx2 = 1,        // AVX2 + FMA
  kAvx512 = 2,      // AVX-512 F/BW/VL
  kAvx512Bf16 = 3,  // AVX-512 + AVX512_BF16 (vcvtneps2bf16 for the output cast)
};

std::string_view IsaName(Isa isa);
std::optional<Isa> ParseIsa(std::string_view name);  // "scalar", "avx2", "avx512", "avx512bf16"
bool IsaSupported(Isa isa);                          // CPUID + XGETBV (OS saves the vector state)
// Every entry point below serves an ISA the CPU lacks with the best supported one; all paths
// give bit-identical results, so this changes speed only.
// Best supported ISA; the environment variable SLIDEDP_ISA may lower it (never raise it past
// what the CPU supports).
Isa BestIsa();

enum class GradType : uint8_t { kFp32 = 0, kBf16 = 1 };
inline constexpr size_t GradTypeBytes(GradType t) { return t == GradType::kFp32 ? 4 : 2; }

// Per-(tensor, step) scalars, computed once by MakeAdamWScalars.
struct AdamWScalars {
  float beta1;
  float beta2;
  float one_minus_beta1;
  float one_minus_beta2;
  float eps;
  float decay_factor;               // 1 - lr * weight_decay (decoupled weight decay)
  float step_size;                  // lr / (1 - beta1^step)
  float inv_sqrt_bias_correction2;  // 1 / sqrt(1 - beta2^step)
  float grad_scale;                 // e.g. 1/world_size times the clipping coefficient
};

// Precondition: step >= 1 (the 1-based optimizer step). Bias corrections are computed in double.
AdamWScalars MakeAdamWScalars(double lr, double beta1, double beta2, double eps,
                              double weight_decay, double grad_scale, uint64_t step);

// Fused AdamW over n elements. `param_bf16` may be null (no cast output). Inputs and outputs may
// have any alignment; `grad` must not alias the state arrays.
void AdamWUpdate(Isa isa, const AdamWScalars& s, const void* grad, GradType grad_type,
                 float* master, float* m, float* v, uint16_t* param_bf16, size_t n);

// Gradient statistics used for clipping and the non-finite check.
struct GradStats {
  double sum_squares = 0;  // of the unscaled gradient; NaN/Inf elements are excluded
  uint64_t nonfinite = 0;  // count of NaN or +-Inf elements
};
// Bit-identical for every ISA: the range is cut into blocks of kStatsBlock elements (the last may
// be short); within a block, element i adds its square (in double) to lane i % 16 in order; the
// block's sum is the lanes added in a fixed pairwise tree; block sums are added in block order.
// A result over a whole range therefore depends on where the range starts and ends: callers that
// need the same value for any thread count call this once per block, keep the per-block sums
// and add them in block order on one thread (the update worker does; see hostd/optimizer.cc).
// CombineGradStats adds two results (sum, then count) for callers that do not need that.
inline constexpr size_t kStatsBlock = 4096;
GradStats ComputeGradStats(Isa isa, const void* grad, GradType grad_type, size_t n);
GradStats CombineGradStats(const GradStats& a, const GradStats& b);

// FP32 -> BF16 round-to-nearest-even (NaN -> quiet NaN keeping sign), and the exact widening.
// Where several NaN inputs meet in one element, NaN-ness is defined, not the payload.
void CastFp32ToBf16(Isa isa, const float* in, uint16_t* out, size_t n);
void CastBf16ToFp32(Isa isa, const uint16_t* in, float* out, size_t n);

}  // namespace slidedp::kernels
