// AVX-512 + AVX512_BF16 paths (compiled with -mavx512f -mavx512bw -mavx512vl -mavx512bf16): the
// code of adamw_avx512_impl.h with the BF16 output cast through vcvtne2ps2bf16, fixed up to the
// integer rule on denormal and NaN lanes.

#include "kernels/cpu/adamw_avx512_impl.h"

#ifndef __AVX512BF16__
#error "adamw_avx512bf16.cc must be compiled with -mavx512bf16"
#endif

namespace slidedp::kernels::internal {

const KernelTable kAvx512Bf16Kernels = MakeAvx512Table<true>();

}  // namespace slidedp::kernels::internal
