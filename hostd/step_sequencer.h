// StepSequencer: the job's step lifecycle as hostd's control plane decides it.
//
// It holds the next step, the running step and the one queued behind it (see engine.h's
// overview: t + 1 may be begun while t's updates run), the step state, the count of layers done
// in the running step, the steps completed and aborted, the recent aborts (so a rank that asks
// to begin an aborted step learns why), the torn layers, the aborted steps the update worker has
// not sealed yet, and the step-time statistics.
//
// It decides and records; it neither knows gRPC nor shared memory. Engine applies each decision
// to the ControlBlock, the reducer, the update worker and the ranks: e.g. Begin() answers
// whether the step starts, joins the running one or is queued, and Engine arms the reducer and
// tells the ranks when it starts.
//
// Thread safety: externally synchronized. Engine guards its one StepSequencer with its mutex.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <deque>
#include <string>
#include <utility>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "proto/shm_abi.h"

namespace slidedp::hostd {

class StepSequencer {
 public:
  using Clock = std::chrono::steady_clock;
  // Upper bounds (seconds) of the step-time histogram: tiny CPU jobs to multi-minute steps. The
  // histogram has one bucket more, for the steps longer than the last bound.
  static constexpr std::array<double, 14> kStepSecondsBounds = {
      0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120, 300};
  // How many aborted or dropped steps Begin can name (a rank is at most a step or two behind).
  static constexpr size_t kRecentAborts = 16;

  StepSequencer();

  // A job is installed: `next_step` begins next, `steps_completed` ran before. No step runs.
  void Reset(uint64_t next_step, uint64_t steps_completed);

  uint64_t next_step() const { return next_step_; }
  uint64_t running_step() const { return running_step_; }  // 0: none
  uint64_t queued_step() const { return queued_step_; }    // 0: none, else running_step() + 1
  // The step the ranks begin now: the running one, else the next.
  uint64_t current_step() const { return running_step_ != 0 ? running_step_ : next_step_; }
  shm::StepState state() const { return state_; }
  uint64_t steps_completed() const { return steps_completed_; }
  uint64_t steps_aborted() const { return steps_aborted_; }

  // --- beginning a step ---
  // ABORTED when `step` was aborted (or dropped) before `rank` began it (`rank_last_step` is
  // the last step it began): the message names the cause and the step to begin next.
  absl::Status CheckNotAbortedBeforeBegun(uint32_t rank, uint64_t rank_last_step,
                                          uint64_t step) const;
  // True when beginning `step` would start it (no step runs and it is the next).
  bool WouldStart(uint64_t step) const { return running_step_ == 0 && step == next_step_; }
  enum class BeginAction {
    kStart,  // no step runs: the caller starts it (Start)
    kJoin,   // it is the running step
    kQueue,  // it is queued behind the running step (recorded here)
  };
  // What beginning `step` does; OUT_OF_RANGE unless it is the running step, the one after it or,
  // with none running, the next step.
  absl::StatusOr<BeginAction> Begin(uint64_t step);
  // `step` becomes the running step at `now`. Precondition: no step runs.
  void Start(uint64_t step, Clock::time_point now);
  // Clears and returns the queued step (0: none), for the caller to Start it.
  uint64_t TakeQueued() { return std::exchange(queued_step_, 0); }

  // --- completion ---
  // Counts a layer of the running step done; true once `layers_per_step` are done (the caller
  // then calls Complete).
  bool NoteLayerDone(uint32_t layers_per_step) { return ++layers_done_in_step_ == layers_per_step; }
  // The running step completed at `now`: it is counted and timed, the next step follows it and
  // none runs. Returns the completed step. Precondition: a step runs.
  uint64_t Complete(Clock::time_point now);

  // --- aborts ---
  // The running step `step` is aborted: none runs, step + 1 is next, the state is kAborted and
  // the step awaits its seal (Sealed). `reason` is kept as given for CheckNotAbortedBeforeBegun.
  void Abort(uint64_t step, std::string reason);
  // Drops the queued step (see engine.h: it never ran and is not counted as aborted) and returns
  // it; 0 when none is queued.
  uint64_t DropQueued(std::string reason);
  // The update worker sealed an aborted step, leaving `torn` layers torn (all of them so far,
  // ascending). True when this seal found new torn layers: the state is then kTorn (Begin's
  // callers refuse to start a step while CheckNotTorn fails).
  bool Sealed(std::vector<uint32_t> torn);
  uint32_t seals_pending() const { return seals_pending_; }
  const std::vector<uint32_t>& torn_layers() const { return torn_layers_; }
  // The message naming the torn layers, each described by `describe_layer` (e.g. "layer 3 'x'
  // (committed_version 4, pending_version 5)"). Precondition: torn_layers() is not empty.
  std::string TornMessage(absl::FunctionRef<std::string(uint32_t)> describe_layer) const;
  // FAILED_PRECONDITION with TornMessage when a layer is torn.
  absl::Status CheckNotTorn(absl::FunctionRef<std::string(uint32_t)> describe_layer) const;

  // --- step timing (GetStats) ---
  uint64_t last_completed_step() const { return last_completed_step_; }
  double last_step_seconds() const { return last_step_seconds_; }
  double step_seconds_sum() const { return step_seconds_sum_; }
  // Completed steps per kStepSecondsBounds bucket (one more than bounds: the overflow).
  const std::vector<uint64_t>& step_seconds_buckets() const { return step_seconds_buckets_; }

 private:
  // Remembers an aborted or dropped step and why, for a rank that asks to begin it later.
  void NoteAbort(uint64_t step, std::string reason);

  uint64_t next_step_ = 1;
  uint64_t running_step_ = 0;
  uint64_t queued_step_ = 0;
  shm::StepState state_ = shm::StepState::kIdle;
  uint32_t layers_done_in_step_ = 0;
  uint64_t steps_completed_ = 0;
  uint64_t steps_aborted_ = 0;
  // The last aborted or dropped steps and their causes, oldest first.
  std::deque<std::pair<uint64_t, std::string>> recent_aborts_;
  std::vector<uint32_t> torn_layers_;
  uint32_t seals_pending_ = 0;  // aborted steps the update worker has not sealed
  Clock::time_point step_started_;
  uint64_t last_completed_step_ = 0;
  double last_step_seconds_ = 0;
  double step_seconds_sum_ = 0;
  std::vector<uint64_t> step_seconds_buckets_;
};

}  // namespace slidedp::hostd
