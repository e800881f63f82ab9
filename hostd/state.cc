#include "hostd/state.h"

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
#include "model/job_spec.h"
#include "model/layer_checksum.h"
#include "proto/doorbell.h"
#include "proto/grad_ring.h"

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

OwnerCheck TrainingState::SegmentCheck(const Options& options, shm::SegmentKind kind) {
  if (kind == shm::SegmentKind::kState) return OwnedBySelf(0600);
  return OwnedBySelf(options.mode, options.group);
}

absl::Status TrainingState::CheckSegmentOwners(const Options& options) {
  for (auto kind : {shm::SegmentKind::kControl, shm::SegmentKind::kState, shm::SegmentKind::kParams,
                    shm::SegmentKind::kGrads}) {
    RETURN_IF_ERROR(ShmSegment::CheckExisting(SegmentName(options.instance, kind),
                                              SegmentCheck(options, kind)));
  }
  return absl::OkStatus();
}

absl::Status TrainingState::RemoveSegments(const Options& options) {
  RETURN_IF_ERROR(CheckSegmentOwners(options));
  for (auto kind : {shm::SegmentKind::kControl, shm::SegmentKind::kState, shm::SegmentKind::kParams,
                    shm::SegmentKind::kGrads}) {
    RETURN_IF_ERROR(
        ShmSegment::Remove(SegmentName(options.instance, kind), SegmentCheck(options, kind)));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<TrainingState>> TrainingState::Create(const Options& options,
                                                                     ThreadPool* pool) {
  RETURN_IF_ERROR(model::ValidateManifest(options.model.manifest));
  if (options.world_size < 1 || options.world_size > shm::kMaxRanks) {
    return absl::InvalidArgumentError(
        absl::StrCat("world_size: must be in 1..", shm::kMaxRanks, ", got ", options.world_size));
  }
  std::unique_ptr<TrainingState> s(new TrainingState());
  RETURN_IF_ERROR(s->Initialize(options, pool));
  return s;
}

void TrainingState::ComputeLayout(const Options& options) {
  model_ = options.model;
  manifest_hash_ = model::ManifestHash(model_.manifest);
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
          TensorRange{t.name(), info.numel, numel, t.no_decay(), model::TensorInitKind(t)});
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
  state_bytes_ = state_off;
  param_bytes_ = param_off;
}

absl::Status TrainingState::Initialize(const Options& options, ThreadPool* pool) {
  ComputeLayout(options);
  const uint64_t state_off = state_bytes_;
  const uint64_t param_off = param_bytes_;

  if (const InitialWeights* source = options.import; source != nullptr) {
    RETURN_IF_ERROR(source->Check(layers_));
    weights_source_ = source->Describe();
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
    // Ranks never map the state segment (master, m, v): hostd's alone, whatever shm_mode says.
    o.mode = kind == shm::SegmentKind::kState ? 0600 : options.mode;
    o.group = kind == shm::SegmentKind::kState ? static_cast<gid_t>(-1) : options.group;
    o.mlock = mlock;
    o.populate_pool = pool;
    return ShmSegment::Create(o);
  };
  const uint32_t nl = num_layers();
  // Until the state is complete, a failure must not leave half-made segments behind.
  uint64_t grads_bytes = 0;
  if (options.chunk_bytes < model::kMinChunkBytes || options.chunk_bytes > model::kMaxChunkBytes ||
      options.chunk_bytes % 4096 != 0 || options.grad_ring_slots < 1 ||
      options.grad_ring_slots > 1024 ||
      !shm::GradSegmentBytes(world_size_, options.grad_ring_slots, options.chunk_bytes,
                             &grads_bytes)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "chunk_bytes must be a multiple of 4096 from 4KiB to 1GiB (got ", options.chunk_bytes,
        ") and grad_ring_slots in 1..1024 (got ", options.grad_ring_slots, ")"));
  }
  chunk_bytes_ = options.chunk_bytes;
  grad_ring_slots_ = options.grad_ring_slots;
  const uint64_t control_bytes = shm::ControlSegmentBytes(nl, world_size_, grad_ring_slots_);
  const uint64_t all_bytes = control_bytes + state_off + param_off + grads_bytes;
  uint64_t allocated = 0;
  auto progress = [&](const char* phase, uint64_t done, uint64_t total, const char* unit) {
    if (!options.progress || options.progress(phase, done, total, unit)) return absl::OkStatus();
    return absl::CancelledError(
        absl::StrCat("creating the state of instance '", inst, "' was cancelled (", phase, ")"));
  };
  RETURN_IF_ERROR(progress("allocating shared memory", 0, all_bytes, "bytes"));
  ASSIGN_OR_RETURN(control_,
                   make(shm::SegmentKind::kControl, control_bytes, numa_node_, options.mlock));
  control_.set_remove_on_destroy(true);
  allocated += control_bytes;
  RETURN_IF_ERROR(progress("allocating shared memory", allocated, all_bytes, "bytes"));
  ASSIGN_OR_RETURN(state_, make(shm::SegmentKind::kState, state_off, numa_node_, options.mlock));
  state_.set_remove_on_destroy(true);
  allocated += state_off;
  RETURN_IF_ERROR(progress("allocating shared memory", allocated, all_bytes, "bytes"));
  ASSIGN_OR_RETURN(params_, make(shm::SegmentKind::kParams, param_off, numa_node_, options.mlock));
  params_.set_remove_on_destroy(true);
  allocated += param_off;
  RETURN_IF_ERROR(progress("allocating shared memory", allocated, all_bytes, "bytes"));
  ASSIGN_OR_RETURN(grads_, make(shm::SegmentKind::kGrads, grads_bytes, numa_node_, options.mlock));
  grads_.set_remove_on_destroy(true);
  const char* init_phase = options.import != nullptr ? "importing weights" : "initializing weights";
  RETURN_IF_ERROR(progress(init_phase, 0, nl, "layers"));

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
        RETURN_IF_ERROR(
            options.import->Fill(info.index, static_cast<uint32_t>(ti), w + t.offset, pool));
        continue;
      }
      model::InitKind init = t.init;
      if (options.zero_init && init == model::InitKind::kNormal) init = model::InitKind::kZeros;
      auto fill = [&](size_t b, size_t e, int) {
        float* out = w + t.offset;
        for (size_t i = b; i < e; ++i) {
          out[i] = model::InitialValue(options.seed, t.name, init, model_.initializer_range, i);
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
    RETURN_IF_ERROR(progress(init_phase, info.index + 1, nl, "layers"));
  }
  // Readers check `ready` (acquire) before trusting a header.
  for (const ShmSegment* seg : {&control_, &state_, &params_, &grads_}) {
    shm::Atomic(seg->at<shm::SegmentHeader>(0)->ready).store(1, std::memory_order_release);
  }
  set_remove_on_destroy(false);
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<TrainingState>> TrainingState::Open(const Options& options) {
  RETURN_IF_ERROR(model::ValidateManifest(options.model.manifest));
  if (options.world_size < 1 || options.world_size > shm::kMaxRanks) {
    return absl::InvalidArgumentError(
        absl::StrCat("world_size: must be in 1..", shm::kMaxRanks, ", got ", options.world_size));
  }
  std::unique_ptr<TrainingState> s(new TrainingState());
  s->ComputeLayout(options);
  s->chunk_bytes_ = options.chunk_bytes;
  s->grad_ring_slots_ = options.grad_ring_slots;
  s->weights_source_ = "re-adopted shared memory";
  uint64_t grads_bytes = 0;
  if (!shm::GradSegmentBytes(s->world_size_, s->grad_ring_slots_, s->chunk_bytes_, &grads_bytes)) {
    return absl::InvalidArgumentError(
        absl::StrCat("a grads segment of ", s->world_size_, " x ", s->grad_ring_slots_,
                     " slots of ", s->chunk_bytes_, " bytes does not fit in 64 bits"));
  }
  const uint32_t nl = s->num_layers();
  const std::string& inst = options.instance;
  struct Want {
    shm::SegmentKind kind;
    ShmSegment* seg;
    uint64_t bytes;
  };
  const Want wants[] = {{shm::SegmentKind::kControl, &s->control_,
                         shm::ControlSegmentBytes(nl, s->world_size_, s->grad_ring_slots_)},
                        {shm::SegmentKind::kState, &s->state_, s->state_bytes_},
                        {shm::SegmentKind::kParams, &s->params_, s->param_bytes_},
                        {shm::SegmentKind::kGrads, &s->grads_, grads_bytes}};
  uint64_t nonce = 0;
  for (const Want& w : wants) {
    const std::string name = SegmentName(inst, w.kind);
    ASSIGN_OR_RETURN(*w.seg,
                     ShmSegment::Open(name, /*writable=*/true, SegmentCheck(options, w.kind)));
    const uint64_t size = shm::AlignUp(w.bytes, shm::kPayloadAlign);
    auto mismatch = [&](absl::string_view field, auto found, auto want) {
      return absl::FailedPreconditionError(
          absl::StrCat("segment ", name, ": ", field, " is ", found, ", expected ", want));
    };
    if (w.seg->size_bytes() < shm::kHeaderBytes) {
      return mismatch("file size", w.seg->size_bytes(), size);
    }
    const shm::SegmentHeader& h = *w.seg->at<shm::SegmentHeader>(0);
    if (shm::Atomic(const_cast<uint64_t&>(h.ready)).load(std::memory_order_acquire) != 1) {
      return absl::FailedPreconditionError(
          absl::StrCat("segment ", name, ": not ready (its creation did not finish)"));
    }
    if (const char* bad = shm::ValidateHeader(h, w.kind, size, s->manifest_hash_)) {
      const absl::string_view field(bad);
      if (field == "magic") return mismatch(field, absl::Hex(h.magic), absl::Hex(shm::kMagic));
      if (field == "abi_version") return mismatch(field, h.abi_version, shm::kAbiVersion);
      if (field == "kind") return mismatch(field, h.kind, static_cast<uint32_t>(w.kind));
      if (field == "size_bytes") return mismatch(field, h.size_bytes, size);
      if (field == "manifest_hash") {
        return mismatch("manifest_hash (another model's state)",
                        model::ManifestHashHex(h.manifest_hash),
                        model::ManifestHashHex(s->manifest_hash_));
      }
      return mismatch(field, h.payload_offset, shm::kHeaderBytes);
    }
    if (w.seg->size_bytes() != size) return mismatch("file size", w.seg->size_bytes(), size);
    if (h.layer_count != nl) return mismatch("layer_count", h.layer_count, nl);
    if (h.world_size != s->world_size_) return mismatch("world_size", h.world_size, s->world_size_);
    if (w.kind == shm::SegmentKind::kControl) {
      nonce = h.instance_nonce;
    } else if (h.instance_nonce != nonce) {
      return mismatch("instance_nonce (segments of different creations)",
                      absl::Hex(h.instance_nonce), absl::Hex(nonce));
    }
  }
  const shm::ControlBlock& cb = s->control();
  auto cb_mismatch = [](absl::string_view field, uint64_t found, uint64_t want) {
    return absl::FailedPreconditionError(
        absl::StrCat("control block: ", field, " is ", found, ", expected ", want));
  };
  if (cb.chunk_bytes != s->chunk_bytes_) {
    return cb_mismatch("chunk_bytes", cb.chunk_bytes, s->chunk_bytes_);
  }
  if (cb.grad_ring_slots != s->grad_ring_slots_) {
    return cb_mismatch("grad_ring_slots", cb.grad_ring_slots, s->grad_ring_slots_);
  }
  if (cb.grad_dtype != options.grad_dtype) {
    return cb_mismatch("grad_dtype", cb.grad_dtype, options.grad_dtype);
  }
  if (cb.grad_route != options.grad_route) {
    return cb_mismatch("grad_route", cb.grad_route, options.grad_route);
  }
  for (ShmSegment* seg : {&s->control_, &s->state_, &s->params_, &s->grads_}) {
    RETURN_IF_ERROR(seg->Lock(options.mlock));
  }
  return s;
}

void TrainingState::ResetControlForAdoption(uint64_t next_step) const {
  shm::ControlBlock& cb = control();
  for (uint32_t r = 0; r < shm::kMaxRanks; ++r) {
    shm::RankSlot& rs = rank_slot(r);
    shm::Atomic(rs.attached).store(0, std::memory_order_release);
    shm::Atomic(rs.pid).store(0);
    shm::Atomic(rs.heartbeat_ns).store(0);
    shm::Atomic(rs.step).store(0);
  }
  for (uint32_t r = 0; r < world_size_; ++r) {
    for (uint32_t k = 0; k < grad_ring_slots_; ++k) {
      shm::ReleaseSlot(chunk_slot(r, k));
    }
  }
  shm::Atomic(cb.next_step).store(next_step, std::memory_order_release);
  shm::Atomic(cb.step_state).store(static_cast<uint64_t>(shm::StepState::kIdle));
  shm::Atomic(cb.hostd_pid).store(static_cast<uint64_t>(getpid()));
  shm::Atomic(cb.shutting_down).store(0, std::memory_order_release);
  shm::Atomic(cb.abort_epoch).fetch_add(1, std::memory_order_acq_rel);
  shm::Doorbell(&cb.wake_seq).Ring();
}

uint64_t TrainingState::pending_version(uint32_t layer) const {
  return shm::Atomic(layer_control(layer).pending_version).load(std::memory_order_acquire);
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
  return grad_ring().slot(rank, slot);
}
void* TrainingState::grad_slot_data(uint32_t rank, uint32_t slot) const {
  return grad_ring().data(rank, slot);
}
shm::GradRing TrainingState::grad_ring() const {
  return shm::GradRing(control_.data(), grads_.data(),
                       shm::RingShape{num_layers(), world_size_, grad_ring_slots_, chunk_bytes_});
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
  shm::Doorbell(&lc.wake_seq).Ring();
}

uint64_t TrainingState::LayerChecksum(uint32_t layer) const {
  return model::LayerStateChecksum(layer, master(layer), exp_avg(layer), exp_avg_sq(layer),
                                   params(layer), layers_[layer].numel);
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
