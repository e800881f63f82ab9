#include "hostd/recovery.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/shm_segment.h"
#include "common/status_macros.h"
#include "spdlog/spdlog.h"

namespace slidedp::hostd {
namespace {

const char* PolicyName(OnInconsistent p) {
  switch (p) {
    case OnInconsistent::kCheckpoint:
      return "checkpoint";
    case OnInconsistent::kFresh:
      return "fresh";
    case OnInconsistent::kRefuse:
      return "refuse";
  }
  return "?";
}

std::string Layers(uint32_t first, uint32_t last) {
  return first == last ? absl::StrCat("layer ", first) : absl::StrCat("layers ", first, "-", last);
}

}  // namespace

absl::StatusOr<OnInconsistent> ParseOnInconsistent(absl::string_view text) {
  if (text == "checkpoint") return OnInconsistent::kCheckpoint;
  if (text == "fresh") return OnInconsistent::kFresh;
  if (text == "refuse") return OnInconsistent::kRefuse;
  return absl::InvalidArgumentError(absl::StrCat("recovery_on_inconsistent: '", text,
                                                 "' is not one of checkpoint, fresh, refuse"));
}

const char* RecoveryActionName(RecoveryPlan::Action action) {
  switch (action) {
    case RecoveryPlan::Action::kCreate:
      return "create";
    case RecoveryPlan::Action::kAdopt:
      return "adopt";
    case RecoveryPlan::Action::kRestoreCheckpoint:
      return "restore_checkpoint";
    case RecoveryPlan::Action::kStartFresh:
      return "start_fresh";
    case RecoveryPlan::Action::kRefuse:
      return "refuse";
  }
  return "?";
}

std::string DescribeInconsistency(const std::vector<uint64_t>& committed,
                                  const std::vector<uint64_t>& pending) {
  std::vector<std::string> parts;
  std::vector<std::string> torn;
  for (uint32_t l = 0; l < committed.size(); ++l) {
    if (l < pending.size() && pending[l] != committed[l]) {
      torn.push_back(absl::StrCat("layer ", l, " (pending version ", pending[l], ", committed ",
                                  committed[l], ")"));
    }
  }
  if (!torn.empty()) {
    parts.push_back(absl::StrCat("mid-update or torn: ", absl::StrJoin(torn, ", ")));
  }
  bool agree = true;
  for (uint64_t v : committed) agree = agree && v == committed.front();
  if (!agree) {
    std::vector<std::string> runs;
    for (uint32_t b = 0; b < committed.size();) {
      uint32_t e = b;
      while (e + 1 < committed.size() && committed[e + 1] == committed[b]) ++e;
      runs.push_back(absl::StrCat(Layers(b, e), " at ", committed[b]));
      b = e + 1;
    }
    parts.push_back(absl::StrCat("committed versions disagree: ", absl::StrJoin(runs, ", ")));
  }
  return absl::StrJoin(parts, "; ");
}

RecoveryPlan PlanRecovery(const FoundState& found, OnInconsistent policy,
                          const std::optional<std::string>& latest_checkpoint) {
  RecoveryPlan plan;
  if (!found.exists) return plan;  // kCreate
  if (found.headers.ok()) {
    plan.reason = found.committed.empty() ? std::string("the state has no layers")
                                          : DescribeInconsistency(found.committed, found.pending);
    if (plan.reason.empty()) {
      plan.action = RecoveryPlan::Action::kAdopt;
      plan.step = found.committed.front();
      return plan;
    }
  } else {
    plan.reason = absl::StrCat("not this job's state: ", found.headers.message());
  }
  switch (policy) {
    case OnInconsistent::kRefuse:
      plan.action = RecoveryPlan::Action::kRefuse;
      break;
    case OnInconsistent::kFresh:
      plan.action = RecoveryPlan::Action::kStartFresh;
      break;
    case OnInconsistent::kCheckpoint:
      if (latest_checkpoint) {
        plan.action = RecoveryPlan::Action::kRestoreCheckpoint;
        plan.checkpoint = *latest_checkpoint;
      } else {
        plan.action = RecoveryPlan::Action::kStartFresh;
        absl::StrAppend(&plan.reason, "; no checkpoint found");
      }
      break;
  }
  return plan;
}

absl::StatusOr<Recovered> RecoverInstance(
    const TrainingState::Options& options, OnInconsistent policy,
    const std::function<std::optional<std::string>()>& find_checkpoint) {
  const std::string& inst = options.instance;
  FoundState found;
  for (auto kind : {shm::SegmentKind::kControl, shm::SegmentKind::kState, shm::SegmentKind::kParams,
                    shm::SegmentKind::kGrads}) {
    found.exists = found.exists || ShmSegment::Exists(SegmentName(inst, kind));
  }
  Recovered out;
  if (!found.exists) return out;
  // Before any policy: a segment hostd does not own is neither adopted nor removed.
  const std::string refused_context =
      absl::StrCat("instance '", inst, "': recovery (recovery_on_inconsistent ", PolicyName(policy),
                   ") refused to touch the shared-memory state it found");
  if (absl::Status owned = TrainingState::CheckSegmentOwners(options); !owned.ok()) {
    return Annotate(owned, refused_context);
  }
  absl::StatusOr<std::unique_ptr<TrainingState>> opened = TrainingState::Open(options);
  if (!opened.ok()) {
    // Open checks each file it maps too: one replaced since the check above is refused as such.
    if (absl::Status owned = TrainingState::CheckSegmentOwners(options); !owned.ok()) {
      return Annotate(owned, refused_context);
    }
  }
  if (opened.ok()) {
    for (uint32_t l = 0; l < (*opened)->num_layers(); ++l) {
      found.committed.push_back((*opened)->committed_version(l));
      found.pending.push_back((*opened)->pending_version(l));
    }
  } else {
    found.headers = opened.status();
  }
  std::optional<std::string> checkpoint;
  if (policy == OnInconsistent::kCheckpoint && find_checkpoint) checkpoint = find_checkpoint();
  out.plan = PlanRecovery(found, policy, checkpoint);
  switch (out.plan.action) {
    case RecoveryPlan::Action::kCreate:
      break;
    case RecoveryPlan::Action::kAdopt:
      out.state = std::move(*opened);
      out.state->ResetControlForAdoption(out.plan.step + 1);
      break;
    case RecoveryPlan::Action::kRefuse:
      return absl::FailedPreconditionError(absl::StrCat(
          "instance '", inst,
          "': the shared-memory state a previous hostd left cannot be "
          "re-adopted: ",
          out.plan.reason,
          ". recovery_on_inconsistent is refuse: set it to "
          "checkpoint or fresh, or remove the state with `slidedpctl cleanup --instance ",
          inst, "`"));
    case RecoveryPlan::Action::kStartFresh:
    case RecoveryPlan::Action::kRestoreCheckpoint:
      if (opened.ok()) opened->reset();  // unmap before removing
      RETURN_IF_ERROR(TrainingState::RemoveSegments(options));
      break;
  }
  spdlog::info("recovery of instance '{}' (recovery_on_inconsistent {}): {}{}{}", inst,
               PolicyName(policy), RecoveryActionName(out.plan.action),
               out.plan.reason.empty() ? "" : ": ", out.plan.reason);
  return out;
}

}  // namespace slidedp::hostd
