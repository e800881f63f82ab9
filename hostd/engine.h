// Engine: hostd's core, independent of gRPC so it can run embedded in tests (DCGM's embedded
// host-engine pattern). It owns, in order of construction: the topology, the update thread pool
// (pinned to the cores of the state's NUMA node), the training state in shared memory, the update
// worker, and the job's control-plane state: the attached ranks, their sessions and NCCL ids
// (RankTable, hostd/rank_table.h) and the step lifecycle (StepSequencer, hostd/step_sequencer.h),
// which decide while the engine applies their decisions to the shared memory and the ranks.
// hostd/service.cc translates RPCs into calls on it; every method validates its input and returns
// a Status with the most specific code and a message naming the field and the expected value.
//
// Torn state: with chunk-granular updates (update_granularity, see GradientReducer) a step
// aborted in the middle of a layer's update leaves that layer torn. The engine then refuses
// BeginStep (and SubmitGradient) with FAILED_PRECONDITION naming the torn layers and asking for a
// restore from a checkpoint; GetStatus reports step_state "torn". Which path updated the layers is
// counted in worker()->stats() (layer_updates_streamed / layer_updates_buffered).
//
// Overlapping steps: BeginStep(t + 1) while step t is running (its gradients or updates still
// under way) is accepted at once: t + 1 is queued and starts (reducer armed, step_begun
// broadcast, ControlBlock::step_state running) the moment t completes, so a rank's forward of
// t + 1 overlaps t's updates, gated per layer by the version gates (FetchParams waits for
// version t). BeginStep(t + 2) stays OUT_OF_RANGE. GetStatus reports the running step's state
// ("running" while t + 1 is queued). A queued step is dropped -- it never ran, no layer moves,
// steps_aborted does not count it, and the job's next step is t + 1 again -- when
//   - step t is aborted (AbortStep, a protocol error, a lost rank, shutdown);
//   - a rank is lost or detaches once t's updates are all published (before, t is aborted);
//   - AbortStep names it, once t's updates are all published (before: FAILED_PRECONDITION,
//     since the job-wide abort epoch would fail t's pushes too).
// A drop bumps abort_epoch like an abort: each rank that began t + 1 gets ABORTED from its next
// wait or push (its epoch, read before its BeginStep, changed) and must BeginStep(t + 1) again,
// which queues it again or starts it. Chunks of the dropped step left in the rings are discarded.
//
// Thread safety: every public method may be called from any thread; job state is guarded by
// mu_, which nothing holds for long. Long work (AdamW, casts) runs on the update worker, never
// on the calling thread, except in CreateJob, which creates and initializes the state before it
// returns -- without mu_: GetStatus shows the job as being created meanwhile, and the other job
// RPCs answer UNAVAILABLE until it exists.
//
// Lock order: mu_ first. The engine's collaborators without a lock of their own -- the rank
// table (ranks_) and the step sequencer (seq_) -- are guarded by it. Under mu_ the engine calls
// into the reducer, the update worker and the checkpointer, which take their own locks (the
// reducer's before the worker's); their callbacks into the engine (OnLayerDone, an aborted step's
// seal, the reducer's protocol error) run under none of those locks and take mu_ themselves.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/instance_files.h"
#include "common/thread_pool.h"
#include "hostd/checkpoint.h"
#include "hostd/client_layer_sync.h"
#include "hostd/config.h"
#include "hostd/optimizer.h"
#include "hostd/rank_table.h"
#include "hostd/reducer.h"
#include "hostd/route_choice.h"
#include "hostd/state.h"
#include "hostd/step_sequencer.h"
#include "hostd/topology.h"
#include "slidedp/v1/control.pb.h"

namespace slidedp::hostd {

// This binary's build identity as sent in handshakes.
slidedp::v1::BuildInfo DaemonBuildInfo();

class Engine {
 public:
  // Discovers the topology, starts the pool and, unless config.model is "none", creates the job
  // for config.model. `topology` overrides discovery (tests).
  // `creation_progress`, when given, is called with a line such as "creating job 'default':
  // initializing weights 12/36 layers (41 s)" as each job's creation goes (hostd's STATUS for
  // systemd), on the creating thread, never under the engine's lock.
  using CreationProgressFn = std::function<void(const std::string& line)>;
  static absl::StatusOr<std::unique_ptr<Engine>> Create(
      const HostdConfig& config, std::vector<ConfigEntry> entries = {},
      std::optional<Topology> topology = std::nullopt,
      CreationProgressFn creation_progress = nullptr);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Stops serving: fails new requests with UNAVAILABLE, aborts a running step, wakes sessions,
  // stops the worker and waits for a checkpoint in flight. With `remove_state` (a clean stop)
  // it writes the final checkpoint (checkpoint.on_stop) and removes the shared-memory names --
  // unless that checkpoint (or the one in flight, with no final one standing in) failed: then
  // the segments stay, re-adoptable by the next hostd, and DATA_LOSS says so and how to go on.
  // A second call does nothing more.
  absl::Status Shutdown(bool remove_state);

  // --- control plane ---
  absl::StatusOr<slidedp::v1::HandshakeResponse> Handshake(const slidedp::v1::HandshakeRequest& r);
  absl::StatusOr<slidedp::v1::CreateJobResponse> CreateJob(const slidedp::v1::CreateJobRequest& r);
  absl::StatusOr<slidedp::v1::AttachRankResponse> AttachRank(
      const slidedp::v1::AttachRankRequest& r);
  absl::Status DetachRank(const slidedp::v1::DetachRankRequest& r);
  // A BeginStep that would start a step while an HF export holds the steps waits for the export
  // until `deadline` (the RPC's; at most 30 min), then UNAVAILABLE. ABORTED for a step that was
  // aborted before this rank began it (naming the cause and the step to begin next).
  absl::StatusOr<slidedp::v1::BeginStepResponse> BeginStep(
      const slidedp::v1::BeginStepRequest& r, absl::Time deadline = absl::InfiniteFuture());
  absl::Status AbortStep(const slidedp::v1::AbortStepRequest& r);
  absl::Status PublishCommId(const slidedp::v1::PublishCommIdRequest& r);
  // Waits up to wait_ms (at most 10 min) and no longer than `deadline` (the RPC's) for rank 0's
  // id of that generation.
  absl::StatusOr<slidedp::v1::FetchCommIdResponse> FetchCommId(
      const slidedp::v1::FetchCommIdRequest& r, absl::Time deadline = absl::InfiniteFuture());
  absl::StatusOr<slidedp::v1::GetStatusResponse> GetStatus();
  // One line for a service manager's STATUS ("job default (qwen3-4b): 120 steps, running, 1/1
  // ranks attached", "creating job ...", "serving, no job"). It waits at most `max_wait` for the
  // engine's lock (nothing holds it for long: a job's creation runs without it), so a stuck
  // engine shows as DEADLINE_EXCEEDED rather than as a stuck caller.
  absl::StatusOr<std::string> StatusLine(absl::Duration max_wait);
  absl::StatusOr<slidedp::v1::ListLayersResponse> ListLayers(
      const slidedp::v1::ListLayersRequest& r);
  absl::StatusOr<slidedp::v1::ListRanksResponse> ListRanks(const slidedp::v1::ListRanksRequest& r);
  absl::StatusOr<slidedp::v1::GetStatsResponse> GetStats(const slidedp::v1::GetStatsRequest& r);
  slidedp::v1::GetConfigResponse GetConfig() const;
  absl::StatusOr<slidedp::v1::UpdateHyperParamsResponse> UpdateHyperParams(
      const slidedp::v1::UpdateHyperParamsRequest& r);
  // Writes the job's weights as an HF model directory (hf_export.h) at a step boundary: waits
  // (up to 10 min, then DEADLINE_EXCEEDED) for the running step to complete, holds the next one
  // (BeginStep blocks, a queued step is not started) while the files are written on the calling
  // thread (the casts on the update pool, idle meanwhile), then releases it. FAILED_PRECONDITION
  // when another export runs, the state is torn, or layers are updated by the ranks
  // (client_updated_layers) and a step has run: hostd's copy of them is stale.
  absl::StatusOr<slidedp::v1::ExportHFResponse> ExportHF(const slidedp::v1::ExportHFRequest& r);

  // Checkpoints version t = the running step (else the last completed one) into r.dir or
  // checkpoint.dir while training goes on (hostd/checkpoint.h); with r.wait, returns once
  // committed. FAILED_PRECONDITION: no directory configured, the state is torn, the ranks update
  // some layers themselves (client_updated_layers: hostd's copy of them is stale), or another
  // checkpoint is being written; ALREADY_EXISTS: step t is already checkpointed there.
  absl::StatusOr<slidedp::v1::CheckpointResponse> Checkpoint(
      const slidedp::v1::CheckpointRequest& r);

  // The ranks' state of the layers they update themselves (client_updated_layers) into hostd's
  // copy, so checkpoints and exports include it (see UploadClientLayerRequest). A checkpoint of
  // version t whose copy of those layers is older asks rank 0 for them (ControlBlock::
  // client_sync_step = t) and writes them once they are in; between steps rank 0 may upload the
  // last completed version unasked (python_client does when it closes), after which a clean
  // stop's final checkpoint and ExportHF include them. ReadClientLayer gives the copy back while
  // it is current (a resumed job: the ranks start from it).
  absl::StatusOr<slidedp::v1::UploadClientLayerResponse> UploadClientLayer(
      const slidedp::v1::UploadClientLayerRequest& r);
  absl::StatusOr<slidedp::v1::ReadClientLayerResponse> ReadClientLayer(
      const slidedp::v1::ReadClientLayerRequest& r);

  // --- sessions (one per attached rank; the service's stream handler drives these) ---
  // A session belongs to one attachment: the rank and the attach_token AttachRank issued. The
  // calls below act only while that attachment lasts, so the stream of an attachment that ended
  // (a detach, a re-attach) cannot touch the one that replaced it.
  // Validates the token and marks the rank connected.
  absl::StatusOr<slidedp::v1::SessionOpened> OpenSession(const slidedp::v1::SessionOpen& open);
  void SessionHeartbeat(uint32_t rank, const std::string& token, const slidedp::v1::Heartbeat& hb);
  // The stream ended (rank died or detached): the rank is dropped and a running step aborted.
  void SessionClosed(uint32_t rank, const std::string& token, absl::string_view reason);
  // False once the attachment's session ended or missed its heartbeat deadline.
  bool SessionActive(uint32_t rank, const std::string& token) const;
  // Waits up to `timeout` for the attachment's next event; nullopt on timeout.
  std::optional<slidedp::v1::SessionEvent> NextSessionEvent(uint32_t rank, const std::string& token,
                                                            std::chrono::milliseconds timeout);

  // --- data plane, in process (the shared-memory protocol of rankclient drives the same path) ---
  // Queues the aggregated gradient of `layer` for `step`; see UpdateWorker::Submit.
  absl::Status SubmitGradient(uint32_t layer, uint64_t step, GradientRef grad,
                              UpdateWorker::DoneFn done = nullptr);
  // Blocks until `layer` reaches `version` or `timeout` passes (DEADLINE_EXCEEDED).
  absl::Status WaitLayerVersion(uint32_t layer, uint64_t version,
                                std::chrono::milliseconds timeout);

  // Null until the job exists, then fixed. Read under mu_: CreateJob (an RPC thread) sets them.
  TrainingState* state() const ABSL_LOCKS_EXCLUDED(mu_) {
    absl::ReaderMutexLock lock(&mu_);
    return state_.get();
  }
  UpdateWorker* worker() const ABSL_LOCKS_EXCLUDED(mu_) {
    absl::ReaderMutexLock lock(&mu_);
    return worker_.get();
  }
  GradientReducer* reducer() const ABSL_LOCKS_EXCLUDED(mu_) {
    absl::ReaderMutexLock lock(&mu_);
    return reducer_.get();
  }
  const HostdConfig& config() const { return config_; }
  const Topology& topology() const { return topology_; }

 private:
  Engine(HostdConfig config, std::vector<ConfigEntry> entries,
         CreationProgressFn creation_progress);
  absl::Status Init(std::optional<Topology> topology);
  // Marks job `job_id` as being created (GetStatus shows it; job RPCs answer UNAVAILABLE);
  // ALREADY_EXISTS when a job exists or another is being created. The caller then calls
  // CreateJobUnlocked, which ends the creation whatever its outcome.
  absl::Status ClaimCreation(const std::string& job_id) ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status ClaimCreationLocked(const std::string& job_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Creates the claimed job: validates the spec, recovers or creates the state, imports or
  // restores its weights (all without mu_), then installs it under mu_.
  // `model_dir`: the model's directory, where init "auto" looks for safetensors weights; empty
  // for a built-in model, a config.json path or a job created over RPC.
  // `resume`: restore this checkpoint into the new state (its step becomes the job's).
  absl::Status CreateJobUnlocked(slidedp::v1::JobSpec spec, model::LoadedModel model,
                                 const std::string& model_dir,
                                 const model::CheckpointInfo* resume = nullptr)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Records the creation's progress; false once hostd stops serving (the creation gives up).
  bool NoteCreation(const char* phase, uint64_t done, uint64_t total, const char* unit)
      ABSL_LOCKS_EXCLUDED(mu_);
  std::string CreationLineLocked() const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // The job as a checkpoint describes it (spec with the current optimizer, model fields).
  model::CheckpointInfo CheckpointDescriptionLocked() const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // OK when a checkpoint of hostd's state alone is complete at `version`: no torn layer, and
  // hostd's copy of the client-updated layers is at `version` (or there are none).
  absl::Status CheckCheckpointableLocked(uint64_t version) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // Starts the checkpointer on version `step`; when hostd's copy of the client-updated layers
  // is not at `step`, the checkpoint awaits them and rank 0 is asked to upload them.
  absl::Status StartCheckpointLocked(const std::string& dir, uint64_t step)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // True when hostd's copy of the client-updated layers is the job's state now (none, or at the
  // last completed step with no step running).
  bool ClientCopyCurrentLocked() const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // Asks rank 0 for the client-updated layers at `step` (0: withdraws the request).
  void RequestClientSyncLocked(uint64_t step) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Withdraws the request once its checkpoint is no longer in flight (committed or failed).
  void ReconcileClientSyncLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Writes the final checkpoint of a clean stop (checkpoint.on_stop); the worker has stopped.
  // OK when written, or when none is due (off, nothing trained, already checkpointed).
  absl::Status FinalCheckpoint();
  absl::Status CheckJob(absl::string_view job_id) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  absl::Status CheckServing() const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // Ends the rank's attachment (a detach or a lost session) in the table and in its RankSlot.
  void ReleaseRankLocked(uint32_t rank) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void AbortStepLocked(uint64_t step, absl::string_view reason) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // `step` becomes the running step: the reducer is armed, the ranks are told.
  void StartStepLocked(uint64_t step) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Drops the queued step (see the overview); only once the running step's pushes are all in, or
  // with the running step's abort, which has bumped the abort epoch already (`bump_epoch` false).
  void DropQueuedStepLocked(absl::string_view reason, bool bump_epoch = true)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // ControlBlock::completed_step = `step` (never backwards): every layer of `step` is published.
  void MarkCompletedLocked(uint64_t step) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Bumps abort_epoch and wakes every rank waiting on a futex of the control segment.
  void BumpAbortEpochLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Waits (bounded) until the worker has sealed every aborted step.
  absl::Status AwaitSealsLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // FAILED_PRECONDITION naming the torn layers (with their versions), if any.
  absl::Status CheckNotTornLocked() const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  std::string TornMessageLocked() const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // A torn layer as TornMessage names it: index, name and versions.
  std::string DescribeTornLayerLocked(uint32_t layer) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  void OnLayerDone(const LayerUpdateResult& r);
  void MonitorLoop();
  std::vector<slidedp::v1::LayerStatus> LayerStatuses() const ABSL_SHARED_LOCKS_REQUIRED(mu_);

  const HostdConfig config_;
  const std::vector<ConfigEntry> entries_;
  const std::chrono::steady_clock::time_point started_;
  Topology topology_;
  int state_node_ = 0;
  std::vector<int> worker_cpus_;
  kernels::Isa isa_ = kernels::Isa::kScalar;
  std::unique_ptr<ThreadPool> pool_;
  // The instance's lock (common/instance_files.h); released after the state is destroyed.
  std::unique_ptr<InstanceLock> instance_lock_;

  const CreationProgressFn creation_progress_;

  mutable absl::Mutex mu_;
  bool serving_ ABSL_GUARDED_BY(mu_) = true;
  // The job being created (ClaimCreation .. CreateJobUnlocked's end), and since when.
  std::optional<slidedp::v1::JobCreation> creating_ ABSL_GUARDED_BY(mu_);
  std::chrono::steady_clock::time_point creation_started_ ABSL_GUARDED_BY(mu_);
  std::optional<slidedp::v1::JobSpec> job_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<TrainingState> state_;           // set once under mu_, then read-only
  std::unique_ptr<UpdateWorker> worker_;           // set once under mu_, then read-only
  std::unique_ptr<GradientReducer> reducer_;       // set once under mu_, then read-only
  std::unique_ptr<Checkpointer> checkpointer_;     // set once under mu_, then read-only
  std::string resumed_from_ ABSL_GUARDED_BY(mu_);  // the checkpoint the job started from
  uint64_t start_step_ ABSL_GUARDED_BY(mu_) = 0;   // the version the job started at
  RankTable ranks_ ABSL_GUARDED_BY(mu_);
  StepSequencer seq_ ABSL_GUARDED_BY(mu_);
  // The gradient route in effect and how it was chosen (hostd/route_choice.h); under grad_route
  // auto, GRAD_ROUTE_AUTO until the first rank attaches, then re-chosen whenever a rank attaches
  // to the job with none attached.
  RouteChoice route_ ABSL_GUARDED_BY(mu_);
  bool pool_prepare_asked_ ABSL_GUARDED_BY(mu_) = false;  // PreparePool asked (once)
  // The layers the ranks update themselves and hostd's copy of them (set by the rank that
  // attaches when no other is attached; the others must send the same set). They never get a
  // gradient: the step completes when the other layers are done, and they are published at the
  // step's version then (state untouched).
  ClientLayerSync client_ ABSL_GUARDED_BY(mu_);
  double last_step_update_seconds_ ABSL_GUARDED_BY(mu_) = 0;
  double step_update_seconds_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<LayerUpdateResult> step_layers_ ABSL_GUARDED_BY(mu_);       // of the running step
  std::vector<LayerUpdateResult> last_step_layers_ ABSL_GUARDED_BY(mu_);  // last completed
  // Traffic (GetStats fields 140+; the step timing is the sequencer's).
  uint64_t param_bytes_published_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t exports_completed_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<double> last_grad_norm_ ABSL_GUARDED_BY(mu_);
  bool monitor_stop_ ABSL_GUARDED_BY(mu_) = false;
  // An ExportHF is writing: no step starts (BeginStep waits, a queued step stays queued).
  bool export_active_ ABSL_GUARDED_BY(mu_) = false;
  std::atomic<bool> stopping_{false};  // set by Shutdown; polled by a running export
  std::thread monitor_;                // heartbeat deadlines; started by Init, joined by Shutdown
};

}  // namespace slidedp::hostd
