#include "hostd/job_setup.h"

#include <algorithm>
#include <chrono>
#include <random>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "hostd/checkpoint.h"
#include "hostd/hf_import.h"
#include "model/job_spec.h"
#include "model/safetensors.h"
#include "spdlog/spdlog.h"

namespace slidedp::hostd {

absl::StatusOr<Recovered> ShmJobStateStore::Recover(
    const TrainingState::Options& options, OnInconsistent policy,
    const std::function<std::optional<std::string>()>& find_checkpoint) {
  return RecoverInstance(options, policy, find_checkpoint);
}

absl::StatusOr<std::unique_ptr<TrainingState>> ShmJobStateStore::Create(
    const TrainingState::Options& options) {
  return TrainingState::Create(options, pool_);
}

absl::StatusOr<model::CheckpointInfo> ShmJobStateStore::FindLatest(const std::string& path) {
  return FindLatestCheckpoint(path);
}

absl::StatusOr<model::CheckpointInfo> ShmJobStateStore::FindLatest(
    const std::string& dir, const model::CheckpointScope& scope) {
  return FindLatestCheckpoint(dir, scope);
}

absl::Status ShmJobStateStore::Restore(const model::CheckpointInfo& info, TrainingState* state,
                                       const std::function<bool(uint32_t)>& progress) {
  return RestoreCheckpoint(info, state, pool_, progress);
}

void ShmJobStateStore::Discard(TrainingState* state) { state->set_remove_on_destroy(true); }

absl::StatusOr<PreparedJob> SetUpJob(const JobSetupOptions& options, slidedp::v1::JobSpec spec,
                                     model::LoadedModel model, const std::string& model_dir,
                                     const model::CheckpointInfo* resume, JobStateStore& store) {
  using Clock = std::chrono::steady_clock;
  auto note = [&options](const char* phase, uint64_t done, uint64_t total, const char* unit) {
    return options.progress == nullptr || options.progress(phase, done, total, unit);
  };
  PreparedJob job;
  ASSIGN_OR_RETURN(spec, model::NormalizeJobSpec(std::move(spec), options.default_routes));
  TrainingState::Options so;
  so.instance = options.instance;
  so.model = std::move(model);
  so.model.manifest.set_manifest_hash(
      model::ManifestHashHex(model::ManifestHash(so.model.manifest)));
  so.world_size = spec.world_size();
  so.numa_node = options.numa_node;
  so.mode = options.mode;
  so.group = options.group;
  so.mlock = options.mlock;
  so.seed = spec.seed();
  so.progress = options.progress;
  // A resumed job's weights come from the checkpoint: the cheapest init, then the restore.
  const WeightsInit init = resume != nullptr ? WeightsInit{WeightsInit::Kind::kZeros, ""}
                                             : ResolveWeightsInit(options.init, model_dir);
  so.zero_init = init.kind == WeightsInit::Kind::kZeros;
  // The checkpoint is opened and matched to the manifest before any memory is committed, so a
  // bad or mismatched checkpoint fails here, fast, with the tensor named.
  std::unique_ptr<model::SafetensorsCheckpoint> checkpoint;
  ImportPlan plan;
  if (init.kind == WeightsInit::Kind::kSafetensors) {
    const std::string context = absl::StrCat("init (", options.init, ")");
    auto opened = model::SafetensorsCheckpoint::Open(init.path);
    if (!opened.ok()) return Annotate(opened.status(), context);
    checkpoint = std::move(*opened);
    auto planned = PlanImport(so.model.manifest, *checkpoint);
    if (!planned.ok()) return Annotate(planned.status(), context);
    plan = std::move(*planned);
    so.import = &plan;
    spdlog::info("importing weights from {} ({} file(s), {:.2f} GiB)", plan.checkpoint,
                 plan.num_files, static_cast<double>(plan.bytes) / (1ull << 30));
    if (!plan.ignored.empty()) {
      constexpr size_t kNamed = 5;
      std::vector<std::string> named(
          plan.ignored.begin(), plan.ignored.begin() + static_cast<std::ptrdiff_t>(
                                                           std::min(plan.ignored.size(), kNamed)));
      spdlog::info("ignoring {} checkpoint tensor(s) the model does not use: {}{}",
                   plan.ignored.size(), absl::StrJoin(named, ", "),
                   plan.ignored.size() > kNamed ? ", ..." : "");
    }
  }
  so.instance_nonce = std::random_device()() | (uint64_t{std::random_device()()} << 32);
  so.chunk_bytes = spec.routes().chunk_bytes();
  so.grad_ring_slots = options.grad_ring_slots;
  so.grad_dtype = static_cast<uint32_t>(spec.optimizer().grad_dtype());
  so.grad_route = static_cast<uint32_t>(spec.routes().grad_route());
  const uint32_t layers = static_cast<uint32_t>(so.model.manifest.layers_size());
  ASSIGN_OR_RETURN(const OnInconsistent policy, ParseOnInconsistent(options.on_inconsistent));

  // Segments left by an earlier hostd of this instance (dead: the caller holds the instance
  // lock): re-adopted when consistent, else handled by the policy. Inconsistent state: the
  // newest committed checkpoint of the directory of this instance and job, if any (never
  // another's that shares the directory).
  auto find_checkpoint = [&options, &spec, &store]() -> std::optional<std::string> {
    if (options.checkpoint_dir.empty()) return std::nullopt;
    absl::StatusOr<model::CheckpointInfo> found =
        store.FindLatest(options.checkpoint_dir, {options.instance, spec.job_id()});
    if (!found.ok()) return std::nullopt;
    return found->path;
  };
  note("recovering", 0, 0, "");
  ASSIGN_OR_RETURN(Recovered recovered, store.Recover(so, policy, find_checkpoint));
  std::optional<model::CheckpointInfo> recovery_checkpoint;
  job.recovery_reason = recovered.plan.reason;
  if (recovered.plan.action == RecoveryPlan::Action::kRestoreCheckpoint && resume == nullptr) {
    absl::StatusOr<model::CheckpointInfo> info = store.FindLatest(recovered.plan.checkpoint);
    if (!info.ok()) return Annotate(info.status(), "recovery");
    RETURN_IF_ERROR(Annotate(CheckCheckpointManifest(*info, so.model.manifest), "recovery"));
    spdlog::warn("the state left by a previous hostd could not be re-adopted ({}); restoring {}",
                 recovered.plan.reason, info->path);
    recovery_checkpoint = std::move(*info);
    resume = &*recovery_checkpoint;
    job.origin = PreparedJob::Origin::kRecovered;
  } else if (resume != nullptr) {
    job.origin = PreparedJob::Origin::kResumed;
  }
  // The long part (populating, initializing or importing, restoring: minutes for a large
  // model).
  const auto t0 = Clock::now();
  if (recovered.plan.action == RecoveryPlan::Action::kAdopt) {
    job.origin = PreparedJob::Origin::kAdopted;
    job.state = std::move(recovered.state);
    job.client_copy_version.reset();  // the client-updated layers' state lived in the ranks
    job.next_step = recovered.plan.step + 1;
    job.steps_completed = recovered.plan.step;
    spdlog::info("re-adopted job {} at step {} (instance '{}'; the job continues at step {})",
                 spec.job_id(), recovered.plan.step, options.instance, job.next_step);
  } else {
    if (recovered.plan.action == RecoveryPlan::Action::kStartFresh) {
      if (resume == nullptr) job.origin = PreparedJob::Origin::kStartedFresh;
      spdlog::warn(
          "starting job {} fresh at step 0: the state left by a previous hostd could not be "
          "re-adopted ({})",
          spec.job_id(), recovered.plan.reason);
    }
    ASSIGN_OR_RETURN(job.state, store.Create(so));
  }
  job.create_seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  if (resume != nullptr) {
    const auto r0 = Clock::now();
    note("restoring checkpoint", 0, layers, "layers");
    absl::Status restored = store.Restore(*resume, job.state.get(), [&note, layers](uint32_t done) {
      return note("restoring checkpoint", done, layers, "layers");
    });
    if (!restored.ok()) {
      // No job comes into existence: the half-restored state is removed.
      store.Discard(job.state.get());
      return Annotate(restored, "resume");
    }
    job.next_step = resume->step + 1;
    job.steps_completed = resume->step;
    job.resumed_from = resume->path;
    job.start_step = resume->step;
    job.client_copy_version = resume->step;  // checkpoints hold every layer, the ranks' too
    job.restore_seconds = std::chrono::duration<double>(Clock::now() - r0).count();
    spdlog::info("resumed from checkpoint {} (step {}, {:.2f} GB) in {:.2f} s; next step {}",
                 resume->path, resume->step, static_cast<double>(resume->total_bytes) / 1e9,
                 job.restore_seconds, job.next_step);
  }
  job.spec = std::move(spec);
  return job;
}

}  // namespace slidedp::hostd
