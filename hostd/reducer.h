// GradientReducer: hostd's side of the gradient push protocol (proto/shm_abi.h). One thread
// watches the ranks' chunk rings; when chunk `seq` of the running step is present in the ring
// of every pushing rank it validates the headers, reduces the chunks in fixed rank order
// (r = 0, 1, ..., R-1, FP32 adds, so the result is deterministic) into the layer's FP32
// gradient buffer, empties the slots (waking the ranks) and, when a layer is complete, hands it
// to the update worker through `submit`.
//
// Bounded memory: two layer-sized FP32 buffers. While both are held by the update worker the
// reducer stops consuming, the rings fill, and the ranks block (backpressure).
//
// A header that breaks the protocol (wrong step or sequence, unknown layer, out-of-order or
// duplicate chunk, wrong dtype, oversize chunk, ranks disagreeing) calls `on_error`, which
// aborts the step; nothing of a partial layer ever reaches the worker.
//
// Thread safety: Arm/Abort/Stop from any thread; the reduction runs on the reducer's thread.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "hostd/optimizer.h"
#include "hostd/state.h"

namespace slidedp {
class ThreadPool;
}

namespace slidedp::hostd {

class GradientReducer {
 public:
  struct Options {
    std::vector<uint32_t> pushing_ranks;  // every rank (CPU reduction) or the designated one
    kernels::GradType grad_type = kernels::GradType::kBf16;
  };
  using SubmitFn = std::function<absl::Status(uint32_t layer, uint64_t step, GradientRef grad,
                                              UpdateWorker::DoneFn done)>;
  using ErrorFn = std::function<void(uint64_t step, const std::string& reason)>;

  // `pool` (may be null) splits each chunk's sum across threads; the adds are element-wise, so
  // the result does not depend on the split.
  GradientReducer(TrainingState* state, ThreadPool* pool, Options options, SubmitFn submit,
                  ErrorFn on_error);
  ~GradientReducer();
  GradientReducer(const GradientReducer&) = delete;
  GradientReducer& operator=(const GradientReducer&) = delete;

  void Start();
  void Stop();
  // `step` is running: chunk 0 of every pushing rank's ring belongs to it.
  void Arm(uint64_t step);
  // Drops the partial layers of `step`, empties every ring slot and wakes the ranks.
  void Abort(uint64_t step);

  struct Stats {
    uint64_t chunks_reduced = 0;
    uint64_t bytes_reduced = 0;  // gradient bytes read from the rings
    double reduce_seconds = 0;
  };
  Stats stats() const;

 private:
  struct Buffer {
    std::vector<float> data;
    bool busy = false;
  };

  void Run();
  // Reduces the next chunk if it is complete; returns true if it made progress.
  bool TryReduceOne();
  bool TryReduceOneLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ReleaseSlots(uint32_t slot) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ClearAllSlotsLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void FailLocked(const std::string& reason) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Ring();

  TrainingState* const state_;
  ThreadPool* const pool_;
  const Options options_;
  const SubmitFn submit_;
  const ErrorFn on_error_;
  const size_t elem_bytes_;
  const uint64_t chunk_elems_;

  mutable absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t armed_step_ ABSL_GUARDED_BY(mu_) = 0;  // 0: no step running
  uint64_t next_seq_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t current_layer_ ABSL_GUARDED_BY(mu_) = -1;
  uint64_t current_done_ ABSL_GUARDED_BY(mu_) = 0;  // elements of current_layer_ reduced
  int current_buffer_ ABSL_GUARDED_BY(mu_) = -1;
  std::vector<bool> reduced_ ABSL_GUARDED_BY(mu_);  // layers complete in the armed step
  Buffer buffers_[2] ABSL_GUARDED_BY(mu_);
  Stats stats_ ABSL_GUARDED_BY(mu_);
  // Set by FailLocked; reported through on_error_ once mu_ is released.
  std::pair<uint64_t, std::string> pending_error_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;  // started by Start, joined by Stop
};

}  // namespace slidedp::hostd
