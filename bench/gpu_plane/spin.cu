#include "bench/gpu_plane/spin.h"
#include "common/status_macros.h"
#include "kernels/cuda/cuda_status.h"

namespace slidedp::bench {
namespace {

__global__ void SpinKernel(long long cycles) {
  const long long start = clock64();
  while (clock64() - start < cycles) {
  }
}

}  // namespace

absl::Status Spin(double cycles, cudaStream_t stream) {
  SpinKernel<<<1, 1, 0, stream>>>(static_cast<long long>(cycles));
  RETURN_IF_CUDA_ERROR(cudaGetLastError(), "spin kernel launch");
  return absl::OkStatus();
}

absl::StatusOr<double> SpinCyclesPerMs(cudaStream_t stream) {
  cudaEvent_t a, b;
  RETURN_IF_CUDA_ERROR(cudaEventCreate(&a), "event");
  RETURN_IF_CUDA_ERROR(cudaEventCreate(&b), "event");
  const double cycles = 2e8;
  RETURN_IF_ERROR(Spin(cycles / 10, stream));  // warm-up: clocks ramp up
  RETURN_IF_CUDA_ERROR(cudaEventRecord(a, stream), "record");
  RETURN_IF_ERROR(Spin(cycles, stream));
  RETURN_IF_CUDA_ERROR(cudaEventRecord(b, stream), "record");
  RETURN_IF_CUDA_ERROR(cudaEventSynchronize(b), "sync");
  float ms = 0;
  RETURN_IF_CUDA_ERROR(cudaEventElapsedTime(&ms, a, b), "elapsed");
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return cycles / ms;
}

}  // namespace slidedp::bench
