#include "proto/grad_ring.h"

#include <atomic>

#include "proto/doorbell.h"

namespace slidedp::shm {

ChunkSlot& GradRing::slot(uint32_t rank, uint32_t slot) const {
  auto* slots = reinterpret_cast<ChunkSlot*>(control_ + ChunkSlotsOffset(shape_.layer_count));
  return slots[ChunkSlotIndex(rank, slot, shape_.slots_per_rank)];
}

void* GradRing::data(uint32_t rank, uint32_t slot) const {
  return grads_ + GradSlotOffset(rank, slot, shape_.slots_per_rank, shape_.chunk_bytes);
}

uint64_t GradRing::ChunkElems(DType dtype) const {
  const size_t elem = DTypeBytes(dtype);
  return elem == 0 ? 0 : shape_.chunk_bytes / elem;
}

bool SlotIsFull(const ChunkSlot& cs) {
  return Atomic(const_cast<uint64_t&>(cs.state)).load(std::memory_order_acquire) == kSlotFull;
}

bool SlotIsEmpty(const ChunkSlot& cs) {
  return Atomic(const_cast<uint64_t&>(cs.state)).load(std::memory_order_acquire) == kSlotEmpty;
}

void PublishChunk(ChunkSlot& cs, const ChunkHeader& h) {
  // Plain stores: the slot is the rank's alone while it is empty; the release store of the state
  // below publishes them (and the data) to hostd.
  cs.step = h.step;
  cs.seq = h.seq;
  cs.offset_elements = h.offset_elements;
  cs.numel = h.numel;
  cs.layer = h.layer;
  cs.dtype = h.dtype;
  cs.flags = h.flags;
  cs.stats_sumsq = h.stats_sumsq;
  Atomic(cs.state).store(kSlotFull, std::memory_order_release);
}

bool ReadFullSlot(ChunkSlot& cs, ChunkHeader* h) {
  if (!SlotIsFull(cs)) return false;
  // Atomic loads: the compiler may neither read a field again nor tear it (the rank writes the
  // header from another process; plain reads of it would be a data race).
  h->step = Atomic(cs.step).load(std::memory_order_relaxed);
  h->seq = Atomic(cs.seq).load(std::memory_order_relaxed);
  h->offset_elements = Atomic(cs.offset_elements).load(std::memory_order_relaxed);
  h->numel = Atomic(cs.numel).load(std::memory_order_relaxed);
  h->layer = Atomic(cs.layer).load(std::memory_order_relaxed);
  h->dtype = Atomic(cs.dtype).load(std::memory_order_relaxed);
  h->flags = Atomic(cs.flags).load(std::memory_order_relaxed);
  h->stats_sumsq = Atomic(cs.stats_sumsq).load(std::memory_order_relaxed);
  return true;
}

void ReleaseSlot(ChunkSlot& cs) {
  Atomic(cs.state).store(kSlotEmpty, std::memory_order_release);
  Doorbell(&cs.wake_seq).Ring();
}

const char* CheckChunkHeader(const ChunkHeader& h, const ChunkLimits& limits) {
  if (!IsDType(h.dtype) || h.dtype != static_cast<uint32_t>(limits.dtype)) return "dtype";
  if (h.layer >= limits.layer_count) return "layer";
  const uint64_t capacity = limits.chunk_bytes / DTypeBytes(limits.dtype);
  if (h.numel == 0 || h.numel > capacity) return "numel";
  constexpr uint32_t kKnownFlags = kChunkFlagStats | kChunkFlagNonFinite;
  if ((h.flags & ~kKnownFlags) != 0) return "flags";
  if ((h.flags & kChunkFlagNonFinite) != 0 && (h.flags & kChunkFlagStats) == 0) return "flags";
  return nullptr;
}

}  // namespace slidedp::shm
