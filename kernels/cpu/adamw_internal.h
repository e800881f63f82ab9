// Per-ISA kernel tables behind the dispatch in adamw.cc. Each table lives in its own translation
// unit compiled with that ISA's flags (kernels/cpu/CMakeLists.txt). Not part of the public API.
//
// Rule for the per-ISA translation units: they define everything in an anonymous namespace and use
// no inline function or template from another header except the intrinsics (which are always
// inlined). Any out-of-line copy of an inline function emitted there would carry that ISA's
// instructions, and the linker may pick it for callers on CPUs without that ISA.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/cpu/adamw.h"

namespace slidedp::kernels::internal {

struct KernelTable {
  void (*adamw_update)(const AdamWScalars& s, const void* grad, GradType grad_type, float* master,
                       float* m, float* v, uint16_t* param_bf16, size_t n);
  GradStats (*grad_stats)(const void* grad, GradType grad_type, size_t n);
  void (*cast_fp32_to_bf16)(const float* in, uint16_t* out, size_t n);
  void (*cast_bf16_to_fp32)(const uint16_t* in, float* out, size_t n);
};

extern const KernelTable kScalarKernels;
extern const KernelTable kAvx2Kernels;
extern const KernelTable kAvx512Kernels;
extern const KernelTable kAvx512Bf16Kernels;

// The fused update writes the BF16 output with non-temporal stores (it is a write-only stream; this
// avoids reading each destination line before overwriting it) when the call covers at least this
// many elements. Below it the output probably stays in cache for its next reader, and the fence
// would cost more than the saved reads.
inline constexpr size_t kStreamingStoreMinElements = size_t{1} << 16;

}  // namespace slidedp::kernels::internal
