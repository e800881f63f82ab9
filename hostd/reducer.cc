#include "hostd/reducer.h"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>

#include <algorithm>
#include <chrono>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/thread_pool.h"
#include "kernels/cpu/bf16.h"
#include "spdlog/spdlog.h"

namespace slidedp::hostd {
namespace {

// Below this a chunk is summed on the reducer thread: waking the pool costs more.
constexpr uint64_t kParallelReduceElems = 1 << 16;

uint32_t DTypeOf(kernels::GradType t) { return t == kernels::GradType::kFp32 ? 1 : 2; }

void FutexWait(uint32_t* word, uint32_t expected, int timeout_ms) {
  timespec ts{timeout_ms / 1000, static_cast<long>(timeout_ms % 1000) * 1000000};
  syscall(SYS_futex, word, FUTEX_WAIT, expected, &ts, nullptr, 0);
}

// dst = src (first rank) or dst += src (later ranks), FP32 adds in element order.
void Accumulate(float* dst, const void* src, kernels::GradType type, uint64_t n, bool first) {
  if (type == kernels::GradType::kFp32) {
    const float* s = static_cast<const float*>(src);
    if (first) {
      std::memcpy(dst, s, n * sizeof(float));
    } else {
      for (uint64_t i = 0; i < n; ++i) dst[i] += s[i];
    }
  } else {
    const uint16_t* s = static_cast<const uint16_t*>(src);
    if (first) {
      for (uint64_t i = 0; i < n; ++i) dst[i] = kernels::Bf16ToFp32(s[i]);
    } else {
      for (uint64_t i = 0; i < n; ++i) dst[i] += kernels::Bf16ToFp32(s[i]);
    }
  }
}

}  // namespace

GradientReducer::GradientReducer(TrainingState* state, ThreadPool* pool, Options options,
                                 SubmitFn submit, ErrorFn on_error)
    : state_(state),
      pool_(pool),
      options_(std::move(options)),
      submit_(std::move(submit)),
      on_error_(std::move(on_error)),
      elem_bytes_(kernels::GradTypeBytes(options_.grad_type)),
      chunk_elems_(state->chunk_bytes() / kernels::GradTypeBytes(options_.grad_type)) {
  uint64_t max_numel = 0;
  for (const LayerInfo& l : state_->layers()) max_numel = std::max(max_numel, l.numel);
  absl::MutexLock lock(&mu_);
  for (Buffer& b : buffers_) b.data.resize(max_numel);
  reduced_.assign(state_->num_layers(), false);
}

GradientReducer::~GradientReducer() { Stop(); }

void GradientReducer::Start() {
  absl::MutexLock lock(&mu_);
  if (thread_.joinable()) return;
  stop_ = false;
  thread_ = std::thread([this] { Run(); });
}

void GradientReducer::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  Ring();
  if (thread_.joinable()) thread_.join();
}

GradientReducer::Stats GradientReducer::stats() const {
  absl::MutexLock lock(&mu_);
  return stats_;
}

void GradientReducer::Ring() {
  shm::ControlBlock& cb = state_->control();
  shm::Atomic(cb.doorbell).fetch_add(1, std::memory_order_acq_rel);
  FutexWakeAll(&cb.doorbell);
}

void GradientReducer::Arm(uint64_t step) {
  {
    absl::MutexLock lock(&mu_);
    armed_step_ = step;
    next_seq_ = 0;
    current_layer_ = -1;
    current_done_ = 0;
    if (current_buffer_ >= 0) buffers_[current_buffer_].busy = false;
    current_buffer_ = -1;
    reduced_.assign(state_->num_layers(), false);
  }
  Ring();
}

void GradientReducer::ClearAllSlotsLocked() {
  for (uint32_t r = 0; r < state_->world_size(); ++r) {
    for (uint32_t s = 0; s < state_->grad_ring_slots(); ++s) {
      shm::ChunkSlot& cs = state_->chunk_slot(r, s);
      shm::Atomic(cs.state).store(shm::kSlotEmpty, std::memory_order_release);
      shm::Atomic(cs.wake_seq).fetch_add(1, std::memory_order_acq_rel);
      FutexWakeAll(&cs.wake_seq);
    }
  }
}

void GradientReducer::Abort(uint64_t step) {
  absl::MutexLock lock(&mu_);
  if (armed_step_ != step) return;
  armed_step_ = 0;
  if (current_buffer_ >= 0) buffers_[current_buffer_].busy = false;  // never submitted
  current_buffer_ = -1;
  current_layer_ = -1;
  ClearAllSlotsLocked();
}

void GradientReducer::FailLocked(const std::string& reason) {
  const uint64_t step = armed_step_;
  spdlog::error("gradient protocol error in step {}: {}", step, reason);
  // Disarmed here, so no further chunk of the step is consumed; on_error_ (which aborts the
  // step through the engine and calls Abort) runs once mu_ is released (TryReduceOne).
  armed_step_ = 0;
  if (current_buffer_ >= 0) buffers_[current_buffer_].busy = false;
  current_buffer_ = -1;
  current_layer_ = -1;
  ClearAllSlotsLocked();
  pending_error_ = {step, reason};
}

void GradientReducer::ReleaseSlots(uint32_t slot) {
  for (uint32_t r : options_.pushing_ranks) {
    shm::ChunkSlot& cs = state_->chunk_slot(r, slot);
    shm::Atomic(cs.state).store(shm::kSlotEmpty, std::memory_order_release);
    shm::Atomic(cs.wake_seq).fetch_add(1, std::memory_order_acq_rel);
    FutexWakeAll(&cs.wake_seq);
  }
}

bool GradientReducer::TryReduceOne() {
  std::pair<uint64_t, std::string> error;
  bool progress = false;
  {
    absl::MutexLock lock(&mu_);
    progress = TryReduceOneLocked();
    error = std::exchange(pending_error_, {0, ""});
  }
  if (!error.second.empty()) on_error_(error.first, error.second);
  return progress;
}

bool GradientReducer::TryReduceOneLocked() {
  if (armed_step_ == 0) return false;
  const uint32_t slots = state_->grad_ring_slots();
  const uint32_t slot = static_cast<uint32_t>(next_seq_ % slots);
  // 1. Is chunk next_seq_ present in every pushing rank's ring?
  for (uint32_t r : options_.pushing_ranks) {
    shm::ChunkSlot& cs = state_->chunk_slot(r, slot);
    if (shm::Atomic(cs.state).load(std::memory_order_acquire) != shm::kSlotFull) return false;
    if (cs.step < armed_step_) {  // left over from an aborted step
      shm::Atomic(cs.state).store(shm::kSlotEmpty, std::memory_order_release);
      shm::Atomic(cs.wake_seq).fetch_add(1, std::memory_order_acq_rel);
      FutexWakeAll(&cs.wake_seq);
      return true;
    }
  }
  // 2. Validate the headers against the protocol and each other.
  const shm::ChunkSlot& h0 = state_->chunk_slot(options_.pushing_ranks[0], slot);
  for (uint32_t r : options_.pushing_ranks) {
    const shm::ChunkSlot& cs = state_->chunk_slot(r, slot);
    if (cs.step != armed_step_ || cs.seq != next_seq_) {
      FailLocked(absl::StrCat("rank ", r, " pushed chunk (step ", cs.step, ", seq ", cs.seq,
                              ") where (step ", armed_step_, ", seq ", next_seq_,
                              ") was expected"));
      return true;
    }
    if (cs.layer != h0.layer || cs.offset_elements != h0.offset_elements || cs.numel != h0.numel ||
        cs.dtype != h0.dtype) {
      FailLocked(absl::StrCat("ranks disagree on chunk ", next_seq_, ": rank ", r, " sent layer ",
                              cs.layer, " offset ", cs.offset_elements, " numel ", cs.numel,
                              ", rank ", options_.pushing_ranks[0], " sent layer ", h0.layer,
                              " offset ", h0.offset_elements, " numel ", h0.numel));
      return true;
    }
  }
  if (h0.dtype != DTypeOf(options_.grad_type)) {
    FailLocked(absl::StrCat("chunk dtype ", h0.dtype, ", expected ", DTypeOf(options_.grad_type)));
    return true;
  }
  if (h0.layer >= state_->num_layers()) {
    FailLocked(absl::StrCat("chunk for unknown layer ", h0.layer));
    return true;
  }
  const uint64_t layer_numel = state_->layers()[h0.layer].numel;
  if (current_layer_ >= 0 && h0.layer != current_layer_) {
    FailLocked(absl::StrCat("chunk of layer ", h0.layer, " while layer ", current_layer_,
                            " is incomplete"));
    return true;
  }
  if (current_layer_ < 0 && reduced_[h0.layer]) {
    FailLocked(absl::StrCat("layer ", h0.layer, " pushed twice in step ", armed_step_));
    return true;
  }
  const uint64_t expect_offset = current_layer_ < 0 ? 0 : current_done_;
  const uint64_t expect_numel = std::min(chunk_elems_, layer_numel - expect_offset);
  if (h0.offset_elements != expect_offset || h0.numel != expect_numel) {
    FailLocked(absl::StrCat("layer ", h0.layer, ": chunk at offset ", h0.offset_elements, " with ",
                            h0.numel, " elements, expected offset ", expect_offset, " with ",
                            expect_numel));
    return true;
  }
  // 3. A buffer for a new layer (wait while the worker holds both).
  if (current_layer_ < 0) {
    int free_buffer = -1;
    for (int b = 0; b < 2; ++b) {
      if (!buffers_[b].busy) free_buffer = b;
    }
    if (free_buffer < 0) return false;
    buffers_[free_buffer].busy = true;
    current_buffer_ = free_buffer;
    current_layer_ = h0.layer;
    current_done_ = 0;
  }
  // 4. Reduce in fixed rank order.
  const auto t0 = std::chrono::steady_clock::now();
  float* dst = buffers_[current_buffer_].data.data() + h0.offset_elements;
  auto reduce_range = [&](size_t b, size_t e, int) {
    bool first = true;
    for (uint32_t r : options_.pushing_ranks) {
      const auto* src = static_cast<const char*>(state_->grad_slot_data(r, slot));
      Accumulate(dst + b, src + b * elem_bytes_, options_.grad_type, e - b, first);
      first = false;
    }
  };
  if (pool_ != nullptr && h0.numel >= kParallelReduceElems) {
    pool_->ParallelFor(h0.numel, 64, reduce_range);
  } else {
    reduce_range(0, h0.numel, 0);
  }
  stats_.chunks_reduced++;
  stats_.bytes_reduced += h0.numel * elem_bytes_ * options_.pushing_ranks.size();
  stats_.reduce_seconds +=
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const uint32_t layer = h0.layer;
  current_done_ += h0.numel;
  ReleaseSlots(slot);
  next_seq_++;
  // 5. A complete layer goes to the update worker.
  if (current_done_ == layer_numel) {
    const int b = current_buffer_;
    reduced_[layer] = true;
    current_layer_ = -1;
    current_buffer_ = -1;
    absl::Status s =
        submit_(layer, armed_step_,
                GradientRef{buffers_[b].data.data(), kernels::GradType::kFp32, layer_numel},
                [this, b](const LayerUpdateResult&) {
                  {
                    absl::MutexLock l(&mu_);
                    buffers_[b].busy = false;
                  }
                  Ring();
                });
    if (!s.ok()) {
      buffers_[b].busy = false;
      FailLocked(absl::StrCat("update of layer ", layer, " refused: ", s.ToString()));
    }
  }
  return true;
}

void GradientReducer::Run() {
  shm::ControlBlock& cb = state_->control();
  for (;;) {
    const uint32_t bell = shm::Atomic(cb.doorbell).load(std::memory_order_acquire);
    {
      absl::MutexLock lock(&mu_);
      if (stop_) return;
    }
    if (TryReduceOne()) continue;
    FutexWait(&cb.doorbell, bell, 50);
  }
}

}  // namespace slidedp::hostd
