#include "bench/adam/triad.h"

#include <immintrin.h>

#include <cstdint>

namespace slidedp::bench {
namespace {

// Elements to process one at a time until `a + i` is `bytes`-aligned (at most n).
size_t HeadToAlign(const float* a, size_t bytes, size_t n) {
  const uintptr_t addr = reinterpret_cast<uintptr_t>(a);
  const size_t head = ((bytes - addr % bytes) % bytes) / sizeof(float);
  return head < n ? head : n;
}

void TriadScalar(float* a, const float* b, const float* c, float s, size_t n) {
  for (size_t i = 0; i < n; ++i) a[i] = b[i] + s * c[i];
}

__attribute__((target("avx2,fma"))) void TriadAvx2(float* a, const float* b, const float* c,
                                                   float s, size_t n, bool stream) {
  const __m256 vs = _mm256_set1_ps(s);
  size_t i = stream ? HeadToAlign(a, 32, n) : 0;
  TriadScalar(a, b, c, s, i);
  if (stream) {
    for (; i + 16 <= n; i += 16) {
      _mm256_stream_ps(a + i, _mm256_fmadd_ps(vs, _mm256_loadu_ps(c + i), _mm256_loadu_ps(b + i)));
      _mm256_stream_ps(a + i + 8,
                       _mm256_fmadd_ps(vs, _mm256_loadu_ps(c + i + 8), _mm256_loadu_ps(b + i + 8)));
    }
    _mm_sfence();
  } else {
    for (; i + 16 <= n; i += 16) {
      _mm256_storeu_ps(a + i, _mm256_fmadd_ps(vs, _mm256_loadu_ps(c + i), _mm256_loadu_ps(b + i)));
      _mm256_storeu_ps(a + i + 8,
                       _mm256_fmadd_ps(vs, _mm256_loadu_ps(c + i + 8), _mm256_loadu_ps(b + i + 8)));
    }
  }
  TriadScalar(a + i, b + i, c + i, s, n - i);
}

__attribute__((target("avx512f"))) void TriadAvx512(float* a, const float* b, const float* c,
                                                    float s, size_t n, bool stream) {
  const __m512 vs = _mm512_set1_ps(s);
  size_t i = stream ? HeadToAlign(a, 64, n) : 0;
  TriadScalar(a, b, c, s, i);
  if (stream) {
    for (; i + 32 <= n; i += 32) {
      _mm512_stream_ps(a + i, _mm512_fmadd_ps(vs, _mm512_loadu_ps(c + i), _mm512_loadu_ps(b + i)));
      _mm512_stream_ps(a + i + 16, _mm512_fmadd_ps(vs, _mm512_loadu_ps(c + i + 16),
                                                   _mm512_loadu_ps(b + i + 16)));
    }
    _mm_sfence();
  } else {
    for (; i + 32 <= n; i += 32) {
      _mm512_storeu_ps(a + i, _mm512_fmadd_ps(vs, _mm512_loadu_ps(c + i), _mm512_loadu_ps(b + i)));
      _mm512_storeu_ps(a + i + 16, _mm512_fmadd_ps(vs, _mm512_loadu_ps(c + i + 16),
                                                   _mm512_loadu_ps(b + i + 16)));
    }
  }
  TriadScalar(a + i, b + i, c + i, s, n - i);
}

void ScaleScalar(float* a, float s, size_t n) {
  for (size_t i = 0; i < n; ++i) a[i] *= s;
}

__attribute__((target("avx2,fma"))) void ScaleAvx2(float* a, float s, size_t n) {
  const __m256 vs = _mm256_set1_ps(s);
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    _mm256_storeu_ps(a + i, _mm256_mul_ps(vs, _mm256_loadu_ps(a + i)));
    _mm256_storeu_ps(a + i + 8, _mm256_mul_ps(vs, _mm256_loadu_ps(a + i + 8)));
  }
  ScaleScalar(a + i, s, n - i);
}

__attribute__((target("avx512f"))) void ScaleAvx512(float* a, float s, size_t n) {
  const __m512 vs = _mm512_set1_ps(s);
  size_t i = 0;
  for (; i + 32 <= n; i += 32) {
    _mm512_storeu_ps(a + i, _mm512_mul_ps(vs, _mm512_loadu_ps(a + i)));
    _mm512_storeu_ps(a + i + 16, _mm512_mul_ps(vs, _mm512_loadu_ps(a + i + 16)));
  }
  ScaleScalar(a + i, s, n - i);
}

}  // namespace

void ScaleInPlace(kernels::Isa isa, float* a, float s, size_t n) {
  switch (isa) {
    case kernels::Isa::kAvx512:
    case kernels::Isa::kAvx512Bf16:
      ScaleAvx512(a, s, n);
      return;
    case kernels::Isa::kAvx2:
      ScaleAvx2(a, s, n);
      return;
    case kernels::Isa::kScalar:
      break;
  }
  ScaleScalar(a, s, n);
}

void Triad(kernels::Isa isa, float* a, const float* b, const float* c, float s, size_t n,
           bool stream) {
  switch (isa) {
    case kernels::Isa::kAvx512:
    case kernels::Isa::kAvx512Bf16:
      TriadAvx512(a, b, c, s, n, stream);
      return;
    case kernels::Isa::kAvx2:
      TriadAvx2(a, b, c, s, n, stream);
      return;
    case kernels::Isa::kScalar:
      break;
  }
  TriadScalar(a, b, c, s, n);
}

}  // namespace slidedp::bench
