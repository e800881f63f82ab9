// Synthetic GPU compute of a set duration for the pipeline benchmark: one block spinning on the
// SM clock, so the step's compute time is known and uses no memory bandwidth.
#pragma once

#include <cuda_runtime_api.h>

#include "absl/status/statusor.h"

namespace slidedp::bench {

// Enqueues a kernel that spins for `cycles` SM clock cycles.
absl::Status Spin(double cycles, cudaStream_t stream);
// Measures the SM clock with events (cycles per millisecond), after a warm-up.
absl::StatusOr<double> SpinCyclesPerMs(cudaStream_t stream);

}  // namespace slidedp::bench
