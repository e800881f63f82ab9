// Scalar BF16 conversions shared by the scalar reference and the tests. The SIMD paths implement
// the same rules with vector integer arithmetic (see adamw_avx2.cc, adamw_avx512_impl.h).
//
// RoundToBf16 is round-to-nearest-even on the FP32 bit pattern: denormals round exactly (no
// flush), overflow rounds to +-Inf, and a NaN becomes a quiet NaN keeping its sign and its upper
// payload bits: (bits >> 16) | 0x0040. Bf16ToFp32 is the exact widening.
//
// Thread safety: pure functions.
#pragma once

#include <bit>
#include <cstdint>

namespace slidedp::kernels {

inline constexpr uint16_t kBf16QuietBit = 0x0040;

inline uint16_t RoundBitsToBf16(uint32_t bits) {
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) {
    return static_cast<uint16_t>((bits >> 16) | kBf16QuietBit);
  }
  // Adding 0x7FFF plus the lowest kept bit rounds half to even; the carry may run into the
  // exponent, which is the correct result (up to +-Inf). Cannot overflow 32 bits: the largest
  // non-NaN pattern is 0xFF800000.
  return static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

inline uint16_t RoundToBf16(float x) { return RoundBitsToBf16(std::bit_cast<uint32_t>(x)); }

inline float Bf16ToFp32(uint16_t b) { return std::bit_cast<float>(static_cast<uint32_t>(b) << 16); }

}  // namespace slidedp::kernels
