// The Checkpointer's snapshot buffers (checkpoint.h): anonymous mappings of a layer's master, m
// and v, kept between checkpoints, and their preparation ahead of the first checkpoint.
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <map>

#include "absl/synchronization/mutex.h"
#include "common/mapping.h"
#include "hostd/checkpoint.h"
#include "hostd/checkpoint_internal.h"
#include "spdlog/spdlog.h"

namespace slidedp::hostd {
namespace {

using checkpoint_internal::Clock;
using checkpoint_internal::InParts;
using checkpoint_internal::kWriterCopyThreads;
using checkpoint_internal::Seconds;

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

}  // namespace slidedp::hostd
