#include "hostd/checkpoint.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/status_macros.h"
#include "common/thread_pool.h"
#include "common/unique_fd.h"
#include "kernels/cpu/adamw.h"
#include "model/manifest.h"
#include "spdlog/spdlog.h"

namespace slidedp::hostd {
namespace fs = std::filesystem;
namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

int64_t NowUnixMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

std::string ShapeText(const slidedp::v1::TensorSpec& t) {
  return absl::StrCat("[", absl::StrJoin(t.shape(), ", "), "]");
}

// Reads exactly `n` bytes at the file's current offset into `dst`, hashing them.
absl::Status ReadExact(int fd, void* dst, size_t n, const std::string& path, XXH3_state_t* st) {
  char* p = static_cast<char*>(dst);
  while (n > 0) {
    const ssize_t r = read(fd, p, std::min<size_t>(n, size_t{64} << 20));
    if (r < 0) {
      if (errno == EINTR) continue;
      return ErrnoStatus("read " + path);
    }
    if (r == 0) return absl::DataLossError(absl::StrCat("layer file ", path, " is truncated"));
    XXH3_64bits_update(st, p, static_cast<size_t>(r));
    p += r;
    n -= static_cast<size_t>(r);
  }
  return absl::OkStatus();
}

// Says which newer step directories of `dir` were passed over for `found` and why (an
// interrupted write is expected after a crash; a marked one that fails its checks is not).
// `consider`: which listings are candidates at all.
void LogSkipped(const std::string& dir, const model::CheckpointInfo& found,
                const std::function<bool(const model::CheckpointListing&)>& consider) {
  absl::StatusOr<std::vector<model::CheckpointListing>> all = model::ListCheckpoints(dir, false);
  if (!all.ok()) return;
  for (const model::CheckpointListing& l : *all) {  // newest first
    if (l.path == found.path || l.step < found.step) break;
    if (!l.valid && consider(l)) {
      spdlog::warn("checkpoint {}: newer than {} but skipped: {}", l.path, found.path, l.reason);
    }
  }
}

}  // namespace

absl::StatusOr<model::CheckpointInfo> FindLatestCheckpoint(const std::string& path) {
  absl::StatusOr<model::CheckpointInfo> info = model::FindLatestCheckpointInfo(path);
  if (!info.ok() || info->path == path) return info;
  LogSkipped(path, *info, [](const model::CheckpointListing&) { return true; });
  return info;
}

absl::StatusOr<model::CheckpointInfo> FindLatestCheckpoint(const std::string& dir,
                                                           const model::CheckpointScope& scope) {
  absl::StatusOr<model::CheckpointInfo> info = model::FindLatestCheckpointInfo(dir, scope);
  if (!info.ok()) return info;
  const std::string mine = model::CheckpointScopeName(scope);
  LogSkipped(dir, *info,
             [&mine](const model::CheckpointListing& l) { return l.scope_name == mine; });
  return info;
}

absl::Status CheckCheckpointManifest(const model::CheckpointInfo& info,
                                     const slidedp::v1::ModelManifest& manifest) {
  const std::string have = model::ManifestHashHex(model::ManifestHash(manifest));
  const std::string want = model::ManifestHashHex(model::ManifestHash(info.spec.manifest()));
  if (have == want && info.manifest_hash == want) return absl::OkStatus();
  const auto& a = info.spec.manifest();
  std::string diff;
  const int layers = std::min(a.layers_size(), manifest.layers_size());
  for (int l = 0; l < layers && diff.empty(); ++l) {
    const auto& la = a.layers(l);
    const auto& lb = manifest.layers(l);
    if (la.name() != lb.name() || la.kind() != lb.kind()) {
      diff = absl::StrCat("layer ", l, " is '", la.name(), "' in the checkpoint, '", lb.name(),
                          "' in the model");
      break;
    }
    const int tensors = std::min(la.tensors_size(), lb.tensors_size());
    for (int t = 0; t < tensors; ++t) {
      const auto& ta = la.tensors(t);
      const auto& tb = lb.tensors(t);
      if (ta.name() != tb.name() || ShapeText(ta) != ShapeText(tb) || ta.dtype() != tb.dtype() ||
          ta.no_decay() != tb.no_decay()) {
        diff =
            absl::StrCat("first differing tensor: '", ta.name(), "' ", ShapeText(ta),
                         " in the checkpoint, '", tb.name(), "' ", ShapeText(tb), " in the model");
        break;
      }
    }
    if (diff.empty() && la.tensors_size() != lb.tensors_size()) {
      diff = absl::StrCat("layer ", l, " '", la.name(), "' has ", la.tensors_size(),
                          " tensors in the checkpoint, ", lb.tensors_size(), " in the model");
    }
  }
  if (diff.empty() && a.layers_size() != manifest.layers_size()) {
    diff = absl::StrCat("the checkpoint has ", a.layers_size(), " layers, the model ",
                        manifest.layers_size());
  }
  if (diff.empty()) diff = "the model's family, name or tied embeddings differ";
  return absl::FailedPreconditionError(absl::StrCat(
      "checkpoint ", info.path, " is of model manifest ", want, " (", a.name(),
      "), but the job's model has manifest ", have, " (", manifest.name(), "); ", diff));
}

absl::Status RestoreCheckpoint(const model::CheckpointInfo& info, TrainingState* state,
                               ThreadPool* pool,
                               const std::function<bool(uint32_t layers_done)>& progress) {
  RETURN_IF_ERROR(CheckCheckpointManifest(info, state->model().manifest));
  if (info.files.size() != state->num_layers()) {
    return absl::DataLossError(absl::StrCat("checkpoint ", info.path, ": ", info.files.size(),
                                            " layer files for ", state->num_layers(), " layers"));
  }
  for (const model::CheckpointFile& f : info.files) {
    if (f.numel != state->layers()[f.layer].numel) {
      return absl::DataLossError(absl::StrCat("checkpoint ", info.path, ": layer file ", f.name,
                                              " holds ", f.numel, " elements, layer ", f.layer,
                                              " has ", state->layers()[f.layer].numel));
    }
  }
  const kernels::Isa isa = kernels::BestIsa();
  uint32_t restored = 0;
  for (const model::CheckpointFile& f : info.files) {
    const std::string path = (fs::path(info.path) / f.name).string();
    UniqueFd fd(open(path.c_str(), O_RDONLY | O_CLOEXEC));
    if (!fd.valid()) return ErrnoStatus("open " + path);
    XXH3_state_t* st = XXH3_createState();
    XXH3_64bits_reset(st);
    model::LayerFileHeader h{};
    absl::Status s = ReadExact(fd.get(), &h, sizeof(h), path, st);
    // The rest of the header block (zeros; hashed like every byte of the file).
    std::vector<char> pad(model::LayerDataOffset(info.format) - sizeof(h));
    if (s.ok() && !pad.empty()) s = ReadExact(fd.get(), pad.data(), pad.size(), path, st);
    const uint32_t l = f.layer;
    for (float* dst : {state->master(l), state->exp_avg(l), state->exp_avg_sq(l)}) {
      if (s.ok()) s = ReadExact(fd.get(), dst, f.numel * sizeof(float), path, st);
    }
    char extra = 0;
    if (s.ok() && read(fd.get(), &extra, 1) > 0) {
      s = absl::DataLossError(absl::StrCat("layer file ", path, " is longer than meta.json says"));
    }
    fd.reset();
    const uint64_t hash = XXH3_64bits_digest(st);
    XXH3_freeState(st);
    if (!s.ok()) return Annotate(s, absl::StrCat("checkpoint ", info.path));
    if (hash != f.xxh64) {
      return absl::DataLossError(absl::StrFormat(
          "checkpoint %s: layer file %s has checksum %016x, meta.json says %016x (corrupted)",
          info.path, f.name, hash, f.xxh64));
    }
    if (std::memcmp(h.magic, model::kLayerFileMagic, sizeof(h.magic)) != 0 || h.layer != l ||
        h.numel != f.numel || h.step != info.step || h.format != info.format) {
      return absl::DataLossError(absl::StrCat("checkpoint ", info.path, ": layer file ", f.name,
                                              " has a header that does not match meta.json"));
    }
    const float* w = state->master(l);
    uint16_t* p = state->params(l);
    auto cast = [&](size_t b, size_t e, int) { kernels::CastFp32ToBf16(isa, w + b, p + b, e - b); };
    if (pool != nullptr) {
      pool->ParallelFor(f.numel, 64, cast);
    } else {
      cast(0, f.numel, 0);
    }
    ++restored;
    if (progress && !progress(restored)) {
      return absl::CancelledError(absl::StrCat("the restore of checkpoint ", info.path,
                                               " was cancelled after ", restored, " layers"));
    }
  }
  for (uint32_t l = 0; l < state->num_layers(); ++l) {
    state->BeginLayerWrite(l, info.step);
    state->PublishLayer(l, info.step);
  }
  shm::Atomic(state->control().next_step).store(info.step + 1, std::memory_order_release);
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------------------
// Checkpointer

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

namespace {
constexpr uint64_t kWriterCopyThreads = 4;

// fn(0) .. fn(kWriterCopyThreads - 1), each on a thread (part 0 on the caller's): the writer's
// copies and the preparer's page faults, off the update pool, which is the worker's.
template <typename Fn>
void InParts(const Fn& fn) {
  std::vector<std::thread> helpers;
  for (uint64_t part = 1; part < kWriterCopyThreads; ++part) helpers.emplace_back(fn, part);
  fn(uint64_t{0});
  for (std::thread& t : helpers) t.join();
}
#ifdef MADV_POPULATE_WRITE
constexpr int kMadvPopulateWrite = MADV_POPULATE_WRITE;
#else
constexpr int kMadvPopulateWrite = 23;  // Linux 5.14; older kernels answer EINVAL
#endif
}  // namespace

Checkpointer::Snapshot Checkpointer::AllocateSnapshot(uint64_t numel) {
  const size_t bytes = 3 * numel * sizeof(float);
  absl::StatusOr<Mapping> mapped = Mapping::Anonymous(bytes, "checkpoint snapshot buffer");
  if (!mapped.ok()) return Snapshot{};  // the caller writes the layer from the live state
  {
    absl::MutexLock lock(&mu_);
    stats_.snapshot_buffers_allocated++;
  }
  if (options_.snapshot_huge_pages) madvise(mapped->data(), bytes, MADV_HUGEPAGE);  // best effort
  Snapshot snap;
  snap.data = std::move(*mapped);
  snap.numel = numel;
  return snap;
}

Checkpointer::Snapshot Checkpointer::TakeKeptLocked(uint64_t numel) {
  auto it = kept_.find(numel);
  if (it == kept_.end()) return Snapshot{};
  Snapshot s = std::move(it->second);
  kept_.erase(it);
  kept_bytes_ -= 3 * numel * sizeof(float);
  stats_.pool_kept_bytes = kept_bytes_;
  return s;
}

void Checkpointer::KeepLocked(Snapshot s) {
  if (!options_.keep_snapshot_pool || !s.data.valid()) return;  // freed here
  kept_bytes_ += 3 * s.numel * sizeof(float);
  kept_.emplace(s.numel, std::move(s));
  stats_.pool_kept_bytes = kept_bytes_;
}

void Checkpointer::TrimKeptLocked(uint64_t bytes) {
  while (kept_bytes_ > bytes && !kept_.empty()) {
    auto it = std::prev(kept_.end());  // the largest first
    kept_bytes_ -= 3 * it->first * sizeof(float);
    kept_.erase(it);
  }
  stats_.pool_kept_bytes = kept_bytes_;
}

uint64_t Checkpointer::PoolSizeLocked() const {
  return options_.snapshot_pool_at_start ? options_.snapshot_pool_at_start(kept_bytes_)
                                         : options_.snapshot_pool_bytes;
}

void Checkpointer::NoRoomLocked(uint32_t layer, uint64_t bytes) {
  layers_[layer] = LayerState::kPending;
  pool_used_ -= bytes;
  pool_bytes_ = pool_used_;  // no more copies: the rest is written from the live state
  stats_.snapshot_alloc_failures++;
  spdlog::warn(
      "checkpoint of step {}: no memory for a snapshot of layer {} ({:.2f} GiB); the pool stays "
      "at {:.2f} GiB and the other layers are written from the live state (updates that need "
      "them wait for the disk)",
      step_, layer, bytes / 1073741824.0, pool_used_ / 1073741824.0);
  cv_.SignalAll();
}

void Checkpointer::PreparePool() {
  absl::MutexLock lock(&mu_);
  if (stop_ || !options_.keep_snapshot_pool || preparing_) return;
  if (preparer_.joinable()) preparer_.join();  // done: preparing_ is false
  preparing_ = true;
  preparer_ = std::thread([this] { RunPrepare(); });
}

void Checkpointer::RunPrepare() {
  absl::MutexLock lock(&mu_);
  PrepareLocked();
  preparing_ = false;
}

void Checkpointer::PrepareLocked() {
  const uint64_t target = PoolSizeLocked();
  // Buffers already kept count for the layers of their size, highest layer first (the order
  // the writer captures them in).
  std::map<uint64_t, uint64_t> unclaimed;
  for (const auto& [numel, snap] : kept_) unclaimed[numel]++;
  std::vector<uint64_t> wanted;
  uint64_t planned = kept_bytes_;
  const auto& layers = state_->layers();
  for (uint32_t l = static_cast<uint32_t>(layers.size()); l-- > 0;) {
    const uint64_t numel = layers[l].numel;
    if (auto it = unclaimed.find(numel); it != unclaimed.end() && it->second > 0) {
      it->second--;
      continue;
    }
    const uint64_t bytes = 3 * numel * sizeof(float);
    if (numel == 0 || planned + bytes > target) continue;
    planned += bytes;
    wanted.push_back(numel);
  }
  if (wanted.empty()) return;
  const auto t0 = Clock::now();
  const long page = sysconf(_SC_PAGESIZE) > 0 ? sysconf(_SC_PAGESIZE) : 4096;
  uint64_t prepared = 0;
  for (uint64_t numel : wanted) {
    if (stop_ || active_) break;  // a checkpoint takes what is ready
    mu_.Unlock();
    Snapshot snap = AllocateSnapshot(numel);
    const uint64_t n = 3 * numel * sizeof(float);
    // Fault every page in (the kernel zero-fills it), a part per thread: one thread zero-filled
    // ~1.7 GiB/s on the H200 host, so a 45 GiB pool was a third ready when the checkpoint of
    // step 8 came. In one call per part where the kernel has MADV_POPULATE_WRITE (5.14), else
    // one write per page.
    if (snap.data.valid()) {
      auto* base = snap.data.as<char>();
      const uint64_t pages = (n + static_cast<uint64_t>(page) - 1) / static_cast<uint64_t>(page);
      auto fault_part = [&](uint64_t part) {
        const uint64_t b = pages * part / kWriterCopyThreads * static_cast<uint64_t>(page);
        const uint64_t e = std::min<uint64_t>(n, pages * (part + 1) / kWriterCopyThreads * page);
        if (b >= e || madvise(base + b, e - b, kMadvPopulateWrite) == 0) return;
        auto* bytes = reinterpret_cast<volatile char*>(base);
        for (uint64_t off = b; off < e; off += static_cast<uint64_t>(page)) bytes[off] = 0;
      };
      InParts(fault_part);
    }
    if (!snap.data.valid()) {
      mu_.Lock();
      spdlog::warn(
          "checkpoint snapshot pool: preparing it stopped at {:.2f} GiB: no memory "
          "for a buffer of {:.2f} GiB; the next checkpoint allocates the rest",
          prepared / 1073741824.0, 3.0 * numel * sizeof(float) / 1073741824.0);
      break;
    }
    mu_.Lock();
    prepared += 3 * numel * sizeof(float);
    KeepLocked(std::move(snap));
  }
  const double s = Seconds(t0, Clock::now());
  stats_.pool_prepared_bytes += prepared;
  stats_.pool_prepare_seconds += s;
  if (prepared > 0) {
    spdlog::info("checkpoint snapshot pool prepared: {:.2f} GiB in {:.2f} s ({:.2f} GiB kept)",
                 prepared / 1073741824.0, s, kept_bytes_ / 1073741824.0);
  }
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
