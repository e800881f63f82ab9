// Device kernels the GPU data plane needs (issue #4): casts between BF16 and FP32, scaling,
// padded shard pack/unpack and gradient statistics. All launches are asynchronous on the given
// stream and return the launch status (the launch call's own error code, so an unrelated error
// still pending in cudaGetLastError is not reported as this call's) as an absl::Status; none
// synchronizes.
// Element counts may be 0 (no launch; GradStats still launches one block to write {0, 0}).
// Pointers are device pointers unless stated otherwise, aligned to their element size; a source
// and a destination must not overlap (Scale works in place). Violations return INVALID_ARGUMENT.
//
// BF16 here is the raw 16-bit pattern (uint16_t), as in kernels/cpu/bf16.h; the FP32 -> BF16
// cast rounds to nearest-even and keeps NaN a quiet NaN, bit-identical to
// kernels::RoundToBf16 on the CPU (including denormals, +-0 and Inf).
//
// Thread safety: stateless; safe from any thread.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"

namespace slidedp::kernels::cuda {

// dst[i] = float(src[i]).
absl::Status Bf16ToFp32(const uint16_t* src, float* dst, uint64_t n, cudaStream_t stream);
// dst[i] = bf16_rne(src[i]).
absl::Status Fp32ToBf16(const float* src, uint16_t* dst, uint64_t n, cudaStream_t stream);
// x[i] *= s (FP32 or BF16 in place; BF16 is widened, scaled in FP32 and rounded back). A NaN
// result is the GPU's canonical NaN (payloads are not kept, unlike the casts).
absl::Status ScaleFp32(float* x, float s, uint64_t n, cudaStream_t stream);
absl::Status ScaleBf16(uint16_t* x, float s, uint64_t n, cudaStream_t stream);

// Pack: dst[0, n) = src[0, n) converted to the destination type, dst[n, padded_n) = 0.
// `src_dtype` / `dst_dtype`: 1 FP32, 2 BF16 (control.proto DType). padded_n >= n.
absl::Status PackPadded(const void* src, int src_dtype, uint64_t n, void* dst, int dst_dtype,
                        uint64_t padded_n, cudaStream_t stream);
// Unpack: dst[0, n) = src[0, n) converted (the padding is dropped).
absl::Status Unpack(const void* src, int src_dtype, void* dst, int dst_dtype, uint64_t n,
                    cudaStream_t stream);

// Statistics of x[0, n) (dtype 1 FP32 or 2 BF16): sum of squares accumulated in FP64 and the
// count of non-finite elements, written to `out` (device or host-mapped/pinned memory, written
// by the last block of the launch). NaN/Inf elements are excluded from the sum and counted, as
// in kernels::GradStats on the CPU. `scratch` is device memory of StatsScratchBytes(n) bytes
// (16-byte aligned, any contents; not shared by launches in flight at the same time).
// Deterministic: the same input gives the same sum on the same device for any stream; the grid
// depends on n only, so the sum is also independent of the device and of x's alignment.
struct GradStatsResult {
  double sumsq;
  unsigned long long nonfinite;
};
// Non-decreasing in n and at most 16 + 16 * 1024 bytes.
uint64_t StatsScratchBytes(uint64_t n);
absl::Status GradStats(const void* x, int dtype, uint64_t n, void* scratch, GradStatsResult* out,
                       cudaStream_t stream);

}  // namespace slidedp::kernels::cuda
