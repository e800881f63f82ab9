// The native MLP's shard pass on the GPU (issue #4 item 6): the same model, task and call
// protocol as ShardPass (mlp_task.h), with the layers computed by cuBLAS in FP32 on a stream the
// caller owns, so a trainer can stream BF16 parameters through a GPU window.
//
// Math: as ShardPass. Forward(l) widens the BF16 layer exactly to FP32 and computes
// h_{l+1} = tanh(W_l h_l + b_l) (the last layer linear) with cublasSgemm in CUBLAS_PEDANTIC_MATH
// (true FP32: no TF32, no BF16x9 emulation, no tensor cores). Loss() is the shard's
// sum of 0.5 * ||f(x) - y||^2 / B (B the global batch), summed on the host in FP64 exactly as
// ShardPass::Loss does. Backward(l) writes d(shard loss)/d(layer l params) with the 1/B scaling
// folded into the output delta as ShardPass does; the bias gradient sums the samples in index
// order (as the CPU), the weight gradient and W^T delta come from cuBLAS. Results therefore match
// ShardPass up to FP32 summation order, FMA contraction inside cuBLAS and tanhf's last ulp
// (gpu_mlp_test.cc bounds the difference), and are bit-identical from run to run on the same GPU
// model, toolkit and shard size (cuBLAS is deterministic for a fixed handle, workspace and
// problem; the handle has its own fixed workspace, so other streams' cuBLAS work cannot change
// the algorithm it picks).
//
// Parameter window: Forward(l) reads `d_params` only in the first operation it enqueues (a
// widening kernel into the pass's own FP32 copy of layer l, kept for Backward(l)). Once Forward(l)
// has returned, an event the caller records on the stream marks the point after which the window
// slot may be overwritten; Backward never touches the caller's parameters. The pass never records
// or waits on events of the caller: the caller orders the slot's upload before Forward(l) (e.g.
// cudaStreamWaitEvent on the stream) and the slot's reuse after its own event.
//
// Gradients: Backward(l, d_grad) writes FP32 to d_grad (device, MlpLayerNumel(D) values, weight
// [D, D] row-major then bias [D]), BackwardBf16 writes the same values rounded to BF16 (RNE,
// NaN kept quiet, as kernels::RoundToBf16). Both are complete when work enqueued on the stream
// after the call has run (record an event after the call to hand the gradient to another stream
// or to a D2H copy). The pass does not read d_grad, so its previous contents do not matter.
//
// Lifetime: Create allocates everything once, for shards of up to `max_samples` samples; a pass
// is then Reset for each step (no allocation per step). Reset generates the shard's inputs and
// targets on the CPU with MlpTask::Sample (the teacher's forward: L * D^2 FMAs per sample, on the
// calling thread) into pinned staging and enqueues their upload. Device memory:
//   4 * (L * (D^2 + D) + (D^2 + D) + (L + 4) * max_samples * D) bytes + 32 MiB cuBLAS workspace,
// and 12 * max_samples * D bytes of pinned host memory.
//
// Errors: every CUDA and cuBLAS status is returned as an absl::Status naming the operation and
// the layer. A call out of protocol order (or any call after a failed one, until Reset) returns
// FAILED_PRECONDITION and enqueues nothing. After a CUDA error other than that, the stream and
// context may be unusable (sticky errors); Reset is the only way back into the protocol.
//
// Thread safety: not thread-safe; use one pass from one thread at a time, with the CUDA device
// that was current at Create current. The task must outlive the pass, and the stream must stay
// valid until the pass is destroyed (the destructor synchronizes it before freeing memory).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "examples/native_trainer/mlp_task.h"

namespace slidedp::examples {

class GpuShardPass {
 public:
  // Allocates device buffers, pinned staging and a cuBLAS handle bound to `stream` on the
  // current device. INVALID_ARGUMENT for max_samples == 0 or max_samples * D > 2^30 (cuBLAS
  // takes int sizes); RESOURCE_EXHAUSTED when an allocation fails; FAILED_PRECONDITION without
  // a usable device. The pass is idle: Reset before the first Forward.
  static absl::StatusOr<GpuShardPass> Create(const MlpTask& task, uint64_t max_samples,
                                             cudaStream_t stream);
  // Create(task, end - begin, stream) followed by Reset(step, begin, end).
  static absl::StatusOr<GpuShardPass> Create(const MlpTask& task, uint64_t step, uint64_t begin,
                                             uint64_t end, cudaStream_t stream);

  GpuShardPass(GpuShardPass&&) noexcept;
  GpuShardPass& operator=(GpuShardPass&&) noexcept;
  GpuShardPass(const GpuShardPass&) = delete;
  GpuShardPass& operator=(const GpuShardPass&) = delete;
  ~GpuShardPass();

  // Starts the pass over the samples [begin, end) of step `step`: waits for the previous pass's
  // upload to have left the staging (not for its compute), generates the samples and enqueues
  // their upload. INVALID_ARGUMENT when end < begin or end - begin > max_samples().
  absl::Status Reset(uint64_t step, uint64_t begin, uint64_t end);

  // Layers 0..L-1 in order. `d_params`: device BF16, MlpLayerNumel(D) values, weight [D, D]
  // row-major then bias [D] (INVALID_ARGUMENT if null). Enqueues only; see the header comment
  // for the window slot.
  absl::Status Forward(uint32_t layer, const uint16_t* d_params);

  // After the last Forward: copies the output activations to the host, synchronizes the stream
  // and returns the shard's loss contribution (ShardPass::Loss). Optional; may be called again.
  absl::StatusOr<double> Loss();

  // After the last Forward, layers L-1..0 in order: d(shard loss)/d(layer params) into the
  // device buffer `d_grad` (MlpLayerNumel(D) values; INVALID_ARGUMENT if null). Enqueues only.
  absl::Status Backward(uint32_t layer, float* d_grad);
  // The same gradient rounded to BF16 (for jobs with a BF16 gradient dtype); bit-identical to
  // kernels::RoundToBf16 of what Backward would have written.
  absl::Status BackwardBf16(uint32_t layer, uint16_t* d_grad);

  uint64_t samples() const;      // of the current pass (0 before the first Reset)
  uint64_t max_samples() const;  // capacity fixed at Create
  cudaStream_t stream() const;

 private:
  struct Impl;
  explicit GpuShardPass(std::unique_ptr<Impl> impl);
  absl::Status BackwardInto(uint32_t layer, float* d_grad);

  std::unique_ptr<Impl> impl_;
};

}  // namespace slidedp::examples
