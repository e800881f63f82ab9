// AVX-512 (F/BW/VL) kernels, shared by adamw_avx512.cc and adamw_avx512bf16.cc, which compile it
// with their own flags and differ only in kUseBf16Insn (the BF16 output cast through
// vcvtne2ps2bf16). Include it only from those two files: everything here has internal linkage on
// purpose (see adamw_internal.h).
//
// Bit-exactness with the scalar reference: the same multiplies, FMAs, IEEE division and square
// root in the same order, per lane; partial vectors use masked loads and stores with the same code.
#pragma once

#include <immintrin.h>

#include <cstddef>
#include <cstdint>

#include "kernels/cpu/adamw.h"
#include "kernels/cpu/adamw_internal.h"

namespace slidedp::kernels::internal {
namespace {  // NOLINT(build/namespaces): internal linkage per including ISA file is the point.

constexpr size_t kLanes = 16;
// One iteration of the main loop writes one 64-byte line of BF16 output.
constexpr size_t kBlock = 2 * kLanes;

inline __mmask16 FirstLanes(size_t count) {
  return count >= kLanes ? static_cast<__mmask16>(0xFFFF)
                         : static_cast<__mmask16>((1u << count) - 1u);
}

struct Params {
  __m512 beta1, beta2, one_minus_beta1, one_minus_beta2, eps, decay_factor, neg_step_size,
      inv_sqrt_bc2, grad_scale;
};

inline Params MakeParams(const AdamWScalars& s) {
  return Params{_mm512_set1_ps(s.beta1),
                _mm512_set1_ps(s.beta2),
                _mm512_set1_ps(s.one_minus_beta1),
                _mm512_set1_ps(s.one_minus_beta2),
                _mm512_set1_ps(s.eps),
                _mm512_set1_ps(s.decay_factor),
                _mm512_set1_ps(-s.step_size),
                _mm512_set1_ps(s.inv_sqrt_bias_correction2),
                _mm512_set1_ps(s.grad_scale)};
}

inline __m512 WidenBf16(__m256i h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

template <bool kBf16Grad>
inline __m512 LoadGrad(const void* grad, size_t i) {
  if constexpr (kBf16Grad) {
    return WidenBf16(_mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(grad) + i)));
  } else {
    return _mm512_loadu_ps(static_cast<const float*>(grad) + i);
  }
}

template <bool kBf16Grad>
inline __m512 MaskLoadGrad(__mmask16 k, const void* grad, size_t i) {
  if constexpr (kBf16Grad) {
    return WidenBf16(_mm256_maskz_loadu_epi16(k, static_cast<const uint16_t*>(grad) + i));
  } else {
    return _mm512_maskz_loadu_ps(k, static_cast<const float*>(grad) + i);
  }
}

// Round-to-nearest-even to BF16 on the bit pattern with the NaN rule of bf16.h; exact for
// denormals. 16 lanes -> 16 x uint16.
inline __m256i RoundToBf16Int(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i high = _mm512_srli_epi32(bits, 16);
  const __m512i lsb = _mm512_and_si512(high, _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(
      _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), lsb), 16);
  const __mmask16 is_nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  const __m512i r = _mm512_mask_or_epi32(rounded, is_nan, high, _mm512_set1_epi32(0x0040));
  return _mm512_cvtepi32_epi16(r);
}

#ifdef __AVX512BF16__
// Lanes where vcvtneps2bf16 may differ from the integer rule: it flushes denormal inputs to zero
// (the SDM's DAZ behaviour, independent of MXCSR), and NaN lanes are taken from the integer rule
// too so exactness does not depend on an implementation's NaN payload handling.
inline __mmask16 Bf16InsnFixupLanes(__m512 x) {
  const __m512i abs = _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(0x7FFFFFFF));
  // 0 < |x| < FLT_MIN  <=>  |x| - 1 < 0x007FFFFF (unsigned); +-0 wraps around to 0xFFFFFFFF.
  const __mmask16 denormal = _mm512_cmplt_epu32_mask(_mm512_sub_epi32(abs, _mm512_set1_epi32(1)),
                                                     _mm512_set1_epi32(0x007FFFFF));
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(abs, _mm512_set1_epi32(0x7F800000));
  return static_cast<__mmask16>(denormal | nan);
}

inline __m512i AsM512i(__m512bh v) {
  __m512i r;
  static_assert(sizeof(r) == sizeof(v));
  __builtin_memcpy(&r, &v, sizeof(r));
  return r;
}

inline __m256i AsM256i(__m256bh v) {
  __m256i r;
  static_assert(sizeof(r) == sizeof(v));
  __builtin_memcpy(&r, &v, sizeof(r));
  return r;
}
#endif

template <bool kUseBf16Insn>
inline __m256i RoundToBf16(__m512 x) {
#ifdef __AVX512BF16__
  if constexpr (kUseBf16Insn) {
    __m256i r = AsM256i(_mm512_cvtneps_pbh(x));
    const __mmask16 fix = Bf16InsnFixupLanes(x);
    if (__builtin_expect(fix != 0, 0)) r = _mm256_mask_blend_epi16(fix, r, RoundToBf16Int(x));
    return r;
  }
#endif
  return RoundToBf16Int(x);
}

// 32 lanes (x0 then x1) -> 32 x uint16 in one register.
template <bool kUseBf16Insn>
inline __m512i RoundToBf16x2(__m512 x0, __m512 x1) {
#ifdef __AVX512BF16__
  if constexpr (kUseBf16Insn) {
    __m512i r = AsM512i(_mm512_cvtne2ps_pbh(x1, x0));  // low half from x0, high half from x1
    const __mmask16 fix0 = Bf16InsnFixupLanes(x0);
    const __mmask16 fix1 = Bf16InsnFixupLanes(x1);
    if (__builtin_expect((fix0 | fix1) != 0, 0)) {
      const __m512i exact =
          _mm512_inserti64x4(_mm512_castsi256_si512(RoundToBf16Int(x0)), RoundToBf16Int(x1), 1);
      const __mmask32 fix = static_cast<__mmask32>(fix0) | (static_cast<__mmask32>(fix1) << 16);
      r = _mm512_mask_blend_epi16(fix, r, exact);
    }
    return r;
  }
#endif
  return _mm512_inserti64x4(_mm512_castsi256_si512(RoundToBf16Int(x0)), RoundToBf16Int(x1), 1);
}

// The contract's formulas, in the contract's order.
inline void Update(const Params& p, __m512 grad, __m512& master, __m512& m, __m512& v) {
  const __m512 g = _mm512_mul_ps(grad, p.grad_scale);
  const __m512 decayed = _mm512_mul_ps(master, p.decay_factor);
  m = _mm512_fmadd_ps(p.one_minus_beta1, g, _mm512_mul_ps(p.beta1, m));
  v = _mm512_fmadd_ps(_mm512_mul_ps(p.one_minus_beta2, g), g, _mm512_mul_ps(p.beta2, v));
  const __m512 denom = _mm512_fmadd_ps(_mm512_sqrt_ps(v), p.inv_sqrt_bc2, p.eps);
  master = _mm512_fmadd_ps(p.neg_step_size, _mm512_div_ps(m, denom), decayed);
}

// Software prefetch of the lines kPrefetchElements ahead in every input stream. The hardware
// prefetchers alone leave bandwidth unused with four input and four output streams per core.
// Measured on a 16-core Sapphire Rapids VM (400M params): +10-20% at 1, 8 and 16 threads, up to
// the bandwidth of a plain in-place read-modify-write loop; 1 KiB ahead of the FP32 streams was the
// best of 512 B / 1 KiB / 2 KiB, and T0 better than T1. Prefetches past the end never fault.
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

// [begin, end) in whole kBlock iterations; end - begin must be a multiple of kBlock.
template <bool kUseBf16Insn, bool kBf16Grad, bool kOut, bool kStream>
inline void UpdateBlocks(const Params& p, const void* grad, float* master, float* m, float* v,
                         uint16_t* out, size_t begin, size_t end) {
  for (size_t i = begin; i < end; i += kBlock) {
    PrefetchAhead<kBf16Grad>(grad, master, m, v, i);
    __m512 mas0 = _mm512_loadu_ps(master + i);
    __m512 mas1 = _mm512_loadu_ps(master + i + kLanes);
    __m512 mom0 = _mm512_loadu_ps(m + i);
    __m512 mom1 = _mm512_loadu_ps(m + i + kLanes);
    __m512 var0 = _mm512_loadu_ps(v + i);
    __m512 var1 = _mm512_loadu_ps(v + i + kLanes);
    Update(p, LoadGrad<kBf16Grad>(grad, i), mas0, mom0, var0);
    Update(p, LoadGrad<kBf16Grad>(grad, i + kLanes), mas1, mom1, var1);
    _mm512_storeu_ps(master + i, mas0);
    _mm512_storeu_ps(master + i + kLanes, mas1);
    _mm512_storeu_ps(m + i, mom0);
    _mm512_storeu_ps(m + i + kLanes, mom1);
    _mm512_storeu_ps(v + i, var0);
    _mm512_storeu_ps(v + i + kLanes, var1);
    if constexpr (kOut) {
      const __m512i bf = RoundToBf16x2<kUseBf16Insn>(mas0, mas1);
      if constexpr (kStream) {
        _mm512_stream_si512(reinterpret_cast<__m512i*>(out + i), bf);
      } else {
        _mm512_storeu_si512(out + i, bf);
      }
    }
  }
}

// Any [begin, end): whole blocks, then masked vectors.
template <bool kUseBf16Insn, bool kBf16Grad, bool kOut>
inline void UpdateRange(const Params& p, const void* grad, float* master, float* m, float* v,
                        uint16_t* out, size_t begin, size_t end) {
  const size_t blocks_end = begin + (end - begin) / kBlock * kBlock;
  UpdateBlocks<kUseBf16Insn, kBf16Grad, kOut, false>(p, grad, master, m, v, out, begin, blocks_end);
  for (size_t i = blocks_end; i < end; i += kLanes) {
    const __mmask16 k = FirstLanes(end - i);
    __m512 mas = _mm512_maskz_loadu_ps(k, master + i);
    __m512 mom = _mm512_maskz_loadu_ps(k, m + i);
    __m512 var = _mm512_maskz_loadu_ps(k, v + i);
    Update(p, MaskLoadGrad<kBf16Grad>(k, grad, i), mas, mom, var);
    _mm512_mask_storeu_ps(master + i, k, mas);
    _mm512_mask_storeu_ps(m + i, k, mom);
    _mm512_mask_storeu_ps(v + i, k, var);
    if constexpr (kOut) {
      _mm256_mask_storeu_epi16(out + i, k, RoundToBf16<kUseBf16Insn>(mas));
    }
  }
}

template <bool kUseBf16Insn, bool kBf16Grad>
void AdamWTyped(const AdamWScalars& s, const void* grad, float* master, float* m, float* v,
                uint16_t* out, size_t n) {
  const Params p = MakeParams(s);
  if (out == nullptr) {
    UpdateRange<kUseBf16Insn, kBf16Grad, false>(p, grad, master, m, v, nullptr, 0, n);
    return;
  }
  const uintptr_t out_addr = reinterpret_cast<uintptr_t>(out);
  if (n < kStreamingStoreMinElements || (out_addr & 1) != 0) {
    UpdateRange<kUseBf16Insn, kBf16Grad, true>(p, grad, master, m, v, out, 0, n);
    return;
  }
  // Peel up to the first 64-byte boundary of the output, stream whole lines, finish plainly.
  const size_t head = ((64 - (out_addr & 63)) & 63) / sizeof(uint16_t);
  const size_t body_end = head + (n - head) / kBlock * kBlock;
  UpdateRange<kUseBf16Insn, kBf16Grad, true>(p, grad, master, m, v, out, 0, head);
  UpdateBlocks<kUseBf16Insn, kBf16Grad, true, true>(p, grad, master, m, v, out, head, body_end);
  UpdateRange<kUseBf16Insn, kBf16Grad, true>(p, grad, master, m, v, out, body_end, n);
  // Streaming stores are weakly ordered: make them visible before the caller publishes the output.
  _mm_sfence();
}

template <bool kUseBf16Insn>
void AdamWUpdateAvx512(const AdamWScalars& s, const void* grad, GradType grad_type, float* master,
                       float* m, float* v, uint16_t* param_bf16, size_t n) {
  if (grad_type == GradType::kBf16) {
    AdamWTyped<kUseBf16Insn, true>(s, grad, master, m, v, param_bf16, n);
  } else {
    AdamWTyped<kUseBf16Insn, false>(s, grad, master, m, v, param_bf16, n);
  }
}

// ---- Gradient statistics: 16 double lanes held as two __m512d (lanes 0-7 and 8-15).

inline void Accumulate16(__m512 x, __m512d& lo, __m512d& hi, uint64_t& nonfinite) {
  const __m512i exponent = _mm512_set1_epi32(0x7F800000);
  const __mmask16 bad =
      _mm512_cmpeq_epi32_mask(_mm512_and_si512(_mm512_castps_si512(x), exponent), exponent);
  nonfinite += static_cast<uint64_t>(__builtin_popcount(bad));
  // Non-finite lanes add +0, which leaves a (non-negative) lane sum unchanged: same as skipping.
  const __m512 finite = _mm512_maskz_mov_ps(static_cast<__mmask16>(~bad), x);
  const __m512d d_lo = _mm512_cvtps_pd(_mm512_castps512_ps256(finite));
  const __m512d d_hi =
      _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(finite), 1)));
  // The square is exact in double, so the FMA rounds exactly like square-then-add.
  lo = _mm512_fmadd_pd(d_lo, d_lo, lo);
  hi = _mm512_fmadd_pd(d_hi, d_hi, hi);
}

// The contract's tree: (j, j+8), then (j, j+4), then (j, j+2), then (0, 1).
inline double ReduceLanes(__m512d lo, __m512d hi) {
  const __m512d s8 = _mm512_add_pd(lo, hi);
  const __m256d s4 = _mm256_add_pd(_mm512_castpd512_pd256(s8), _mm512_extractf64x4_pd(s8, 1));
  const __m128d s2 = _mm_add_pd(_mm256_castpd256_pd128(s4), _mm256_extractf128_pd(s4, 1));
  return _mm_cvtsd_f64(_mm_add_sd(s2, _mm_unpackhi_pd(s2, s2)));
}

template <bool kBf16Grad>
GradStats GradStatsTyped(const void* grad, size_t n) {
  double sum_squares = 0;
  uint64_t nonfinite = 0;
  for (size_t block = 0; block < n; block += kStatsBlock) {
    const size_t block_end = n - block < kStatsBlock ? n : block + kStatsBlock;
    __m512d lo = _mm512_setzero_pd();
    __m512d hi = _mm512_setzero_pd();
    size_t i = block;
    for (; i + kLanes <= block_end; i += kLanes) {
      Accumulate16(LoadGrad<kBf16Grad>(grad, i), lo, hi, nonfinite);
    }
    if (i < block_end) {
      // Masked-off lanes load +0 and add +0.
      Accumulate16(MaskLoadGrad<kBf16Grad>(FirstLanes(block_end - i), grad, i), lo, hi, nonfinite);
    }
    sum_squares += ReduceLanes(lo, hi);
  }
  return GradStats{sum_squares, nonfinite};
}

GradStats GradStatsAvx512(const void* grad, GradType grad_type, size_t n) {
  return grad_type == GradType::kBf16 ? GradStatsTyped<true>(grad, n)
                                      : GradStatsTyped<false>(grad, n);
}

// ---- Casts.

template <bool kUseBf16Insn>
void CastFp32ToBf16Avx512(const float* in, uint16_t* out, size_t n) {
  size_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    _mm512_storeu_si512(out + i, RoundToBf16x2<kUseBf16Insn>(_mm512_loadu_ps(in + i),
                                                             _mm512_loadu_ps(in + i + kLanes)));
  }
  for (; i < n; i += kLanes) {
    const __mmask16 k = FirstLanes(n - i);
    _mm256_mask_storeu_epi16(out + i, k,
                             RoundToBf16<kUseBf16Insn>(_mm512_maskz_loadu_ps(k, in + i)));
  }
}

void CastBf16ToFp32Avx512(const uint16_t* in, float* out, size_t n) {
  size_t i = 0;
  for (; i + kLanes <= n; i += kLanes) _mm512_storeu_ps(out + i, LoadGrad<true>(in, i));
  if (i < n) {
    const __mmask16 k = FirstLanes(n - i);
    _mm512_mask_storeu_ps(out + i, k, MaskLoadGrad<true>(k, in, i));
  }
}

template <bool kUseBf16Insn>
constexpr KernelTable MakeAvx512Table() {
  return KernelTable{
      .adamw_update = AdamWUpdateAvx512<kUseBf16Insn>,
      .grad_stats = GradStatsAvx512,
      .cast_fp32_to_bf16 = CastFp32ToBf16Avx512<kUseBf16Insn>,
      .cast_bf16_to_fp32 = CastBf16ToFp32Avx512,
  };
}

}  // namespace
}  // namespace slidedp::kernels::internal
