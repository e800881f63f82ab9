#include "hostd/step_sequencer.h"

#include <algorithm>
#include <iterator>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace slidedp::hostd {

StepSequencer::StepSequencer() : step_seconds_buckets_(kStepSecondsBounds.size() + 1, 0) {}

void StepSequencer::Reset(uint64_t next_step, uint64_t steps_completed) {
  *this = StepSequencer();
  next_step_ = next_step;
  steps_completed_ = steps_completed;
}

absl::Status StepSequencer::CheckNotAbortedBeforeBegun(uint32_t rank, uint64_t rank_last_step,
                                                       uint64_t step) const {
  // A step aborted before this rank began it (another rank's failure sealed it while this one
  // was still finishing the previous step): the rank is told what happened, as a rank inside
  // the step is, rather than that it asked for the wrong step.
  if (step >= current_step() || rank_last_step >= step) return absl::OkStatus();
  for (const auto& [aborted, reason] : recent_aborts_) {
    if (aborted != step) continue;
    return absl::AbortedError(absl::StrCat("step ", step, " was aborted before rank ", rank,
                                           " began it (", reason, "); begin step ", current_step(),
                                           " next"));
  }
  return absl::OkStatus();
}

absl::StatusOr<StepSequencer::BeginAction> StepSequencer::Begin(uint64_t step) {
  // While step t's updates run, t + 1 is accepted at once and queued; it starts the moment t
  // completes. The ranks' forward of t + 1 waits per layer on the version gates.
  const bool queue = running_step_ != 0 && step == running_step_ + 1;
  if (step != current_step() && !queue) {
    return absl::OutOfRangeError(
        running_step_ != 0 ? absl::StrCat("step: expected ", running_step_, " (running) or ",
                                          running_step_ + 1, " (queued behind it), got ", step)
                           : absl::StrCat("step: expected ", next_step_, " (next), got ", step));
  }
  if (queue) {
    if (queued_step_ == 0) queued_step_ = step;
    return BeginAction::kQueue;
  }
  return running_step_ == 0 ? BeginAction::kStart : BeginAction::kJoin;
}

void StepSequencer::Start(uint64_t step, Clock::time_point now) {
  step_started_ = now;
  running_step_ = step;
  state_ = shm::StepState::kRunning;
  layers_done_in_step_ = 0;
}

uint64_t StepSequencer::Complete(Clock::time_point now) {
  const uint64_t step = running_step_;
  const double seconds = std::chrono::duration<double>(now - step_started_).count();
  last_completed_step_ = step;
  last_step_seconds_ = seconds;
  step_seconds_sum_ += seconds;
  step_seconds_buckets_[static_cast<size_t>(
      std::lower_bound(kStepSecondsBounds.begin(), kStepSecondsBounds.end(), seconds) -
      kStepSecondsBounds.begin())]++;
  steps_completed_++;
  next_step_ = step + 1;
  running_step_ = 0;
  state_ = shm::StepState::kIdle;
  return step;
}

void StepSequencer::NoteAbort(uint64_t step, std::string reason) {
  recent_aborts_.emplace_back(step, std::move(reason));
  if (recent_aborts_.size() > kRecentAborts) recent_aborts_.pop_front();
}

void StepSequencer::Abort(uint64_t step, std::string reason) {
  NoteAbort(step, std::move(reason));
  steps_aborted_++;
  running_step_ = 0;
  next_step_ = step + 1;
  state_ = shm::StepState::kAborted;
  seals_pending_++;
}

uint64_t StepSequencer::DropQueued(std::string reason) {
  const uint64_t step = queued_step_;
  if (step == 0) return 0;
  NoteAbort(step, std::move(reason));
  queued_step_ = 0;
  return step;
}

bool StepSequencer::Sealed(std::vector<uint32_t> torn) {
  seals_pending_--;
  // The worker reports every torn layer so far: a seal that tears nothing new changes nothing.
  if (torn.size() <= torn_layers_.size()) return false;
  torn_layers_ = std::move(torn);
  state_ = shm::StepState::kTorn;
  return true;
}

std::string StepSequencer::TornMessage(
    absl::FunctionRef<std::string(uint32_t)> describe_layer) const {
  std::vector<std::string> layers;
  for (uint32_t l : torn_layers_) layers.push_back(describe_layer(l));
  return absl::StrCat(
      "the training state is torn: part of each of these layers was updated when its step was "
      "aborted, so each holds a mix of two versions: ",
      absl::StrJoin(layers, ", "),
      ". No further step can run: restore the state from a checkpoint (update_granularity = layer "
      "never tears, at the cost of the chunk-level overlap)");
}

absl::Status StepSequencer::CheckNotTorn(
    absl::FunctionRef<std::string(uint32_t)> describe_layer) const {
  if (torn_layers_.empty()) return absl::OkStatus();
  return absl::FailedPreconditionError(TornMessage(describe_layer));
}

}  // namespace slidedp::hostd
