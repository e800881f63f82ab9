// Crash recovery: what a starting hostd does with the shared-memory state a previous hostd of
// its instance left behind (DESIGN §3.1). The caller holds the instance's lock
// (common/instance_files.h), so the state's owner is dead: a live hostd's segments never get here.
//
//   nothing found                          -> create (a new job)
//   every segment present, every header    -> ADOPT: map the segments as they are (no copy, no
//   valid for the job the config describes    re-init); the job continues at step t + 1
//   (magic, ABI version, kind, size,
//   manifest hash, layer count, world size,
//   one creation nonce, same routes), and
//   every layer consistent
//   (pending == committed) at the same t
//   anything else ("inconsistent")         -> recovery_on_inconsistent:
//       checkpoint: restore the latest checkpoint (when one is found; else start fresh, logged
//                   as a rollback to step 0)
//       fresh:      remove the segments and create the job anew (step 0)
//       refuse:     fail startup with FAILED_PRECONDITION naming the layers and versions
//
// Whatever the policy, a segment hostd does not own (TrainingState::SegmentCheck: another user's,
// a symbolic link, a wider mode than configured) is neither adopted nor removed: RecoverInstance
// fails with FAILED_PRECONDITION naming the file, its owner and mode, and what was expected.
//
// A crash mid-step leaves some layers at t and others at t + 1, or a layer mid-update
// (pending t + 1, committed t): both are inconsistent, since the gradient of the interrupted
// step is gone and half a step cannot be finished.
//
// PlanRecovery is a pure function of what was found (unit-tested); RecoverInstance does the
// mapping, planning and removal. Thread safety: no shared state.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "hostd/state.h"

namespace slidedp::hostd {

enum class OnInconsistent { kCheckpoint, kFresh, kRefuse };

// "checkpoint" | "fresh" | "refuse"; INVALID_ARGUMENT naming the key and the choices otherwise.
absl::StatusOr<OnInconsistent> ParseOnInconsistent(absl::string_view text);

// What a starting hostd found of its instance.
struct FoundState {
  bool exists = false;  // at least one segment of the instance exists
  // TrainingState::Open's verdict on the segments' headers (OK: they are this job's).
  absl::Status headers = absl::OkStatus();
  // Per layer, when the headers are OK.
  std::vector<uint64_t> committed;
  std::vector<uint64_t> pending;
};

struct RecoveryPlan {
  enum class Action { kCreate, kAdopt, kRestoreCheckpoint, kStartFresh, kRefuse };
  Action action = Action::kCreate;
  uint64_t step = 0;       // kAdopt: the version every layer has; the job continues at step + 1
  std::string checkpoint;  // kRestoreCheckpoint: the checkpoint to load
  // Why the found state cannot be adopted (empty for kCreate and kAdopt), e.g.
  // "layer 3 is mid-update (pending version 8, committed 7); committed versions disagree:
  // layers 0-2 at 8, layers 3-5 at 7".
  std::string reason;
};

const char* RecoveryActionName(RecoveryPlan::Action action);

// "" when every layer is consistent at one version; else what is wrong, naming layers and
// versions. `committed` and `pending` have one entry per layer.
std::string DescribeInconsistency(const std::vector<uint64_t>& committed,
                                  const std::vector<uint64_t>& pending);

// The decision. `latest_checkpoint`: the newest complete checkpoint of this job, if any (the
// seam for hostd/checkpoint.h's FindLatestCheckpoint).
RecoveryPlan PlanRecovery(const FoundState& found, OnInconsistent policy,
                          const std::optional<std::string>& latest_checkpoint);

struct Recovered {
  RecoveryPlan plan;
  std::unique_ptr<TrainingState> state;  // kAdopt only: the mapped state, control plane reset
};

// Inspects options.instance's segments, plans, and carries out the plan's shared-memory part:
// kAdopt maps the state (TrainingState::Open) and resets its control plane for step + 1;
// kStartFresh and kRestoreCheckpoint remove the old segments (the caller then creates the state,
// and restores the checkpoint into it); kRefuse returns FAILED_PRECONDITION with the reason, the
// policy and how to get out; a segment that fails TrainingState::SegmentCheck is
// FAILED_PRECONDITION naming it, for every policy, with nothing mapped or removed. The caller
// must hold the instance's lock.
absl::StatusOr<Recovered> RecoverInstance(
    const TrainingState::Options& options, OnInconsistent policy,
    const std::function<std::optional<std::string>()>& find_checkpoint);

}  // namespace slidedp::hostd
