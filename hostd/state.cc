#include "hostd/state.h"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <xxhash.h>

#include <cmath>
#include <cstring>
#include <numbers>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/status_macros.h"
#include "common/thread_pool.h"
#include "kernels/cpu/adamw.h"

namespace slidedp::hostd {
namespace {

const char* KindSuffix(shm::SegmentKind kind) {
  switch (kind) {
    case shm::SegmentKind::kControl:
      return "control";
    case shm::SegmentKind::kState:
      return "state";
    case shm::SegmentKind::kParams:
      return "params";
    case shm::SegmentKind::kGrads:
      return "grads";
  }
  return "unknown";
}

uint64_t SplitMix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

void WriteHeader(const ShmSegment& seg, shm::SegmentKind kind, uint64_t manifest_hash,
                 uint64_t nonce, uint32_t layers, uint32_t world_size,
                 const std::string& instance) {
  auto* h = seg.at<shm::SegmentHeader>(0);
  std::memset(h, 0, sizeof(*h));
  h->magic = shm::kMagic;
  h->abi_version = shm::kAbiVersion;
  h->kind = static_cast<uint32_t>(kind);
  h->size_bytes = seg.size_bytes();
  h->manifest_hash = manifest_hash;
  h->instance_nonce = nonce;
  h->layer_count = layers;
  h->world_size = world_size;
  h->payload_offset = shm::kHeaderBytes;
  std::strncpy(h->instance, instance.c_str(), sizeof(h->instance) - 1);
}

}  // namespace

std::string SegmentName(const std::string& instance, shm::SegmentKind kind) {
  return absl::StrCat("slidedp.", instance, ".", KindSuffix(kind));
}

void FutexWakeAll(uint32_t* word) {
  syscall(SYS_futex, word, FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
}

absl::Status TrainingState::RemoveSegments(const std::string& instance) {
  for (auto kind : {shm::SegmentKind::kControl, shm::SegmentKind::kState, shm::SegmentKind::kParams,
                    shm::SegmentKind::kGrads}) {
    RETURN_IF_ERROR(ShmSegment::Remove(SegmentName(instance, kind)));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<TrainingState>> TrainingState::Create(const Options& options,
                                                                     ThreadPool* pool) {
  RETURN_IF_ERROR(ValidateManifest(options.model.manifest));
  if (options.world_size < 1 || options.world_size > shm::kMaxRanks) {
    return absl::InvalidArgumentError(
        absl::StrCat("world_size: must be in 1..", shm::kMaxRanks, ", got ", options.world_size));
  }
  std::unique_ptr<TrainingState> s(new TrainingState());
  RETURN_IF_ERROR(s->Initialize(options, pool));
  return s;
}

absl::Status TrainingState::Initialize(const Options& options, ThreadPool* pool) {
  model_ = options.model;
  manifest_hash_ = ManifestHash(model_.manifest);
  world_size_ = options.world_size;
  numa_node_ = options.numa_node;

  // Layout: every layer region page-aligned in both data segments.
  uint64_t state_off = shm::kHeaderBytes;
  uint64_t param_off = shm::kHeaderBytes;
  const auto& mlayers = model_.manifest.layers();
  for (int l = 0; l < mlayers.size(); ++l) {
    const auto& spec = mlayers[l];
    LayerInfo info;
    info.index = static_cast<uint32_t>(l);
    info.name = spec.name();
    info.kind = spec.kind();
    for (const auto& t : spec.tensors()) {
      uint64_t numel = 1;
      for (int64_t d : t.shape()) numel *= static_cast<uint64_t>(d);
      info.tensors.push_back(
          TensorRange{t.name(), info.numel, numel, t.no_decay(), TensorInitKind(t)});
      info.numel += numel;
    }
    info.state_stride = shm::AlignUp(info.numel * sizeof(float), shm::kPayloadAlign);
    info.state_offset = state_off;
    state_off += 3 * info.state_stride;
    info.param_bytes = info.numel * sizeof(uint16_t);
    info.param_offset = param_off;
    param_off += shm::AlignUp(info.param_bytes, shm::kPayloadAlign);
    total_params_ += info.numel;
    layers_.push_back(std::move(info));
  }

  if (const ImportPlan* plan = options.import; plan != nullptr) {
    bool fits = plan->sources.size() == layers_.size();
    for (size_t l = 0; fits && l < layers_.size(); ++l) {
      fits = plan->sources[l].size() == layers_[l].tensors.size();
      for (size_t t = 0; fits && t < layers_[l].tensors.size(); ++t) {
        fits = plan->sources[l][t].name == layers_[l].tensors[t].name &&
               plan->sources[l][t].tensor->numel == layers_[l].tensors[t].numel;
      }
    }
    if (!fits) {
      return absl::InvalidArgumentError(absl::StrCat("the import plan of ", plan->checkpoint,
                                                     " was not made for this model's manifest"));
    }
    weights_source_ = absl::StrCat("safetensors ", plan->checkpoint);
    if (plan->num_files > 1) absl::StrAppend(&weights_source_, " (", plan->num_files, " files)");
  } else if (options.zero_init) {
    weights_source_ = "zeros";
  } else {
    weights_source_ = absl::StrCat("random (seed ", options.seed, ")");
  }

  const std::string& inst = options.instance;
  for (auto kind :
       {shm::SegmentKind::kControl, shm::SegmentKind::kState, shm::SegmentKind::kParams}) {
    if (ShmSegment::Exists(SegmentName(inst, kind))) {
      return absl::AlreadyExistsError(absl::StrCat("shared-memory segment ",
                                                   SegmentName(inst, kind), " of instance '", inst,
                                                   "' already exists"));
    }
  }
  auto make = [&](shm::SegmentKind kind, uint64_t bytes, int node,
                  MlockPolicy mlock) -> absl::StatusOr<ShmSegment> {
    ShmSegment::CreateOptions o;
    o.name = SegmentName(inst, kind);
    o.size_bytes = shm::AlignUp(bytes, shm::kPayloadAlign);
    o.numa_node = node;
    o.mode = options.mode;
    o.group = options.group;
    o.mlock = mlock;
    o.populate_pool = pool;
    return ShmSegment::Create(o);
  };
  const uint32_t nl = num_layers();
  // Until the state is complete, a failure must not leave half-made segments behind.
  if (options.chunk_bytes < 4096 || options.chunk_bytes % 4096 != 0 ||
      options.grad_ring_slots < 1 || options.grad_ring_slots > 1024) {
    return absl::InvalidArgumentError(
        absl::StrCat("chunk_bytes must be a multiple of 4096 (got ", options.chunk_bytes,
                     ") and grad_ring_slots in 1..1024 (got ", options.grad_ring_slots, ")"));
  }
  chunk_bytes_ = options.chunk_bytes;
  grad_ring_slots_ = options.grad_ring_slots;
  ASSIGN_OR_RETURN(control_, make(shm::SegmentKind::kControl,
                                  shm::ControlSegmentBytes(nl, world_size_, grad_ring_slots_),
                                  numa_node_, options.mlock));
  control_.set_remove_on_destroy(true);
  ASSIGN_OR_RETURN(state_, make(shm::SegmentKind::kState, state_off, numa_node_, options.mlock));
  state_.set_remove_on_destroy(true);
  ASSIGN_OR_RETURN(params_, make(shm::SegmentKind::kParams, param_off, numa_node_, options.mlock));
  params_.set_remove_on_destroy(true);
  ASSIGN_OR_RETURN(grads_, make(shm::SegmentKind::kGrads,
                                shm::GradSlotOffset(world_size_, 0, grad_ring_slots_, chunk_bytes_),
                                numa_node_, options.mlock));
  grads_.set_remove_on_destroy(true);

  const uint64_t nonce = options.instance_nonce;
  WriteHeader(control_, shm::SegmentKind::kControl, manifest_hash_, nonce, nl, world_size_, inst);
  WriteHeader(state_, shm::SegmentKind::kState, manifest_hash_, nonce, nl, world_size_, inst);
  WriteHeader(params_, shm::SegmentKind::kParams, manifest_hash_, nonce, nl, world_size_, inst);
  WriteHeader(grads_, shm::SegmentKind::kGrads, manifest_hash_, nonce, nl, world_size_, inst);
  shm::ControlBlock& cb = control();
  std::memset(&cb, 0, sizeof(cb));
  cb.next_step = 1;
  cb.hostd_pid = static_cast<uint64_t>(getpid());
  cb.chunk_bytes = chunk_bytes_;
  cb.grad_ring_slots = grad_ring_slots_;
  cb.grad_dtype = options.grad_dtype;
  cb.grad_route = options.grad_route;
  std::memset(&chunk_slot(0, 0), 0,
              size_t{world_size_} * grad_ring_slots_ * sizeof(shm::ChunkSlot));
  for (uint32_t r = 0; r < shm::kMaxRanks; ++r)
    std::memset(&rank_slot(r), 0, sizeof(shm::RankSlot));

  const kernels::Isa isa = kernels::BestIsa();
  for (const LayerInfo& info : layers_) {
    shm::LayerControl& lc = layer_control(info.index);
    std::memset(&lc, 0, sizeof(lc));
    lc.numel = info.numel;
    lc.state_offset = info.state_offset;
    lc.state_stride = info.state_stride;
    lc.param_offset = info.param_offset;
    lc.kind = static_cast<uint32_t>(info.kind);

    float* w = master(info.index);
    float* m = exp_avg(info.index);
    float* v = exp_avg_sq(info.index);
    uint16_t* p = params(info.index);
    for (size_t ti = 0; ti < info.tensors.size(); ++ti) {
      const TensorRange& t = info.tensors[ti];
      if (options.import != nullptr) {
        RETURN_IF_ERROR(ImportTensor(options.import->sources[info.index][ti], w + t.offset, pool));
        continue;
      }
      InitKind init = t.init;
      if (options.zero_init && init == InitKind::kNormal) init = InitKind::kZeros;
      auto fill = [&](size_t b, size_t e, int) {
        float* out = w + t.offset;
        for (size_t i = b; i < e; ++i) {
          out[i] = InitialValue(options.seed, t.name, init, model_.initializer_range, i);
        }
      };
      if (pool != nullptr) {
        pool->ParallelFor(t.numel, 64, fill);
      } else {
        fill(0, t.numel, 0);
      }
    }
    auto finish = [&](size_t b, size_t e, int) {
      std::memset(m + b, 0, (e - b) * sizeof(float));
      std::memset(v + b, 0, (e - b) * sizeof(float));
      kernels::CastFp32ToBf16(isa, w + b, p + b, e - b);
    };
    if (pool != nullptr) {
      pool->ParallelFor(info.numel, 64, finish);
    } else {
      finish(0, info.numel, 0);
    }
  }
  // Readers check `ready` (acquire) before trusting a header.
  for (const ShmSegment* seg : {&control_, &state_, &params_, &grads_}) {
    shm::Atomic(seg->at<shm::SegmentHeader>(0)->ready).store(1, std::memory_order_release);
  }
  set_remove_on_destroy(false);
  return absl::OkStatus();
}

TrainingState::~TrainingState() = default;

float* TrainingState::master(uint32_t layer) const {
  return state_.at<float>(layers_[layer].state_offset);
}
float* TrainingState::exp_avg(uint32_t layer) const {
  return state_.at<float>(layers_[layer].state_offset + layers_[layer].state_stride);
}
float* TrainingState::exp_avg_sq(uint32_t layer) const {
  return state_.at<float>(layers_[layer].state_offset + 2 * layers_[layer].state_stride);
}
absl::StatusOr<size_t> TrainingState::ReleaseMoments(uint32_t layer) {
  const LayerInfo& l = layers_[layer];
  return state_.ReleasePages(l.state_offset + l.state_stride, 2 * l.state_stride);
}

uint16_t* TrainingState::params(uint32_t layer) const {
  return params_.at<uint16_t>(layers_[layer].param_offset);
}
shm::ControlBlock& TrainingState::control() const {
  return *control_.at<shm::ControlBlock>(shm::kControlBlockOffset);
}
shm::RankSlot& TrainingState::rank_slot(uint32_t rank) const {
  return control_.at<shm::RankSlot>(shm::kRankSlotsOffset)[rank];
}
shm::LayerControl& TrainingState::layer_control(uint32_t layer) const {
  return control_.at<shm::LayerControl>(shm::kLayerControlOffset)[layer];
}
shm::ChunkSlot& TrainingState::chunk_slot(uint32_t rank, uint32_t slot) const {
  return control_.at<shm::ChunkSlot>(
      shm::ChunkSlotsOffset(num_layers()))[shm::ChunkSlotIndex(rank, slot, grad_ring_slots_)];
}
void* TrainingState::grad_slot_data(uint32_t rank, uint32_t slot) const {
  return grads_.at<char>(shm::GradSlotOffset(rank, slot, grad_ring_slots_, chunk_bytes_));
}

uint64_t TrainingState::committed_version(uint32_t layer) const {
  return shm::Atomic(layer_control(layer).committed_version).load(std::memory_order_acquire);
}

void TrainingState::BeginLayerWrite(uint32_t layer, uint64_t version) const {
  shm::Atomic(layer_control(layer).pending_version).store(version, std::memory_order_release);
}

void TrainingState::PublishLayer(uint32_t layer, uint64_t version) const {
  shm::LayerControl& lc = layer_control(layer);
  shm::Atomic(lc.committed_version).store(version, std::memory_order_release);
  shm::Atomic(lc.wake_seq).fetch_add(1, std::memory_order_acq_rel);
  FutexWakeAll(&lc.wake_seq);
}

uint64_t LayerStateChecksum(uint32_t layer, const float* master, const float* m, const float* v,
                            const uint16_t* params, uint64_t n) {
  XXH64_state_t* st = XXH64_createState();
  XXH64_reset(st, layer);
  XXH64_update(st, master, n * sizeof(float));
  XXH64_update(st, m, n * sizeof(float));
  XXH64_update(st, v, n * sizeof(float));
  XXH64_update(st, params, n * sizeof(uint16_t));
  const uint64_t h = XXH64_digest(st);
  XXH64_freeState(st);
  return h;
}

uint64_t TrainingState::LayerChecksum(uint32_t layer) const {
  return LayerStateChecksum(layer, master(layer), exp_avg(layer), exp_avg_sq(layer), params(layer),
                            layers_[layer].numel);
}

uint64_t TrainingState::Checksum() const {
  uint64_t h = 0;
  for (uint32_t l = 0; l < num_layers(); ++l) h = SplitMix64(h ^ LayerChecksum(l));
  return h;
}

std::vector<TrainingState::SegmentView> TrainingState::segments() const {
  std::vector<SegmentView> out;
  const std::pair<const ShmSegment*, shm::SegmentKind> segs[] = {
      {&control_, shm::SegmentKind::kControl},
      {&state_, shm::SegmentKind::kState},
      {&params_, shm::SegmentKind::kParams},
      {&grads_, shm::SegmentKind::kGrads}};
  for (const auto& [seg, kind] : segs) {
    out.push_back({seg->name(), kind, seg->size_bytes(), seg->numa_node(), seg->locked()});
  }
  return out;
}

uint64_t TrainingState::shm_bytes() const {
  return control_.size_bytes() + state_.size_bytes() + params_.size_bytes() + grads_.size_bytes();
}

uint64_t TrainingState::locked_bytes() const {
  uint64_t b = 0;
  for (const ShmSegment* seg : {&control_, &state_, &params_, &grads_}) {
    if (seg->locked()) b += seg->size_bytes();
  }
  return b;
}

void TrainingState::set_remove_on_destroy(bool remove) {
  control_.set_remove_on_destroy(remove);
  state_.set_remove_on_destroy(remove);
  params_.set_remove_on_destroy(remove);
  grads_.set_remove_on_destroy(remove);
}

}  // namespace slidedp::hostd
