// CUDA, cuBLAS and NCCL return codes as absl::Status, wrapped at the call site (STYLE.md:
// foreign codes are translated where they occur, with what was being done).
//   RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(...), "H2D of layer ", l);
// Header-only; needs the CUDA runtime headers (and nccl.h / cublas_api.h for those overloads).
#pragma once

#include <cuda_runtime_api.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace slidedp::cuda {

inline absl::Status CudaStatus(cudaError_t e, absl::string_view what) {
  if (e == cudaSuccess) return absl::OkStatus();
  const absl::StatusCode code = e == cudaErrorMemoryAllocation
                                    ? absl::StatusCode::kResourceExhausted
                                : e == cudaErrorNoDevice || e == cudaErrorInsufficientDriver
                                    ? absl::StatusCode::kFailedPrecondition
                                    : absl::StatusCode::kInternal;
  return absl::Status(code, absl::StrCat(what, ": CUDA error ", static_cast<int>(e), " (",
                                         cudaGetErrorName(e), ": ", cudaGetErrorString(e), ")"));
}

}  // namespace slidedp::cuda

#define SLIDEDP_CUDA_CONCAT_INNER(a, b) a##b
#define SLIDEDP_CUDA_CONCAT(a, b) SLIDEDP_CUDA_CONCAT_INNER(a, b)
#define RETURN_IF_CUDA_ERROR(expr, ...)                                             \
  do {                                                                              \
    const cudaError_t SLIDEDP_CUDA_CONCAT(_cuda_err_, __LINE__) = (expr);           \
    if (SLIDEDP_CUDA_CONCAT(_cuda_err_, __LINE__) != cudaSuccess) {                 \
      return ::slidedp::cuda::CudaStatus(SLIDEDP_CUDA_CONCAT(_cuda_err_, __LINE__), \
                                         ::absl::StrCat(__VA_ARGS__));              \
    }                                                                               \
  } while (0)
