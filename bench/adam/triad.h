// Bandwidth yardsticks of adam_bench, vectorized for the same ISA as the kernel under test so the
// comparison is like for like: the STREAM triad a[i] = b[i] + s * c[i], and an in-place scale
// a[i] = s * a[i], the pure read-modify-write stream that bounds any in-place update.
//
// Thread safety: pure over the given range.
#pragma once

#include <cstddef>

#include "kernels/cpu/adamw.h"

namespace slidedp::bench {

// `stream`: non-temporal stores for `a` (STREAM itself uses plain stores; both are reported).
// Streaming stores are used on AVX2 / AVX-512 only.
void Triad(kernels::Isa isa, float* a, const float* b, const float* c, float s, size_t n,
           bool stream);

// a[i] = s * a[i] with plain stores (the lines are read first, so streaming stores do not apply).
void ScaleInPlace(kernels::Isa isa, float* a, float s, size_t n);

}  // namespace slidedp::bench
