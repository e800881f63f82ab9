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
// Streamed (chunk-granular) layers: when the layer's statistics are known before its gradient
// has fully arrived (the ranks send them with their first chunk, proto/shm_abi.h), steps 1-3 run
// once up front (BeginStreamedLayer) and step 4 runs range by range as the ranges arrive
// (SubmitRange), reading each range where it lies (a ring slot) and releasing it when done; the
// layer is published after its last range. The kernel is element-wise, so a layer updated in
// ranges is bit-identical to the same layer updated whole with the same statistics. Global
// clipping cannot stream (the norm needs every layer). The cost: an abort between a layer's first
// and last range leaves that layer torn (some elements at version t, the rest at t - 1). A torn
// layer is never published: its pending_version stays t != committed_version (the inconsistency
// shm_abi.h defines), TornLayers() lists it, and only a restore from a checkpoint can make the
// state consistent again. Whole-layer updates never tear (an update that has started completes).
//
// Thread safety: Submit/BeginStreamedLayer/SubmitRange/AbortStep/SetOptimizer/Stats may be
// called from any thread. Updates (whole layers and ranges alike, in submission order) run on one
// internal thread, which is the only caller of the pool's ParallelFor from this class; `done`,
// `released` and `sealed` callbacks run on that thread (or, for work an abort drops, on the
// thread that calls AbortStep), never under the worker's lock.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <optional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "hostd/state.h"
#include "hostd/update_stats.h"
#include "kernels/cpu/adamw.h"
#include "model/job_spec.h"  // NormalizeOptimizerConfig
#include "model/lr_schedule.h"
#include "slidedp/v1/control.pb.h"

namespace slidedp {
class ThreadPool;
}

namespace slidedp::hostd {

struct GradientRef {
  const void* data = nullptr;
  kernels::GradType type = kernels::GradType::kBf16;
  uint64_t numel = 0;
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

  // Starts a streamed update of `layer` for `step` from the statistics of its aggregated,
  // unscaled gradient: `sum_squares` (finite, >= 0, unless `nonfinite`) and whether any element
  // is NaN/Inf. The clip coefficient (none or per layer, as for whole layers) and the optimizer
  // config in effect now are fixed for every range of the layer. `done` runs once the layer is
  // published (or skipped, or aborted). Errors as Submit; OK(false) when the clip policy is
  // global, which cannot stream: nothing is recorded and the caller submits the layer whole.
  absl::StatusOr<bool> BeginStreamedLayer(uint32_t layer, uint64_t step, double sum_squares,
                                          bool nonfinite, DoneFn done);
  // Queues the update of elements [offset, offset + grad.numel) of a layer begun with
  // BeginStreamedLayer for `step`; grad.data points at element `offset` and must stay valid until
  // `released` has run, which happens on the worker thread right after the range is written (or
  // when an abort drops the range). Ranges of a layer must be disjoint and may come in any order;
  // the layer is published when they cover it. FAILED_PRECONDITION: no streamed update of this
  // layer and step is open; OUT_OF_RANGE: the range exceeds the layer or what is left of it;
  // INVALID_ARGUMENT: null or empty range; ABORTED: the step was aborted.
  absl::Status SubmitRange(uint32_t layer, uint64_t step, uint64_t offset, GradientRef grad,
                           std::function<void()> released);

  // Drops every queued, not-yet-started layer and range of steps <= `step` (their done() runs
  // with aborted=true, dropped ranges are released). A whole-layer update that has started
  // completes (it is never left half-written). Then, in order after it, every layer still below
  // version `step` is published at `step` with its state untouched, so each layer sits at a
  // well-defined version and the job can continue with step + 1 -- except a streamed layer that
  // already had ranges written: it is torn, stays unpublished (pending_version != committed) and
  // is listed by TornLayers(). `sealed` runs on the worker thread once that is done.
  void AbortStep(uint64_t step, std::function<void()> sealed = nullptr);
  // Layers left torn by an aborted streamed update (ascending); empty while the state is
  // consistent. Nothing clears it: the state must be restored from a checkpoint.
  std::vector<uint32_t> TornLayers() const;

  // Called on the worker thread before a layer's master/m/v are written for `step` (a whole
  // layer's update, or a streamed layer's first range); the checkpointer captures the layer's
  // previous version there (hostd/checkpoint.h). Set before Start; may block the update.
  using BeforeWriteFn = std::function<void(uint32_t layer, uint64_t step)>;
  void SetBeforeWriteHook(BeforeWriteFn hook) { before_write_ = std::move(hook); }

  // Takes effect for updates that start afterwards; a change of the clip policy with the next
  // step (see StepClipLocked).
  void SetOptimizer(const slidedp::v1::OptimizerConfig& optimizer);
  slidedp::v1::OptimizerConfig optimizer() const;
  // The clip policy step `step` runs with: the config's when the step's first gradient (or this
  // call) came; a later change of the config takes effect with the next step.
  slidedp::v1::ClipPolicy ClipOfStep(uint64_t step);
  UpdateStats stats() const;
  kernels::Isa isa() const { return options_.isa; }

  // Runs one layer's update on the calling thread (with the pool), bypassing the queue; used by
  // tests and benchmarks. `clip_coef_override` < 0: computed from the config.
  // `stats`: the gradient's statistics when already computed (global clipping computes them
  // for the norm), else null.
  // `clip`: the step's clip policy (the config's when absent).
  LayerUpdateResult UpdateLayerNow(uint32_t layer, uint64_t step, const GradientRef& grad,
                                   double clip_coef_override = -1,
                                   const kernels::GradStats* stats = nullptr,
                                   std::optional<slidedp::v1::ClipPolicy> clip = std::nullopt);

 private:
  enum class ItemKind {
    kLayer,        // a whole layer's gradient
    kSeal,         // publish every layer below `step` at `step` (AbortStep)
    kStreamBegin,  // BeginStreamedLayer
    kStreamRange,  // SubmitRange
  };
  struct Item {
    ItemKind kind = ItemKind::kLayer;
    uint32_t layer = 0;
    uint64_t step = 0;
    GradientRef grad;
    DoneFn done;
    std::function<void()> sealed;      // kSeal
    std::function<void()> released;    // kStreamRange
    uint64_t offset = 0;               // kStreamRange
    double sum_squares = 0;            // kStreamBegin
    bool nonfinite = false;            // kStreamBegin
    slidedp::v1::OptimizerConfig cfg;  // kStreamBegin: the config the layer's ranges use
  };
  // A streamed layer between its begin and its last range; confined to the worker thread.
  struct Stream {
    uint64_t step = 0;
    bool skip = false;                           // non-finite: ranges are only released
    std::vector<kernels::AdamWScalars> scalars;  // per tensor
    uint64_t elements_done = 0;
    uint64_t ranges_applied = 0;
    LayerUpdateResult result;
    DoneFn done;
  };
  // What submitters may still send for a streamed layer (open_streams_).
  struct OpenStream {
    uint64_t step = 0;
    uint64_t elements_submitted = 0;
  };

  absl::Status CheckSubmitLocked(uint32_t layer, uint64_t step) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The clip policy of `step`: the config's when the step's first gradient arrived.
  slidedp::v1::ClipPolicy StepClipLocked(uint64_t step) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Seal(uint64_t step);
  void BeginStream(Item& item);
  void ApplyStreamRange(Item& item);

  void Run();
  kernels::GradStats LayerStats(const GradientRef& grad);
  std::vector<kernels::AdamWScalars> LayerScalars(uint32_t layer, uint64_t step, double grad_scale,
                                                  const slidedp::v1::OptimizerConfig& cfg) const;
  // The fused kernel over elements [begin, end) of `layer`; `grad` points at element `begin`.
  void ApplyRange(uint32_t layer, const std::vector<kernels::AdamWScalars>& scalars,
                  const void* grad, kernels::GradType type, uint64_t begin, uint64_t end);
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
  std::map<uint64_t, slidedp::v1::ClipPolicy> step_clip_ ABSL_GUARDED_BY(mu_);  // latest steps
  std::map<uint32_t, OpenStream> open_streams_ ABSL_GUARDED_BY(mu_);            // by layer
  std::vector<uint32_t> torn_ ABSL_GUARDED_BY(mu_);                             // ascending
  uint64_t aborted_through_ ABSL_GUARDED_BY(mu_) = 0;  // every step <= this is aborted
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  UpdateStats stats_ ABSL_GUARDED_BY(mu_);
  std::map<uint32_t, Stream> streams_;  // by layer; worker thread only
  // Time the worker waited on an empty queue since it last applied anything; handed to the
  // next layer it works on (LayerUpdateResult::idle_before_seconds). Worker thread only.
  double idle_pending_ = 0;
  std::thread thread_;              // started by Start, joined by Stop
  std::vector<double> block_sums_;  // scratch of the update thread
  BeforeWriteFn before_write_;      // set before Start; called on the update thread
};

}  // namespace slidedp::hostd
