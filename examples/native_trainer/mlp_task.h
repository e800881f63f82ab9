// The native trainer's model and task (issue #3), shared by the rank process (native_trainer)
// and the single-process reference (native_reference), so both compute bit-identical gradients.
//
// Model: a stack of L layers of width D. Layer i is the manifest layer "mlp.{i}" (DECODER) with
// tensors "mlp.{i}.weight" [D, D] and "mlp.{i}.bias" [D] (no_decay), laid out in one flat buffer
// in manifest order (weight, then bias), exactly as hostd lays out a layer:
//   h_{i+1} = tanh(W_i h_i + b_i) for i < L-1, and the last layer is linear.
// The parameters are BF16; the model computes in FP32 with them widened exactly (as a GPU
// computes with BF16 weights).
//
// Task: regression against a fixed random teacher MLP of the same shape (FP32, built from
// seed + 1, never trained). Sample j of step t has the input x(t, j) from a counter-based
// generator (splitmix64, uniform in [-1, 1)), so any process can produce any sample, and the
// target y = teacher(x). The loss of a sample is 0.5 * ||f(x) - y||^2 / B with B the GLOBAL
// batch, so the sum of the shards' gradients over ranks is the global-batch gradient.
//
// A shard's gradient is the sum over its samples in index order, computed by ShardPass in FP32,
// single-threaded, in a fixed order of operations: the same inputs always give the same bits.
//
// Thread safety: MlpTask is immutable after construction and may be shared; a ShardPass is
// confined to one thread.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "slidedp/v1/control.pb.h"

namespace slidedp::examples {

struct MlpConfig {
  uint32_t layers = 4;  // L
  uint32_t dim = 64;    // D
  uint32_t batch = 32;  // global batch B (samples per step, over all ranks)
  uint64_t seed = 0;    // hostd's init seed; the teacher uses seed + 1, the data seed + 2
};

// INVALID_ARGUMENT naming the field: layers in 1..4096, dim in 1..4096, batch >= 1, world_size
// in 1..64, batch divisible by world_size.
absl::Status ValidateMlpConfig(const MlpConfig& config, uint32_t world_size);

std::string MlpLayerName(uint32_t layer);      // "mlp.{layer}"
inline uint64_t MlpLayerNumel(uint32_t dim) {  // weight, then bias
  return uint64_t{dim} * dim + dim;
}

// The manifest described above (family "mlp", name "native-mlp-L{L}-D{D}"); manifest_hash
// is left empty (hostd computes it; ranks use ManifestHashHex(ManifestHash(m))).
slidedp::v1::ModelManifest MlpManifest(const MlpConfig& config);

struct MlpOptimizer {
  double lr = 1e-2;
  double weight_decay = 0.01;
};

// The job the trainer creates: the manifest, world_size, seed; AdamW (betas 0.9/0.999, eps 1e-8,
// constant LR, no_decay for biases, FP32 gradients, averaged over ranks, no clipping); the
// replicated / CPU-reduction routes with `chunk_bytes` per gradient ring slot.
slidedp::v1::JobSpec MlpJobSpec(const MlpConfig& config, const MlpOptimizer& optimizer,
                                uint32_t world_size, uint64_t chunk_bytes);

// The input of global sample `index` of step `step`: `dim` values in [-1, 1).
void MlpSampleInput(uint64_t seed, uint64_t step, uint64_t index, uint32_t dim, float* x);

class MlpTask {
 public:
  explicit MlpTask(const MlpConfig& config);

  const MlpConfig& config() const { return config_; }
  // Writes the input and the teacher's target of sample `index` of step `step` (dim each).
  void Sample(uint64_t step, uint64_t index, float* x, float* y) const;

 private:
  MlpConfig config_;
  std::vector<std::vector<float>> teacher_;  // per layer: weight [D, D] then bias [D]
};

// One shard's forward and backward pass over the samples [begin, end) of step `step`. Call
// Forward for layers 0..L-1 in order (each with that layer's parameters), then Loss, then
// Backward for layers L-1..0 in order. Out-of-order calls are a bug of the caller and abort.
// The pass keeps the widened parameters of the forward for the backward: no second fetch.
class ShardPass {
 public:
  ShardPass(const MlpTask& task, uint64_t step, uint64_t begin, uint64_t end);

  // `params`: the layer's BF16 parameters (MlpLayerNumel(D) values, weight then bias).
  void Forward(uint32_t layer, const uint16_t* params);
  // The same with FP32 parameters (for gradient checks); Forward(BF16) widens and calls this.
  void ForwardFp32(uint32_t layer, const float* params);
  // The shard's loss contribution: sum over its samples of 0.5 * ||f(x) - y||^2 / B.
  double Loss() const;
  // Writes d(shard loss)/d(layer params) (FP32, MlpLayerNumel(D) values, weight then bias).
  void Backward(uint32_t layer, float* grad);

  uint64_t samples() const { return n_; }

 private:
  const MlpTask& task_;
  const uint32_t layers_;
  const uint32_t dim_;
  const uint64_t n_;
  std::vector<float> targets_;                   // [n, D]
  std::vector<std::vector<float>> activations_;  // h_0 .. h_L, each [n, D]
  std::vector<std::vector<float>> params_;       // widened parameters of each layer
  std::vector<float> delta_;                     // dL/dh_{l+1} of the layer being backpropagated
  std::vector<float> delta_prev_;
  uint32_t forward_done_ = 0;   // layers done
  uint32_t backward_next_ = 0;  // next layer + 1 to backpropagate (0: none left)
};

}  // namespace slidedp::examples
