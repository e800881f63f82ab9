// AVX2 + FMA paths. Compiled with -mavx2 -mfma; see adamw_internal.h for why everything here has
// internal linkage and uses no inline function from other headers.
//
// Bit-exactness with the scalar reference: the same multiplies, FMAs, IEEE division and square
// root in the same order, per lane. Partial vectors (heads and tails of < 8 elements) go through
// a zero-padded stack copy and the same vector code, so no scalar code path exists here.

#include <immintrin.h>

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "kernels/cpu/adamw.h"
#include "kernels/cpu/adamw_internal.h"

namespace slidedp::kernels::internal {
namespace {

constexpr size_t kLanes = 8;
// One iteration of the main loop writes one 64-byte line of BF16 output.
constexpr size_t kUnroll = 4;
constexpr size_t kBlock = kLanes * kUnroll;

struct Params {
  __m256 beta1, beta2, one_minus_beta1, one_minus_beta2, eps, decay_factor, neg_step_size,
      inv_sqrt_bc2, grad_scale;
};

inline Params MakeParams(const AdamWScalars& s) {
  return Params{_mm256_set1_ps(s.beta1),
                _mm256_set1_ps(s.beta2),
                _mm256_set1_ps(s.one_minus_beta1),
                _mm256_set1_ps(s.one_minus_beta2),
                _mm256_set1_ps(s.eps),
                _mm256_set1_ps(s.decay_factor),
                _mm256_set1_ps(-s.step_size),
                _mm256_set1_ps(s.inv_sqrt_bias_correction2),
                _mm256_set1_ps(s.grad_scale)};
}

inline __m256 WidenBf16(__m128i h) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

template <bool kBf16Grad>
inline __m256 LoadGrad(const void* grad, size_t i) {
  if constexpr (kBf16Grad) {
    return WidenBf16(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(grad) + i)));
  } else {
    return _mm256_loadu_ps(static_cast<const float*>(grad) + i);
  }
}

// Round-to-nearest-even to BF16 with the NaN rule of bf16.h, 8 lanes -> 8 x uint16.
inline __m128i RoundToBf16(__m256 x) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i high = _mm256_srli_epi32(bits, 16);
  const __m256i lsb = _mm256_and_si256(high, _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(
      _mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7FFF)), lsb), 16);
  const __m256i quiet_nan = _mm256_or_si256(high, _mm256_set1_epi32(0x0040));
  const __m256i is_nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  const __m256i r = _mm256_blendv_epi8(rounded, quiet_nan, is_nan);
  // All lanes are <= 0xFFFF, so the unsigned-saturating pack is exact.
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

// The contract's formulas, in the contract's order.
inline void Update(const Params& p, __m256 grad, __m256& master, __m256& m, __m256& v) {
  const __m256 g = _mm256_mul_ps(grad, p.grad_scale);
  const __m256 decayed = _mm256_mul_ps(master, p.decay_factor);
  m = _mm256_fmadd_ps(p.one_minus_beta1, g, _mm256_mul_ps(p.beta1, m));
  v = _mm256_fmadd_ps(_mm256_mul_ps(p.one_minus_beta2, g), g, _mm256_mul_ps(p.beta2, v));
  const __m256 denom = _mm256_fmadd_ps(_mm256_sqrt_ps(v), p.inv_sqrt_bc2, p.eps);
  master = _mm256_fmadd_ps(p.neg_step_size, _mm256_div_ps(m, denom), decayed);
}

// Software prefetch of the lines kPrefetchElements ahead in every input stream (one iteration
// covers two 64-byte lines of each FP32 array). See adamw_avx512_impl.h for the measurement behind
// the distance.
constexpr size_t kPrefetchElements = 256;

// Addresses are formed as integers: the lines ahead may lie past the end of the arrays, where a
// prefetch is harmless but pointer arithmetic would not be. Both helpers are always_inline: GCC 12
// at -O2 otherwise finds an out-of-line copy free of side effects and deletes the calls to it.
[[gnu::always_inline]] inline void Prefetch(const void* base, size_t byte_offset) {
  _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(base) + byte_offset),
               _MM_HINT_T0);
}

template <bool kBf16Grad>
[[gnu::always_inline]] inline void PrefetchAhead(const void* grad, const float* master,
                                                 const float* m, const float* v, size_t i) {
  const size_t ahead = (i + kPrefetchElements) * sizeof(float);
  Prefetch(master, ahead);
  Prefetch(master, ahead + 64);
  Prefetch(m, ahead);
  Prefetch(m, ahead + 64);
  Prefetch(v, ahead);
  Prefetch(v, ahead + 64);
  if constexpr (kBf16Grad) {
    Prefetch(grad, ahead / 2);
  } else {
    Prefetch(grad, ahead);
    Prefetch(grad, ahead + 64);
  }
}

template <bool kBf16Grad, bool kOut, bool kStream>
inline void UpdateFullVectors(const Params& p, const void* grad, float* master, float* m, float* v,
                              uint16_t* out, size_t begin, size_t end) {
  size_t i = begin;
  for (; i + kBlock <= end; i += kBlock) {
    PrefetchAhead<kBf16Grad>(grad, master, m, v, i);
    for (size_t u = 0; u < kUnroll; ++u) {
      const size_t j = i + u * kLanes;
      __m256 mas = _mm256_loadu_ps(master + j);
      __m256 mom = _mm256_loadu_ps(m + j);
      __m256 var = _mm256_loadu_ps(v + j);
      Update(p, LoadGrad<kBf16Grad>(grad, j), mas, mom, var);
      _mm256_storeu_ps(master + j, mas);
      _mm256_storeu_ps(m + j, mom);
      _mm256_storeu_ps(v + j, var);
      if constexpr (kOut) {
        __m128i* dst = reinterpret_cast<__m128i*>(out + j);
        if constexpr (kStream) {
          _mm_stream_si128(dst, RoundToBf16(mas));
        } else {
          _mm_storeu_si128(dst, RoundToBf16(mas));
        }
      }
    }
  }
  for (; i + kLanes <= end; i += kLanes) {
    __m256 mas = _mm256_loadu_ps(master + i);
    __m256 mom = _mm256_loadu_ps(m + i);
    __m256 var = _mm256_loadu_ps(v + i);
    Update(p, LoadGrad<kBf16Grad>(grad, i), mas, mom, var);
    _mm256_storeu_ps(master + i, mas);
    _mm256_storeu_ps(m + i, mom);
    _mm256_storeu_ps(v + i, var);
    if constexpr (kOut) _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), RoundToBf16(mas));
  }
}

// Fewer than kLanes elements at i: through zero-padded copies and the same vector code.
template <bool kBf16Grad, bool kOut>
inline void UpdatePartial(const Params& p, const void* grad, float* master, float* m, float* v,
                          uint16_t* out, size_t i, size_t count) {
  alignas(32) float buf_master[kLanes] = {};
  alignas(32) float buf_m[kLanes] = {};
  alignas(32) float buf_v[kLanes] = {};
  alignas(32) float buf_grad32[kLanes] = {};
  alignas(16) uint16_t buf_grad16[kLanes] = {};
  std::memcpy(buf_master, master + i, count * sizeof(float));
  std::memcpy(buf_m, m + i, count * sizeof(float));
  std::memcpy(buf_v, v + i, count * sizeof(float));
  __m256 g;
  if constexpr (kBf16Grad) {
    std::memcpy(buf_grad16, static_cast<const uint16_t*>(grad) + i, count * sizeof(uint16_t));
    g = LoadGrad<true>(buf_grad16, 0);
  } else {
    std::memcpy(buf_grad32, static_cast<const float*>(grad) + i, count * sizeof(float));
    g = LoadGrad<false>(buf_grad32, 0);
  }
  __m256 mas = _mm256_load_ps(buf_master);
  __m256 mom = _mm256_load_ps(buf_m);
  __m256 var = _mm256_load_ps(buf_v);
  Update(p, g, mas, mom, var);
  _mm256_store_ps(buf_master, mas);
  _mm256_store_ps(buf_m, mom);
  _mm256_store_ps(buf_v, var);
  std::memcpy(master + i, buf_master, count * sizeof(float));
  std::memcpy(m + i, buf_m, count * sizeof(float));
  std::memcpy(v + i, buf_v, count * sizeof(float));
  if constexpr (kOut) {
    alignas(16) uint16_t buf_out[kLanes];
    _mm_store_si128(reinterpret_cast<__m128i*>(buf_out), RoundToBf16(mas));
    std::memcpy(out + i, buf_out, count * sizeof(uint16_t));
  }
}

template <bool kBf16Grad, bool kOut>
inline void UpdateRange(const Params& p, const void* grad, float* master, float* m, float* v,
                        uint16_t* out, size_t begin, size_t end) {
  const size_t full_end = begin + (end - begin) / kLanes * kLanes;
  UpdateFullVectors<kBf16Grad, kOut, false>(p, grad, master, m, v, out, begin, full_end);
  if (full_end < end) {
    UpdatePartial<kBf16Grad, kOut>(p, grad, master, m, v, out, full_end, end - full_end);
  }
}

template <bool kBf16Grad>
void AdamWTyped(const AdamWScalars& s, const void* grad, float* master, float* m, float* v,
                uint16_t* out, size_t n) {
  const Params p = MakeParams(s);
  if (out == nullptr) {
    UpdateRange<kBf16Grad, false>(p, grad, master, m, v, nullptr, 0, n);
    return;
  }
  const uintptr_t out_addr = reinterpret_cast<uintptr_t>(out);
  if (n < kStreamingStoreMinElements || (out_addr & 1) != 0) {
    UpdateRange<kBf16Grad, true>(p, grad, master, m, v, out, 0, n);
    return;
  }
  // Peel up to the first 64-byte boundary of the output, stream whole lines, finish plainly.
  const size_t head = ((64 - (out_addr & 63)) & 63) / sizeof(uint16_t);
  const size_t body_end = head + (n - head) / kBlock * kBlock;
  UpdateRange<kBf16Grad, true>(p, grad, master, m, v, out, 0, head);
  UpdateFullVectors<kBf16Grad, true, true>(p, grad, master, m, v, out, head, body_end);
  UpdateRange<kBf16Grad, true>(p, grad, master, m, v, out, body_end, n);
  // Streaming stores are weakly ordered: make them visible before the caller publishes the output.
  _mm_sfence();
}

void AdamWUpdateAvx2(const AdamWScalars& s, const void* grad, GradType grad_type, float* master,
                     float* m, float* v, uint16_t* param_bf16, size_t n) {
  if (grad_type == GradType::kBf16) {
    AdamWTyped<true>(s, grad, master, m, v, param_bf16, n);
  } else {
    AdamWTyped<false>(s, grad, master, m, v, param_bf16, n);
  }
}

// ---- Gradient statistics: 16 double lanes held as four __m256d (lanes 0-3, 4-7, 8-11, 12-15).

struct StatsAcc {
  __m256d a0, a1, a2, a3;
  uint64_t nonfinite;
};

// Adds 8 consecutive elements to two accumulators of 4 lanes each.
inline void Accumulate8(__m256 x, __m256d& lo, __m256d& hi, uint64_t& nonfinite) {
  const __m256i exponent = _mm256_set1_epi32(0x7F800000);
  const __m256i bad =
      _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_castps_si256(x), exponent), exponent);
  nonfinite +=
      static_cast<uint64_t>(__builtin_popcount(_mm256_movemask_ps(_mm256_castsi256_ps(bad))));
  // Non-finite lanes add +0, which leaves a (non-negative) lane sum unchanged: same as skipping.
  const __m256 finite = _mm256_andnot_ps(_mm256_castsi256_ps(bad), x);
  const __m256d d_lo = _mm256_cvtps_pd(_mm256_castps256_ps128(finite));
  const __m256d d_hi = _mm256_cvtps_pd(_mm256_extractf128_ps(finite, 1));
  // The square is exact in double, so the FMA rounds exactly like square-then-add.
  lo = _mm256_fmadd_pd(d_lo, d_lo, lo);
  hi = _mm256_fmadd_pd(d_hi, d_hi, hi);
}

template <bool kBf16Grad>
inline void Accumulate16(const void* grad, size_t i, StatsAcc& acc) {
  Accumulate8(LoadGrad<kBf16Grad>(grad, i), acc.a0, acc.a1, acc.nonfinite);
  Accumulate8(LoadGrad<kBf16Grad>(grad, i + 8), acc.a2, acc.a3, acc.nonfinite);
}

// The contract's tree: (j, j+8), then (j, j+4), then (j, j+2), then (0, 1).
inline double ReduceLanes(const StatsAcc& acc) {
  const __m256d s8_lo = _mm256_add_pd(acc.a0, acc.a2);  // lanes 0-3
  const __m256d s8_hi = _mm256_add_pd(acc.a1, acc.a3);  // lanes 4-7
  const __m256d s4 = _mm256_add_pd(s8_lo, s8_hi);
  const __m128d s2 = _mm_add_pd(_mm256_castpd256_pd128(s4), _mm256_extractf128_pd(s4, 1));
  return _mm_cvtsd_f64(_mm_add_sd(s2, _mm_unpackhi_pd(s2, s2)));
}

template <bool kBf16Grad>
GradStats GradStatsTyped(const void* grad, size_t n) {
  double sum_squares = 0;
  uint64_t nonfinite = 0;
  for (size_t block = 0; block < n; block += kStatsBlock) {
    const size_t block_end = n - block < kStatsBlock ? n : block + kStatsBlock;
    StatsAcc acc{_mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd(),
                 0};
    size_t i = block;
    for (; i + 16 <= block_end; i += 16) Accumulate16<kBf16Grad>(grad, i, acc);
    if (i < block_end) {
      // Zero padding adds +0 to the lanes past the end.
      const size_t count = block_end - i;
      if constexpr (kBf16Grad) {
        alignas(32) uint16_t buf[16] = {};
        std::memcpy(buf, static_cast<const uint16_t*>(grad) + i, count * sizeof(uint16_t));
        Accumulate16<true>(buf, 0, acc);
      } else {
        alignas(32) float buf[16] = {};
        std::memcpy(buf, static_cast<const float*>(grad) + i, count * sizeof(float));
        Accumulate16<false>(buf, 0, acc);
      }
    }
    sum_squares += ReduceLanes(acc);
    nonfinite += acc.nonfinite;
  }
  return GradStats{sum_squares, nonfinite};
}

GradStats GradStatsAvx2(const void* grad, GradType grad_type, size_t n) {
  return grad_type == GradType::kBf16 ? GradStatsTyped<true>(grad, n)
                                      : GradStatsTyped<false>(grad, n);
}

// ---- Casts.

void CastFp32ToBf16Avx2(const float* in, uint16_t* out, size_t n) {
  size_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), RoundToBf16(_mm256_loadu_ps(in + i)));
  }
  if (i < n) {
    alignas(32) float buf_in[kLanes] = {};
    alignas(16) uint16_t buf_out[kLanes];
    std::memcpy(buf_in, in + i, (n - i) * sizeof(float));
    _mm_store_si128(reinterpret_cast<__m128i*>(buf_out), RoundToBf16(_mm256_load_ps(buf_in)));
    std::memcpy(out + i, buf_out, (n - i) * sizeof(uint16_t));
  }
}

void CastBf16ToFp32Avx2(const uint16_t* in, float* out, size_t n) {
  size_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    _mm256_storeu_ps(out + i, LoadGrad<true>(in, i));
  }
  if (i < n) {
    alignas(16) uint16_t buf_in[kLanes] = {};
    alignas(32) float buf_out[kLanes];
    std::memcpy(buf_in, in + i, (n - i) * sizeof(uint16_t));
    _mm256_store_ps(buf_out, LoadGrad<true>(buf_in, 0));
    std::memcpy(out + i, buf_out, (n - i) * sizeof(float));
  }
}

}  // namespace

const KernelTable kAvx2Kernels = {
    .adamw_update = AdamWUpdateAvx2,
    .grad_stats = GradStatsAvx2,
    .cast_fp32_to_bf16 = CastFp32ToBf16Avx2,
    .cast_bf16_to_fp32 = CastBf16ToFp32Avx2,
};

}  // namespace slidedp::kernels::internal
