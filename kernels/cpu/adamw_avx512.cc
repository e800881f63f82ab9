// AVX-512 F/BW/VL paths (compiled with -mavx512f -mavx512bw -mavx512vl). The BF16 output cast uses
// vector integer rounding; adamw_avx512bf16.cc is the same code with vcvtne2ps2bf16.

#include "kernels/cpu/adamw_avx512_impl.h"

namespace slidedp::kernels::internal {

const KernelTable kAvx512Kernels = MakeAvx512Table<false>();

}  // namespace slidedp::kernels::internal
