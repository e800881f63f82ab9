// TrainingState: the one authoritative copy of a model's training state, in named shared memory.
//
//   control segment: SegmentHeader, ControlBlock, RankSlot[kMaxRanks], LayerControl[L]
//   state segment:   per layer, FP32 master | m | v (hostd only; never mapped by ranks)
//   params segment:  per layer, the BF16 parameters of the layer's committed version
//   grads segment:   per rank, a ring of gradient chunks (see proto/shm_abi.h)
// Layer regions start on page boundaries so ranks can register and DMA them in chunks.
//
// Create() sizes, binds, populates and locks the segments (see ShmSegment), then initializes
// the weights: from an InitialWeights source (Options::import: hf_import.h's ImportPlan reads an
// HF safetensors checkpoint; the state knows no file format),
// or deterministically from the seed: element i of tensor T gets a value that depends only on
// (seed, T's name, i), so the init does not depend on thread count or layer order. Norm weights
// are 1, biases 0, other tensors N(0, initializer_range). m = v = 0, every layer at version 0,
// and the BF16 params are the round-to-nearest-even cast of the master.
//
// Ownership: TrainingState owns the mappings; it removes the segment names on destruction only
// when set_remove_on_destroy(true) (a clean stop), so a crash leaves them for re-adoption.
// Access: the segments ranks map (control, params, grads) get Options::mode and Options::group;
// the state segment (master, m, v) is hostd's alone, mode 0600 whatever the options say. An
// existing segment is adopted or removed only when it passes SegmentCheck (owner hostd's
// effective uid, no wider mode or other group than that; see OwnerCheck in shm_segment.h).
// Thread safety: layer data is written only by the update worker (one writer per layer at a
// time); version words and counters are atomics (shm::Atomic). Accessors are const and safe.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/shm_segment.h"
#include "model/manifest.h"
#include "proto/grad_ring.h"
#include "proto/shm_abi.h"

namespace slidedp {
class ThreadPool;
}

namespace slidedp::hostd {

struct TensorRange {
  std::string name;
  uint64_t offset = 0;  // elements from the start of the layer
  uint64_t numel = 0;
  bool no_decay = false;
  model::InitKind init = model::InitKind::kNormal;
};

struct LayerInfo {
  uint32_t index = 0;
  std::string name;
  int kind = 0;  // slidedp::v1::LayerKind
  uint64_t numel = 0;
  std::vector<TensorRange> tensors;
  uint64_t state_offset = 0;  // bytes in the state segment
  uint64_t state_stride = 0;  // bytes between master, m and v
  uint64_t param_offset = 0;  // bytes in the params segment
  uint64_t param_bytes = 0;   // numel * 2 (region is page-aligned beyond)
};

std::string SegmentName(const std::string& instance, shm::SegmentKind kind);

// Where a new state's initial weights come from when not from the seed. TrainingState::Create
// calls Check once with the layout before any segment is created (an error fails Create and
// nothing is left behind), then Fill for every tensor of every layer, in order, writing
// `numel` FP32 values to `dst`; m, v and the BF16 params follow from the filled master as for a
// random init. Implementations must outlive Create; Fill may split its work over `pool`.
class InitialWeights {
 public:
  virtual ~InitialWeights() = default;
  virtual absl::Status Check(const std::vector<LayerInfo>& layers) const = 0;
  // What GetStatus shows as the weights' source, e.g. "safetensors /m/model.safetensors".
  virtual std::string Describe() const = 0;
  virtual absl::Status Fill(uint32_t layer, uint32_t tensor, float* dst,
                            ThreadPool* pool) const = 0;
};

class TrainingState {
 public:
  struct Options {
    std::string instance = "default";
    model::LoadedModel model;
    uint32_t world_size = 1;
    int numa_node = -1;
    mode_t mode = 0600;                    // control, params, grads: shm_mode (0600 or 0660)
    gid_t group = static_cast<gid_t>(-1);  // their group (shm_group) with 0660; -1: hostd's
    MlockPolicy mlock = MlockPolicy::kRequired;
    uint64_t seed = 0;
    bool zero_init = false;  // "init = zeros": every tensor 0 except norms (1)
    // Initial weights from elsewhere instead of the seed (e.g. a plan from PlanImport for
    // model.manifest), which must outlive Create (not the state).
    const InitialWeights* import = nullptr;
    uint64_t instance_nonce = 0;
    // Gradient staging: per rank a ring of grad_ring_slots chunks of chunk_bytes.
    uint64_t chunk_bytes = 1 << 20;
    uint32_t grad_ring_slots = 4;
    uint32_t grad_dtype = 2;  // slidedp::v1::DType
    uint32_t grad_route = 1;  // slidedp::v1::GradRoute
    // Called as Create goes ("allocating shared memory": bytes, "initializing weights" or
    // "importing weights": layers), on the creating thread; false stops it (CANCELLED, nothing
    // left behind). Null: none.
    std::function<bool(const char* phase, uint64_t done, uint64_t total, const char* unit)>
        progress;
  };

  // ALREADY_EXISTS if segments of this instance exist (the caller decides to adopt or remove),
  // RESOURCE_EXHAUSTED when memory is short, INVALID_ARGUMENT for a bad manifest, an import
  // plan that does not fit it, or ImportTensor's errors (no segment is left behind then).
  static absl::StatusOr<std::unique_ptr<TrainingState>> Create(const Options& options,
                                                               ThreadPool* pool);
  // Maps the segments a previous hostd of options.instance left behind (re-adoption after a
  // crash, see hostd/recovery.h), without touching their data. Every segment must exist and be
  // ready, and its header must match what Create would write for `options`: magic, ABI
  // version, kind, size, manifest hash, layer count, world size, and one creation nonce; the
  // control block must have the same chunk_bytes, grad_ring_slots, grad_dtype and grad_route.
  // NOT_FOUND when a segment is missing, FAILED_PRECONDITION naming the segment, the field, the
  // value found and the value expected otherwise; CheckOwner's FAILED_PRECONDITION before a
  // segment is mapped when it fails SegmentCheck. The versions are
  // left for the caller to judge (committed_version / pending_version); ResetControlForAdoption
  // makes the control plane fresh.
  static absl::StatusOr<std::unique_ptr<TrainingState>> Open(const Options& options);
  // After Open: this process owns the state; rank slots and gradient ring slots are emptied, the
  // step state is idle, next_step = `next_step`, and waiters of the dead hostd are woken (the
  // abort epoch is bumped so a rank of the old hostd cannot mistake the new one's steps).
  void ResetControlForAdoption(uint64_t next_step) const;
  uint64_t pending_version(uint32_t layer) const;
  // What an existing segment of `kind` must be before it is adopted or removed: owned by this
  // process's effective uid, mode within 0600 for the state segment and options.mode for the
  // others (which, when group-accessible, must have options.group, or hostd's group).
  static OwnerCheck SegmentCheck(const Options& options, shm::SegmentKind kind);
  // OK when every segment of options.instance that exists passes SegmentCheck; CheckOwner's
  // FAILED_PRECONDITION naming the first that does not.
  static absl::Status CheckSegmentOwners(const Options& options);
  // Removes every segment name of options.instance (stale state nobody will adopt), after
  // CheckSegmentOwners: a foreign segment is FAILED_PRECONDITION and none is removed.
  static absl::Status RemoveSegments(const Options& options);

  ~TrainingState();
  TrainingState(const TrainingState&) = delete;
  TrainingState& operator=(const TrainingState&) = delete;

  const model::LoadedModel& model() const { return model_; }
  uint64_t manifest_hash() const { return manifest_hash_; }
  uint32_t world_size() const { return world_size_; }
  int numa_node() const { return numa_node_; }
  const std::vector<LayerInfo>& layers() const { return layers_; }
  uint32_t num_layers() const { return static_cast<uint32_t>(layers_.size()); }
  uint64_t total_params() const { return total_params_; }
  // Where the initial weights came from: "random (seed N)", "zeros" or "safetensors PATH".
  const std::string& weights_source() const { return weights_source_; }

  float* master(uint32_t layer) const;
  float* exp_avg(uint32_t layer) const;
  float* exp_avg_sq(uint32_t layer) const;
  uint16_t* params(uint32_t layer) const;
  // Gives the memory of a layer's Adam moments (m, v) back while they are all zeros and hostd
  // will not update the layer (the ranks do: client_updated_layers). They read as zeros
  // afterwards, so the layer's optimizer state is unchanged. Returns the bytes released.
  absl::StatusOr<size_t> ReleaseMoments(uint32_t layer);

  shm::ControlBlock& control() const;
  shm::RankSlot& rank_slot(uint32_t rank) const;
  shm::LayerControl& layer_control(uint32_t layer) const;
  shm::ChunkSlot& chunk_slot(uint32_t rank, uint32_t slot) const;
  // Every rank's ring, as a view of the control and grads segments (valid while this lives).
  shm::GradRing grad_ring() const;
  // The data region of a ring slot in the grads segment (chunk_bytes long).
  void* grad_slot_data(uint32_t rank, uint32_t slot) const;
  uint64_t chunk_bytes() const { return chunk_bytes_; }
  uint32_t grad_ring_slots() const { return grad_ring_slots_; }

  uint64_t committed_version(uint32_t layer) const;
  // Marks the start of writing `version` into `layer` (pending_version = version).
  void BeginLayerWrite(uint32_t layer, uint64_t version) const;
  // Publishes `version` (release) and wakes waiters on the layer's futex word.
  void PublishLayer(uint32_t layer, uint64_t version) const;

  // xxh64 over master, m, v and params of one layer / of every layer (for tests and audits).
  uint64_t LayerChecksum(uint32_t layer) const;
  uint64_t Checksum() const;

  struct SegmentView {
    std::string name;
    shm::SegmentKind kind;
    uint64_t size_bytes;
    int numa_node;
    bool locked;
  };
  std::vector<SegmentView> segments() const;
  uint64_t shm_bytes() const;
  uint64_t locked_bytes() const;

  void set_remove_on_destroy(bool remove);

 private:
  TrainingState() = default;
  absl::Status Initialize(const Options& options, ThreadPool* pool);
  // Fills model_, manifest_hash_, world_size_, numa_node_, layers_, total_params_ and the two
  // data segments' byte sizes from `options` (no memory is touched).
  void ComputeLayout(const Options& options);

  model::LoadedModel model_;
  uint64_t manifest_hash_ = 0;
  uint32_t world_size_ = 1;
  int numa_node_ = -1;
  std::vector<LayerInfo> layers_;
  uint64_t total_params_ = 0;
  std::string weights_source_;
  uint64_t chunk_bytes_ = 0;
  uint32_t grad_ring_slots_ = 0;
  uint64_t state_bytes_ = 0;  // unaligned end of the state segment's layout
  uint64_t param_bytes_ = 0;  // unaligned end of the params segment's layout
  // Declared in creation order; destroyed in reverse.
  ShmSegment control_;
  ShmSegment state_;
  ShmSegment params_;
  ShmSegment grads_;
};

}  // namespace slidedp::hostd
