// JobSetup: how a job's state comes into existence before Engine installs it.
//
// SetUpJob normalizes the job spec (model::NormalizeJobSpec), chooses the initial weights (the
// seed, zeros, or a safetensors import planned against the manifest before any memory is
// committed), and then, through a JobStateStore, recovers the instance's leftover state (re-adopt
// it, start fresh, or restore the newest checkpoint of this instance and job; hostd/recovery.h)
// or creates a new one, and restores a checkpoint into it when the job resumes. It returns the
// state and where the job stands (its next step, the steps behind it, which checkpoint it came
// from, the version of hostd's copy of the layers the ranks may update themselves). The store is
// the seam: hostd's is shared memory and checkpoint files (ShmJobStateStore); a test's holds no
// memory at all and records what it was asked.
//
// SetUpJob runs on the creating thread without any lock of Engine (it takes minutes for a large
// model); `progress` reports its phases and stops it when it answers false.
//
// Thread safety: SetUpJob shares nothing but the store, which it calls from the calling thread.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "common/shm_segment.h"
#include "common/thread_pool.h"
#include "hostd/recovery.h"
#include "hostd/state.h"
#include "model/checkpoint_format.h"
#include "model/defaults.h"
#include "model/manifest.h"
#include "slidedp/v1/control.pb.h"

namespace slidedp::hostd {

// Where SetUpJob gets a job's state from and restores checkpoints into.
class JobStateStore {
 public:
  virtual ~JobStateStore() = default;
  // What RecoverInstance does: plans from the instance's leftover state and carries out the
  // plan's state part (kAdopt: the mapped state in Recovered::state).
  virtual absl::StatusOr<Recovered> Recover(
      const TrainingState::Options& options, OnInconsistent policy,
      const std::function<std::optional<std::string>()>& find_checkpoint) = 0;
  virtual absl::StatusOr<std::unique_ptr<TrainingState>> Create(
      const TrainingState::Options& options) = 0;
  // FindLatestCheckpoint of a path the user or the recovery plan named.
  virtual absl::StatusOr<model::CheckpointInfo> FindLatest(const std::string& path) = 0;
  // FindLatestCheckpoint of hostd's own (instance, job) in the checkpoint directory.
  virtual absl::StatusOr<model::CheckpointInfo> FindLatest(const std::string& dir,
                                                           const model::CheckpointScope& scope) = 0;
  virtual absl::Status Restore(const model::CheckpointInfo& info, TrainingState* state,
                               const std::function<bool(uint32_t layers_done)>& progress) = 0;
  // `state` does not become a job (its restore failed): its segments go when it is destroyed.
  virtual void Discard(TrainingState* state) = 0;
};

// hostd's store: TrainingState's shared memory and the checkpoint directory, with `pool` for the
// initialization and the restore.
class ShmJobStateStore final : public JobStateStore {
 public:
  explicit ShmJobStateStore(ThreadPool* pool) : pool_(pool) {}
  absl::StatusOr<Recovered> Recover(
      const TrainingState::Options& options, OnInconsistent policy,
      const std::function<std::optional<std::string>()>& find_checkpoint) override;
  absl::StatusOr<std::unique_ptr<TrainingState>> Create(
      const TrainingState::Options& options) override;
  absl::StatusOr<model::CheckpointInfo> FindLatest(const std::string& path) override;
  absl::StatusOr<model::CheckpointInfo> FindLatest(const std::string& dir,
                                                   const model::CheckpointScope& scope) override;
  absl::Status Restore(const model::CheckpointInfo& info, TrainingState* state,
                       const std::function<bool(uint32_t layers_done)>& progress) override;
  void Discard(TrainingState* state) override;

 private:
  ThreadPool* const pool_;
};

struct JobSetupOptions {
  std::string instance = "default";
  // Route defaults for what the spec leaves unset (the config's routes.*).
  slidedp::v1::Routes default_routes = model::DefaultRoutes();
  int numa_node = -1;  // the state's node, -1: none
  mode_t mode = 0600;
  gid_t group = static_cast<gid_t>(-1);
  MlockPolicy mlock = MlockPolicy::kRequired;
  std::string init = "auto";                   // the config's init (hf_import.h's WeightsInit)
  std::string on_inconsistent = "checkpoint";  // recovery.on_inconsistent
  std::string checkpoint_dir;                  // checkpoint.dir; empty: none
  uint32_t grad_ring_slots = 4;
  // (phase, done, total, unit) as the setup goes; false gives up (CANCELLED). Null: none.
  std::function<bool(const char* phase, uint64_t done, uint64_t total, const char* unit)> progress;
};

struct PreparedJob {
  enum class Origin {
    kCreated,       // a new state (no leftovers), initialized from the seed, zeros or import
    kAdopted,       // the previous hostd's state, re-adopted as it was
    kStartedFresh,  // leftovers could not be re-adopted; recovery policy fresh
    kResumed,       // a new state restored from the checkpoint the caller named
    kRecovered,     // leftovers could not be re-adopted; restored from this job's newest
  };
  Origin origin = Origin::kCreated;
  slidedp::v1::JobSpec spec;  // normalized
  std::unique_ptr<TrainingState> state;
  uint64_t next_step = 1;
  uint64_t steps_completed = 0;
  uint64_t start_step = 0;   // the version the job starts at (a resumed job: the checkpoint's)
  std::string resumed_from;  // the checkpoint restored, if any
  // hostd's copy of every layer is the job's state at this version; nullopt for a re-adopted
  // job (the layers its ranks updated themselves lived in the ranks).
  std::optional<uint64_t> client_copy_version = 0;
  std::string recovery_reason;  // kStartedFresh, kRecovered: why the leftovers were not adopted
  double create_seconds = 0;    // recovering or creating the state
  double restore_seconds = 0;   // restoring the checkpoint
};

// Sets the job up (see the overview). `model_dir`: where init "auto" looks for safetensors
// weights (empty for a built-in model or a job created over RPC). `resume`: restore this
// checkpoint (its step becomes the job's); it wins over a recovery plan's checkpoint. Errors
// carry their context ("init (...)", "recovery", "resume"); a state whose restore failed is
// discarded (no job, no segments left).
absl::StatusOr<PreparedJob> SetUpJob(const JobSetupOptions& options, slidedp::v1::JobSpec spec,
                                     model::LoadedModel model, const std::string& model_dir,
                                     const model::CheckpointInfo* resume, JobStateStore& store);

}  // namespace slidedp::hostd
