// JobSetup through an in-memory store: no shared memory is created, mapped or removed, and no
// checkpoint file is read; the store records what SetUpJob asked of it.
#include "hostd/job_setup.h"

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/manifest.h"

namespace slidedp::hostd {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using Origin = PreparedJob::Origin;
using Action = RecoveryPlan::Action;

class FakeStore final : public JobStateStore {
 public:
  // What Recover finds; Recover calls find_checkpoint when the plan restores one.
  RecoveryPlan plan;
  // What FindLatest answers, by path or for the scoped search (key: dir + "|" + instance + "|"
  // + job).
  std::map<std::string, model::CheckpointInfo> checkpoints;
  absl::Status restore_status;
  absl::Status create_status;
  bool give_up_restore_at_layer_2 = false;

  std::vector<std::string> calls;
  std::optional<TrainingState::Options> created;
  std::string restored_path;
  std::optional<std::string> found_for_recovery;

  absl::StatusOr<Recovered> Recover(
      const TrainingState::Options& options, OnInconsistent,
      const std::function<std::optional<std::string>()>& find_checkpoint) override {
    calls.push_back("recover");
    Recovered r;
    r.plan = plan;
    if (plan.action == Action::kRestoreCheckpoint) {
      found_for_recovery = find_checkpoint();
      if (!found_for_recovery) return absl::FailedPreconditionError("no checkpoint to restore");
      r.plan.checkpoint = *found_for_recovery;
    }
    if (plan.action == Action::kAdopt) created = options;  // the adopted state's options
    return r;
  }
  absl::StatusOr<std::unique_ptr<TrainingState>> Create(
      const TrainingState::Options& options) override {
    calls.push_back("create");
    if (!create_status.ok()) return create_status;
    created = options;
    return std::unique_ptr<TrainingState>();
  }
  absl::StatusOr<model::CheckpointInfo> FindLatest(const std::string& path) override {
    calls.push_back("find " + path);
    auto it = checkpoints.find(path);
    if (it == checkpoints.end()) return absl::NotFoundError("no checkpoint in " + path);
    return it->second;
  }
  absl::StatusOr<model::CheckpointInfo> FindLatest(const std::string& dir,
                                                   const model::CheckpointScope& scope) override {
    return FindLatest(dir + "|" + scope.instance + "|" + scope.job_id);
  }
  absl::Status Restore(const model::CheckpointInfo& info, TrainingState*,
                       const std::function<bool(uint32_t)>& progress) override {
    calls.push_back("restore " + info.path);
    restored_path = info.path;
    for (uint32_t l = 1; l <= 4; ++l) {
      if (!progress(l)) return absl::CancelledError("restore given up");
    }
    return restore_status;
  }
  void Discard(TrainingState*) override { calls.push_back("discard"); }
};

class JobSetupTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<model::LoadedModel> m = model::LoadModel("tiny");
    ASSERT_TRUE(m.ok()) << m.status();
    model_ = *m;
    spec_.set_job_id("job-a");
    spec_.set_world_size(2);
    spec_.set_seed(7);
    options_.instance = "inst";
    options_.init = "random";
    options_.checkpoint_dir = "/ckpt";
    options_.progress = [this](const char* phase, uint64_t done, uint64_t total, const char*) {
      phases_.push_back(absl::StrCat(phase, " ", done, "/", total));
      return keep_going_;
    };
  }

  // A checkpoint of the tiny model at `step`.
  model::CheckpointInfo Checkpoint(const std::string& path, uint64_t step) const {
    model::CheckpointInfo info;
    info.path = path;
    info.step = step;
    *info.spec.mutable_manifest() = model_.manifest;
    info.manifest_hash = model::ManifestHashHex(model::ManifestHash(model_.manifest));
    return info;
  }

  absl::StatusOr<PreparedJob> Run(const model::CheckpointInfo* resume = nullptr) {
    return SetUpJob(options_, spec_, model_, "", resume, store_);
  }

  model::LoadedModel model_;
  slidedp::v1::JobSpec spec_;
  JobSetupOptions options_;
  FakeStore store_;
  std::vector<std::string> phases_;
  bool keep_going_ = true;
};

TEST_F(JobSetupTest, NoLeftoversCreateAFreshStateFromTheSpec) {
  absl::StatusOr<PreparedJob> job = Run();
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->origin, Origin::kCreated);
  EXPECT_EQ(job->next_step, 1u);
  EXPECT_EQ(job->steps_completed, 0u);
  EXPECT_EQ(job->client_copy_version, 0u);
  EXPECT_TRUE(job->resumed_from.empty());
  EXPECT_THAT(store_.calls, ElementsAre("recover", "create"));
  ASSERT_TRUE(store_.created.has_value());
  const TrainingState::Options& so = *store_.created;
  EXPECT_EQ(so.instance, "inst");
  EXPECT_EQ(so.world_size, 2u);
  EXPECT_EQ(so.seed, 7u);
  EXPECT_FALSE(so.zero_init);
  EXPECT_EQ(so.import, nullptr);
  EXPECT_NE(so.instance_nonce, 0u);
  // The normalized spec's routes reach the state (the defaults fill what the spec left unset).
  EXPECT_EQ(so.chunk_bytes, job->spec.routes().chunk_bytes());
  EXPECT_GT(so.chunk_bytes, 0u);
  EXPECT_EQ(so.grad_route, static_cast<uint32_t>(job->spec.routes().grad_route()));
  EXPECT_FALSE(so.model.manifest.manifest_hash().empty());
  EXPECT_THAT(phases_, ElementsAre("recovering 0/0"));
}

TEST_F(JobSetupTest, ABadSpecFailsBeforeTheStoreIsAsked) {
  spec_.set_job_id("../etc");
  absl::StatusOr<PreparedJob> job = Run();
  EXPECT_EQ(job.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(job.status().message(), HasSubstr("job_id"));
  EXPECT_TRUE(store_.calls.empty());
}

TEST_F(JobSetupTest, ABadRecoveryPolicyFailsBeforeTheStoreIsAsked) {
  options_.on_inconsistent = "sometimes";
  absl::StatusOr<PreparedJob> job = Run();
  EXPECT_FALSE(job.ok());
  EXPECT_THAT(job.status().message(), HasSubstr("sometimes"));
  EXPECT_TRUE(store_.calls.empty());
}

TEST_F(JobSetupTest, AMissingImportFailsWithItsContextBeforeTheStoreIsAsked) {
  options_.init = "/nonexistent/model.safetensors";
  absl::StatusOr<PreparedJob> job = Run();
  EXPECT_FALSE(job.ok());
  EXPECT_THAT(job.status().message(), HasSubstr("init (/nonexistent/model.safetensors)"));
  EXPECT_TRUE(store_.calls.empty());
}

TEST_F(JobSetupTest, ConsistentLeftoversAreAdoptedAtTheirStep) {
  store_.plan.action = Action::kAdopt;
  store_.plan.step = 41;
  absl::StatusOr<PreparedJob> job = Run();
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->origin, Origin::kAdopted);
  EXPECT_EQ(job->next_step, 42u);
  EXPECT_EQ(job->steps_completed, 41u);
  EXPECT_EQ(job->start_step, 0u);
  // The layers the ranks updated lived in the ranks: hostd's copy of them is of no known step.
  EXPECT_EQ(job->client_copy_version, std::nullopt);
  EXPECT_THAT(store_.calls, ElementsAre("recover"));
}

TEST_F(JobSetupTest, InconsistentLeftoversRestoreThisInstancesAndJobsNewestCheckpoint) {
  store_.plan.action = Action::kRestoreCheckpoint;
  store_.plan.reason = "layer 2 torn";
  store_.checkpoints["/ckpt|inst|job-a"] = Checkpoint("/ckpt/step-9.inst.job-a", 9);
  store_.checkpoints["/ckpt/step-9.inst.job-a"] = Checkpoint("/ckpt/step-9.inst.job-a", 9);
  absl::StatusOr<PreparedJob> job = Run();
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(store_.found_for_recovery, "/ckpt/step-9.inst.job-a");
  EXPECT_EQ(job->origin, Origin::kRecovered);
  EXPECT_EQ(job->recovery_reason, "layer 2 torn");
  EXPECT_EQ(job->next_step, 10u);
  EXPECT_EQ(job->start_step, 9u);
  EXPECT_EQ(job->resumed_from, "/ckpt/step-9.inst.job-a");
  EXPECT_EQ(job->client_copy_version, 9u);  // a checkpoint holds every layer
  // Recovery decides after the state's options are made: the state is initialized as
  // configured, then overwritten by the restore.
  EXPECT_THAT(store_.calls,
              ElementsAre("recover", "find /ckpt|inst|job-a", "find /ckpt/step-9.inst.job-a",
                          "create", "restore /ckpt/step-9.inst.job-a"));
  // The tiny model has 7 layers (embeddings, 4 decoder layers, norm, head).
  EXPECT_THAT(phases_, ElementsAre("recovering 0/0", "restoring checkpoint 0/7",
                                   "restoring checkpoint 1/7", "restoring checkpoint 2/7",
                                   "restoring checkpoint 3/7", "restoring checkpoint 4/7"));
}

TEST_F(JobSetupTest, ARecoveryCheckpointOfAnotherModelIsRefusedNamingRecovery) {
  store_.plan.action = Action::kRestoreCheckpoint;
  absl::StatusOr<model::LoadedModel> other = model::LoadModel("tiny-tied");
  ASSERT_TRUE(other.ok());
  model::CheckpointInfo info = Checkpoint("/ckpt/step-3.inst.job-a", 3);
  *info.spec.mutable_manifest() = other->manifest;
  info.manifest_hash = model::ManifestHashHex(model::ManifestHash(other->manifest));
  store_.checkpoints["/ckpt|inst|job-a"] = info;
  store_.checkpoints["/ckpt/step-3.inst.job-a"] = info;
  absl::StatusOr<PreparedJob> job = Run();
  EXPECT_EQ(job.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(job.status().message(), HasSubstr("recovery"));
  EXPECT_THAT(store_.calls, ::testing::Not(::testing::Contains("create")));
}

TEST_F(JobSetupTest, AnExplicitResumeWinsOverTheRecoveryPlansCheckpoint) {
  store_.plan.action = Action::kRestoreCheckpoint;
  store_.checkpoints["/ckpt|inst|job-a"] = Checkpoint("/ckpt/step-9.inst.job-a", 9);
  const model::CheckpointInfo resume = Checkpoint("/elsewhere/step-4", 4);
  absl::StatusOr<PreparedJob> job = Run(&resume);
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->origin, Origin::kResumed);
  EXPECT_EQ(job->next_step, 5u);
  EXPECT_EQ(job->resumed_from, "/elsewhere/step-4");
  EXPECT_EQ(store_.restored_path, "/elsewhere/step-4");
  // A resumed job's weights come from the checkpoint: the state starts as zeros.
  ASSERT_TRUE(store_.created.has_value());
  EXPECT_TRUE(store_.created->zero_init);
}

TEST_F(JobSetupTest, FreshAfterInconsistentLeftoversStartsAtStepOne) {
  store_.plan.action = Action::kStartFresh;
  store_.plan.reason = "manifest differs";
  absl::StatusOr<PreparedJob> job = Run();
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->origin, Origin::kStartedFresh);
  EXPECT_EQ(job->next_step, 1u);
  EXPECT_EQ(job->recovery_reason, "manifest differs");
  EXPECT_THAT(store_.calls, ElementsAre("recover", "create"));
}

TEST_F(JobSetupTest, AFailedRestoreDiscardsTheStateAndSaysResume) {
  store_.restore_status = absl::DataLossError("layer 3: checksum mismatch");
  const model::CheckpointInfo resume = Checkpoint("/elsewhere/step-4", 4);
  absl::StatusOr<PreparedJob> job = Run(&resume);
  EXPECT_EQ(job.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(job.status().message(), HasSubstr("resume"));
  EXPECT_THAT(job.status().message(), HasSubstr("checksum mismatch"));
  EXPECT_THAT(store_.calls,
              ElementsAre("recover", "create", "restore /elsewhere/step-4", "discard"));
}

TEST_F(JobSetupTest, GivingUpDuringTheRestoreDiscardsTheState) {
  const model::CheckpointInfo resume = Checkpoint("/elsewhere/step-4", 4);
  keep_going_ = false;
  absl::StatusOr<PreparedJob> job = Run(&resume);
  EXPECT_EQ(job.status().code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(store_.calls.back(), "discard");
}

TEST_F(JobSetupTest, ACreateFailureIsReturnedAsIs) {
  store_.create_status = absl::ResourceExhaustedError("shared memory: 12 GiB short");
  absl::StatusOr<PreparedJob> job = Run();
  EXPECT_EQ(job.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(job.status().message(), HasSubstr("12 GiB short"));
}

}  // namespace
}  // namespace slidedp::hostd
