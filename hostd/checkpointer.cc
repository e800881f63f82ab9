// The Checkpointer (checkpoint.h): starting, waiting for and cancelling a checkpoint, the update
// worker's hook, and the writer thread that captures and writes the layers. The snapshot buffers
// are snapshot_pool.cc's; resume is checkpoint_restore.cc's.
#include <algorithm>
#include <cstring>
#include <filesystem>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/thread_pool.h"
#include "hostd/checkpoint.h"
#include "hostd/checkpoint_internal.h"
#include "spdlog/spdlog.h"

namespace slidedp::hostd {
namespace fs = std::filesystem;
namespace {

using checkpoint_internal::Clock;
using checkpoint_internal::InParts;
using checkpoint_internal::kWriterCopyThreads;
using checkpoint_internal::Seconds;

int64_t NowUnixMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

}  // namespace

Checkpointer::Checkpointer(TrainingState* state, ThreadPool* pool, Options options)
    : state_(state), pool_(pool), options_(options) {
  writer_ = std::thread([this] { Run(); });
}

Checkpointer::~Checkpointer() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
    if (active_ && cancel_reason_.empty()) cancel_reason_ = "hostd is stopping";
  }
  unpaced_ = true;
  cv_.SignalAll();
  writer_.join();
  if (preparer_.joinable()) preparer_.join();  // stops after its current buffer
}

absl::Status Checkpointer::Start(const std::string& dir, uint64_t step, model::CheckpointInfo info,
                                 const std::vector<uint32_t>& awaiting_client) {
  absl::MutexLock lock(&mu_);
  if (stop_) return absl::UnavailableError("the checkpointer is stopping");
  if (active_ && failed_) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the checkpoint of step ", step_,
        " failed but its writer is still in a write that has not returned (a hung disk?); retry "
        "once it returns"));
  }
  if (active_) {
    return absl::FailedPreconditionError(
        absl::StrCat("a checkpoint of step ", step_,
                     " is being written; wait for it (slidedpctl checkpoint "
                     "waits by default) and retry"));
  }
  if (info.job_id.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("checkpoint of step ", step, ": the job id is empty"));
  }
  const model::CheckpointScope scope{options_.instance, info.job_id};
  const fs::path final_path = fs::path(dir) / model::CheckpointDirName(step, scope);
  std::error_code ec;
  if (fs::exists(final_path / model::kCheckpointMarker, ec)) {
    return absl::AlreadyExistsError(
        absl::StrCat("checkpoint of step ", step, " already exists: ", final_path.string()));
  }
  active_ = true;
  step_ = step;
  dir_ = dir;
  scope_ = scope;
  info_ = std::move(info);
  cancel_reason_.clear();
  layers_.assign(state_->num_layers(), LayerState::kPending);
  for (uint32_t l : awaiting_client) {
    if (l < layers_.size()) layers_[l] = LayerState::kAwaitingClient;
  }
  snapshots_.clear();
  pool_used_ = 0;
  pool_bytes_ = PoolSizeLocked();
  TrimKeptLocked(pool_bytes_);
  wanted_layer_ = -1;
  update_waiting_ = false;
  unpaced_ = false;
  next_step_begun_ = false;
  started_ = Clock::now();
  results_.erase(step);
  stats_.checkpoints_started++;
  cv_.SignalAll();
  return absl::OkStatus();
}

absl::StatusOr<CheckpointResult> Checkpointer::Wait(uint64_t step, int64_t timeout_ms) {
  absl::MutexLock lock(&mu_);
  auto done = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return results_.count(step) > 0 || (!active_ || step_ != step);
  };
  // On the steady clock; absl::Duration saturates, so any timeout_ms is safe.
  const absl::Duration timeout = absl::Milliseconds(timeout_ms);
  const auto t0 = Clock::now();
  while (!done()) {
    if (cv_.WaitWithTimeout(&mu_, timeout - absl::FromChrono(Clock::now() - t0)) && !done()) {
      return absl::DeadlineExceededError(absl::StrCat(
          "the checkpoint of step ", step, " did not finish within ", timeout_ms, " ms"));
    }
  }
  auto it = results_.find(step);
  if (it == results_.end()) {
    return absl::NotFoundError(absl::StrCat("no checkpoint of step ", step, " was started"));
  }
  return it->second;
}

void Checkpointer::ClientLayerReady(uint32_t layer, uint64_t step) {
  {
    absl::MutexLock lock(&mu_);
    if (!active_ || step != step_ || layer >= layers_.size() ||
        layers_[layer] != LayerState::kAwaitingClient) {
      return;
    }
    layers_[layer] = LayerState::kPending;
  }
  cv_.SignalAll();
}

std::vector<uint32_t> Checkpointer::awaiting_client() const {
  absl::MutexLock lock(&mu_);
  std::vector<uint32_t> out;
  if (!active_) return out;
  for (uint32_t l = 0; l < layers_.size(); ++l) {
    if (layers_[l] == LayerState::kAwaitingClient) out.push_back(l);
  }
  return out;
}

void Checkpointer::Cancel(const std::string& reason) {
  {
    absl::MutexLock lock(&mu_);
    if (!active_) return;
    cancel_reason_ = reason;
  }
  unpaced_ = true;  // the layer being written ends sooner, then the writer sees the reason
  cv_.SignalAll();
}

void Checkpointer::Unpace() { unpaced_ = true; }

bool Checkpointer::in_flight() const {
  absl::MutexLock lock(&mu_);
  return active_;
}

uint64_t Checkpointer::in_flight_step() const {
  absl::MutexLock lock(&mu_);
  return active_ ? step_ : 0;
}

CheckpointResult Checkpointer::last_committed() const {
  absl::MutexLock lock(&mu_);
  return last_;
}

int64_t Checkpointer::last_committed_unix_ms() const {
  absl::MutexLock lock(&mu_);
  return last_unix_ms_;
}

void Checkpointer::set_last_committed(const CheckpointResult& r, int64_t unix_ms) {
  absl::MutexLock lock(&mu_);
  last_ = r;
  last_unix_ms_ = unix_ms;
}

CheckpointStats Checkpointer::stats() const {
  absl::MutexLock lock(&mu_);
  return stats_;
}

void Checkpointer::FailInFlightLocked(absl::Status status) {
  if (!active_ || failed_) return;
  failed_ = true;
  if (cancel_reason_.empty()) cancel_reason_ = std::string(status.message());
  stats_.checkpoints_failed++;
  spdlog::error("checkpoint of step {} failed: {}", step_, status.ToString());
  results_[step_] = std::move(status);
  unpaced_ = true;  // the write in progress ends sooner, if it ends
  cv_.SignalAll();
}

void Checkpointer::BeforeLayerWrite(uint32_t layer, uint64_t step) {
  absl::MutexLock lock(&mu_);
  if (!active_ || failed_ || step <= step_ || layer >= layers_.size()) return;
  next_step_begun_ = true;
  auto busy = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const LayerState st = layers_[layer];
    return st == LayerState::kPending || st == LayerState::kCopying ||
           st == LayerState::kWritingLive;
  };
  if (!busy()) return;
  const LayerInfo& info = state_->layers()[layer];
  const uint64_t bytes = 3 * info.numel * sizeof(float);
  const auto t0 = Clock::now();
  const auto deadline = t0 + std::chrono::milliseconds(options_.capture_timeout_ms);
  bool waited = false;
  while (active_ && !failed_ && step_ < step && busy()) {
    if (layers_[layer] == LayerState::kPending && pool_used_ + bytes <= pool_bytes_) {
      layers_[layer] = LayerState::kSnapshotted;
      pool_used_ += bytes;
      stats_.pool_high_water_bytes = std::max(stats_.pool_high_water_bytes, pool_used_);
      if (waited) stats_.stall_seconds += Seconds(t0, Clock::now());
      Snapshot kept = TakeKeptLocked(info.numel);
      mu_.Unlock();
      // The copy runs on the update pool: the update of this layer is waiting for it anyway.
      const auto c0 = Clock::now();
      Snapshot snap = kept.data.valid() ? std::move(kept) : AllocateSnapshot(info.numel);
      if (!snap.data.valid()) {
        mu_.Lock();
        NoRoomLocked(layer, bytes);
        continue;  // waits for the writer, which writes this layer from the live state
      }
      const float* src[3] = {state_->master(layer), state_->exp_avg(layer),
                             state_->exp_avg_sq(layer)};
      float* dst = snap.data.as<float>();
      const size_t n = info.numel;
      auto copy = [&](size_t b, size_t e, int) {
        for (int k = 0; k < 3; ++k) {
          std::memcpy(dst + k * n + b, src[k] + b, (e - b) * sizeof(float));
        }
      };
      if (pool_ != nullptr) {
        pool_->ParallelFor(n, 1024, copy);
      } else {
        copy(0, n, 0);
      }
      const double copy_s = Seconds(c0, Clock::now());
      mu_.Lock();
      snapshots_[layer] = std::move(snap);
      stats_.snapshot_seconds += copy_s;
      stats_.layers_snapshotted++;
      cv_.SignalAll();
      return;
    }
    waited = true;
    wanted_layer_ = layer;
    update_waiting_ = true;
    cv_.SignalAll();
    if (options_.capture_timeout_ms <= 0) {
      cv_.Wait(&mu_);
    } else if (cv_.WaitWithTimeout(&mu_, absl::FromChrono(deadline - Clock::now())) && active_ &&
               !failed_ && step_ < step && busy()) {
      const LayerState st = layers_[layer];
      FailInFlightLocked(absl::DeadlineExceededError(absl::StrCat(
          "the update of layer ", layer, " for step ", step, " waited ",
          absl::StrFormat("%g", static_cast<double>(options_.capture_timeout_ms) / 1000.0),
          " s (checkpoint.capture_timeout_s) for the checkpoint of step ", step_,
          " to capture that layer, while ",
          st == LayerState::kWritingLive ? "the writer was writing it to disk from the live state"
          : st == LayerState::kCopying
              ? "the writer was copying it into the snapshot pool"
              : absl::StrCat("the snapshot pool was full (", pool_used_, " of ", pool_bytes_,
                             " bytes) and the writer freed no room"),
          " (a hung or very slow disk?); the checkpoint fails, the update goes on, and the "
          "committed checkpoints stay")));
    }
  }
  if (waited) {
    const double s = Seconds(t0, Clock::now());
    stats_.stall_seconds += s;
    stats_.last_stall_max_layer_wait_us =
        std::max<uint64_t>(stats_.last_stall_max_layer_wait_us, static_cast<uint64_t>(s * 1e6));
  }
  if (wanted_layer_ == static_cast<int64_t>(layer)) {
    wanted_layer_ = -1;
    update_waiting_ = false;
  }
}

void Checkpointer::Run() {
  absl::MutexLock lock(&mu_);
  for (;;) {
    while (!stop_ && !active_) cv_.Wait(&mu_);
    if (active_) RunCheckpoint();
    if (stop_) return;
  }
}

void Checkpointer::RunCheckpoint() {
  const uint64_t step = step_;
  const std::string dir = dir_;
  const model::CheckpointScope scope = scope_;
  const uint32_t num_layers = static_cast<uint32_t>(layers_.size());
  stats_.last_stall_max_layer_wait_us = 0;
  mu_.Unlock();
  absl::Status status;
  std::unique_ptr<model::CheckpointDirWriter> writer;
  {
    auto begun = model::CheckpointDirWriter::Begin(dir, step, scope, options_.writer);
    if (begun.ok()) {
      writer = std::move(*begun);
    } else {
      status = begun.status();
    }
  }
  mu_.Lock();
  double write_s = 0;
  // Pacing (max_write_bytes_per_s) of the writes from the pool: a token bucket whose credit,
  // built up while the writer waits for layers, is at most a quarter second of writing. An
  // update waiting for a layer, Unpace and Cancel lift it at once.
  double paced_s = 0;
  Clock::time_point due = Clock::now();
  model::LayerWrite paced;
  paced.direct = options_.direct_io;
  if (options_.max_write_bytes_per_s > 0) {
    paced.after_piece = [&](uint64_t bytes) {
      const auto now = Clock::now();
      due = std::max(due, now - std::chrono::milliseconds(250)) +
            std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(
                static_cast<double>(bytes) / static_cast<double>(options_.max_write_bytes_per_s)));
      for (auto t = now; t < due && !unpaced_.load(std::memory_order_relaxed) &&
                         !update_waiting_.load(std::memory_order_relaxed);
           t = Clock::now()) {
        std::this_thread::sleep_for(
            std::min<Clock::duration>(due - t, std::chrono::milliseconds(5)));
      }
      paced_s += Seconds(now, Clock::now());
    };
  }
  while (status.ok()) {
    if (!cancel_reason_.empty()) {
      status = absl::AbortedError(
          absl::StrCat("checkpoint of step ", step, " cancelled: ", cancel_reason_));
      break;
    }
    // 1. Capture: copy a layer at version t into the pool while there is room (the layer an
    //    update waits for first, then highest first, the order the next step updates them),
    //    so updates find it captured and never wait for the disk.
    // 2. Write the pooled copies (highest first), freeing room.
    // 3. No room: write a layer at version t straight from the live state (an update that
    //    needs it meanwhile waits: the stall).
    auto ready = [&](uint32_t l) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return layers_[l] == LayerState::kPending && state_->committed_version(l) >= step;
    };
    int64_t pick = -1;
    if (wanted_layer_ >= 0 && ready(static_cast<uint32_t>(wanted_layer_))) {
      pick = wanted_layer_;
    } else {
      // Highest first until the next step's updates begin; they go from the highest layer down
      // and copy the layers they reach themselves (with the update pool's threads), so from
      // then on the writer takes the other end, and an update waits for the writer's copy at
      // most where the two meet.
      for (uint32_t i = 0; i < num_layers; ++i) {
        const uint32_t l = next_step_begun_ ? i : num_layers - 1 - i;
        if (ready(l)) {
          pick = l;
          break;
        }
      }
    }
    if (pick >= 0) {
      const uint32_t l = static_cast<uint32_t>(pick);
      const uint64_t n = state_->layers()[l].numel;
      if (pool_used_ + 3 * n * sizeof(float) <= pool_bytes_) {
        layers_[l] = LayerState::kCopying;
        pool_used_ += 3 * n * sizeof(float);
        stats_.pool_high_water_bytes = std::max(stats_.pool_high_water_bytes, pool_used_);
        Snapshot kept = TakeKeptLocked(n);
        mu_.Unlock();
        Snapshot copy = kept.data.valid() ? std::move(kept) : AllocateSnapshot(n);
        if (!copy.data.valid()) {
          mu_.Lock();
          NoRoomLocked(l, 3 * n * sizeof(float));
          continue;  // no room now: this layer and the rest are written from the live state
        }
        // A few threads of its own (the update pool is the worker's): a single memcpy stream
        // does not reach the DRAM bandwidth, and every layer copied here is one the next
        // step's update need not copy itself.
        const float* src[3] = {state_->master(l), state_->exp_avg(l), state_->exp_avg_sq(l)};
        float* dst = copy.data.as<float>();
        InParts([&](uint64_t part) {
          const uint64_t b = n * part / kWriterCopyThreads, e = n * (part + 1) / kWriterCopyThreads;
          for (int k = 0; k < 3; ++k) {
            std::memcpy(dst + k * n + b, src[k] + b, (e - b) * sizeof(float));
          }
        });
        mu_.Lock();
        snapshots_[l] = std::move(copy);
        layers_[l] = LayerState::kSnapshotted;
        stats_.layers_copied_by_writer++;
        cv_.SignalAll();
        continue;
      }
    }
    Snapshot snap;
    if (!snapshots_.empty()) {
      auto it = std::prev(snapshots_.end());
      pick = it->first;
      snap = std::move(it->second);
      snapshots_.erase(it);
    } else if (pick >= 0) {
      layers_[static_cast<size_t>(pick)] = LayerState::kWritingLive;
    }
    if (pick < 0) {
      if (std::all_of(layers_.begin(), layers_.end(),
                      [](LayerState s) { return s == LayerState::kDone; })) {
        break;
      }
      // Layers not yet at version t (their update for step t is still to come), being copied,
      // or awaited from the ranks (bounded by client_upload_timeout_ms).
      std::vector<uint32_t> awaited;
      for (uint32_t l = 0; l < num_layers; ++l) {
        if (layers_[l] == LayerState::kAwaitingClient) awaited.push_back(l);
      }
      if (!awaited.empty() && Seconds(started_, Clock::now()) * 1000.0 >
                                  static_cast<double>(options_.client_upload_timeout_ms)) {
        status = absl::DeadlineExceededError(absl::StrCat(
            "checkpoint of step ", step, ": rank 0 did not upload its state of layers ",
            absl::StrJoin(awaited, ", "), " (updated by the ranks: client_updated_layers) within ",
            options_.client_upload_timeout_ms / 1000,
            " s (checkpoint.client_upload_timeout_s); python_client uploads them at opt.step() "
            "when hostd asks, a native rank with client_updated_layers must call "
            "slidedp_rank_upload_client_layer"));
        break;
      }
      cv_.WaitWithTimeout(&mu_, absl::Milliseconds(2));
      continue;
    }
    const uint32_t l = static_cast<uint32_t>(pick);
    mu_.Unlock();
    const auto w0 = Clock::now();
    absl::StatusOr<uint64_t> written;
    if (snap.data.valid()) {
      const float* d = snap.data.as<const float>();
      written = writer->WriteLayer(l, snap.numel, d, d + snap.numel, d + 2 * snap.numel, paced);
    } else {
      written = writer->WriteLayer(l, state_->layers()[l].numel, state_->master(l),
                                   state_->exp_avg(l), state_->exp_avg_sq(l));
    }
    write_s += Seconds(w0, Clock::now());
    const uint64_t freed = snap.data.valid() ? 3 * snap.numel * sizeof(float) : 0;
    mu_.Lock();
    KeepLocked(std::move(snap));
    if (!written.ok()) {
      status = written.status();
      break;
    }
    layers_[l] = LayerState::kDone;
    pool_used_ -= freed;
    if (freed == 0) stats_.layers_written_live++;
    stats_.bytes_written += *written;
    cv_.SignalAll();
  }
  // From here no update needs to wait: release them before the (slow) commit fsyncs.
  model::CheckpointInfo info = std::move(info_);
  // active_ stays true until the result is recorded (Wait, Start); every layer is marked done,
  // so updates pass the hook untouched meanwhile.
  for (auto& s : layers_) s = LayerState::kDone;
  for (auto& [l, s] : snapshots_) KeepLocked(std::move(s));
  snapshots_.clear();
  pool_used_ = 0;
  cv_.SignalAll();
  mu_.Unlock();
  // A checkpoint failed by an update's timeout (FailInFlightLocked) has its cancel reason set
  // while a layer was still busy, so the loop above saw it: it never commits.
  absl::StatusOr<model::CheckpointInfo> committed =
      status.ok() ? writer->Commit(std::move(info)) : absl::StatusOr<model::CheckpointInfo>(status);
  std::vector<std::string> pruned;
  if (committed.ok() && options_.keep_last > 0) {
    auto p = model::PruneCheckpoints(dir, options_.keep_last, step, scope);
    if (p.ok()) {
      pruned = std::move(*p);
    } else {
      spdlog::warn("checkpoint: pruning {}: {}", dir, p.status().ToString());
    }
  }
  const uint64_t direct_bytes = writer ? writer->bytes_written_direct() : 0;
  writer.reset();  // removes the .tmp directory of a failed checkpoint
  mu_.Lock();
  const double total_s = Seconds(started_, Clock::now());
  stats_.write_seconds += write_s;
  stats_.paced_seconds += paced_s;
  stats_.bytes_written_direct += direct_bytes;
  if (failed_) {
    // Recorded, counted and logged when the update gave up waiting; the writer only came back.
    spdlog::info("checkpoint of step {}: the writer returned; its .tmp directory is removed", step);
  } else if (committed.ok()) {
    CheckpointResult r;
    r.step = step;
    r.path = committed->path;
    r.bytes = committed->total_bytes;
    r.seconds = total_s;
    last_ = r;
    last_unix_ms_ = NowUnixMs();
    stats_.checkpoints_committed++;
    stats_.last_seconds = total_s;
    stats_.last_mb_per_s = total_s > 0 ? static_cast<double>(r.bytes) / total_s / 1e6 : 0;
    results_[step] = r;
    spdlog::info("checkpoint of step {} committed: {} ({:.1f} MB in {:.2f} s, {:.0f} MB/s){}", step,
                 r.path, r.bytes / 1e6, total_s, stats_.last_mb_per_s,
                 pruned.empty() ? "" : absl::StrCat("; removed ", pruned.size(), " older"));
  } else {
    stats_.checkpoints_failed++;
    results_[step] = committed.status();
    spdlog::error("checkpoint of step {} failed: {}", step, committed.status().ToString());
  }
  // Old results are of no use beyond a few.
  while (results_.size() > 16) results_.erase(results_.begin());
  active_ = false;
  failed_ = false;
  cancel_reason_.clear();
  cv_.SignalAll();
}

}  // namespace slidedp::hostd
