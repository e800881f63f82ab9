// Checkpoints of a live job (issue #6): capture, write, restore.
//
// Consistency while training runs. Layers are updated one by one as gradients arrive and the next
// step's updates may start while a checkpoint is written, so "every layer at version t" exists
// only per layer. A checkpoint of version t captures each layer's master, m and v at version t
// before that layer's update for step t + 1 touches it:
//   - the update worker calls BeforeLayerWrite(layer, step) before it writes a layer (a hook set
//     with UpdateWorker::SetBeforeWriteHook); for step t + 1 and a layer not yet captured, it
//     copies the layer into a bounded snapshot pool (with the update pool's threads) and goes on;
//   - a writer thread captures layers that have reached version t (committed >= t, not yet
//     captured) into the pool with a memcpy, highest layer first (the order the next step
//     updates them) until the first update of step t + 1 reaches the hook, then lowest first
//     (the other end from the updates, which copy what they reach themselves), while there is
//     room; writes pooled layers to disk and frees their room;
//     and, when the pool is full, writes a layer at version t straight from the live state;
//   - when the pool has no room for a layer, or the writer is copying or writing that layer
//     from the live state, the update waits: that wait is the checkpoint's stall
//     (stats().stall_seconds); the update's own copy is counted as snapshot_seconds. The wait
//     is bounded (Options::capture_timeout_ms): past it the checkpoint fails (a hung disk must
//     not stall the optimizer for good), the update goes on, and no update waits for that
//     checkpoint again; the writer, once its write returns, removes the .tmp directory.
// With a pool as large as the state the writer captures every layer at memcpy speed and the
// updates wait at most for one layer's copy; with a small pool they wait for the disk.
// The files go through CheckpointDirWriter (checkpoint_format.h): temp directory, fsyncs,
// rename, directory fsync, commit marker last; keep_last older committed ones of the same
// instance and job are pruned after the new one is committed (checkpoints are scoped:
// checkpoint_format.h).
//
// Resume (the seam hostd's start-up and crash re-adoption use): FindLatestCheckpoint picks the
// newest committed checkpoint of a directory (any job's when the user named it; only the
// instance's and job's own for recovery), CheckCheckpointManifest compares it with a model,
// RestoreCheckpoint loads it into a freshly created TrainingState.
//
// Thread safety: every Checkpointer method may be called from any thread; BeforeLayerWrite is
// called by the update worker's thread (the only user of `pool` while it runs).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/mapping.h"
#include "hostd/checkpoint_stats.h"
#include "hostd/state.h"
#include "model/checkpoint_format.h"

namespace slidedp {
class ThreadPool;
}

namespace slidedp::hostd {

// A path the user named (--resume, CreateJob's resume_path): the newest committed checkpoint
// under `path` (a step directory, or a checkpoint directory holding one job's checkpoints;
// INVALID_ARGUMENT listing them when it holds several jobs'); marker, meta.json and file sizes
// are checked, the data is not (RestoreCheckpoint checks it as it reads). NOT_FOUND /
// DATA_LOSS / INVALID_ARGUMENT naming the file. Logs the newer step directories skipped.
absl::StatusOr<model::CheckpointInfo> FindLatestCheckpoint(const std::string& path);
// hostd's own pick (recovery after a crash): the newest committed checkpoint of `scope` in the
// checkpoint directory `dir`, never another instance's or job's nor an unscoped (format 1-2)
// one. NOT_FOUND when there is none.
absl::StatusOr<model::CheckpointInfo> FindLatestCheckpoint(const std::string& dir,
                                                           const model::CheckpointScope& scope);

// FAILED_PRECONDITION when `manifest` is not the checkpoint's model: names both manifest hashes
// and the first differing layer or tensor (name, shape).
absl::Status CheckCheckpointManifest(const model::CheckpointInfo& info,
                                     const slidedp::v1::ModelManifest& manifest);

// Loads the checkpoint into `state`, which must have been created for the checkpoint's manifest
// and not be in use (no rank attached, no update running): master, m and v of every layer (each
// file's XXH3-64 and header verified as it is read), the BF16 params re-cast from the master,
// and every layer's committed and pending version set to info.step. The manifest is checked
// first, before any byte of the state changes; a checksum or read error in a layer file is
// reported (DATA_LOSS naming the file) after earlier layers were loaded: the caller must then
// discard the state (hostd does, and no job is created).
// `progress(layers_done)`, when given, is called after each layer; false stops the restore
// (CANCELLED).
absl::Status RestoreCheckpoint(const model::CheckpointInfo& info, TrainingState* state,
                               ThreadPool* pool,
                               const std::function<bool(uint32_t layers_done)>& progress = nullptr);

class Checkpointer {
 public:
  struct Options {
    // The hostd instance whose checkpoints these are (with each Start's info.job_id: the
    // checkpoints' scope, checkpoint_format.h).
    std::string instance = "default";
    uint32_t keep_last = 3;  // of this instance's and job's checkpoints; 0: keep every one
    uint64_t snapshot_pool_bytes = 1ull << 30;  // room for copies of layers
    // When set, each checkpoint's room is what this returns at its Start (e.g. from the
    // MemAvailable of that moment) instead of snapshot_pool_bytes; its argument is the bytes of
    // snapshot buffers kept from earlier checkpoints (not in MemAvailable, yet room).
    std::function<uint64_t(uint64_t kept_bytes)> snapshot_pool_at_start;
    // Snapshot buffers stay allocated (and their pages faulted in) for the next checkpoint, up
    // to its pool size. Faulting in fresh pages made the copy 3x slower than into warm ones
    // (capture_bench; the copy of the whole state lands in the step after the capture point).
    bool keep_snapshot_pool = true;
    // Ask for transparent huge pages for snapshot buffers (MADV_HUGEPAGE). Off: with THP defrag
    // "madvise" (the usual default) those faults compact memory and the copy got slower.
    bool snapshot_huge_pages = false;
    // How long a checkpoint waits for ClientLayerReady of the layers it awaits from the ranks.
    int64_t client_upload_timeout_ms = 300000;
    // Layer-file bytes per second a checkpoint writes at most while training runs (0: no
    // limit). The write competes with the update for host memory bandwidth, so a slower write
    // spreads that cost thinner over more steps. Not applied to a layer an update waits for,
    // nor after Unpace (a stop, the final checkpoint).
    uint64_t max_write_bytes_per_s = 0;
    // Snapshot buffers go to disk with O_DIRECT where the file system takes it.
    bool direct_io = true;
    // How long an update waits in BeforeLayerWrite for the checkpoint to capture its layer
    // (checkpoint.capture_timeout_s; 0: no limit). Then the checkpoint in flight fails
    // (DEADLINE_EXCEEDED naming the layer, both steps and the wait; counted in
    // checkpoints_failed, logged once) and the update goes on; the committed checkpoints stay.
    int64_t capture_timeout_ms = 300000;
    // Passed to each checkpoint's CheckpointDirWriter (tests: a trace that blocks stands in
    // for a hung disk).
    model::CheckpointDirWriter::Options writer;
  };
  // `state` and `pool` must outlive the checkpointer; `pool` is used only inside
  // BeforeLayerWrite (on the update worker's thread).
  Checkpointer(TrainingState* state, ThreadPool* pool, Options options);
  ~Checkpointer();  // cancels a checkpoint in flight and joins the writer
  Checkpointer(const Checkpointer&) = delete;
  Checkpointer& operator=(const Checkpointer&) = delete;

  // Starts a checkpoint of version `step` into `dir`; `info` carries the job's description
  // (spec, model fields; step and files are filled here). Every layer must be at version <= step
  // and none may yet have started its update for step + 1 (the caller, the engine, holds the
  // step lifecycle and guarantees that). FAILED_PRECONDITION when another checkpoint is in
  // flight (naming its step; also one that failed while its writer is still in a write that
  // has not returned); ALREADY_EXISTS when the job's checkpoint of `step` is committed in `dir`
  // already; INVALID_ARGUMENT when info.job_id is empty.
  // `awaiting_client`: layers the ranks update themselves whose version-t state is not in
  // hostd's copy yet; they are captured only after ClientLayerReady (the ranks' upload), and the
  // checkpoint fails (DEADLINE_EXCEEDED naming them) when that does not come within
  // options.client_upload_timeout_ms.
  absl::Status Start(const std::string& dir, uint64_t step, model::CheckpointInfo info,
                     const std::vector<uint32_t>& awaiting_client = {});
  // Blocks until the checkpoint of `step` has committed or failed (or `timeout_ms` passed:
  // DEADLINE_EXCEEDED). NOT_FOUND when no checkpoint of `step` was started.
  absl::StatusOr<CheckpointResult> Wait(uint64_t step, int64_t timeout_ms);
  // Fails the checkpoint in flight (its .tmp directory is removed): e.g. the state is torn.
  void Cancel(const std::string& reason);
  // The checkpoint in flight writes the rest at full speed (max_write_bytes_per_s no longer
  // applies to it): someone waits for it (a stop, a final checkpoint).
  void Unpace();

  // hostd's copy of a layer awaited from the ranks now holds version `step` (no-op for another
  // step, a layer not awaited, or no checkpoint in flight).
  void ClientLayerReady(uint32_t layer, uint64_t step);
  // The layers the checkpoint in flight still awaits from the ranks (empty when none).
  std::vector<uint32_t> awaiting_client() const;

  // Allocates and faults in the next checkpoint's snapshot pool (its size as Start would
  // compute it now, highest layer first) on a thread of its own, in the background, and keeps
  // it (keep_snapshot_pool), so that the first checkpoint copies into warm pages like the later
  // ones: fresh pages made the step after the capture point wait for the page faults. Stops
  // when a checkpoint starts (which takes what is ready) or when the pool is ready; a call while
  // it runs does nothing. A failed allocation ends the preparation (logged); nothing else
  // changes.
  void PreparePool();

  // The update worker's hook: called before `layer`'s data is written for `step`.
  void BeforeLayerWrite(uint32_t layer, uint64_t step);

  bool in_flight() const;
  uint64_t in_flight_step() const;  // 0 when none
  // The last committed checkpoint (step 0 and empty path when none yet).
  CheckpointResult last_committed() const;
  int64_t last_committed_unix_ms() const;
  void set_last_committed(const CheckpointResult& r, int64_t unix_ms);
  CheckpointStats stats() const;

 private:
  // kPending: at or below version t, not captured; kCopying: the writer copies it into the
  // pool; kSnapshotted: its copy is in the pool (or being made by an update); kWritingLive: the
  // writer writes it from the live state; kDone: written; kAwaitingClient: a client-updated
  // layer whose version-t state the ranks have not uploaded yet (becomes kPending).
  enum class LayerState { kPending, kCopying, kSnapshotted, kWritingLive, kDone, kAwaitingClient };
  struct Snapshot {
    Mapping data;  // anonymous memory: master | m | v as floats
    uint64_t numel = 0;
  };
  // Empty when the host has no memory for it (mmap failed).
  Snapshot AllocateSnapshot(uint64_t numel) ABSL_LOCKS_EXCLUDED(mu_);
  // A capture got no memory for `layer`'s snapshot: the layer is pending again and the pool
  // shrinks to what is in use, so the writer writes the rest from the live state.
  void NoRoomLocked(uint32_t layer, uint64_t bytes) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A kept buffer for `numel` elements (empty when none); a buffer back to the kept ones (or
  // freed when keep_snapshot_pool is off).
  Snapshot TakeKeptLocked(uint64_t numel) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void KeepLocked(Snapshot s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The room a checkpoint starting now gets (snapshot_pool_at_start or snapshot_pool_bytes).
  uint64_t PoolSizeLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Frees kept buffers until at most `bytes` are kept.
  void TrimKeptLocked(uint64_t bytes) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The checkpoint in flight fails now with `status` (recorded for Wait, counted, logged); the
  // writer stops at its next layer and removes the .tmp directory; updates pass the hook.
  void FailInFlightLocked(absl::Status status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // The writer thread's loop, and one checkpoint of it (mu_ held, released around the copies,
  // the writes and the commit).
  void Run() ABSL_LOCKS_EXCLUDED(mu_);
  void RunCheckpoint() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The preparer thread (PreparePool): allocates and faults in buffers, mu_ released around
  // each buffer's page faults.
  void RunPrepare() ABSL_LOCKS_EXCLUDED(mu_);
  void PrepareLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  TrainingState* const state_;
  ThreadPool* const pool_;
  const Options options_;

  mutable absl::Mutex mu_;
  absl::CondVar cv_;  // any of the state below changed
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  // The checkpoint in flight (active_).
  bool active_ ABSL_GUARDED_BY(mu_) = false;
  bool preparing_ ABSL_GUARDED_BY(mu_) = false;  // the preparer thread runs
  uint64_t step_ ABSL_GUARDED_BY(mu_) = 0;
  std::string dir_ ABSL_GUARDED_BY(mu_);
  model::CheckpointScope scope_ ABSL_GUARDED_BY(mu_);
  model::CheckpointInfo info_ ABSL_GUARDED_BY(mu_);
  std::string cancel_reason_ ABSL_GUARDED_BY(mu_);
  // The checkpoint in flight has failed (FailInFlightLocked) while its writer still runs.
  bool failed_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<LayerState> layers_ ABSL_GUARDED_BY(mu_);
  std::map<uint32_t, Snapshot> snapshots_ ABSL_GUARDED_BY(mu_);
  // By numel; buffers of earlier checkpoints.
  std::multimap<uint64_t, Snapshot> kept_ ABSL_GUARDED_BY(mu_);
  uint64_t kept_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t pool_used_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t pool_bytes_ ABSL_GUARDED_BY(mu_) = 0;    // the checkpoint in flight's room for copies
  int64_t wanted_layer_ ABSL_GUARDED_BY(mu_) = -1;  // the layer an update waits for
  // Read by the writer's pacing without mu_: an update waits (wanted_layer_ >= 0), Unpace.
  std::atomic<bool> update_waiting_{false};
  std::atomic<bool> unpaced_{false};
  // An update of step t + 1 has reached the hook.
  bool next_step_begun_ ABSL_GUARDED_BY(mu_) = false;
  std::chrono::steady_clock::time_point started_ ABSL_GUARDED_BY(mu_);
  // Results by step, for Wait.
  std::map<uint64_t, absl::StatusOr<CheckpointResult>> results_ ABSL_GUARDED_BY(mu_);
  CheckpointResult last_ ABSL_GUARDED_BY(mu_);
  int64_t last_unix_ms_ ABSL_GUARDED_BY(mu_) = 0;
  CheckpointStats stats_ ABSL_GUARDED_BY(mu_);
  std::thread writer_;  // started by the constructor, joined by the destructor
  // PreparePool's, started and joined (once done) by the next PreparePool under mu_, or joined
  // by the destructor after the writer.
  std::thread preparer_;
};

}  // namespace slidedp::hostd
