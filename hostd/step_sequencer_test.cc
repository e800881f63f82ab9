#include "hostd/step_sequencer.h"

#include <chrono>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace slidedp::hostd {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using Action = StepSequencer::BeginAction;
using std::chrono::milliseconds;

std::string Describe(uint32_t layer) { return absl::StrCat("layer ", layer); }

class StepSequencerTest : public ::testing::Test {
 protected:
  // Begins `step` and, when Begin says so, starts it at t0_ + `at`.
  Action BeginAt(uint64_t step, milliseconds at = milliseconds(0)) {
    absl::StatusOr<Action> a = seq_.Begin(step);
    EXPECT_TRUE(a.ok()) << a.status();
    if (!a.ok()) return Action::kJoin;
    if (*a == Action::kStart) seq_.Start(step, t0_ + at);
    return *a;
  }
  // Counts all `layers` of the running step done and completes it at t0_ + `at`.
  uint64_t CompleteAt(uint32_t layers, milliseconds at) {
    for (uint32_t l = 1; l < layers; ++l) EXPECT_FALSE(seq_.NoteLayerDone(layers));
    EXPECT_TRUE(seq_.NoteLayerDone(layers));
    return seq_.Complete(t0_ + at);
  }

  StepSequencer seq_;
  const StepSequencer::Clock::time_point t0_ = StepSequencer::Clock::now();
};

TEST(StepStateTest, NamesAreThoseOnTheWire) {
  EXPECT_STREQ(shm::ToString(shm::StepState::kIdle), "idle");
  EXPECT_STREQ(shm::ToString(shm::StepState::kRunning), "running");
  EXPECT_STREQ(shm::ToString(shm::StepState::kAborted), "aborted");
  EXPECT_STREQ(shm::ToString(shm::StepState::kTorn), "torn");
  // The values ControlBlock::step_state holds are the ABI's: they never change.
  EXPECT_EQ(static_cast<uint64_t>(shm::StepState::kIdle), 0u);
  EXPECT_EQ(static_cast<uint64_t>(shm::StepState::kRunning), 1u);
  EXPECT_EQ(static_cast<uint64_t>(shm::StepState::kAborting), 2u);
}

TEST_F(StepSequencerTest, StartsIdleAtStepOne) {
  EXPECT_EQ(seq_.next_step(), 1u);
  EXPECT_EQ(seq_.running_step(), 0u);
  EXPECT_EQ(seq_.queued_step(), 0u);
  EXPECT_EQ(seq_.state(), shm::StepState::kIdle);
  EXPECT_EQ(seq_.current_step(), 1u);
}

TEST_F(StepSequencerTest, ResetResumesAtTheGivenStep) {
  seq_.Reset(/*next_step=*/41, /*steps_completed=*/40);
  EXPECT_EQ(seq_.next_step(), 41u);
  EXPECT_EQ(seq_.steps_completed(), 40u);
  EXPECT_TRUE(seq_.WouldStart(41));
  EXPECT_FALSE(seq_.WouldStart(1));
}

TEST_F(StepSequencerTest, FirstBeginStartsLaterOnesJoin) {
  EXPECT_TRUE(seq_.WouldStart(1));
  EXPECT_EQ(BeginAt(1), Action::kStart);
  EXPECT_EQ(seq_.running_step(), 1u);
  EXPECT_EQ(seq_.state(), shm::StepState::kRunning);
  EXPECT_FALSE(seq_.WouldStart(1));
  EXPECT_EQ(BeginAt(1), Action::kJoin);
  EXPECT_EQ(seq_.running_step(), 1u);
}

TEST_F(StepSequencerTest, NextStepIsQueuedBehindTheRunningOneOnce) {
  BeginAt(1);
  EXPECT_EQ(BeginAt(2), Action::kQueue);
  EXPECT_EQ(seq_.queued_step(), 2u);
  EXPECT_EQ(BeginAt(2), Action::kQueue);  // another rank of the queued step
  EXPECT_EQ(seq_.queued_step(), 2u);
  EXPECT_EQ(seq_.running_step(), 1u);
  CompleteAt(2, milliseconds(5));
  EXPECT_EQ(seq_.running_step(), 0u);
  EXPECT_EQ(seq_.next_step(), 2u);
  EXPECT_EQ(seq_.TakeQueued(), 2u);
  EXPECT_EQ(seq_.queued_step(), 0u);
  EXPECT_EQ(seq_.TakeQueued(), 0u);
}

TEST_F(StepSequencerTest, StepsOutsideTheWindowAreOutOfRange) {
  absl::StatusOr<Action> a = seq_.Begin(2);
  EXPECT_EQ(a.status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(a.status().message(), "step: expected 1 (next), got 2");
  BeginAt(1);
  a = seq_.Begin(3);
  EXPECT_EQ(a.status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(a.status().message(), "step: expected 1 (running) or 2 (queued behind it), got 3");
  a = seq_.Begin(0);
  EXPECT_EQ(a.status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(seq_.queued_step(), 0u);  // a refused Begin records nothing
}

TEST_F(StepSequencerTest, CompletionCountsAndAdvances) {
  BeginAt(1);
  EXPECT_EQ(CompleteAt(3, milliseconds(20)), 1u);
  EXPECT_EQ(seq_.steps_completed(), 1u);
  EXPECT_EQ(seq_.next_step(), 2u);
  EXPECT_EQ(seq_.state(), shm::StepState::kIdle);
  EXPECT_EQ(seq_.last_completed_step(), 1u);
  // Start resets the count of layers done.
  BeginAt(2);
  EXPECT_FALSE(seq_.NoteLayerDone(2));
  EXPECT_TRUE(seq_.NoteLayerDone(2));
}

TEST_F(StepSequencerTest, TimingHistogramBucketsEachStep) {
  const auto& bounds = StepSequencer::kStepSecondsBounds;
  ASSERT_EQ(seq_.step_seconds_buckets().size(), bounds.size() + 1);
  EXPECT_THAT(seq_.step_seconds_buckets(), ::testing::Each(0u));
  BeginAt(1, milliseconds(0));
  CompleteAt(1, milliseconds(30));  // 0.03 s: the (0.025, 0.05] bucket
  BeginAt(2, milliseconds(1000));
  CompleteAt(1, milliseconds(1050));  // 0.05 s: on the bound, so the same bucket
  BeginAt(3, milliseconds(2000));
  CompleteAt(1, milliseconds(2000 + 400 * 1000));  // 400 s: past the last bound
  const std::vector<uint64_t>& b = seq_.step_seconds_buckets();
  EXPECT_EQ(b[2], 2u);
  EXPECT_EQ(b[bounds.size()], 1u);
  uint64_t total = 0;
  for (uint64_t n : b) total += n;
  EXPECT_EQ(total, 3u);
  EXPECT_NEAR(seq_.last_step_seconds(), 400.0, 1e-6);
  EXPECT_NEAR(seq_.step_seconds_sum(), 400.08, 1e-6);
  EXPECT_EQ(seq_.last_completed_step(), 3u);
}

TEST_F(StepSequencerTest, AbortMakesTheNextStepFollowAndAwaitsItsSeal) {
  BeginAt(1);
  seq_.Abort(1, "rank 1 lost");
  EXPECT_EQ(seq_.running_step(), 0u);
  EXPECT_EQ(seq_.next_step(), 2u);
  EXPECT_EQ(seq_.state(), shm::StepState::kAborted);
  EXPECT_EQ(seq_.steps_aborted(), 1u);
  EXPECT_EQ(seq_.steps_completed(), 0u);
  EXPECT_EQ(seq_.seals_pending(), 1u);
  EXPECT_FALSE(seq_.Sealed({}));
  EXPECT_EQ(seq_.seals_pending(), 0u);
  EXPECT_EQ(seq_.state(), shm::StepState::kAborted);  // until a step starts
  EXPECT_EQ(BeginAt(2), Action::kStart);
  EXPECT_EQ(seq_.state(), shm::StepState::kRunning);
}

TEST_F(StepSequencerTest, AStepAbortedBeforeARankBeganItIsAborted) {
  BeginAt(1);  // rank 0 began step 1; rank 1 still finishes step 0
  seq_.Abort(1, "rank 0 lost");
  const absl::Status s = seq_.CheckNotAbortedBeforeBegun(/*rank=*/1, /*rank_last_step=*/0, 1);
  EXPECT_EQ(s.code(), absl::StatusCode::kAborted);
  EXPECT_EQ(s.message(),
            "step 1 was aborted before rank 1 began it (rank 0 lost); begin step 2 next");
  // The rank that did begin it is inside the step: it gets its ABORTED elsewhere, not here.
  EXPECT_TRUE(seq_.CheckNotAbortedBeforeBegun(0, 1, 1).ok());
  // The next step and a step never aborted are not refused here.
  EXPECT_TRUE(seq_.CheckNotAbortedBeforeBegun(1, 0, 2).ok());
  seq_.Sealed({});
  BeginAt(2);
  CompleteAt(1, milliseconds(1));
  EXPECT_TRUE(seq_.CheckNotAbortedBeforeBegun(1, 0, 2).ok());  // completed, not aborted
}

TEST_F(StepSequencerTest, OnlyTheLastAbortsAreRemembered) {
  for (uint64_t step = 1; step <= StepSequencer::kRecentAborts + 1; ++step) {
    BeginAt(step);
    seq_.Abort(step, absl::StrCat("abort ", step));
    seq_.Sealed({});
  }
  EXPECT_TRUE(seq_.CheckNotAbortedBeforeBegun(0, 0, 1).ok());  // forgotten
  const absl::Status s = seq_.CheckNotAbortedBeforeBegun(0, 0, 2);
  EXPECT_EQ(s.code(), absl::StatusCode::kAborted);
  EXPECT_THAT(s.message(), HasSubstr("(abort 2)"));
}

TEST_F(StepSequencerTest, DropOfTheQueuedStep) {
  EXPECT_EQ(seq_.DropQueued("nothing queued"), 0u);
  BeginAt(1);
  BeginAt(2);
  EXPECT_EQ(seq_.DropQueued("rank 1 detached"), 2u);
  EXPECT_EQ(seq_.queued_step(), 0u);
  // The running step goes on; the dropped one never ran and is not counted as aborted.
  EXPECT_EQ(seq_.running_step(), 1u);
  EXPECT_EQ(seq_.steps_aborted(), 0u);
  EXPECT_EQ(seq_.seals_pending(), 0u);
  EXPECT_EQ(seq_.state(), shm::StepState::kRunning);
  CompleteAt(1, milliseconds(1));
  EXPECT_EQ(seq_.next_step(), 2u);  // begun again, it runs
  // A rank that began the dropped step and asks for it again begins it afresh: it is the next.
  EXPECT_TRUE(seq_.CheckNotAbortedBeforeBegun(0, 2, 2).ok());
  EXPECT_EQ(BeginAt(2), Action::kStart);
}

TEST_F(StepSequencerTest, AbortOfTheRunningStepLeavesTheQueuedOneToDrop) {
  BeginAt(1);
  BeginAt(2);
  seq_.Abort(1, "protocol error");
  EXPECT_EQ(seq_.queued_step(), 2u);  // the caller drops it with the abort
  EXPECT_EQ(seq_.DropQueued("queued behind step 1, which was aborted: protocol error"), 2u);
  EXPECT_EQ(seq_.next_step(), 2u);
  // A rank still finishing step 0 is told about step 1's abort, with the step to begin next.
  const absl::Status s = seq_.CheckNotAbortedBeforeBegun(1, 0, 1);
  EXPECT_THAT(s.message(), HasSubstr("begin step 2 next"));
}

TEST_F(StepSequencerTest, TornLayersAreKnownAtTheSeal) {
  EXPECT_TRUE(seq_.CheckNotTorn(Describe).ok());
  BeginAt(1);
  seq_.Abort(1, "lost");
  EXPECT_TRUE(seq_.CheckNotTorn(Describe).ok());  // not known before the seal
  EXPECT_TRUE(seq_.Sealed({3, 5}));
  EXPECT_EQ(seq_.state(), shm::StepState::kTorn);
  EXPECT_THAT(seq_.torn_layers(), ElementsAre(3u, 5u));
  const absl::Status s = seq_.CheckNotTorn(Describe);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(s.message(), seq_.TornMessage(Describe));
  EXPECT_THAT(s.message(), HasSubstr("each holds a mix of two versions: layer 3, layer 5. No "
                                     "further step can run"));
}

TEST_F(StepSequencerTest, ASealWithNoNewTornLayerChangesNothing) {
  BeginAt(1);
  seq_.Abort(1, "a");
  ASSERT_TRUE(seq_.Sealed({4}));
  seq_.Start(2, t0_);  // the in-process path starts steps without Begin's callers' torn check
  seq_.Abort(2, "b");
  EXPECT_FALSE(seq_.Sealed({4}));
  EXPECT_EQ(seq_.seals_pending(), 0u);
  EXPECT_EQ(seq_.state(), shm::StepState::kAborted);
  EXPECT_THAT(seq_.torn_layers(), ElementsAre(4u));
}

TEST_F(StepSequencerTest, SealsArePendingPerAbortedStep) {
  BeginAt(1);
  seq_.Abort(1, "a");
  BeginAt(2);
  seq_.Abort(2, "b");
  EXPECT_EQ(seq_.seals_pending(), 2u);
  seq_.Sealed({});
  EXPECT_EQ(seq_.seals_pending(), 1u);
  seq_.Sealed({});
  EXPECT_EQ(seq_.seals_pending(), 0u);
}

}  // namespace
}  // namespace slidedp::hostd
