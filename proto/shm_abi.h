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
//   control: SegmentHeader, ControlBlock, RankSlot[kMaxRanks], LayerControl[layer_count]
//   state:   per layer, FP32 master | m | v (hostd only)
//   params:  per layer, the BF16 parameters of the layer's committed version
//   grads:   gradient staging (layout defined by the data-plane protocol)
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace slidedp::shm {

inline constexpr uint64_t kMagic = 0x314D485350444C53ULL;  // "SLDPSHM1" little-endian
inline constexpr uint32_t kAbiVersion = 1;
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

enum class StepState : uint64_t { kIdle = 0, kRunning = 1, kAborting = 2 };

// One per job, right after the header of the control segment.
struct alignas(64) ControlBlock {
  uint64_t next_step;       // atomic: 1-based id of the step that begins next
  uint64_t step_state;      // atomic: StepState of next_step
  uint64_t abort_epoch;     // atomic: bumped on every abort; waiters compare it
  uint64_t hostd_pid;       // atomic
  uint64_t hostd_alive_ns;  // atomic: CLOCK_MONOTONIC of hostd's last liveness tick
  uint32_t wake_seq;        // atomic futex word: bumped on every abort and shutdown
  uint32_t shutting_down;   // atomic: 1 once hostd stops serving
  uint64_t reserved[10];
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
inline constexpr size_t ControlSegmentBytes(uint32_t layer_count) {
  return kLayerControlOffset + size_t{layer_count} * sizeof(LayerControl);
}

inline constexpr uint64_t AlignUp(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

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
