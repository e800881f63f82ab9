// The gradient rings of shm_abi.h, as code both ends share: where a slot and its data are, the
// slot's state transitions with their memory ordering, and a chunk header filled by the rank and
// read back by hostd. Lives next to shm_abi.h (the contract) for the reason doorbell.h gives.
//
// A slot's life (the protocol comment in shm_abi.h has the whole push):
//   empty --(rank: copy data, PublishChunk: header, then state = full with release)--> full
//   full  --(hostd: ReadFullSlot: state with acquire, then the header; consume the data;
//            ReleaseSlot: state = empty with release, then ring the slot's wake_seq)--> empty
// While a slot is empty only its rank writes it; while it is full only hostd does. The release
// store of the state is what publishes the header and data written before it.
//
// Thread safety: GradRing is an immutable view (any thread); the free functions touch one slot
// and follow the ownership rule above.
#pragma once

#include <cstddef>
#include <cstdint>

#include "proto/shm_abi.h"

namespace slidedp::shm {

// The ring layout a job's control and grads segments hold.
struct RingShape {
  uint32_t layer_count = 0;     // LayerControl entries before the chunk slots
  uint32_t world_size = 0;      // rings
  uint32_t slots_per_rank = 0;  // grad_ring_slots
  uint64_t chunk_bytes = 0;     // data bytes per slot
};

// Addresses of the slots and their data in mapped segments; owns nothing.
class GradRing {
 public:
  GradRing() = default;
  // `control` and `grads` are the bases of the mapped control and grads segments; they must be
  // at least ControlSegmentBytes(shape...) and GradSegmentBytes(shape...) long (the caller checks
  // the sizes once, where it maps them) and outlive this view.
  GradRing(void* control, void* grads, RingShape shape)
      : control_(static_cast<char*>(control)), grads_(static_cast<char*>(grads)), shape_(shape) {}

  const RingShape& shape() const { return shape_; }

  // The slot of a rank's chunk with sequence number `seq` within its step.
  uint32_t SlotOf(uint64_t seq) const { return static_cast<uint32_t>(seq % shape_.slots_per_rank); }
  // Precondition: rank < world_size, slot < slots_per_rank.
  ChunkSlot& slot(uint32_t rank, uint32_t slot) const;
  // The slot's data region (chunk_bytes long) in the grads segment.
  void* data(uint32_t rank, uint32_t slot) const;
  // Elements of `dtype` one slot holds (0 for a value outside DType).
  uint64_t ChunkElems(DType dtype) const;

 private:
  char* control_ = nullptr;
  char* grads_ = nullptr;
  RingShape shape_;
};

// A chunk's header, as a value: what the rank fills in and the one copy hostd validates and uses
// (a second read of the shared slot could see other values than the ones checked).
struct ChunkHeader {
  uint64_t step = 0;
  uint64_t seq = 0;
  uint64_t offset_elements = 0;
  uint64_t numel = 0;
  uint32_t layer = 0;
  uint32_t dtype = 0;  // a DType's value as read from the slot; unchecked until CheckChunkHeader
  uint32_t flags = 0;  // kChunkFlag*
  double stats_sumsq = 0;
};

// The slot's state with acquire ordering: once it reads full, the header and data are visible.
bool SlotIsFull(const ChunkSlot& cs);
bool SlotIsEmpty(const ChunkSlot& cs);

// The rank's side: writes the header into the slot it holds (empty, its data already copied),
// then marks it full (release). The caller rings ControlBlock::doorbell afterwards.
void PublishChunk(ChunkSlot& cs, const ChunkHeader& h);

// hostd's side: whether the slot is full; if so its header is copied into *h, each field read
// once (atomically: the rank wrote it from another process) after the acquire load of the state.
bool ReadFullSlot(ChunkSlot& cs, ChunkHeader* h);

// hostd's side: marks the slot empty (release: hostd is done with its data) and rings its
// wake_seq, so a rank waiting for the slot goes on.
void ReleaseSlot(ChunkSlot& cs);

// What the job allows in a chunk header.
struct ChunkLimits {
  DType dtype = DType::kBf16;  // the job's gradient dtype
  uint32_t layer_count = 0;
  uint64_t chunk_bytes = 0;  // a slot's capacity
};

// Checks the fields of a header that need nothing but the job's limits: dtype is the job's,
// layer exists, 1 <= numel <= the elements a slot holds, flags has no unknown bit and sets
// kChunkFlagNonFinite only with kChunkFlagStats. Returns nullptr when they hold, else a static
// string naming the first field that does not ("dtype", "layer", "numel", "flags"). Where a
// chunk belongs in its step and layer (step, seq, offset) is the consumer's to check.
const char* CheckChunkHeader(const ChunkHeader& h, const ChunkLimits& limits);

}  // namespace slidedp::shm
