#include "hostd/reducer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/thread_pool.h"
#include "kernels/cpu/bf16.h"
#include "proto/doorbell.h"
#include "spdlog/spdlog.h"

namespace slidedp::hostd {
namespace {

// Below this a chunk is summed on the reducer thread: waking the pool costs more.
constexpr uint64_t kParallelReduceElems = 1 << 16;

// The shared-memory DType of the job's gradients, as the integer a chunk header carries.
uint32_t DTypeOf(kernels::GradType t) {
  return static_cast<uint32_t>(t == kernels::GradType::kFp32 ? shm::DType::kFp32
                                                             : shm::DType::kBf16);
}

// How long the reducer sleeps on the doorbell before it looks at its state again.
constexpr std::chrono::milliseconds kDoorbellSleep(50);

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

GradientReducer::GradientReducer(TrainingState* state, ThreadPool* pool, UpdateWorker* worker,
                                 Options options, UpdateWorker::DoneFn on_layer_done,
                                 ErrorFn on_error)
    : state_(state),
      pool_(pool),
      worker_(worker),
      options_(std::move(options)),
      on_layer_done_(std::move(on_layer_done)),
      on_error_(std::move(on_error)),
      elem_bytes_(kernels::GradTypeBytes(options_.grad_type)),
      chunk_elems_(state->chunk_bytes() / kernels::GradTypeBytes(options_.grad_type)) {
  uint64_t max_numel = 0;
  for (const LayerInfo& l : state_->layers()) max_numel = std::max(max_numel, l.numel);
  absl::MutexLock lock(&mu_);
  route_ = options_.route;
  pushing_ranks_ = options_.pushing_ranks;
  buffer_elems_ = max_numel;
  // Allocated at first use: the streamed route (and layers the ranks update themselves) may
  // never need them, and each is as large as the largest layer (the embeddings: GBs).
  buffers_.resize(2);
  reduced_.assign(state_->num_layers(), false);
  cursors_.assign(pushing_ranks_.size(), Cursor{});
  sum_heads_.resize(pushing_ranks_.size());
  lent_.assign(size_t{state_->world_size()} * state_->grad_ring_slots(), false);
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

uint32_t GradientReducer::FullSlotsOfStep(uint32_t rank, uint64_t step) const {
  absl::MutexLock lock(&mu_);
  uint32_t n = 0;
  for (uint32_t s = 0; s < state_->grad_ring_slots(); ++s) {
    shm::ChunkSlot& cs = state_->chunk_slot(rank, s);
    if (shm::SlotIsFull(cs) && cs.step == step) {
      n++;
    }
  }
  return n;
}

void GradientReducer::Ring() { shm::Doorbell(&state_->control().doorbell).Ring(); }

void GradientReducer::ResetLayerLocked() {
  if (current_buffer_ >= 0) buffers_[current_buffer_].busy = false;  // never submitted
  current_buffer_ = -1;
  current_layer_ = -1;
  current_done_ = 0;
  current_streamed_ = false;
}

void GradientReducer::Arm(uint64_t step) {
  {
    absl::MutexLock lock(&mu_);
    if (armed_step_ == 0 || step != armed_step_ + 1) ClearAllSlotsLocked();
    armed_step_ = step;
    next_seq_ = 0;
    cursors_.assign(pushing_ranks_.size(), Cursor{});
    ResetLayerLocked();
    reduced_.assign(state_->num_layers(), false);
  }
  Ring();
}

absl::Status GradientReducer::SetRoute(Route route, std::vector<uint32_t> pushing_ranks) {
  if (pushing_ranks.empty()) {
    return absl::InvalidArgumentError("pushing_ranks: expected at least one rank, got none");
  }
  for (uint32_t r : pushing_ranks) {
    if (r >= state_->world_size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("pushing_ranks: rank ", r, " of world size ", state_->world_size()));
    }
  }
  {
    absl::MutexLock lock(&mu_);
    if (armed_step_ != 0 && current_layer_ >= 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("the route changes only between steps; step ", armed_step_,
                       " is reducing layer ", current_layer_));
    }
    if (std::find(lent_.begin(), lent_.end(), true) != lent_.end()) {
      return absl::FailedPreconditionError(
          "the route changes only between steps; the update worker still reads gradient slots");
    }
    route_ = route;
    pushing_ranks_ = std::move(pushing_ranks);
    armed_step_ = 0;  // the next Arm clears the rings: nothing pushed before belongs to it
    next_seq_ = 0;
    cursors_.assign(pushing_ranks_.size(), Cursor{});
    sum_heads_.assign(pushing_ranks_.size(), ChunkHeader{});
    ResetLayerLocked();
  }
  Ring();
  return absl::OkStatus();
}

void GradientReducer::EmptySlotLocked(uint32_t rank, uint32_t slot) {
  // A lent slot's data is still being read by the worker: the rank must not refill it yet.
  if (lent_[size_t{rank} * state_->grad_ring_slots() + slot]) return;
  shm::ReleaseSlot(state_->chunk_slot(rank, slot));
}

void GradientReducer::ClearAllSlotsLocked() {
  for (uint32_t r = 0; r < state_->world_size(); ++r) {
    for (uint32_t s = 0; s < state_->grad_ring_slots(); ++s) EmptySlotLocked(r, s);
  }
}

void GradientReducer::Abort(uint64_t step) {
  absl::MutexLock lock(&mu_);
  if (armed_step_ != step) return;
  armed_step_ = 0;
  ResetLayerLocked();
  ClearAllSlotsLocked();
}

void GradientReducer::DiscardStep(uint64_t step) {
  {
    absl::MutexLock lock(&mu_);
    for (uint32_t r = 0; r < state_->world_size(); ++r) {
      for (uint32_t s = 0; s < state_->grad_ring_slots(); ++s) {
        ChunkHeader h;
        if (shm::ReadFullSlot(state_->chunk_slot(r, s), &h) && h.step == step) {
          EmptySlotLocked(r, s);
        }
      }
    }
  }
  Ring();
}

void GradientReducer::FailLocked(const std::string& reason) {
  const uint64_t step = armed_step_;
  spdlog::error("gradient protocol error in step {}: {}", step, reason);
  // Disarmed here, so no further chunk of the step is consumed; on_error_ (which aborts the
  // step through the engine and calls Abort) runs once mu_ is released (TryReduceOne).
  armed_step_ = 0;
  ResetLayerLocked();
  ClearAllSlotsLocked();
  pending_error_ = {step, reason};
}

void GradientReducer::ReleaseSlots(uint32_t slot) {
  for (uint32_t r : pushing_ranks_) EmptySlotLocked(r, slot);
}

void GradientReducer::ReturnSlot(uint32_t rank, uint32_t slot) {
  {
    absl::MutexLock lock(&mu_);
    lent_[size_t{rank} * state_->grad_ring_slots() + slot] = false;
    EmptySlotLocked(rank, slot);
  }
  Ring();  // the reducer may be waiting for this slot (its cursor came round to it)
}

bool GradientReducer::TryReduceOne() {
  std::pair<uint64_t, std::string> error;
  bool progress = false;
  {
    absl::MutexLock lock(&mu_);
    progress = route_ == Route::kSum ? TrySumLocked() : TryShardsLocked();
    error = std::exchange(pending_error_, {0, ""});
  }
  if (!error.second.empty()) on_error_(error.first, error.second);
  return progress;
}

void GradientReducer::SubmitBufferLocked(uint64_t numel) {
  const int b = current_buffer_;
  const auto layer = static_cast<uint32_t>(current_layer_);
  reduced_[layer] = true;
  current_buffer_ = -1;  // now the worker's, freed by the done callback
  ResetLayerLocked();
  absl::Status s = worker_->Submit(
      layer, armed_step_, GradientRef{buffers_[b].data.data(), kernels::GradType::kFp32, numel},
      [this, b](const LayerUpdateResult& r) {
        {
          absl::MutexLock l(&mu_);
          buffers_[b].busy = false;
        }
        Ring();
        if (on_layer_done_) on_layer_done_(r);
      });
  if (!s.ok()) {
    buffers_[b].busy = false;
    FailLocked(absl::StrCat("update of layer ", layer, " refused: ", s.ToString()));
    return;
  }
  stats_.layers_buffered++;
}

bool GradientReducer::TrySumLocked() {
  if (armed_step_ == 0) return false;
  const uint32_t slots = state_->grad_ring_slots();
  const uint32_t slot = static_cast<uint32_t>(next_seq_ % slots);
  // 1. Is chunk next_seq_ present in every pushing rank's ring? Each header is read here, once.
  const size_t parts = pushing_ranks_.size();
  for (size_t i = 0; i < parts; ++i) {
    const uint32_t r = pushing_ranks_[i];
    ChunkHeader& h = sum_heads_[i];
    if (!shm::ReadFullSlot(state_->chunk_slot(r, slot), &h)) return false;
    if (h.step < armed_step_) {  // left over from an aborted step
      EmptySlotLocked(r, slot);
      return true;
    }
    // The next step, pushed early by a rank that is done with this one: it waits for Arm.
    if (h.step == armed_step_ + 1) return false;
  }
  // 2. Validate the headers against the protocol and each other.
  const ChunkHeader& h0 = sum_heads_[0];
  for (size_t i = 0; i < parts; ++i) {
    const uint32_t r = pushing_ranks_[i];
    const ChunkHeader& cs = sum_heads_[i];
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
                              ", rank ", pushing_ranks_[0], " sent layer ", h0.layer, " offset ",
                              h0.offset_elements, " numel ", h0.numel));
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
    const int free_buffer = AcquireBufferLocked();
    if (free_buffer < 0) return false;
    current_buffer_ = free_buffer;
    current_layer_ = h0.layer;
    current_done_ = 0;
  }
  // 4. Reduce in fixed rank order.
  const auto t0 = std::chrono::steady_clock::now();
  float* dst = buffers_[current_buffer_].data.data() + h0.offset_elements;
  // Read here, under mu_: the pool's threads run the lambda while this thread holds mu_ and waits.
  const std::vector<uint32_t>* ranks = &pushing_ranks_;
  auto reduce_range = [&](size_t b, size_t e, int) {
    bool first = true;
    for (uint32_t r : *ranks) {
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
  stats_.bytes_reduced += h0.numel * elem_bytes_ * pushing_ranks_.size();
  stats_.reduce_seconds +=
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  current_done_ += h0.numel;
  ReleaseSlots(slot);
  next_seq_++;
  // 5. A complete layer goes to the update worker.
  if (current_done_ == layer_numel) SubmitBufferLocked(layer_numel);
  return true;
}

bool GradientReducer::PeekLocked(size_t i, bool* progress, ChunkHeader* h) {
  const uint32_t r = pushing_ranks_[i];
  const uint32_t slots = state_->grad_ring_slots();
  const auto slot = static_cast<uint32_t>(cursors_[i].next_seq % slots);
  // Still lent: it holds chunk next_seq - slots (or one of an aborted step) until the worker has
  // written it; the rank cannot have refilled it.
  if (lent_[size_t{r} * slots + slot]) return false;
  if (!shm::ReadFullSlot(state_->chunk_slot(r, slot), h)) return false;
  if (h->step < armed_step_) {  // left over from an aborted step
    EmptySlotLocked(r, slot);
    *progress = true;
    return false;
  }
  // The next step, pushed early by a rank that is done with this one: it waits for Arm.
  return h->step != armed_step_ + 1;
}

bool GradientReducer::CheckShardChunkLocked(size_t i, const ChunkHeader& cs, uint32_t layer) {
  const uint32_t r = pushing_ranks_[i];
  const Cursor& c = cursors_[i];
  if (cs.step != armed_step_ || cs.seq != c.next_seq) {
    FailLocked(absl::StrCat("rank ", r, " pushed chunk (step ", cs.step, ", seq ", cs.seq,
                            ") where (step ", armed_step_, ", seq ", c.next_seq, ") was expected"));
    return false;
  }
  if (cs.layer != layer) {
    FailLocked(absl::StrCat("rank ", r, ", chunk seq ", cs.seq, ": layer: got ", cs.layer,
                            ", expected ", layer,
                            " (the layer the ranks are on; every rank pushes layers in the same "
                            "order)"));
    return false;
  }
  if (cs.dtype != DTypeOf(options_.grad_type)) {
    FailLocked(absl::StrCat("rank ", r, ", chunk seq ", cs.seq, ": dtype: got ", cs.dtype,
                            ", expected ", DTypeOf(options_.grad_type)));
    return false;
  }
  const uint64_t expect_offset = c.begin + c.done;
  const uint64_t expect_numel = std::min(chunk_elems_, c.end - expect_offset);
  const std::string shard = absl::StrCat("rank ", r, "'s shard of layer ", layer, " is [", c.begin,
                                         ", ", c.end, "), ", c.done, " elements of it arrived");
  if (cs.offset_elements != expect_offset) {
    FailLocked(absl::StrCat("rank ", r, ", layer ", layer, " chunk seq ", cs.seq,
                            ": offset_elements: got ", cs.offset_elements, ", expected ",
                            expect_offset, " (", shard, ")"));
    return false;
  }
  if (cs.numel != expect_numel) {
    FailLocked(absl::StrCat("rank ", r, ", layer ", layer, " chunk seq ", cs.seq, ": numel: got ",
                            cs.numel, ", expected ", expect_numel, " (", shard,
                            cs.numel > chunk_elems_
                                ? absl::StrCat("; a slot holds at most ", chunk_elems_, " elements")
                                : std::string(),
                            ")"));
    return false;
  }
  return true;
}

bool GradientReducer::StartShardLayerLocked(bool* progress) {
  ChunkHeader h;
  if (!PeekLocked(0, progress, &h)) return false;
  const uint32_t r0 = pushing_ranks_[0];
  if (h.step != armed_step_ || h.seq != cursors_[0].next_seq) {
    FailLocked(absl::StrCat("rank ", r0, " pushed chunk (step ", h.step, ", seq ", h.seq,
                            ") where (step ", armed_step_, ", seq ", cursors_[0].next_seq,
                            ") was expected"));
    return false;
  }
  if (h.layer >= state_->num_layers()) {
    FailLocked(absl::StrCat("rank ", r0, ", chunk seq ", h.seq, ": layer: got ", h.layer,
                            ", expected a layer of the model (0..", state_->num_layers() - 1, ")"));
    return false;
  }
  if (reduced_[h.layer]) {
    FailLocked(absl::StrCat("rank ", r0, ", chunk seq ", h.seq, ": layer: got ", h.layer,
                            ", but layer ", h.layer, " was already pushed in step ", armed_step_));
    return false;
  }
  const uint32_t layer = h.layer;
  const uint64_t numel = state_->layers()[layer].numel;
  const auto parts = static_cast<uint32_t>(pushing_ranks_.size());
  for (uint32_t i = 0; i < parts; ++i) {
    const shm::ShardRange sh = shm::ShardOf(numel, parts, i);
    cursors_[i].begin = sh.begin;
    cursors_[i].end = sh.begin + sh.numel;
    cursors_[i].done = 0;
  }
  // Streamed only if every contributing rank's first chunk carries the stats; so wait for all of
  // them (each is already at its rank's cursor or on its way: the layers before are complete).
  bool stream = options_.granularity != Granularity::kLayer;
  std::string why_buffered = "update_granularity is layer";
  double sum_squares = 0;
  bool nonfinite = false;
  if (stream) {
    for (uint32_t i = 0; i < parts; ++i) {
      if (cursors_[i].end == cursors_[i].begin) continue;  // empty shard: 0, finite, no chunk
      ChunkHeader cs;
      if (!PeekLocked(i, progress, &cs)) return false;
      if (!CheckShardChunkLocked(i, cs, layer)) return false;
      const uint32_t r = pushing_ranks_[i];
      if ((cs.flags & shm::kChunkFlagStats) == 0) {
        stream = false;
        why_buffered = absl::StrCat("rank ", r, "'s first chunk carries no stats");
        break;
      }
      if ((cs.flags & shm::kChunkFlagNonFinite) != 0) {
        nonfinite = true;
      } else if (!(cs.stats_sumsq >= 0) || !std::isfinite(cs.stats_sumsq)) {
        FailLocked(absl::StrCat(
            "rank ", r, ", layer ", layer, " chunk seq ", cs.seq, ": stats_sumsq: got ",
            cs.stats_sumsq, ", expected a finite sum of squares >= 0 (or kChunkFlagNonFinite)"));
        return false;
      } else {
        sum_squares += cs.stats_sumsq;  // in rank order: deterministic
      }
    }
  }
  if (stream) {
    absl::StatusOr<bool> began = worker_->BeginStreamedLayer(
        layer, armed_step_, nonfinite ? 0.0 : sum_squares, nonfinite, on_layer_done_);
    if (!began.ok()) {
      FailLocked(absl::StrCat("update of layer ", layer, " refused: ", began.status().ToString()));
      return false;
    }
    if (!*began) {
      stream = false;
      why_buffered = "clip is global";
    }
  }
  if (!stream) {
    const int free_buffer = AcquireBufferLocked();
    if (free_buffer < 0) return false;
    current_buffer_ = free_buffer;
    if (options_.granularity == Granularity::kChunk && !warned_fallback_) {
      warned_fallback_ = true;
      spdlog::warn(
          "update_granularity is chunk, but layer {} of step {} is updated whole: {} (logged "
          "once)",
          layer, armed_step_, why_buffered);
    }
  }
  current_layer_ = layer;
  current_streamed_ = stream;
  return true;
}

bool GradientReducer::ConsumeShardChunkLocked(size_t i, const ChunkHeader& cs) {
  const uint32_t r = pushing_ranks_[i];
  Cursor& c = cursors_[i];
  const uint32_t slots = state_->grad_ring_slots();
  const auto slot = static_cast<uint32_t>(c.next_seq % slots);
  const uint64_t n = cs.numel;
  const uint64_t offset = cs.offset_elements;
  const auto layer = static_cast<uint32_t>(current_layer_);
  if (current_streamed_) {
    // The worker reads the gradient where it lies; the slot stays full (the rank cannot reuse
    // it) until ReturnSlot, which also bounds the ranges in flight to the ring size.
    lent_[size_t{r} * slots + slot] = true;
    absl::Status s =
        worker_->SubmitRange(layer, armed_step_, offset,
                             GradientRef{state_->grad_slot_data(r, slot), options_.grad_type, n},
                             [this, r, slot] { ReturnSlot(r, slot); });
    if (!s.ok()) {
      lent_[size_t{r} * slots + slot] = false;
      FailLocked(absl::StrCat("update of layer ", layer, " elements [", offset, ", ", offset + n,
                              ") from rank ", r, " refused: ", s.ToString()));
      return false;
    }
    stats_.chunks_streamed++;
  } else {
    const auto t0 = std::chrono::steady_clock::now();
    float* dst = buffers_[current_buffer_].data.data() + offset;
    const auto* src = static_cast<const char*>(state_->grad_slot_data(r, slot));
    auto copy_range = [&](size_t b, size_t e, int) {
      Accumulate(dst + b, src + b * elem_bytes_, options_.grad_type, e - b, /*first=*/true);
    };
    if (pool_ != nullptr && n >= kParallelReduceElems) {
      pool_->ParallelFor(n, 64, copy_range);
    } else {
      copy_range(0, n, 0);
    }
    stats_.reduce_seconds +=
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    EmptySlotLocked(r, slot);
  }
  stats_.chunks_reduced++;
  stats_.bytes_reduced += n * elem_bytes_;
  c.done += n;
  c.next_seq++;
  return true;
}

bool GradientReducer::TryShardsLocked() {
  if (armed_step_ == 0) return false;
  bool progress = false;
  if (current_layer_ < 0 && !StartShardLayerLocked(&progress)) {
    return progress || armed_step_ == 0;  // armed_step_ == 0: failed, report it
  }
  const auto layer = static_cast<uint32_t>(current_layer_);
  bool complete = true;
  for (size_t i = 0; i < cursors_.size(); ++i) {
    Cursor& c = cursors_[i];
    while (c.done < c.end - c.begin) {
      ChunkHeader cs;
      if (!PeekLocked(i, &progress, &cs)) break;
      if (!CheckShardChunkLocked(i, cs, layer) || !ConsumeShardChunkLocked(i, cs)) return true;
      progress = true;
    }
    if (c.done < c.end - c.begin) {
      complete = false;
      continue;
    }
    // The rank's shard is complete, so its next chunk must be of a later layer; one of this
    // layer means it pushed more than its shard.
    ChunkHeader next;
    if (PeekLocked(i, &progress, &next) && next.step == armed_step_ && next.layer == layer) {
      FailLocked(absl::StrCat("rank ", pushing_ranks_[i], ", layer ", layer, " chunk seq ",
                              next.seq, ": offset_elements: got ", next.offset_elements,
                              " with numel ", next.numel, ", expected nothing more (its shard [",
                              c.begin, ", ", c.end, ") is complete)"));
      return true;
    }
  }
  if (!complete) return progress;
  if (current_streamed_) {
    // The worker publishes the layer after its last range; nothing is left to do here.
    reduced_[layer] = true;
    stats_.layers_streamed++;
    ResetLayerLocked();
  } else {
    SubmitBufferLocked(state_->layers()[layer].numel);
  }
  return true;
}

int GradientReducer::AcquireBufferLocked() {
  for (size_t b = 0; b < buffers_.size(); ++b) {
    if (!buffers_[b].busy) {
      buffers_[b].busy = true;
      if (buffers_[b].data.empty()) buffers_[b].data.resize(buffer_elems_);
      return static_cast<int>(b);
    }
  }
  if (worker_ != nullptr && worker_->ClipOfStep(armed_step_) == slidedp::v1::CLIP_POLICY_GLOBAL &&
      buffers_.size() < state_->num_layers()) {
    buffers_.emplace_back();
    buffers_.back().data.resize(buffer_elems_);
    buffers_.back().busy = true;
    spdlog::info("global clipping: gradient buffer {} of {} allocated ({} MiB)", buffers_.size(),
                 state_->num_layers(), buffer_elems_ * 4 >> 20);
    return static_cast<int>(buffers_.size() - 1);
  }
  return -1;
}

void GradientReducer::Run() {
  const shm::Doorbell bell(&state_->control().doorbell);
  for (;;) {
    const uint32_t seen = bell.Load();
    {
      absl::MutexLock lock(&mu_);
      if (stop_) return;
    }
    if (TryReduceOne()) continue;
    bell.Wait(seen, kDoorbellSleep);
  }
}

}  // namespace slidedp::hostd
