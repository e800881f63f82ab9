#include "hostd/engine.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <random>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "common/status_macros.h"
#include "common/version.h"
#include "hostd/engine_report.h"
#include "hostd/hf_export.h"
#include "hostd/hf_import.h"
#include "hostd/job_setup.h"
#include "hostd/output_roots.h"
#include "hostd/recovery.h"
#include "model/lr_schedule.h"
#include "model/manifest.h"
#include "model/safetensors.h"
#include "proto/doorbell.h"
#include "spdlog/spdlog.h"

namespace slidedp::hostd {
namespace {

using std::chrono::milliseconds;
using SteadyClock = std::chrono::steady_clock;

// Gradient ring slots per rank: enough for a chunk in flight per rank while the reducer works
// on the previous ones.
constexpr uint32_t kGradRingSlots = 4;
// GPU reduction routes: the rank that pushes the aggregated gradient.
constexpr uint32_t kGradPushingRank = 0;

// The reducer's route and pushing ranks for a job's gradient route.
void ReducerRoute(slidedp::v1::GradRoute route, uint32_t world_size,
                  GradientReducer::Route* reducer_route, std::vector<uint32_t>* pushing_ranks) {
  pushing_ranks->clear();
  switch (route) {
    case slidedp::v1::GRAD_ROUTE_REDUCE_SCATTER:
      // Every rank pushes its shard of the aggregated gradient (shm::ShardOf).
      *reducer_route = GradientReducer::Route::kShards;
      for (uint32_t r = 0; r < world_size; ++r) pushing_ranks->push_back(r);
      break;
    case slidedp::v1::GRAD_ROUTE_GPU_REDUCTION:
      // One rank pushes the whole aggregated gradient: the one-shard case of the shard route.
      *reducer_route = GradientReducer::Route::kShards;
      pushing_ranks->push_back(kGradPushingRank);
      break;
    default:
      *reducer_route = GradientReducer::Route::kSum;
      for (uint32_t r = 0; r < world_size; ++r) pushing_ranks->push_back(r);
      break;
  }
}

// True when every layer has reached version `step`: the step's updates are all published and
// only the update worker's completion callbacks (OnLayerDone) are left to close the step. A rank
// sees the step done (WaitStep) at this point, so its detach or exit must not abort the step.
// Layers the ranks update themselves (`client_updated`) are published only when the step
// completes, so they are not waited for.
bool AllLayersAt(const TrainingState& state, uint64_t step,
                 const std::vector<bool>& client_updated) {
  for (uint32_t l = 0; l < state.num_layers(); ++l) {
    if (l < client_updated.size() && client_updated[l]) continue;
    if (state.committed_version(l) < step) return false;
  }
  return true;
}

uint64_t MonotonicNs() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000000000ull + static_cast<uint64_t>(ts.tv_nsec);
}

absl::StatusOr<kernels::Isa> ChooseIsa(const std::string& name) {
  if (name.empty() || name == "auto") return kernels::BestIsa();
  std::optional<kernels::Isa> isa = kernels::ParseIsa(name);
  if (!isa) {
    return absl::InvalidArgumentError(
        absl::StrCat("isa: '", name, "' is not one of auto, scalar, avx2, avx512, avx512bf16"));
  }
  if (!kernels::IsaSupported(*isa)) {
    return absl::FailedPreconditionError(
        absl::StrCat("isa: this CPU does not support ", name, "; best supported is ",
                     std::string(kernels::IsaName(kernels::BestIsa()))));
  }
  return *isa;
}

// MemAvailable of /proc/meminfo in bytes; 0 when unknown.
uint64_t MemAvailableBytes() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  uint64_t kib = 0;
  std::string unit;
  while (in >> key >> kib >> unit) {
    if (key == "MemAvailable:") return kib * 1024;
  }
  return 0;
}

int64_t UnixMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// The longest a BeginStep waits for an HF export that holds the steps.
constexpr absl::Duration kExportHoldMax = absl::Minutes(30);

// How long an RPC with wait blocks for a checkpoint to commit.
constexpr int64_t kCheckpointWaitMs = int64_t{6} * 3600 * 1000;
// Elements per UploadClientLayer / ReadClientLayer message (16 MiB of FP32; hostd's server and
// rankclient's channel accept 20 MiB messages).
constexpr uint64_t kClientLayerChunkElements = uint64_t{1} << 22;

}  // namespace

slidedp::v1::BuildInfo DaemonBuildInfo() {
  slidedp::v1::BuildInfo b;
  b.set_version(kVersion);
  b.set_git_revision(kGitRevision);
  b.set_protocol_version(kProtocolVersion);
  b.set_shm_abi_version(kShmAbiVersion);
  b.set_component("hostd");
  for (const char* f : {"cpu_reduction", "gpu_reduction", "reduce_scatter", "chunk_streamed_update",
                        "per_layer_clip", "global_clip", "lr_schedules", "nonfinite_skip",
                        "nccl_rendezvous", "checkpoint", "resume"}) {
    b.add_features(f);
  }
  return b;
}

Engine::Engine(HostdConfig config, std::vector<ConfigEntry> entries,
               CreationProgressFn creation_progress)
    : config_(std::move(config)),
      entries_(std::move(entries)),
      started_(SteadyClock::now()),
      creation_progress_(std::move(creation_progress)) {}

absl::StatusOr<std::unique_ptr<Engine>> Engine::Create(const HostdConfig& config,
                                                       std::vector<ConfigEntry> entries,
                                                       std::optional<Topology> topology,
                                                       CreationProgressFn creation_progress) {
  std::unique_ptr<Engine> e(new Engine(config, std::move(entries), std::move(creation_progress)));
  RETURN_IF_ERROR(e->Init(std::move(topology)));
  return e;
}

absl::Status Engine::Init(std::optional<Topology> topology) {
  if (topology) {
    topology_ = std::move(*topology);
  } else {
    ASSIGN_OR_RETURN(topology_, DiscoverTopology());
  }
  ASSIGN_OR_RETURN(state_node_, ChooseStateNode(topology_, config_.numa_node));
  ASSIGN_OR_RETURN(worker_cpus_,
                   WorkerCpus(topology_, state_node_, config_.update_threads, config_.world_size));
  ASSIGN_OR_RETURN(isa_, ChooseIsa(config_.isa));
  // Held for this engine's life: no other hostd adopts, removes or recreates our segments. Its
  // mode and group (shm_mode, shm_group) are those of the segments ranks map and the socket.
  InstanceLock::Options lock_options;
  lock_options.mode = config_.shm_mode == "0660" ? 0660 : 0600;
  ASSIGN_OR_RETURN(lock_options.group, ResolveShmGroup(config_.shm_group));
  ASSIGN_OR_RETURN(instance_lock_, InstanceLock::Acquire(config_.instance, lock_options));
  ThreadPool::Options po;
  po.num_threads = static_cast<int>(worker_cpus_.size());
  po.cpus = worker_cpus_;
  po.name = "slidedp-update";
  ASSIGN_OR_RETURN(pool_, ThreadPool::Create(po));
  spdlog::info(
      "topology: {} NUMA node(s), {} cores, {} GPU(s); state on node {}; {} update "
      "threads ({}); ISA {}",
      topology_.nodes.size(), topology_.cores, topology_.gpus.size(), state_node_,
      worker_cpus_.size(),
      config_.update_threads == 0
          ? absl::StrCat("auto: the node's cores less ", kCoresPerRank, " for each of ",
                         config_.world_size, " rank(s) and ", kCoresForHostd, " for hostd")
          : std::string("set"),
      kernels::IsaName(isa_));

  if (!config_.checkpoint.resume.empty()) {
    // Everything about the checkpoint is checked before any memory is committed.
    auto found = FindLatestCheckpoint(config_.checkpoint.resume);
    if (!found.ok()) return Annotate(found.status(), "checkpoint.resume");
    const model::CheckpointInfo info = std::move(*found);
    model::LoadedModel model;
    std::string model_dir;
    if (config_.model == "none" || config_.model.empty()) {
      model.manifest = info.spec.manifest();
      model.initializer_range = info.initializer_range;
      model.config_json = info.config_json;
      model.source = info.model_source;
    } else {
      ASSIGN_OR_RETURN(model, model::LoadModel(config_.model));
      RETURN_IF_ERROR(Annotate(CheckCheckpointManifest(info, model.manifest), "checkpoint.resume"));
    }
    slidedp::v1::JobSpec spec = info.spec;
    spec.set_job_id(info.job_id);
    *spec.mutable_routes() = config_.routes;
    spec.set_world_size(config_.world_size);  // any world size may resume
    spec.clear_manifest();
    RETURN_IF_ERROR(ClaimCreation(spec.job_id()));
    RETURN_IF_ERROR(CreateJobUnlocked(std::move(spec), std::move(model), model_dir, &info));
  } else if (config_.model != "none" && !config_.model.empty()) {
    ASSIGN_OR_RETURN(model::LoadedModel model, model::LoadModel(config_.model));
    slidedp::v1::JobSpec spec;
    spec.set_job_id("default");
    *spec.mutable_optimizer() = config_.optimizer;
    *spec.mutable_routes() = config_.routes;
    spec.set_world_size(config_.world_size);
    spec.set_seed(config_.seed);
    // LoadModel resolves the built-in names before paths, so a directory named "tiny" is not
    // the model's directory unless written as a path.
    std::string model_dir;
    std::error_code ec;
    if (config_.model != "tiny" && config_.model != "tiny-tied" &&
        std::filesystem::is_directory(config_.model, ec)) {
      model_dir = config_.model;
    }
    RETURN_IF_ERROR(ClaimCreation(spec.job_id()));
    RETURN_IF_ERROR(CreateJobUnlocked(std::move(spec), std::move(model), model_dir));
  }
  monitor_ = std::thread([this] { MonitorLoop(); });
  return absl::OkStatus();
}

Engine::~Engine() { Shutdown(/*remove_state=*/false).IgnoreError(); }

absl::Status Engine::Shutdown(bool remove_state) {
  stopping_.store(true);
  {
    absl::MutexLock lock(&mu_);
    if (serving_) {
      serving_ = false;
      if (seq_.running_step() != 0) AbortStepLocked(seq_.running_step(), "hostd is shutting down");
      slidedp::v1::SessionEvent ev;
      ev.mutable_shutting_down()->set_reason("hostd is shutting down");
      ranks_.Broadcast(ev);
      if (state_) {
        shm::Atomic(state_->control().shutting_down).store(1, std::memory_order_release);
        shm::Atomic(state_->control().wake_seq).fetch_add(1);
        shm::Doorbell(&state_->control().wake_seq).WakeAll();
      }
    }
    monitor_stop_ = true;
    // A job being created sees serving_ false at its next progress note and stops there (or
    // completes its last phase); the rest of the stop needs it installed or gone.
    auto no_creation = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !creating_; };
    mu_.Await(absl::Condition(&no_creation));
  }
  if (monitor_.joinable()) monitor_.join();
  if (reducer_) reducer_->Stop();
  if (worker_) worker_->Stop();
  // With the worker stopped every layer sits at its final version: a checkpoint in flight
  // completes from the live state, and a clean stop writes the final one.
  absl::Status saved = absl::OkStatus();
  if (checkpointer_) {
    const uint64_t in_flight = checkpointer_->in_flight_step();
    if (in_flight != 0) {
      // A layer below the checkpoint's version now never reaches it: the checkpoint was of a
      // step queued behind the one the stop aborted, which no rank will begin again.
      bool reachable = state_ != nullptr;
      for (uint32_t l = 0; reachable && l < state_->num_layers(); ++l) {
        reachable = state_->committed_version(l) >= in_flight;
      }
      if (!reachable) {
        spdlog::warn("the checkpoint of step {} is cancelled: hostd stops before that step ran",
                     in_flight);
        checkpointer_->Cancel(absl::StrCat("hostd is stopping before step ", in_flight, " ran"));
        (void)checkpointer_->Wait(in_flight, kCheckpointWaitMs);
      } else {
        spdlog::info("waiting for the checkpoint of step {} to commit", in_flight);
        checkpointer_->Unpace();
        absl::StatusOr<CheckpointResult> done = checkpointer_->Wait(in_flight, kCheckpointWaitMs);
        if (!done.ok()) {
          saved = Annotate(done.status(), absl::StrCat("the checkpoint of step ", in_flight));
        }
      }
    }
    // A clean stop's own checkpoint; it also stands in for one in flight that failed.
    if (remove_state) {
      absl::Status final_saved = FinalCheckpoint();
      if (final_saved.ok() && !saved.ok() &&
          checkpointer_->last_committed().step >= checkpointer_->in_flight_step()) {
        saved = absl::OkStatus();
      }
      if (!final_saved.ok()) saved = final_saved;
    }
  }
  if (!state_ || !remove_state) return saved;
  if (!saved.ok()) {
    // The shared memory is the only copy of what was trained since the last checkpoint: it
    // stays, re-adoptable, for a hostd started again on the same configuration.
    const std::string instance = config_.instance;
    spdlog::error(
        "keeping the training state in /dev/shm/slidedp.{}.* because {}; start hostd again with "
        "the same configuration to re-adopt it (then checkpoint), or remove it with `slidedpctl "
        "cleanup --instance {}`",
        instance, std::string(saved.message()), instance);
    return absl::DataLossError(
        absl::StrCat("no checkpoint holds the final state (", saved.message(),
                     "); the training state stays in /dev/shm/slidedp.", instance,
                     ".*: start hostd again with the same configuration to re-adopt it"));
  }
  state_->set_remove_on_destroy(true);
  return absl::OkStatus();
}

absl::Status Engine::FinalCheckpoint() {
  std::string dir;
  model::CheckpointInfo info;
  uint64_t version = 0;
  {
    absl::MutexLock lock(&mu_);
    if (!config_.checkpoint.on_stop || config_.checkpoint.dir.empty() || !job_ || !state_) {
      return absl::OkStatus();
    }
    version = state_->committed_version(0);
    if (absl::Status s = CheckCheckpointableLocked(version); !s.ok()) {
      return Annotate(s, "no final checkpoint");
    }
    for (uint32_t l = 1; l < state_->num_layers(); ++l) {
      if (state_->committed_version(l) != version) {
        return absl::FailedPreconditionError(
            absl::StrCat("no final checkpoint: layer ", l, " is at version ",
                         state_->committed_version(l), ", layer 0 at ", version));
      }
    }
    if (version == start_step_) return absl::OkStatus();  // nothing trained since the start
    if (checkpointer_->last_committed().step == version &&
        !checkpointer_->last_committed().path.empty()) {
      spdlog::info("final checkpoint: step {} is already checkpointed ({})", version,
                   checkpointer_->last_committed().path);
      return absl::OkStatus();
    }
    dir = config_.checkpoint.dir;
    info = CheckpointDescriptionLocked();
  }
  spdlog::info("writing the final checkpoint of step {} to {}", version, dir);
  absl::Status s = checkpointer_->Start(dir, version, std::move(info));
  if (absl::IsAlreadyExists(s)) return absl::OkStatus();
  checkpointer_->Unpace();  // hostd is stopping: no training to spare
  absl::StatusOr<CheckpointResult> r = s.ok() ? checkpointer_->Wait(version, kCheckpointWaitMs)
                                              : absl::StatusOr<CheckpointResult>(s);
  if (!r.ok()) {
    spdlog::error("final checkpoint failed: {}", r.status().ToString());
    return Annotate(r.status(), absl::StrCat("the final checkpoint of step ", version));
  }
  return absl::OkStatus();
}

model::CheckpointInfo Engine::CheckpointDescriptionLocked() const {
  model::CheckpointInfo info;
  info.job_id = job_->job_id();
  info.manifest_hash = model::ManifestHashHex(state_->manifest_hash());
  info.spec = *job_;
  *info.spec.mutable_optimizer() = worker_->optimizer();
  *info.spec.mutable_manifest() = state_->model().manifest;
  info.initializer_range = state_->model().initializer_range;
  info.config_json = state_->model().config_json;
  info.model_source = state_->model().source;
  info.weights_source =
      resumed_from_.empty() ? state_->weights_source() : "checkpoint " + resumed_from_;
  info.hostd_version = kVersion;
  return info;
}

absl::Status Engine::CheckCheckpointableLocked(uint64_t version) const {
  RETURN_IF_ERROR(CheckNotTornLocked());
  return client_.CheckCheckpointable(version);
}

bool Engine::ClientCopyCurrentLocked() const {
  return client_.CopyCurrent(seq_.running_step(), seq_.next_step() - 1);
}

void Engine::RequestClientSyncLocked(uint64_t step) {
  client_.SetSyncStep(step);
  if (state_) {
    shm::Atomic(state_->control().client_sync_step).store(step, std::memory_order_release);
  }
  if (step != 0) {
    spdlog::info("asking rank 0 for its state of layers {} at version {}",
                 LayerList(client_.layers()), step);
  }
}

void Engine::ReconcileClientSyncLocked() {
  // A request outlives no checkpoint: one that committed or failed (e.g. timed out) withdraws it.
  if (client_.ShouldWithdraw(checkpointer_->in_flight_step())) RequestClientSyncLocked(0);
}

absl::Status Engine::StartCheckpointLocked(const std::string& dir, uint64_t step) {
  RETURN_IF_ERROR(CheckNotTornLocked());
  ReconcileClientSyncLocked();
  const std::vector<uint32_t> awaiting = client_.AwaitedBy(step);
  RETURN_IF_ERROR(checkpointer_->Start(dir, step, CheckpointDescriptionLocked(), awaiting));
  if (!awaiting.empty()) RequestClientSyncLocked(step);
  return absl::OkStatus();
}

absl::StatusOr<slidedp::v1::UploadClientLayerResponse> Engine::UploadClientLayer(
    const slidedp::v1::UploadClientLayerRequest& r) {
  absl::MutexLock lock(&mu_);
  RETURN_IF_ERROR(CheckJob(r.job_id()));
  RETURN_IF_ERROR(ranks_.CheckToken(r.rank(), r.attach_token()));
  if (r.rank() != 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "rank: only rank 0 uploads the client-updated layers (every rank holds the same state); "
        "got rank ",
        r.rank()));
  }
  RETURN_IF_ERROR(client_.CheckPart(r.layer(), r.part()));
  ReconcileClientSyncLocked();
  if (r.data().size() % sizeof(float) != 0 || r.data().empty() ||
      r.data().size() > kClientLayerChunkElements * sizeof(float)) {
    return absl::InvalidArgumentError(absl::StrCat("data: expected 1..", kClientLayerChunkElements,
                                                   " FP32 values (a multiple of 4 bytes), got ",
                                                   r.data().size(), " bytes"));
  }
  const uint64_t count = r.data().size() / sizeof(float);
  RETURN_IF_ERROR(client_.CheckRange(r.layer(), r.offset(), count));
  // Which version is accepted: the one a checkpoint asked for, else (between steps, no export,
  // no checkpoint writing) the last completed step.
  for (;;) {
    RETURN_IF_ERROR(client_.CheckUploadVersion(r.step(), seq_.running_step(), seq_.next_step(),
                                               export_active_));
    if (client_.sync_step() != 0) break;
    const uint64_t in_flight = checkpointer_->in_flight_step();
    if (in_flight == 0) break;
    // A checkpoint may still read the layers from the live state: let it finish first (at
    // full speed: the rank waits).
    checkpointer_->Unpace();
    mu_.Unlock();
    (void)checkpointer_->Wait(in_flight, kCheckpointWaitMs);
    mu_.Lock();
    RETURN_IF_ERROR(CheckJob(r.job_id()));
  }
  RETURN_IF_ERROR(client_.BeginPiece(r.layer(), r.part(), r.offset(), r.step()));
  // The copy (16 MiB, and the BF16 cast of a master piece) runs outside mu_: the update
  // worker's OnLayerDone and SubmitGradient take mu_, and a checkpoint's upload of the resident
  // layers (GiBs) under it delayed every update of the steps it overlapped. The layer is
  // updated by the ranks, so no update touches it, and nothing reads it before it is complete
  // (the checkpoint waits for ClientLayerReady; export and ReadClientLayer want a current copy,
  // which an upload in progress is not). BeginPiece lets no other piece in meanwhile.
  float* dst = r.part() == 0   ? state_->master(r.layer())
               : r.part() == 1 ? state_->exp_avg(r.layer())
                               : state_->exp_avg_sq(r.layer());
  mu_.Unlock();
  std::memcpy(dst + r.offset(), r.data().data(), count * sizeof(float));
  if (r.part() == 0) {
    kernels::CastFp32ToBf16(isa_, dst + r.offset(), state_->params(r.layer()) + r.offset(), count);
  }
  mu_.Lock();
  const ClientLayerSync::PieceDone done = client_.EndPiece(r.layer(), r.part(), r.offset(), count);
  slidedp::v1::UploadClientLayerResponse resp;
  if (done.layer_complete) {
    resp.set_layer_complete(true);
    checkpointer_->ClientLayerReady(r.layer(), r.step());
  }
  if (done.all_complete) {
    resp.set_all_complete(true);
    if (client_.sync_step() == r.step()) RequestClientSyncLocked(0);
    spdlog::info("hostd's copy of layers {} is at version {} (uploaded by rank 0)",
                 LayerList(client_.layers()), r.step());
  }
  return resp;
}

absl::StatusOr<slidedp::v1::ReadClientLayerResponse> Engine::ReadClientLayer(
    const slidedp::v1::ReadClientLayerRequest& r) {
  absl::MutexLock lock(&mu_);
  RETURN_IF_ERROR(CheckJob(r.job_id()));
  RETURN_IF_ERROR(ranks_.CheckToken(r.rank(), r.attach_token()));
  RETURN_IF_ERROR(client_.CheckPart(r.layer(), r.part()));
  if (r.count() == 0 || r.count() > kClientLayerChunkElements) {
    return absl::InvalidArgumentError(
        absl::StrCat("count: expected 1..", kClientLayerChunkElements, ", got ", r.count()));
  }
  RETURN_IF_ERROR(client_.CheckRange(r.layer(), r.offset(), r.count()));
  RETURN_IF_ERROR(client_.CheckReadable(r.layer(), seq_.running_step(), seq_.next_step() - 1));
  const float* src = r.part() == 0   ? state_->master(r.layer())
                     : r.part() == 1 ? state_->exp_avg(r.layer())
                                     : state_->exp_avg_sq(r.layer());
  slidedp::v1::ReadClientLayerResponse resp;
  resp.set_version(seq_.next_step() - 1);
  resp.set_data(reinterpret_cast<const char*>(src + r.offset()), r.count() * sizeof(float));
  return resp;
}

absl::StatusOr<slidedp::v1::CheckpointResponse> Engine::Checkpoint(
    const slidedp::v1::CheckpointRequest& r) {
  uint64_t step = 0;
  std::string dir;
  std::string path;
  if (!r.dir().empty()) {
    ASSIGN_OR_RETURN(dir,
                     CheckCheckpointDir(r.dir(), config_.checkpoint.dir, config_.output_roots));
  }
  {
    absl::MutexLock lock(&mu_);
    RETURN_IF_ERROR(CheckJob(r.job_id()));
    if (dir.empty()) dir = config_.checkpoint.dir;
    if (dir.empty()) {
      return absl::FailedPreconditionError(
          "dir: no checkpoint directory: start hostd with --checkpoint.dir DIR (or [checkpoint] "
          "dir in its config), or name one in the request");
    }
    // Version t: the newest step the ranks have begun (queued behind the running one, else the
    // running one; its layers reach t as its updates land, and none can start t + 1 before its
    // capture), else the last completed step's (every layer is at it). The newest, so that each
    // layer can be captured from its update for t until its update for t + 1, a whole step
    // later: a checkpoint of the step before a begun one must capture every layer before that
    // step's updates, and those waited (the H200 stall run: the first step of a checkpoint
    // took twice as long).
    step = seq_.queued_step() != 0    ? seq_.queued_step()
           : seq_.running_step() != 0 ? seq_.running_step()
                                      : seq_.next_step() - 1;
    RETURN_IF_ERROR(StartCheckpointLocked(dir, step));
    spdlog::info("checkpoint of step {} requested into {}", step, dir);
    path = (std::filesystem::path(dir) /
            model::CheckpointDirName(step, {config_.instance, job_->job_id()}))
               .string();
  }
  slidedp::v1::CheckpointResponse resp;
  resp.set_step(step);
  resp.set_path(path);
  if (!r.wait()) return resp;
  ASSIGN_OR_RETURN(const CheckpointResult done, checkpointer_->Wait(step, kCheckpointWaitMs));
  resp.set_path(done.path);
  resp.set_committed(true);
  resp.set_seconds(done.seconds);
  resp.set_bytes(done.bytes);
  return resp;
}

absl::Status Engine::CheckServing() const {
  if (!serving_) return absl::UnavailableError("hostd is shutting down");
  return absl::OkStatus();
}

absl::Status Engine::CheckJob(absl::string_view job_id) const {
  RETURN_IF_ERROR(CheckServing());
  if (!job_ && creating_) {
    return absl::UnavailableError(absl::StrCat(CreationLineLocked(), "; retry once it exists"));
  }
  if (!job_) {
    return absl::FailedPreconditionError(
        "no job exists yet: create one with CreateJob (or start hostd with --model)");
  }
  if (!job_id.empty() && job_id != job_->job_id()) {
    return absl::NotFoundError(absl::StrCat("job_id: unknown job '", model::ShownText(job_id),
                                            "'; this hostd has '", job_->job_id(), "'"));
  }
  return absl::OkStatus();
}

absl::StatusOr<slidedp::v1::HandshakeResponse> Engine::Handshake(
    const slidedp::v1::HandshakeRequest& r) {
  const auto& c = r.client();
  if (c.protocol_version() != kProtocolVersion) {
    return absl::FailedPreconditionError(absl::StrCat(
        "version skew: ", c.component().empty() ? "client" : model::ShownText(c.component()), " ",
        model::ShownText(c.version()), " speaks protocol_version ", c.protocol_version(),
        " but hostd ", kVersion, " speaks protocol_version ", kProtocolVersion,
        "; install matching versions"));
  }
  if (c.shm_abi_version() != 0 && c.shm_abi_version() != kShmAbiVersion) {
    return absl::FailedPreconditionError(absl::StrCat(
        "version skew: ", c.component().empty() ? "client" : model::ShownText(c.component()), " ",
        model::ShownText(c.version()), " uses shm_abi_version ", c.shm_abi_version(), " but hostd ",
        kVersion, " uses shm_abi_version ", kShmAbiVersion, "; install matching versions"));
  }
  slidedp::v1::HandshakeResponse resp;
  *resp.mutable_daemon() = DaemonBuildInfo();
  resp.set_instance(config_.instance);
  return resp;
}

absl::Status Engine::ClaimCreation(const std::string& job_id) {
  absl::MutexLock lock(&mu_);
  return ClaimCreationLocked(job_id);
}

absl::Status Engine::ClaimCreationLocked(const std::string& job_id) {
  RETURN_IF_ERROR(CheckServing());
  if (job_ || creating_) {
    return absl::AlreadyExistsError(absl::StrCat("a job ", job_ ? "exists" : "is being created",
                                                 " ('", job_ ? job_->job_id() : creating_->job_id(),
                                                 "'); this hostd serves one job"));
  }
  creating_.emplace();
  creating_->set_job_id(job_id.empty() ? std::string("default") : job_id);
  creating_->set_phase("checking");
  creation_started_ = SteadyClock::now();
  return absl::OkStatus();
}

bool Engine::NoteCreation(const char* phase, uint64_t done, uint64_t total, const char* unit) {
  std::string line;
  bool go_on = true;
  {
    absl::MutexLock lock(&mu_);
    if (!creating_) return true;
    creating_->set_phase(phase);
    creating_->set_done(done);
    creating_->set_total(total);
    creating_->set_unit(unit);
    go_on = serving_;
    if (creation_progress_) line = CreationLineLocked();
  }
  if (creation_progress_) creation_progress_(line);
  return go_on;
}

std::string Engine::CreationLineLocked() const {
  return RenderCreationLine(
      *creating_, std::chrono::duration<double>(SteadyClock::now() - creation_started_).count());
}

absl::Status Engine::CreateJobUnlocked(slidedp::v1::JobSpec spec, model::LoadedModel model,
                                       const std::string& model_dir,
                                       const model::CheckpointInfo* resume) {
  // This call owns the creation (ClaimCreation); it ends with the call, whatever the outcome.
  absl::Cleanup ended = [this] {
    absl::MutexLock lock(&mu_);
    creating_.reset();
  };
  JobSetupOptions jo;
  jo.instance = config_.instance;
  jo.default_routes = config_.routes;
  jo.numa_node = topology_.nodes.size() > 1 || config_.numa_node >= 0 ? state_node_ : -1;
  jo.mode = instance_lock_->mode();
  jo.group = instance_lock_->group();
  jo.mlock = config_.mlock == "off"           ? MlockPolicy::kOff
             : config_.mlock == "best_effort" ? MlockPolicy::kBestEffort
                                              : MlockPolicy::kRequired;
  jo.init = config_.init;
  jo.on_inconsistent = config_.recovery_on_inconsistent;
  jo.checkpoint_dir = config_.checkpoint.dir;
  jo.grad_ring_slots = kGradRingSlots;
  jo.progress = [this](const char* phase, uint64_t done, uint64_t total, const char* unit) {
    return NoteCreation(phase, done, total, unit);
  };
  // The long part (populating, initializing or importing, restoring: minutes for a large
  // model) runs without mu_: status queries, the watchdog's among them, answer meanwhile.
  ShmJobStateStore store(pool_.get());
  ASSIGN_OR_RETURN(PreparedJob prepared,
                   SetUpJob(jo, std::move(spec), std::move(model), model_dir, resume, store));
  spec = std::move(prepared.spec);
  const slidedp::v1::Routes* routes = &spec.routes();
  std::unique_ptr<TrainingState> state = std::move(prepared.state);
  spdlog::info(
      "job '{}': model {} ({}), {} layers, {} parameters, weights {}, {:.2f} GiB shared memory, "
      "created in {:.2f} s",
      spec.job_id(), state->model().manifest.name(), state->model().source, state->num_layers(),
      state->total_params(), state->weights_source(),
      static_cast<double>(state->shm_bytes()) / (1ull << 30), prepared.create_seconds);
  NoteCreation("starting the update worker", 0, 0, "");
  absl::MutexLock lock(&mu_);
  // Installed even when hostd began stopping meanwhile: Shutdown then treats it like any job
  // (a re-adopted one's final checkpoint, a fresh one's segments removed).
  state_ = std::move(state);
  seq_.Reset(prepared.next_step, prepared.steps_completed);
  start_step_ = prepared.start_step;
  resumed_from_ = prepared.resumed_from;
  std::vector<uint64_t> layer_numel;
  for (const auto& layer : state_->layers()) layer_numel.push_back(layer.numel);
  client_.Reset(std::move(layer_numel), prepared.client_copy_version);
  *spec.mutable_manifest() = state_->model().manifest;
  UpdateWorker::Options wo;
  wo.isa = isa_;
  wo.chunk_elements = std::max<uint64_t>(routes->chunk_bytes() / 2, kernels::kStatsBlock) /
                      kernels::kStatsBlock * kernels::kStatsBlock;
  worker_ = std::make_unique<UpdateWorker>(state_.get(), pool_.get(), wo, spec.optimizer());
  Checkpointer::Options co;
  co.instance = config_.instance;
  co.keep_last = config_.checkpoint.keep_last;
  co.snapshot_pool_bytes = config_.checkpoint.snapshot_pool_bytes;
  co.keep_snapshot_pool = config_.checkpoint.keep_snapshot_pool;
  co.client_upload_timeout_ms =
      static_cast<int64_t>(config_.checkpoint.client_upload_timeout_s) * 1000;
  co.capture_timeout_ms = static_cast<int64_t>(config_.checkpoint.capture_timeout_s) * 1000;
  co.max_write_bytes_per_s = config_.checkpoint.max_write_mb_per_s * 1000000;
  co.direct_io = config_.checkpoint.direct_io;
  if (co.snapshot_pool_bytes == 0) {
    // Auto: room for the whole state when the host has it when the checkpoint starts (then no
    // update waits for the disk), keeping an eighth of MemAvailable (at least 4 GiB) free.
    const uint64_t state_bytes = 3 * sizeof(float) * state_->total_params();
    co.snapshot_pool_at_start = [state_bytes](uint64_t kept) {
      const uint64_t avail = MemAvailableBytes();
      if (avail == 0) return state_bytes;
      // Buffers kept from the last checkpoint are not in MemAvailable, yet they are room.
      const uint64_t reserve = std::max<uint64_t>(uint64_t{4} << 30, avail / 8);
      const uint64_t room = avail + kept > reserve ? avail + kept - reserve : 0;
      const uint64_t pool = std::min(state_bytes, room);
      spdlog::info(
          "checkpoint snapshot pool: {:.2f} GiB (the state: {:.2f} GiB; MemAvailable "
          "{:.2f} GiB){}",
          pool / 1073741824.0, state_bytes / 1073741824.0, avail / 1073741824.0,
          pool < state_bytes ? "; updates may wait for the disk (the stall)" : "");
      return pool;
    };
  }
  checkpointer_ = std::make_unique<Checkpointer>(state_.get(), pool_.get(), co);
  worker_->SetBeforeWriteHook([cp = checkpointer_.get()](uint32_t layer, uint64_t step) {
    cp->BeforeLayerWrite(layer, step);
  });
  worker_->Start();
  GradientReducer::Options ro;
  ro.grad_type = spec.optimizer().grad_dtype() == slidedp::v1::DTYPE_FP32
                     ? kernels::GradType::kFp32
                     : kernels::GradType::kBf16;
  ro.granularity = config_.update_granularity == "layer"   ? GradientReducer::Granularity::kLayer
                   : config_.update_granularity == "chunk" ? GradientReducer::Granularity::kChunk
                                                           : GradientReducer::Granularity::kAuto;
  // grad_route auto: CPU reduction's reducer until the first rank attaches (AttachRank).
  ReducerRoute(routes->grad_route(), spec.world_size(), &ro.route, &ro.pushing_ranks);
  if (routes->grad_route() == slidedp::v1::GRAD_ROUTE_CPU_REDUCTION &&
      ro.granularity == GradientReducer::Granularity::kChunk) {
    spdlog::warn(
        "update_granularity is chunk, but grad_route cpu_reduction sums whole layers on the "
        "host: every layer is updated whole");
  }
  // The reducer calls the worker directly (never under mu_: lock order is engine, then reducer).
  reducer_ = std::make_unique<GradientReducer>(
      state_.get(), pool_.get(), worker_.get(), ro,
      [this](const LayerUpdateResult& r) { OnLayerDone(r); },
      [this](uint64_t step, const std::string& reason) {
        absl::MutexLock lock(&mu_);
        if (seq_.running_step() == step) {
          AbortStepLocked(step, "gradient protocol error: " + reason);
        }
      });
  reducer_->Start();
  ranks_.Reset(spec.world_size());
  route_ = RouteChoice{};
  route_.route = routes->grad_route();
  route_.automatic = route_.route == slidedp::v1::GRAD_ROUTE_AUTO;
  route_.why = route_.automatic ? "" : "set";
  last_grad_norm_.assign(state_->num_layers(), 0.0);
  job_ = std::move(spec);
  return absl::OkStatus();
}

absl::StatusOr<slidedp::v1::CreateJobResponse> Engine::CreateJob(
    const slidedp::v1::CreateJobRequest& r) {
  std::optional<model::CheckpointInfo> resume;
  slidedp::v1::ModelManifest manifest = r.spec().manifest();
  if (!r.resume_path().empty()) {
    if (r.resume_path().front() != '/') {
      return absl::InvalidArgumentError(absl::StrCat(
          "resume_path: expected an absolute path (hostd has its own working directory), got '",
          model::ShownText(r.resume_path(), 1024), "'"));
    }
    auto found = FindLatestCheckpoint(r.resume_path());
    if (!found.ok()) return Annotate(found.status(), "resume_path");
    resume = std::move(*found);
    if (manifest.layers_size() == 0) {
      manifest = resume->spec.manifest();
    } else {
      RETURN_IF_ERROR(Annotate(CheckCheckpointManifest(*resume, manifest), "resume_path"));
    }
  }
  RETURN_IF_ERROR(model::ValidateManifest(manifest));
  {
    absl::MutexLock lock(&mu_);
    RETURN_IF_ERROR(CheckServing());
    // Another CreateJob (another rank of the same training job, usually) first: then this one
    // is the same job's (idempotent) or refused.
    auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !creating_ || !serving_; };
    mu_.Await(absl::Condition(&idle));
    RETURN_IF_ERROR(CheckServing());
    if (job_) {
      const uint64_t want = model::ManifestHash(manifest);
      if (want == state_->manifest_hash() &&
          (r.spec().job_id().empty() || r.spec().job_id() == job_->job_id())) {
        // The same bounds as a new job's: a value out of them is refused, not ignored.
        RETURN_IF_ERROR(model::NormalizeJobSpec(r.spec(), config_.routes).status());
        // Idempotent: the same model is already loaded (e.g. hostd started with --model).
        slidedp::v1::CreateJobResponse resp;
        *resp.mutable_spec() = *job_;
        return resp;
      }
      return absl::AlreadyExistsError(absl::StrCat(
          "a job already exists ('", job_->job_id(), "', manifest ",
          model::ManifestHashHex(state_->manifest_hash()),
          "); this hostd serves one job; requested manifest ", model::ManifestHashHex(want)));
    }
    // Claimed in the same critical section as the checks: a concurrent CreateJob waits above.
    std::string job_id = r.spec().job_id();
    if (job_id.empty() && resume) job_id = resume->job_id;
    RETURN_IF_ERROR(ClaimCreationLocked(job_id));
  }
  model::LoadedModel model;
  model.manifest = manifest;
  model.source = "rpc";
  slidedp::v1::JobSpec spec = r.spec();
  if (resume) {
    model.initializer_range = resume->initializer_range;
    model.config_json = resume->config_json;
    model.source = resume->model_source;
    // The optimizer (and its LR schedule) continue from the checkpoint; the world size is the
    // request's (any may resume).
    *spec.mutable_optimizer() = resume->spec.optimizer();
    if (spec.job_id().empty()) spec.set_job_id(resume->job_id);
    if (spec.seed() == 0) spec.set_seed(resume->spec.seed());
  }
  spec.clear_manifest();
  RETURN_IF_ERROR(CreateJobUnlocked(std::move(spec), std::move(model), /*model_dir=*/"",
                                    resume ? &*resume : nullptr));
  absl::MutexLock lock(&mu_);
  RETURN_IF_ERROR(CheckJob(""));
  slidedp::v1::CreateJobResponse resp;
  *resp.mutable_spec() = *job_;
  return resp;
}

absl::StatusOr<slidedp::v1::AttachRankResponse> Engine::AttachRank(
    const slidedp::v1::AttachRankRequest& r) {
  absl::MutexLock lock(&mu_);
  if (!job_ && !creating_ && serving_) {
    return absl::FailedPreconditionError(
        "attach before the model exists: no job yet; create one with CreateJob first");
  }
  RETURN_IF_ERROR(CheckJob(r.job_id()));
  if (r.rank() >= job_->world_size()) {
    return absl::OutOfRangeError(absl::StrCat("rank: expected 0..", job_->world_size() - 1,
                                              " (world_size ", job_->world_size(), "), got ",
                                              r.rank()));
  }
  const std::string have = model::ManifestHashHex(state_->manifest_hash());
  if (r.manifest_hash() != have) {
    return absl::FailedPreconditionError(
        absl::StrCat("manifest_hash: the rank's model has manifest ",
                     r.manifest_hash().empty() ? "(empty)" : model::ShownText(r.manifest_hash()),
                     " but the job's is ", have, "; the rank must build the same model as hostd"));
  }
  RETURN_IF_ERROR(ranks_.CheckAttachable(r.rank()));
  // grad_route auto: the first rank to attach to the job with none attached chooses the route
  // (applied below, once the attach is known to succeed); the ranks after it join that route.
  std::optional<RouteChoice> chosen;
  if (job_->routes().grad_route() == slidedp::v1::GRAD_ROUTE_AUTO && !ranks_.AnyAttached()) {
    chosen = ChooseGradRoute(slidedp::v1::GRAD_ROUTE_AUTO, job_->world_size(), r.rank(), r.gpu(),
                             static_cast<uint32_t>(topology_.gpus.size()));
  } else if (absl::Status st = CheckRankDevice(route_, r.rank(), r.gpu()); !st.ok()) {
    // Warned, not refused: AttachRankRequest.gpu defaults to 0, so a client that never sets
    // it reads as a GPU rank; the rank library refuses a route it cannot run.
    spdlog::warn("{}", std::string(st.message()));
  }
  ASSIGN_OR_RETURN(std::vector<uint32_t> client_layers,
                   client_.NormalizeSet(std::vector<uint32_t>(r.client_updated_layers().begin(),
                                                              r.client_updated_layers().end())));
  if (!client_layers.empty() && worker_->optimizer().clip() == slidedp::v1::CLIP_POLICY_GLOBAL) {
    return absl::FailedPreconditionError(absl::StrCat(
        "client_updated_layers: the job clips by the global norm (clip = global), which needs "
        "every layer's gradient, but the ranks would update layers ",
        LayerList(client_layers),
        " themselves and hostd never sees their gradients; use clip = per_layer or none, or "
        "let hostd update every layer (python_client: nondecoder=\"host\", resident_layers=0)"));
  }
  RETURN_IF_ERROR(client_.CheckChange(client_layers, r.rank(), ranks_.AnyAttached(),
                                      seq_.running_step(), seq_.next_step() - 1));
  if (client_layers != client_.layers()) {
    client_.SetLayers(std::move(client_layers), seq_.next_step() - 1);
    if (!client_.empty()) {
      spdlog::info("the ranks update layers {} themselves; hostd's copy of them is not updated",
                   LayerList(client_.layers()));
    }
    if (seq_.steps_completed() == 0 && seq_.next_step() == 1) {
      // A fresh job: the moments of layers hostd will not update are zeros and stay so; their
      // memory goes back to the system (the ranks hold those layers' moments).
      size_t released = 0;
      for (uint32_t l : client_.layers()) {
        absl::StatusOr<size_t> n = state_->ReleaseMoments(l);
        if (!n.ok()) {
          spdlog::warn("keeping the moments of layer {}: {}", l, n.status().ToString());
          continue;
        }
        released += *n;
      }
      if (released > 0) {
        spdlog::info("released {:.2f} GiB of Adam moments of the ranks' layers",
                     released / 1073741824.0);
      }
    }
  }
  if (chosen && chosen->route != route_.route) {
    GradientReducer::Route rr;
    std::vector<uint32_t> pushing;
    ReducerRoute(chosen->route, job_->world_size(), &rr, &pushing);
    if (absl::Status st = reducer_->SetRoute(rr, std::move(pushing)); !st.ok()) {
      return absl::UnavailableError(
          absl::StrCat("grad_route auto: cannot switch the route now (", st.message(),
                       "); attach again once the aborted step has drained"));
    }
    spdlog::info("grad_route auto: {} ({})", DescribeRouteChoice(*chosen),
                 slidedp::v1::GradRoute_Name(chosen->route));
  }
  if (chosen) route_ = *std::move(chosen);
  const std::string& token =
      ranks_.Attach(r.rank(), r.pid(), r.hostname(), r.gpu(), SteadyClock::now());
  shm::RankSlot& slot = state_->rank_slot(r.rank());
  shm::Atomic(slot.pid).store(static_cast<uint64_t>(r.pid()));
  shm::Atomic(slot.heartbeat_ns).store(MonotonicNs());
  shm::Atomic(slot.attached).store(1, std::memory_order_release);

  slidedp::v1::AttachRankResponse resp;
  resp.set_attach_token(token);
  resp.set_next_step(seq_.next_step());
  resp.set_client_layers_current(!client_.empty() && ClientCopyCurrentLocked());
  slidedp::v1::Layout* layout = resp.mutable_layout();
  layout->set_chunk_bytes(job_->routes().chunk_bytes());
  layout->set_manifest_hash(have);
  layout->set_world_size(job_->world_size());
  layout->set_grad_ring_slots(state_->grad_ring_slots());
  layout->set_grad_dtype(job_->optimizer().grad_dtype());
  layout->set_grad_route(route_.route);
  layout->set_grad_pushing_rank(kGradPushingRank);  // GPU reduction only; RS: every rank pushes
  for (uint32_t l : client_.layers()) layout->add_client_updated_layers(l);
  for (const auto& seg : state_->segments()) {
    if (seg.kind == shm::SegmentKind::kState) continue;  // hostd only
    auto* s = layout->add_segments();
    s->set_name(seg.name);
    s->set_kind(static_cast<slidedp::v1::SegmentKind>(seg.kind));
    s->set_size_bytes(seg.size_bytes);
    s->set_numa_node(seg.numa_node);
  }
  for (const LayerInfo& info : state_->layers()) {
    auto* l = layout->add_layers();
    l->set_layer(info.index);
    l->set_name(info.name);
    l->set_kind(static_cast<slidedp::v1::LayerKind>(info.kind));
    l->set_numel(info.numel);
    l->set_param_offset_bytes(info.param_offset);
    l->set_param_bytes(info.param_bytes);
    l->set_control_offset_bytes(shm::kLayerControlOffset + info.index * sizeof(shm::LayerControl));
    const auto& spec_layer = state_->model().manifest.layers(static_cast<int>(info.index));
    for (size_t t = 0; t < info.tensors.size(); ++t) {
      auto* tl = l->add_tensors();
      tl->set_name(info.tensors[t].name);
      tl->set_offset_elements(info.tensors[t].offset);
      tl->set_numel(info.tensors[t].numel);
      *tl->mutable_shape() = spec_layer.tensors(static_cast<int>(t)).shape();
      tl->set_no_decay(info.tensors[t].no_decay);
    }
  }
  spdlog::info("rank {} attached (pid {}, host {}, gpu {})", r.rank(), r.pid(), r.hostname(),
               r.gpu());
  return resp;
}

absl::Status Engine::DetachRank(const slidedp::v1::DetachRankRequest& r) {
  absl::MutexLock lock(&mu_);
  RETURN_IF_ERROR(CheckJob(r.job_id()));
  RETURN_IF_ERROR(ranks_.CheckToken(r.rank(), r.attach_token()));
  if (seq_.running_step() != 0 && !AllLayersAt(*state_, seq_.running_step(), client_.updated())) {
    AbortStepLocked(seq_.running_step(), absl::StrCat("rank ", r.rank(), " detached"));
  } else if (seq_.queued_step() != 0) {
    DropQueuedStepLocked(absl::StrCat("rank ", r.rank(), " detached"));
  }
  ReleaseRankLocked(r.rank());
  return absl::OkStatus();
}

void Engine::ReleaseRankLocked(uint32_t rank) {
  ranks_.Release(rank);
  shm::Atomic(state_->rank_slot(rank).attached).store(0, std::memory_order_release);
}

absl::StatusOr<slidedp::v1::BeginStepResponse> Engine::BeginStep(
    const slidedp::v1::BeginStepRequest& r, absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  // An export holds the steps that have not started: a BeginStep that would start one waits
  // (bounded), then everything is checked again.
  deadline = std::min(deadline, absl::Now() + kExportHoldMax);
  for (;;) {
    RETURN_IF_ERROR(CheckJob(r.job_id()));
    RETURN_IF_ERROR(ranks_.CheckToken(r.rank(), r.attach_token()));
    RETURN_IF_ERROR(AwaitSealsLocked());
    RETURN_IF_ERROR(CheckNotTornLocked());
    RETURN_IF_ERROR(
        seq_.CheckNotAbortedBeforeBegun(r.rank(), ranks_.rank(r.rank()).last_step, r.step()));
    if (seq_.WouldStart(r.step()) && export_active_) {
      auto done = [this]()
                      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !export_active_ || !serving_; };
      if (!mu_.AwaitWithDeadline(absl::Condition(&done), deadline)) {
        return absl::UnavailableError(absl::StrCat(
            "step: ", r.step(), " cannot start while an HF export holds the steps; retry"));
      }
      continue;
    }
    break;
  }
  // A queued step starts the moment its predecessor completes (OnLayerDone).
  const uint64_t queued_before = seq_.queued_step();
  ASSIGN_OR_RETURN(const StepSequencer::BeginAction action, seq_.Begin(r.step()));
  ranks_.NoteBegun(r.rank(), r.step());
  shm::Atomic(state_->rank_slot(r.rank()).step).store(r.step());
  if (action == StepSequencer::BeginAction::kQueue && queued_before == 0) {
    spdlog::debug("step {} queued behind step {}", r.step(), seq_.running_step());
  } else if (action == StepSequencer::BeginAction::kStart) {
    StartStepLocked(r.step());
  }
  slidedp::v1::BeginStepResponse resp;
  resp.set_step(r.step());
  return resp;
}

void Engine::StartStepLocked(uint64_t step) {
  seq_.Start(step, SteadyClock::now());
  step_update_seconds_ = 0;
  step_layers_.clear();
  reducer_->Arm(step);
  shm::Atomic(state_->control().step_state)
      .store(static_cast<uint64_t>(shm::StepState::kRunning), std::memory_order_release);
  const uint64_t every = config_.checkpoint.every_steps;
  // (A checkpoint of this very step may be in flight already: asked for while it was queued.)
  if (every > 0 && step % every == 0 &&
      (checkpointer_ == nullptr || checkpointer_->in_flight_step() != step)) {
    // The checkpoint of version `step` starts with the step: each layer is captured after its
    // update for this step, while the rest of the step and the next forward run, instead of
    // all of them before the next step's updates.
    absl::Status cs = StartCheckpointLocked(config_.checkpoint.dir, step);
    if (!cs.ok()) {
      spdlog::warn("checkpoint of step {} skipped: {}", step, std::string(cs.message()));
    }
  }
  slidedp::v1::SessionEvent ev;
  ev.mutable_step_begun()->set_step(step);
  ranks_.Broadcast(ev);
}

void Engine::BumpAbortEpochLocked() {
  shm::ControlBlock& cb = state_->control();
  shm::Atomic(cb.abort_epoch).fetch_add(1, std::memory_order_acq_rel);
  shm::Atomic(cb.wake_seq).fetch_add(1, std::memory_order_acq_rel);
  shm::Doorbell(&cb.wake_seq).WakeAll();
  // Ranks blocked on a version gate wake up and see the new abort_epoch.
  for (uint32_t l = 0; l < state_->num_layers(); ++l) {
    shm::Atomic(state_->layer_control(l).wake_seq).fetch_add(1, std::memory_order_acq_rel);
    shm::Doorbell(&state_->layer_control(l).wake_seq).WakeAll();
  }
}

void Engine::DropQueuedStepLocked(absl::string_view reason, bool bump_epoch) {
  const uint64_t step = seq_.DropQueued(model::ShownText(reason, 256));
  if (step == 0) return;
  spdlog::warn("dropping queued step {}: {}", step, std::string(reason));
  // The step's ranks may be anywhere in it; only the abort epoch reaches all of them. Nothing of
  // the running step is disturbed: its pushers are done (the callers make sure of that).
  if (bump_epoch) {
    // Every layer of the running step is published (the callers checked), though OnLayerDone may
    // not have counted the last one yet: mark it completed before the epoch moves, or a rank's
    // WaitStep of it would take this drop for an abort of it.
    MarkCompletedLocked(seq_.running_step());
    BumpAbortEpochLocked();
  }
  reducer_->DiscardStep(step);
  slidedp::v1::SessionEvent ev;
  ev.mutable_step_aborted()->set_step(step);
  ev.mutable_step_aborted()->set_reason(std::string(reason));
  ranks_.Broadcast(ev);
}

void Engine::MarkCompletedLocked(uint64_t step) {
  uint64_t& completed = state_->control().completed_step;
  if (step > shm::Atomic(completed).load(std::memory_order_relaxed)) {
    shm::Atomic(completed).store(step, std::memory_order_release);
  }
}

void Engine::AbortStepLocked(uint64_t step, absl::string_view reason) {
  spdlog::warn("aborting step {}: {}", step, std::string(reason));
  seq_.Abort(step, model::ShownText(reason, 256));
  shm::ControlBlock& cb = state_->control();
  shm::Atomic(cb.step_state).store(static_cast<uint64_t>(shm::StepState::kAborting));
  BumpAbortEpochLocked();
  reducer_->Abort(step);
  // The queued step goes with it (the same epoch bump tells its ranks); it is the next step.
  DropQueuedStepLocked(absl::StrCat("queued behind step ", step, ", which was aborted: ", reason),
                       /*bump_epoch=*/false);
  worker_->AbortStep(step, [this, step] {
    // On the worker thread, after every update of the step has finished or been dropped: the
    // versions are final, so this is where a torn layer becomes known.
    const std::vector<uint32_t> torn = worker_->TornLayers();
    absl::MutexLock lock(&mu_);
    if (seq_.Sealed(torn)) {
      spdlog::error("step {} was aborted in the middle of a chunk-granular update: {}", step,
                    TornMessageLocked());
      checkpointer_->Cancel("the state is torn");
    }
    shm::ControlBlock& c = state_->control();
    shm::Atomic(c.next_step).store(step + 1, std::memory_order_release);
    shm::Atomic(c.step_state).store(static_cast<uint64_t>(shm::StepState::kIdle));
  });
  slidedp::v1::SessionEvent ev;
  ev.mutable_step_aborted()->set_step(step);
  ev.mutable_step_aborted()->set_reason(std::string(reason));
  ranks_.Broadcast(ev);
}

std::string Engine::DescribeTornLayerLocked(uint32_t layer) const {
  shm::LayerControl& lc = state_->layer_control(layer);
  return absl::StrCat("layer ", layer, " '", state_->layers()[layer].name, "' (committed_version ",
                      shm::Atomic(lc.committed_version).load(), ", pending_version ",
                      shm::Atomic(lc.pending_version).load(), ")");
}

std::string Engine::TornMessageLocked() const {
  return seq_.TornMessage([this](uint32_t layer) ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    return DescribeTornLayerLocked(layer);
  });
}

absl::Status Engine::CheckNotTornLocked() const {
  return seq_.CheckNotTorn([this](uint32_t layer) ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    return DescribeTornLayerLocked(layer);
  });
}

absl::Status Engine::AwaitSealsLocked() {
  // An aborted step's versions are final only once the worker has sealed it; until then a new
  // step's updates would find layers below the version they expect, and a torn layer would not
  // be known yet. The seal waits at most for the one update in progress.
  auto sealed = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return seq_.seals_pending() == 0 || !serving_;
  };
  mu_.AwaitWithTimeout(absl::Condition(&sealed), absl::Seconds(60));
  RETURN_IF_ERROR(CheckServing());
  if (seq_.seals_pending() != 0) {
    return absl::UnavailableError(
        "the aborted step's updates have not finished within 60 s; retry BeginStep");
  }
  return absl::OkStatus();
}

absl::Status Engine::AbortStep(const slidedp::v1::AbortStepRequest& r) {
  absl::MutexLock lock(&mu_);
  RETURN_IF_ERROR(CheckJob(r.job_id()));
  if (seq_.queued_step() != 0 && r.step() == seq_.queued_step()) {
    // The abort epoch is job-wide: bumped while the running step's gradients still arrive, it
    // would fail that step's pushes too.
    if (!AllLayersAt(*state_, seq_.running_step(), client_.updated())) {
      return absl::FailedPreconditionError(
          absl::StrCat("step: ", r.step(), " is queued behind step ", seq_.running_step(),
                       ", whose gradients are still arriving; abort step ", seq_.running_step(),
                       " (which drops ", r.step(), " with it) or retry once step ",
                       seq_.running_step(), "'s updates are published"));
    }
    DropQueuedStepLocked(r.reason().empty() ? "aborted by request" : r.reason());
    return absl::OkStatus();
  }
  if (seq_.running_step() == 0 || r.step() != seq_.running_step()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "step: ", r.step(), " is not running",
        seq_.running_step() != 0 ? absl::StrCat(" (running: ", seq_.running_step(), ")")
                                 : std::string(" (no step is running)")));
  }
  AbortStepLocked(r.step(), r.reason().empty() ? "aborted by request" : r.reason());
  return absl::OkStatus();
}

void Engine::OnLayerDone(const LayerUpdateResult& r) {
  if (r.aborted) return;
  absl::MutexLock lock(&mu_);
  if (r.layer < last_grad_norm_.size()) last_grad_norm_[r.layer] = r.grad_norm;
  if (r.step != seq_.running_step()) return;
  if (client_.is_client(r.layer)) {
    spdlog::warn(
        "layer {} is updated by the ranks (client_updated_layers) but got a gradient in "
        "step {}; not counted",
        r.layer, r.step);
    return;
  }
  step_update_seconds_ += r.seconds;
  step_layers_.push_back(r);
  if (r.applied) param_bytes_published_ += state_->layers()[r.layer].param_bytes;
  if (seq_.NoteLayerDone(static_cast<uint32_t>(state_->num_layers() - client_.layers().size()))) {
    const uint64_t step = seq_.Complete(SteadyClock::now());
    for (uint32_t l : client_.layers()) {
      if (state_->committed_version(l) < step) state_->PublishLayer(l, step);
    }
    if (!pool_prepare_asked_ && !config_.checkpoint.dir.empty() &&
        config_.checkpoint.prepare_snapshot_pool && config_.checkpoint.keep_snapshot_pool) {
      // The ranks have attached and run a step (their own memory is allocated): the next
      // checkpoint's pool can be set up now, off the step path.
      pool_prepare_asked_ = true;
      checkpointer_->PreparePool();
    }
    MarkCompletedLocked(step);
    last_step_update_seconds_ = step_update_seconds_;
    last_step_layers_ = std::move(step_layers_);
    step_layers_.clear();
    shm::ControlBlock& cb = state_->control();
    shm::Atomic(cb.next_step).store(seq_.next_step(), std::memory_order_release);
    shm::Atomic(cb.step_state).store(static_cast<uint64_t>(shm::StepState::kIdle));
    ReconcileClientSyncLocked();
    // A queued step starts the moment its predecessor completes: its ranks are already in it
    // (unless an export holds it: ExportHF starts it when done).
    if (seq_.queued_step() != 0 && !export_active_) StartStepLocked(seq_.TakeQueued());
  }
}

absl::Status Engine::SubmitGradient(uint32_t layer, uint64_t step, GradientRef grad,
                                    UpdateWorker::DoneFn done) {
  {
    absl::MutexLock lock(&mu_);
    RETURN_IF_ERROR(CheckJob(""));
    RETURN_IF_ERROR(CheckNotTornLocked());
    if (seq_.WouldStart(step) && export_active_) {
      return absl::UnavailableError("step: an HF export is in progress; retry once it is done");
    }
    if (seq_.WouldStart(step)) {
      seq_.Start(step, SteadyClock::now());
      step_update_seconds_ = 0;
      step_layers_.clear();
    }
    if (step != seq_.running_step()) {
      return absl::OutOfRangeError(
          absl::StrCat("step: expected ", seq_.current_step(), ", got ", step));
    }
  }
  return worker_->Submit(layer, step, grad, [this, done](const LayerUpdateResult& r) {
    OnLayerDone(r);
    if (done) done(r);
  });
}

absl::Status Engine::WaitLayerVersion(uint32_t layer, uint64_t version, milliseconds timeout) {
  if (!state_ || layer >= state_->num_layers()) {
    return absl::NotFoundError(absl::StrCat("layer: ", layer, " does not exist"));
  }
  const auto deadline = SteadyClock::now() + timeout;
  const shm::Doorbell bell(&state_->layer_control(layer).wake_seq);
  for (;;) {
    const uint32_t seen = bell.Load();
    if (state_->committed_version(layer) >= version) return absl::OkStatus();
    const auto now = SteadyClock::now();
    if (now >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat("layer ", layer, " did not reach version ",
                                                      version, " (at ",
                                                      state_->committed_version(layer), ")"));
    }
    bell.Wait(seen, deadline - now);
  }
}

absl::Status Engine::PublishCommId(const slidedp::v1::PublishCommIdRequest& r) {
  absl::MutexLock lock(&mu_);
  RETURN_IF_ERROR(CheckJob(r.job_id()));
  RETURN_IF_ERROR(ranks_.CheckToken(r.rank(), r.attach_token()));
  if (r.rank() != 0) {
    return absl::PermissionDeniedError(
        absl::StrCat("rank: only rank 0 publishes the communicator id, got rank ", r.rank()));
  }
  if (r.unique_id().empty() || r.unique_id().size() > 4096) {
    return absl::InvalidArgumentError(absl::StrCat(
        "unique_id: expected 1..4096 bytes (128 for NCCL), got ", r.unique_id().size()));
  }
  if (r.generation() == 0) {
    return absl::InvalidArgumentError("generation: expected >= 1, got 0");
  }
  return ranks_.PublishCommId(r.generation(), r.unique_id());
}

absl::StatusOr<slidedp::v1::FetchCommIdResponse> Engine::FetchCommId(
    const slidedp::v1::FetchCommIdRequest& r, absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  RETURN_IF_ERROR(CheckJob(r.job_id()));
  RETURN_IF_ERROR(ranks_.CheckToken(r.rank(), r.attach_token()));
  if (r.generation() == 0) {
    return absl::InvalidArgumentError("generation: expected >= 1, got 0");
  }
  const uint64_t gen = r.generation();
  const uint64_t wait_ms = std::min<uint64_t>(r.wait_ms(), 600000);
  const std::string token = ranks_.rank(r.rank()).token;
  auto ready = [this, gen, &r, &token]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return !serving_ || ranks_.FindCommId(gen) != nullptr || ranks_.rank(r.rank()).token != token;
  };
  mu_.AwaitWithDeadline(
      absl::Condition(&ready),
      std::min(deadline, absl::Now() + absl::Milliseconds(static_cast<int64_t>(wait_ms))));
  RETURN_IF_ERROR(CheckServing());
  RETURN_IF_ERROR(ranks_.CheckToken(r.rank(), r.attach_token()));
  const std::string* id = ranks_.FindCommId(gen);
  if (id == nullptr) {
    return absl::DeadlineExceededError(
        absl::StrCat("rank 0 has not published the communicator id of generation ", gen, " within ",
                     wait_ms, " ms", ranks_.rank(0).attached ? "" : " (rank 0 is not attached)"));
  }
  slidedp::v1::FetchCommIdResponse resp;
  resp.set_unique_id(*id);
  return resp;
}

std::vector<slidedp::v1::LayerStatus> Engine::LayerStatuses() const {
  std::vector<slidedp::v1::LayerStatus> out;
  if (!state_) return out;
  for (const LayerInfo& info : state_->layers()) {
    LayerSnapshot s;
    s.index = info.index;
    s.name = info.name;
    s.kind = static_cast<uint32_t>(info.kind);
    s.numel = info.numel;
    s.version = state_->committed_version(info.index);
    s.state_stride = info.state_stride;
    s.param_bytes = info.param_bytes;
    s.numa_node = state_->numa_node() >= 0 ? state_->numa_node() : state_node_;
    s.skipped_steps = shm::Atomic(state_->layer_control(info.index).skipped_steps).load();
    s.last_grad_norm = last_grad_norm_.empty() ? 0 : last_grad_norm_[info.index];
    out.push_back(RenderLayer(s));
  }
  return out;
}

absl::StatusOr<slidedp::v1::GetStatusResponse> Engine::GetStatus() {
  absl::MutexLock lock(&mu_);
  slidedp::v1::GetStatusResponse resp;
  *resp.mutable_daemon() = DaemonBuildInfo();
  resp.set_instance(config_.instance);
  resp.set_socket(config_.socket);
  resp.set_uptime_ms(static_cast<uint64_t>(
      std::chrono::duration_cast<milliseconds>(SteadyClock::now() - started_).count()));
  auto* topo = resp.mutable_topology();
  topo->set_numa_nodes(static_cast<int32_t>(topology_.nodes.size()));
  topo->set_cores(topology_.cores);
  topo->set_state_numa_node(state_node_);
  for (int cpu : worker_cpus_) topo->add_worker_cpus(cpu);
  for (const GpuTopology& g : topology_.gpus) {
    auto* gi = topo->add_gpus();
    gi->set_pci_bus_id(g.pci_bus_id);
    gi->set_name(g.name);
    gi->set_numa_node(g.numa_node);
  }
  if (creating_) {
    *resp.mutable_creating() = *creating_;
    resp.mutable_creating()->set_elapsed_s(
        std::chrono::duration<double>(SteadyClock::now() - creation_started_).count());
  }
  if (!job_) return resp;
  JobSnapshot job;
  job.spec = *job_;
  job.grad_route = route_.route;
  job.grad_route_choice = DescribeRouteChoice(route_);
  job.optimizer = worker_->optimizer();
  job.model_name = state_->model().manifest.name();
  job.family = state_->model().manifest.family();
  job.steps_completed = seq_.steps_completed();
  job.next_step = seq_.next_step();
  job.step_state = seq_.state();
  job.total_params = state_->total_params();
  job.manifest_hash = model::ManifestHashHex(state_->manifest_hash());
  job.weights_source = state_->weights_source();
  job.resumed_from = resumed_from_;
  job.client_updated_layers = client_.layers();
  job.checkpoint_dir = config_.checkpoint.dir;
  job.last_checkpoint = checkpointer_->last_committed();
  job.last_checkpoint_unix_ms = checkpointer_->last_committed_unix_ms();
  job.checkpoint_in_flight_step = checkpointer_->in_flight_step();
  job.now_unix_ms = UnixMs();
  *resp.mutable_job() = RenderJob(job);
  for (auto& l : LayerStatuses()) *resp.add_layers() = std::move(l);
  for (auto& r : ranks_.Statuses(SteadyClock::now())) *resp.add_ranks() = std::move(r);
  for (const auto& seg : state_->segments()) {
    auto* s = resp.add_segments();
    s->set_name(seg.name);
    s->set_kind(static_cast<slidedp::v1::SegmentKind>(seg.kind));
    s->set_size_bytes(seg.size_bytes);
    s->set_numa_node(seg.numa_node);
  }
  resp.set_shm_bytes(state_->shm_bytes());
  resp.set_locked_bytes(state_->locked_bytes());
  return resp;
}

absl::StatusOr<std::string> Engine::StatusLine(absl::Duration max_wait) {
  const absl::Time deadline = absl::Now() + max_wait;
  while (!mu_.TryLock()) {
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat("the engine's lock was held for more than ",
                                                      absl::FormatDuration(max_wait)));
    }
    absl::SleepFor(absl::Milliseconds(5));
  }
  StatusLineSnapshot snap;
  if (creating_) {
    snap.creating = *creating_;
    snap.creation_elapsed_s =
        std::chrono::duration<double>(SteadyClock::now() - creation_started_).count();
  }
  if (job_) {
    snap.has_job = true;
    snap.job_id = job_->job_id();
    snap.model_name = state_->model().manifest.name();
    snap.steps_completed = seq_.steps_completed();
    snap.step_state = seq_.state();
    snap.ranks_attached = ranks_.NumAttached();
    snap.world_size = job_->world_size();
  }
  const std::string line = RenderStatusLine(snap);
  mu_.Unlock();
  return line;
}

absl::StatusOr<slidedp::v1::ListLayersResponse> Engine::ListLayers(
    const slidedp::v1::ListLayersRequest& r) {
  slidedp::v1::ListLayersResponse resp;
  TrainingState* state = nullptr;
  {
    absl::MutexLock lock(&mu_);
    RETURN_IF_ERROR(CheckJob(r.job_id()));
    for (auto& l : LayerStatuses()) *resp.add_layers() = std::move(l);
    state = state_.get();  // set once, destroyed with the engine
  }
  // A pass over the whole state (GBs): never under mu_, which every step's bookkeeping and
  // status query takes. Checksums of layers that train meanwhile are of whatever they hold.
  if (r.checksums()) {
    for (auto& l : *resp.mutable_layers()) {
      l.set_checksum(absl::StrFormat("%016x", state->LayerChecksum(l.layer())));
    }
  }
  return resp;
}

absl::StatusOr<slidedp::v1::ListRanksResponse> Engine::ListRanks(
    const slidedp::v1::ListRanksRequest& r) {
  absl::MutexLock lock(&mu_);
  RETURN_IF_ERROR(CheckJob(r.job_id()));
  slidedp::v1::ListRanksResponse resp;
  for (auto& s : ranks_.Statuses(SteadyClock::now())) *resp.add_ranks() = std::move(s);
  return resp;
}

absl::StatusOr<slidedp::v1::GetStatsResponse> Engine::GetStats(
    const slidedp::v1::GetStatsRequest& r) {
  absl::MutexLock lock(&mu_);
  RETURN_IF_ERROR(CheckJob(r.job_id()));
  StatsSnapshot snap;
  snap.worker = worker_->stats();
  snap.checkpoint = checkpointer_->stats();
  snap.steps_completed = seq_.steps_completed();
  snap.steps_aborted = seq_.steps_aborted();
  snap.step_running = seq_.running_step();
  snap.last_step = seq_.last_completed_step();
  snap.last_step_seconds = seq_.last_step_seconds();
  snap.step_seconds_sum = seq_.step_seconds_sum();
  snap.step_seconds_bounds.assign(StepSequencer::kStepSecondsBounds.begin(),
                                  StepSequencer::kStepSecondsBounds.end());
  for (uint64_t n : seq_.step_seconds_buckets()) snap.step_seconds_buckets.push_back(n);
  snap.last_step_update_seconds = last_step_update_seconds_;
  snap.last_step_layers = last_step_layers_;
  snap.total_params = state_->total_params();
  snap.fp32_grads = job_->optimizer().grad_dtype() == slidedp::v1::DTYPE_FP32;
  snap.isa = std::string(kernels::IsaName(isa_));
  snap.update_threads = static_cast<int32_t>(worker_cpus_.size());
  snap.grad_bytes_received = reducer_->stats().bytes_reduced;
  snap.param_bytes_published = param_bytes_published_;
  snap.exports_completed = exports_completed_;
  snap.last_checkpoint_step = checkpointer_->last_committed().step;
  snap.last_checkpoint_unix_ms = checkpointer_->last_committed_unix_ms();
  snap.now_unix_ms = UnixMs();
  return RenderStats(snap);
}

slidedp::v1::GetConfigResponse Engine::GetConfig() const {
  slidedp::v1::GetConfigResponse resp;
  for (const ConfigEntry& e : entries_) {
    auto* out = resp.add_entries();
    out->set_key(e.key);
    out->set_value(e.value);
    out->set_source(e.source);
  }
  resp.set_toml(ConfigToToml(entries_));
  return resp;
}

absl::StatusOr<slidedp::v1::UpdateHyperParamsResponse> Engine::UpdateHyperParams(
    const slidedp::v1::UpdateHyperParamsRequest& r) {
  absl::MutexLock lock(&mu_);
  RETURN_IF_ERROR(CheckJob(r.job_id()));
  ASSIGN_OR_RETURN(const slidedp::v1::OptimizerConfig next,
                   model::ApplyHyperParams(worker_->optimizer(), r.optimizer(), r.fields()));
  if (next.clip() == slidedp::v1::CLIP_POLICY_GLOBAL && !client_.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "clip: global needs every layer's gradient, but the ranks update layers ",
        LayerList(client_.layers()),
        " themselves (client_updated_layers) and hostd never sees their gradients; keep "
        "per_layer or none for this job"));
  }
  worker_->SetOptimizer(next);
  *job_->mutable_optimizer() = next;
  slidedp::v1::SessionEvent ev;
  *ev.mutable_hyper_params_changed()->mutable_optimizer() = next;
  ranks_.Broadcast(ev);
  slidedp::v1::UpdateHyperParamsResponse resp;
  *resp.mutable_optimizer() = next;
  return resp;
}

absl::StatusOr<slidedp::v1::SessionOpened> Engine::OpenSession(
    const slidedp::v1::SessionOpen& open) {
  absl::MutexLock lock(&mu_);
  RETURN_IF_ERROR(CheckJob(open.job_id()));
  RETURN_IF_ERROR(ranks_.OpenSession(open.rank(), open.attach_token(), SteadyClock::now()));
  slidedp::v1::SessionOpened opened;
  opened.set_heartbeat_interval_ms(config_.heartbeat_interval_ms);
  opened.set_heartbeat_deadline_ms(config_.heartbeat_deadline_ms);
  return opened;
}

void Engine::SessionHeartbeat(uint32_t rank, const std::string& token,
                              const slidedp::v1::Heartbeat& hb) {
  absl::MutexLock lock(&mu_);
  if (!ranks_.Heartbeat(rank, token, SteadyClock::now())) return;
  shm::Atomic(state_->rank_slot(rank).heartbeat_ns).store(MonotonicNs());
  shm::Atomic(state_->rank_slot(rank).layer).store(hb.layer());
}

void Engine::SessionClosed(uint32_t rank, const std::string& token, absl::string_view reason) {
  absl::MutexLock lock(&mu_);
  // The stream of an attachment that already ended (the rank detached, or re-attached with a new
  // token) closing late must not end the attachment that replaced it.
  if (!ranks_.IsAttachment(rank, token)) return;
  spdlog::warn("rank {} session closed: {}", rank, std::string(reason));
  if (seq_.running_step() != 0 && serving_ &&
      !AllLayersAt(*state_, seq_.running_step(), client_.updated())) {
    AbortStepLocked(seq_.running_step(), absl::StrCat("rank ", rank, " lost: ", reason));
  } else if (seq_.queued_step() != 0 && serving_) {
    DropQueuedStepLocked(absl::StrCat("rank ", rank, " lost: ", reason));
  }
  ReleaseRankLocked(rank);
}

std::optional<slidedp::v1::SessionEvent> Engine::NextSessionEvent(uint32_t rank,
                                                                  const std::string& token,
                                                                  milliseconds timeout) {
  absl::MutexLock lock(&mu_);
  auto ready = [this, rank, &token]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return ranks_.EventReadyOrGone(rank, token);
  };
  mu_.AwaitWithTimeout(absl::Condition(&ready), absl::Milliseconds(timeout.count()));
  return ranks_.PopEvent(rank, token);
}

bool Engine::SessionActive(uint32_t rank, const std::string& token) const {
  absl::MutexLock lock(&mu_);
  return serving_ && ranks_.SessionOpen(rank, token);
}

absl::StatusOr<slidedp::v1::ExportHFResponse> Engine::ExportHF(
    const slidedp::v1::ExportHFRequest& r) {
  HfExportOptions o;
  switch (r.dtype()) {
    case slidedp::v1::DTYPE_UNSPECIFIED:
    case slidedp::v1::DTYPE_BF16:
      o.dtype = ExportDtype::kBf16;
      break;
    case slidedp::v1::DTYPE_FP32:
      o.dtype = ExportDtype::kFp32;
      break;
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          "dtype: expected DTYPE_BF16 or DTYPE_FP32, got ", static_cast<int>(r.dtype())));
  }
  o.max_shard_bytes = r.max_shard_bytes();
  o.overwrite = r.overwrite();
  o.isa = isa_;
  o.cancelled = [this] { return stopping_.load(); };
  // Fast checks before waiting for a step boundary.
  ASSIGN_OR_RETURN(const std::string out_dir, CheckExportOutDir(r.out_dir(), config_.output_roots));
  ASSIGN_OR_RETURN(o.out_dir, CheckExportDestination(out_dir, r.overwrite()));
  uint64_t version = 0;
  {
    absl::MutexLock lock(&mu_);
    RETURN_IF_ERROR(CheckJob(r.job_id()));
    if (export_active_) {
      return absl::FailedPreconditionError("another HF export is running; retry once it is done");
    }
    o.config_json = !r.config_json().empty() ? r.config_json() : state_->model().config_json;
    o.job_id = job_->job_id();
    RETURN_IF_ERROR(ExportConfigJson(o.config_json, state_->model().manifest, o.dtype).status());
    export_active_ = true;
    auto boundary = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return (seq_.running_step() == 0 && seq_.seals_pending() == 0) || !serving_;
    };
    absl::Status ready = absl::OkStatus();
    if (!mu_.AwaitWithTimeout(absl::Condition(&boundary), absl::Minutes(10))) {
      ready = absl::DeadlineExceededError(
          absl::StrCat("step ", seq_.running_step(),
                       " did not complete within 10 minutes; the export waits for a "
                       "step boundary"));
    }
    if (ready.ok()) ready = CheckServing();
    if (ready.ok()) ready = CheckNotTornLocked();
    if (ready.ok() && !ClientCopyCurrentLocked()) {
      std::vector<std::string> names;
      for (uint32_t l : client_.layers()) {
        names.push_back(absl::StrCat(l, " '", state_->layers()[l].name, "'"));
      }
      ready = absl::FailedPreconditionError(absl::StrCat(
          "layers ", absl::StrJoin(names, ", "),
          " are updated by the ranks (client_updated_layers) and hostd's copy of them is ",
          client_.DescribeCopy(), ", not ", seq_.next_step() - 1,
          ", so an export would mix versions; it is current after rank 0 uploads it (python_client "
          "does when it closes) and in a job resumed from a checkpoint (hostd --resume DIR); or "
          "export from the training job (save_pretrained)"));
    }
    version = seq_.next_step() - 1;
    if (ready.ok()) {
      for (uint32_t l = 0; l < state_->num_layers(); ++l) {
        if (state_->committed_version(l) != version) {
          ready = absl::InternalError(absl::StrCat("layer ", l, " is at version ",
                                                   state_->committed_version(l), ", expected ",
                                                   version, " at the step boundary"));
          break;
        }
      }
    }
    if (!ready.ok()) {
      export_active_ = false;
      return ready;
    }
  }
  spdlog::info("exporting version {} as HF {} to {}", version,
               o.dtype == ExportDtype::kFp32 ? "fp32" : "bf16", o.out_dir);
  absl::StatusOr<HfExportResult> done = ExportHf(*state_, o, pool_.get());
  {
    absl::MutexLock lock(&mu_);
    export_active_ = false;
    if (done.ok()) exports_completed_++;
    if (serving_ && seq_.running_step() == 0 && seq_.queued_step() != 0) {
      StartStepLocked(seq_.TakeQueued());
    }
  }
  if (!done.ok()) {
    spdlog::error("HF export to {} failed: {}", o.out_dir, done.status().ToString());
    return done.status();
  }
  spdlog::info("exported {} tensors ({:.1f} MiB) in {} file(s) to {} in {:.2f} s", done->tensors,
               static_cast<double>(done->tensor_bytes) / (1 << 20), done->files.size(),
               done->out_dir, done->seconds);
  slidedp::v1::ExportHFResponse resp;
  resp.set_out_dir(done->out_dir);
  resp.set_version(version);
  for (const std::string& f : done->files) resp.add_files(f);
  resp.set_tensor_bytes(done->tensor_bytes);
  resp.set_tensors(done->tensors);
  resp.set_seconds(done->seconds);
  resp.set_dtype(o.dtype == ExportDtype::kFp32 ? slidedp::v1::DTYPE_FP32 : slidedp::v1::DTYPE_BF16);
  return resp;
}

void Engine::MonitorLoop() {
  absl::MutexLock lock(&mu_);
  const auto deadline = milliseconds(config_.heartbeat_deadline_ms);
  while (!monitor_stop_) {
    auto stop = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return monitor_stop_; };
    mu_.AwaitWithTimeout(absl::Condition(&stop), absl::Milliseconds(100));
    if (monitor_stop_) break;
    if (!state_) continue;
    shm::Atomic(state_->control().hostd_alive_ns).store(MonotonicNs(), std::memory_order_release);
    for (uint32_t r : ranks_.MissedDeadline(SteadyClock::now(), deadline)) {
      spdlog::warn("rank {} missed its heartbeat deadline ({} ms)", r, deadline.count());
      if (seq_.running_step() != 0 && serving_) {
        AbortStepLocked(seq_.running_step(),
                        absl::StrCat("rank ", r, " missed its heartbeat deadline"));
      }
      // The rank stays attached but disconnected; its stream handler ends on the next event.
      ranks_.Disconnect(r);
    }
  }
}

}  // namespace slidedp::hostd
