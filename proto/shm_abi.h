// The shared-memory ABI between hostd and rank processes (the data plane's half of the contract;
// slidedp/v1/control.proto is the control plane's half).
//
// Every segment starts with a SegmentHeader (kHeaderBytes, so the payload is page aligned). The
// structs are plain old data: trivially copyable, standard layout, offsets not pointers, fixed
// sizes checked by static_assert. Fields documented "atomic" are accessed only through
// std::atomic_ref (see Atomic() below), never with plain loads and stores, and never through
// interprocess mutexes (not crash-safe): a process that dies mid-update cannot leave a lock held.
//
// Segments (names are instance scoped: "slidedp.<instance>.<kind>"):
//   control: SegmentHeader, ControlBlock, RankSlot[kMaxRanks], LayerControl[layer_count],
//            ChunkSlot[world_size][grad_ring_slots]
//   state:   per layer, FP32 master | m | v (hostd only)
//   params:  per layer, the BF16 parameters of the layer's committed version
//   grads:   gradient staging: per rank a ring of grad_ring_slots chunks of chunk_bytes each
//
// Gradient push protocol (CPU reduction: every rank pushes its whole gradient, hostd sums; GPU
// reduction: one rank pushes the aggregated gradient; reduce-scatter: every rank pushes its shard
// of the aggregated gradient, ShardOf below, and hostd sums nothing). Within a step every pushing
// rank sends its layers in the same order, each layer (or shard) cut into chunks of
// chunk_bytes / element size elements; a rank's k-th chunk of the step has sequence number k and
// goes to ring slot k % grad_ring_slots:
//   rank:  wait until slot.state == kSlotEmpty (futex on slot.wake_seq), copy the data into the
//          slot's region of the grads segment, fill the header fields, store state = kSlotFull
//          (release), bump ControlBlock::doorbell and wake it;
//   hostd: when slot k % S of every pushing rank is full with sequence k of the running step,
//          reduce those chunks in fixed rank order into the layer's FP32 gradient, store
//          state = kSlotEmpty (release) and bump/wake each slot's wake_seq. When a layer's last
//          chunk is reduced the layer goes to the update worker.
// An abort bumps abort_epoch and every wake word: waiters return ABORTED; hostd then empties
// every slot. A slot whose header names an earlier step is stale and is discarded. Steps overlap:
// a rank may begin step t+1 while t's updates run, and push t+1's chunks (sequence restarting at
// 0) once all of its t chunks are published; hostd leaves such a chunk in its slot until t+1 runs.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace slidedp::shm {

inline constexpr uint64_t kMagic = 0x314D485350444C53ULL;  // "SLDPSHM1" little-endian
inline constexpr uint32_t kAbiVersion = 2;
inline constexpr size_t kHeaderBytes = 4096;
inline constexpr size_t kPayloadAlign = 4096;  // every layer region starts on a page
inline constexpr uint32_t kMaxRanks = 64;
inline constexpr size_t kInstanceNameBytes = 64;

enum class SegmentKind : uint32_t { kControl = 1, kState = 2, kParams = 3, kGrads = 4 };

// At offset 0 of every segment. Written by hostd before `ready` is set (release); a reader
// checks magic, abi_version, kind, size_bytes and manifest_hash after seeing ready == 1.
struct alignas(64) SegmentHeader {
  uint64_t magic;
  uint32_t abi_version;
  uint32_t kind;  // SegmentKind
  uint64_t size_bytes;
  uint64_t manifest_hash;
  uint64_t instance_nonce;  // random per creation; equal across the segments of one creation
  uint32_t layer_count;
  uint32_t world_size;
  uint64_t payload_offset;  // == kHeaderBytes
  uint64_t ready;           // atomic: 1 once the segment is fully initialized
  char instance[kInstanceNameBytes];
};
static_assert(sizeof(SegmentHeader) == 128);
static_assert(offsetof(SegmentHeader, ready) == 56);

// The job's step state. ControlBlock::step_state holds kIdle, kRunning or kAborting (an aborted
// step until the update worker has sealed it); GetStatus also reports kAborted (the last step was
// aborted, none has started since) and kTorn (an abort tore a layer: no step can run).
enum class StepState : uint64_t { kIdle = 0, kRunning = 1, kAborting = 2, kAborted = 3, kTorn = 4 };

// The state's name as GetStatus reports it (JobStatus.step_state).
constexpr const char* ToString(StepState s) {
  switch (s) {
    case StepState::kIdle:
      return "idle";
    case StepState::kRunning:
      return "running";
    case StepState::kAborting:
      return "aborting";
    case StepState::kAborted:
      return "aborted";
    case StepState::kTorn:
      return "torn";
  }
  return "unknown";
}

// The element type of the gradients in the grads segment (ControlBlock::grad_dtype,
// ChunkSlot::dtype). The values are control.proto's DType and the rank C ABI's SLIDEDP_DTYPE_*
// (both check it with a static_assert); 0 and anything else are not a DType.
enum class DType : uint32_t { kFp32 = 1, kBf16 = 2 };

inline constexpr bool IsDType(uint32_t value) {
  return value == static_cast<uint32_t>(DType::kFp32) ||
         value == static_cast<uint32_t>(DType::kBf16);
}

// Bytes per element; 0 for a value outside the enum (a header read from shared memory).
inline constexpr size_t DTypeBytes(DType t) {
  switch (t) {
    case DType::kFp32:
      return 4;
    case DType::kBf16:
      return 2;
  }
  return 0;
}

inline constexpr const char* DTypeName(DType t) {
  switch (t) {
    case DType::kFp32:
      return "FP32";
    case DType::kBf16:
      return "BF16";
  }
  return "unknown";
}

// One per job, right after the header of the control segment.
struct alignas(64) ControlBlock {
  uint64_t next_step;        // atomic: 1-based id of the step that begins next
  uint64_t step_state;       // atomic: StepState of next_step
  uint64_t abort_epoch;      // atomic: bumped on every abort; waiters compare it
  uint64_t hostd_pid;        // atomic
  uint64_t hostd_alive_ns;   // atomic: CLOCK_MONOTONIC of hostd's last liveness tick
  uint32_t wake_seq;         // atomic futex word: bumped on every abort and shutdown
  uint32_t shutting_down;    // atomic: 1 once hostd stops serving
  uint64_t chunk_bytes;      // capacity of one gradient ring slot
  uint32_t grad_ring_slots;  // slots per rank
  uint32_t grad_dtype;       // DType (1 FP32, 2 BF16)
  uint32_t doorbell;         // atomic futex word: ranks bump it after filling a slot
  uint32_t grad_route;       // GradRoute of control.proto
  // atomic: the last step whose updates are all published (0: none yet, or a hostd that predates
  // the field). Stored before the abort epoch moves for a later step, so a rank that began step
  // t + 1 and waits for step t can tell "t completed, t + 1 was aborted" from "t was aborted".
  uint64_t completed_step;
  // atomic: the version at which hostd asks rank 0 to upload the layers the ranks update
  // themselves (UploadClientLayer; a checkpoint of that step waits for them); 0: none. Stored
  // before the step's remaining layers are published, so a rank past their version gates sees it.
  uint64_t client_sync_step;
  uint64_t reserved[4];
};
static_assert(sizeof(ControlBlock) == 128);

// One per rank id.
struct alignas(64) RankSlot {
  uint64_t attached;      // atomic: 1 while a rank is attached
  uint64_t pid;           // atomic
  uint64_t heartbeat_ns;  // atomic: CLOCK_MONOTONIC of the rank's last heartbeat
  uint64_t step;          // atomic: the step the rank is in
  uint64_t layer;         // atomic: the layer the rank last touched
  uint64_t reserved[3];
};
static_assert(sizeof(RankSlot) == 64);

// One per layer.
struct alignas(64) LayerControl {
  // Version protocol: an update of step t first sets pending_version = t, writes master/m/v and
  // the BF16 params, then sets committed_version = t (release) and bumps wake_seq. A layer is
  // consistent iff pending_version == committed_version; after a crash, hostd re-adopts the
  // state only if every layer is consistent and all committed versions agree.
  uint64_t committed_version;  // atomic
  uint64_t pending_version;    // atomic
  uint64_t numel;              // elements (FP32 master / BF16 params)
  uint64_t state_offset;       // bytes in the state segment: master, m, v, each state_stride
  uint64_t state_stride;       // bytes between master, m and v of this layer (page multiple)
  uint64_t param_offset;       // bytes in the params segment
  uint64_t skipped_steps;      // atomic: updates skipped for a non-finite gradient
  uint32_t wake_seq;           // atomic futex word: bumped on every publish
  uint32_t kind;               // LayerKind of control.proto
  uint64_t reserved[8];
};
static_assert(sizeof(LayerControl) == 128);

// ChunkSlot::flags. kChunkFlagStats is set only on a rank's first chunk of a layer; it lets hostd
// apply AdamW chunk by chunk as the chunks arrive (it knows the layer's norm and finiteness
// before the last chunk). kChunkFlagNonFinite: the rank's part holds a NaN or Inf.
inline constexpr uint32_t kChunkFlagStats = 1u << 0;
inline constexpr uint32_t kChunkFlagNonFinite = 1u << 1;

// The reduce-scatter route's shards (and the sharded parameter route's slices): a layer of
// `numel` elements is padded to world_size * ShardElems(numel, world_size) elements and rank r
// owns [r * S, (r + 1) * S) of it, clipped to numel (the last ranks' shards may be short or
// empty). S is a multiple of kShardAlignElems so every shard starts 256-byte aligned in FP32.
inline constexpr uint64_t kShardAlignElems = 64;
inline constexpr uint64_t ShardElems(uint64_t numel, uint32_t world_size) {
  const uint64_t per = (numel + world_size - 1) / world_size;
  return (per + kShardAlignElems - 1) / kShardAlignElems * kShardAlignElems;
}
inline constexpr uint64_t PaddedNumel(uint64_t numel, uint32_t world_size) {
  return ShardElems(numel, world_size) * world_size;
}
struct ShardRange {
  uint64_t begin;  // first element of the layer
  uint64_t numel;  // elements (0: empty shard)
};
inline constexpr ShardRange ShardOf(uint64_t numel, uint32_t world_size, uint32_t rank) {
  const uint64_t s = ShardElems(numel, world_size);
  const uint64_t b = s * rank < numel ? s * rank : numel;
  const uint64_t e = s * (rank + 1) < numel ? s * (rank + 1) : numel;
  return ShardRange{b, e - b};
}

inline constexpr uint64_t kSlotEmpty = 0;
inline constexpr uint64_t kSlotFull = 1;

// One gradient chunk slot of one rank's ring.
struct alignas(64) ChunkSlot {
  uint64_t state;            // atomic: kSlotEmpty or kSlotFull
  uint64_t step;             // the step the chunk belongs to
  uint64_t seq;              // the chunk's sequence number within the rank's step
  uint64_t offset_elements;  // where the chunk starts within the layer
  uint64_t numel;            // elements in this chunk
  uint32_t layer;
  uint32_t dtype;     // DType
  uint32_t wake_seq;  // atomic futex word: bumped when hostd empties the slot or aborts
  uint32_t flags;     // kChunkFlag* below
  // With kChunkFlagStats: the sum of squares (FP64) of everything this rank pushes for the
  // layer in this step (the whole layer on the GPU-reduction route, the rank's shard on the
  // reduce-scatter route), computed by the rank before its first chunk of the layer.
  double stats_sumsq;
};
static_assert(sizeof(ChunkSlot) == 64);
static_assert(offsetof(ChunkSlot, stats_sumsq) == 56);

static_assert(std::is_trivially_copyable_v<SegmentHeader> &&
              std::is_standard_layout_v<SegmentHeader>);
static_assert(std::is_trivially_copyable_v<ControlBlock> &&
              std::is_standard_layout_v<ControlBlock>);
static_assert(std::is_trivially_copyable_v<RankSlot> && std::is_standard_layout_v<RankSlot>);
static_assert(std::is_trivially_copyable_v<LayerControl> &&
              std::is_standard_layout_v<LayerControl>);
static_assert(std::atomic_ref<uint64_t>::is_always_lock_free);
static_assert(std::atomic_ref<uint32_t>::is_always_lock_free);

// Byte offsets inside the control segment.
inline constexpr size_t kControlBlockOffset = kHeaderBytes;
inline constexpr size_t kRankSlotsOffset = kControlBlockOffset + sizeof(ControlBlock);
inline constexpr size_t kLayerControlOffset = kRankSlotsOffset + kMaxRanks * sizeof(RankSlot);
inline constexpr size_t ChunkSlotsOffset(uint32_t layer_count) {
  return kLayerControlOffset + size_t{layer_count} * sizeof(LayerControl);
}
inline constexpr size_t ChunkSlotIndex(uint32_t rank, uint32_t slot, uint32_t slots_per_rank) {
  return size_t{rank} * slots_per_rank + slot;
}
inline constexpr size_t ControlSegmentBytes(uint32_t layer_count, uint32_t world_size = 0,
                                            uint32_t slots_per_rank = 0) {
  return ChunkSlotsOffset(layer_count) + size_t{world_size} * slots_per_rank * sizeof(ChunkSlot);
}
// Byte offset of a ring slot's data in the grads segment.
inline constexpr size_t GradSlotOffset(uint32_t rank, uint32_t slot, uint32_t slots_per_rank,
                                       uint64_t chunk_bytes) {
  return kHeaderBytes + ChunkSlotIndex(rank, slot, slots_per_rank) * chunk_bytes;
}

inline constexpr uint64_t AlignUp(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

// Bytes of the grads segment (its header, then world_size rings of slots_per_rank slots of
// chunk_bytes each, ending on a page); false when the size does not fit in 64 bits: no machine
// holds that layout, and every offset in it would wrap. Both ends size the segment with this.
inline constexpr bool GradSegmentBytes(uint32_t world_size, uint32_t slots_per_rank,
                                       uint64_t chunk_bytes, uint64_t* out) {
  const uint64_t slots = uint64_t{world_size} * slots_per_rank;  // 32 x 32 bits: cannot wrap
  uint64_t data = 0;
  uint64_t end = 0;
  if (__builtin_mul_overflow(slots, chunk_bytes, &data) ||
      __builtin_add_overflow(data, uint64_t{kHeaderBytes} + kPayloadAlign - 1, &end)) {
    return false;
  }
  *out = end / kPayloadAlign * kPayloadAlign;
  return true;
}

template <typename T>
inline std::atomic_ref<T> Atomic(T& field) {
  return std::atomic_ref<T>(field);
}

// Checks a header read from a mapping; returns nullptr when valid, else a static string naming
// the first field that does not match.
inline const char* ValidateHeader(const SegmentHeader& h, SegmentKind kind, uint64_t size_bytes,
                                  uint64_t manifest_hash) {
  if (h.magic != kMagic) return "magic";
  if (h.abi_version != kAbiVersion) return "abi_version";
  if (h.kind != static_cast<uint32_t>(kind)) return "kind";
  if (h.size_bytes != size_bytes) return "size_bytes";
  if (h.manifest_hash != manifest_hash) return "manifest_hash";
  if (h.payload_offset != kHeaderBytes) return "payload_offset";
  return nullptr;
}

}  // namespace slidedp::shm
