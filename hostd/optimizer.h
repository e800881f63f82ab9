// The update worker: applies AdamW (decoupled weight decay, bias correction, optional no-decay
// for norms and biases, LR schedule, gradient clipping) to one layer at a time, fused with the
// BF16 cast of the next version's parameters, and publishes the layer's version when every
// chunk of it is written.
//
// Per layer and step t (the update that produces version t):
//   1. statistics pass over the gradient (sum of squares, non-finite count), deterministic for
//      any thread count (fixed kStatsBlock blocks summed in block order);
//   2. a non-finite gradient skips the update: master, m, v and params are untouched, the layer
//      still advances to version t (so the next step can proceed) and the skip is counted;
//   3. clip coefficient: none; per layer min(1, max_norm / (norm + 1e-6)); or global, where the
//      norm is over every finite layer's gradient of the step, so no layer of the step can be
//      updated before the last layer's gradient has arrived (the cost: the update of step t can
//      no longer overlap backward; it starts after the last gradient and all of it is exposed
//      at the step boundary);
//   4. the fused kernel over the layer in chunks of `chunk_elements`, each chunk split across the
//      pool's threads at fixed boundaries (bit-identical for any thread count);
//   5. PublishLayer(layer, t).
// Gradients are the sum over ranks; grad_scale = 1/world_size when scale_by_world_size.
//
// Thread safety: Submit/AbortStep/SetOptimizer/Stats may be called from any thread. Updates run
// on one internal thread (plus the pool); `done` callbacks run on that thread.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "hostd/state.h"
#include "kernels/cpu/adamw.h"
#include "slidedp/v1/control.pb.h"

namespace slidedp {
class ThreadPool;
}

namespace slidedp::hostd {

// LR for the 1-based update `step`, following Hugging Face's schedulers (s = step - 1):
//   warm-up (s < warmup_steps): lr * s / warmup_steps
//   constant: lr; linear: lr * max(0, (total - s) / (total - warmup));
//   cosine: lr * 0.5 * (1 + cos(pi * (s - warmup) / (total - warmup)))
// with the decay part floored at min_lr_ratio: f' = min_lr_ratio + (1 - min_lr_ratio) * f.
double LearningRate(const slidedp::v1::OptimizerConfig& cfg, uint64_t step);

// Fills unspecified optimizer fields with defaults and checks ranges; INVALID_ARGUMENT naming
// the field and the expected range.
absl::StatusOr<slidedp::v1::OptimizerConfig> NormalizeOptimizerConfig(
    const slidedp::v1::OptimizerConfig& in);

struct GradientRef {
  const void* data = nullptr;
  kernels::GradType type = kernels::GradType::kBf16;
  uint64_t numel = 0;
};

struct LayerUpdateResult {
  uint32_t layer = 0;
  uint64_t step = 0;
  bool applied = false;  // false: skipped (non-finite) or aborted
  bool aborted = false;
  uint64_t nonfinite = 0;
  double grad_norm = 0;  // of the scaled (averaged) gradient; NaN when non-finite
  double clip_coef = 1;
  double seconds = 0;  // stats + update
};

struct UpdateStats {
  uint64_t layer_updates = 0;
  uint64_t layer_updates_skipped = 0;
  uint64_t params_updated = 0;
  double update_seconds_total = 0;
  double last_layer_seconds = 0;
};

class UpdateWorker {
 public:
  struct Options {
    kernels::Isa isa = kernels::Isa::kScalar;
    uint64_t chunk_elements = 8u << 20;  // elements per chunk (multiple of kStatsBlock)
  };

  // `state` and `pool` must outlive the worker.
  UpdateWorker(TrainingState* state, ThreadPool* pool, Options options,
               slidedp::v1::OptimizerConfig optimizer);
  ~UpdateWorker();
  UpdateWorker(const UpdateWorker&) = delete;
  UpdateWorker& operator=(const UpdateWorker&) = delete;

  void Start();
  // Finishes queued work of non-aborted steps, then joins the thread.
  void Stop();

  using DoneFn = std::function<void(const LayerUpdateResult&)>;
  // Queues the aggregated gradient of `layer` for `step`; the buffer must stay valid until
  // `done` has run. NOT_FOUND: unknown layer; INVALID_ARGUMENT: wrong numel or null data;
  // FAILED_PRECONDITION: the layer is not at version step - 1; ALREADY_EXISTS: this layer's
  // gradient for `step` was already submitted.
  absl::Status Submit(uint32_t layer, uint64_t step, GradientRef grad, DoneFn done);

  // Drops every queued, not-yet-started layer of steps <= `step` (their done() runs with
  // aborted=true). A layer whose update has started completes (it is never left half-written).
  // Then, in order after it, every layer still below version `step` is published at `step`
  // with its state untouched, so each layer sits at a well-defined version and the job can
  // continue with step + 1. `sealed` runs on the worker thread once that is done.
  void AbortStep(uint64_t step, std::function<void()> sealed = nullptr);

  // Takes effect for updates that start afterwards.
  void SetOptimizer(const slidedp::v1::OptimizerConfig& optimizer);
  slidedp::v1::OptimizerConfig optimizer() const;
  UpdateStats stats() const;
  kernels::Isa isa() const { return options_.isa; }

  // Runs one layer's update on the calling thread (with the pool), bypassing the queue; used by
  // tests and benchmarks. `clip_coef_override` < 0: computed from the config.
  // `stats`: the gradient's statistics when already computed (global clipping computes them
  // for the norm), else null.
  LayerUpdateResult UpdateLayerNow(uint32_t layer, uint64_t step, const GradientRef& grad,
                                   double clip_coef_override = -1,
                                   const kernels::GradStats* stats = nullptr);

 private:
  static constexpr uint32_t kSealLayer = UINT32_MAX;
  struct Item {
    uint32_t layer;  // kSealLayer: publish every layer below `step` at `step`
    uint64_t step;
    GradientRef grad;
    DoneFn done;
    std::function<void()> sealed;
  };
  void Seal(uint64_t step);

  void Run();
  kernels::GradStats LayerStats(const GradientRef& grad);
  void ApplyKernel(uint32_t layer, uint64_t step, const GradientRef& grad, double grad_scale,
                   const slidedp::v1::OptimizerConfig& cfg);
  void Finish(const Item& item, LayerUpdateResult result);

  TrainingState* const state_;
  ThreadPool* const pool_;
  const Options options_;

  mutable absl::Mutex mu_;
  slidedp::v1::OptimizerConfig optimizer_ ABSL_GUARDED_BY(mu_);
  std::deque<Item> queue_ ABSL_GUARDED_BY(mu_);
  // For global clipping: the items of a step collected until every layer has arrived.
  std::map<uint64_t, std::vector<Item>> pending_global_ ABSL_GUARDED_BY(mu_);
  std::map<uint64_t, std::vector<bool>> submitted_ ABSL_GUARDED_BY(mu_);
  uint64_t aborted_through_ ABSL_GUARDED_BY(mu_) = 0;  // every step <= this is aborted
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  UpdateStats stats_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;              // started by Start, joined by Stop
  std::vector<double> block_sums_;  // scratch of the update thread
};

}  // namespace slidedp::hostd
