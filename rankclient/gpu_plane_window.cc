// GpuDataPlane's parameter window: Fetch (by the parameter route), the fetch schedule
// (BeginSchedule/Next), WaitSlot and ReleaseSlot. The window is the caller's thread's alone;
// only the counters are shared (under Impl::mu).
#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/nccl_status.h"
#include "proto/shm_abi.h"
#include "rankclient/gpu_plane.h"
#include "rankclient/gpu_plane_internal.h"

namespace slidedp::rankclient {
namespace v1 = slidedp::v1;
using cuda::NcclStatus;

absl::Status GpuDataPlane::CopyH2D(void* dst, const char* src, uint64_t bytes) {
  Impl& m = *impl_;
  char* d = static_cast<char*>(dst);
  uint64_t done = 0;
  while (done < bytes) {
    const uint64_t src_off = static_cast<uint64_t>(src + done - m.params_base);
    const uint64_t to_piece = kRegisterPieceBytes - src_off % kRegisterPieceBytes;
    const uint64_t n = std::min({options_.h2d_chunk_bytes, bytes - done, to_piece});
    RETURN_IF_CUDA_ERROR(
        cudaMemcpyAsync(d + done, src + done, n, cudaMemcpyHostToDevice, m.h2d.get()), "H2D of ", n,
        " parameter bytes");
    done += n;
  }
  return absl::OkStatus();
}

absl::StatusOr<GpuDataPlane::Slot> GpuDataPlane::Fetch(uint32_t layer, uint64_t version,
                                                       std::chrono::milliseconds timeout) {
  Impl& m = *impl_;
  RETURN_IF_ERROR(client_->CheckLayer(layer));
  if (client_->client_updated(layer)) {
    return absl::FailedPreconditionError(
        absl::StrCat("layer ", layer,
                     " is updated by the ranks themselves "
                     "(client_updated_layers) and has no window slot; read it with FetchParams"));
  }
  uint16_t* const window = m.window.as<uint16_t>();
  // A free slot that still holds this layer at this version -- the recompute in backward of a
  // layer the forward fetched, when the window has room for them all -- is taken as it is.
  for (uint32_t i = 0; i < m.slots.size(); ++i) {
    WindowSlot& c = m.slots[i];
    if (!c.held && c.valid && c.layer == layer && c.version == version) {
      RETURN_IF_ERROR(client_->CheckLayerVersion(layer, version));
      c.held = true;
      {
        absl::MutexLock l(&m.mu);
        m.stats.window_hits++;
      }
      return Slot{i, layer, version, window + uint64_t{i} * slot_elems_,
                  client_->layer_numel(layer)};
    }
  }
  // The first free slot from the rotation cursor: in a plain forward/backward rotation that is
  // the least recently used one; a caller that keeps some layers longer (e.g. embeddings for the
  // whole step) still gets the others.
  uint32_t index = static_cast<uint32_t>(fetches_ % m.slots.size());
  for (size_t tried = 0; m.slots[index].held; ++tried) {
    if (tried + 1 >= m.slots.size()) {
      std::string held;
      for (const WindowSlot& w : m.slots) absl::StrAppend(&held, held.empty() ? "" : ", ", w.layer);
      return absl::FailedPreconditionError(
          absl::StrCat("every window slot is held (", m.slots.size(), " slots, layers ", held,
                       "); release one before fetching layer ", layer, " or use more slots"));
    }
    index = static_cast<uint32_t>((index + 1) % m.slots.size());
  }
  WindowSlot& ws = m.slots[index];
  const uint64_t cur = client_->current_step();
  if (cur == 0 || version + 1 > cur) {
    return absl::OutOfRangeError(absl::StrCat("version: ", version, " cannot come in step ", cur,
                                              "; expected at most ", cur == 0 ? 0 : cur - 1,
                                              " (begin the step first)"));
  }
  RETURN_IF_ERROR(client_->WaitLayer(layer, version, timeout));
  RETURN_IF_ERROR(client_->CheckLayerVersion(layer, version));

  const uint64_t numel = client_->layer_numel(layer);
  const auto* src = static_cast<const char*>(client_->LayerParams(layer));
  uint16_t* dst = window + uint64_t{index} * slot_elems_;
  ws.valid = false;
  if (ws.free_recorded) {
    RETURN_IF_CUDA_ERROR(cudaStreamWaitEvent(m.h2d.get(), ws.free.get(), 0),
                         "H2D wait for slot reuse");
  }
  const uint32_t world = client_->world_size();
  if (options_.param_route == v1::PARAM_ROUTE_SHARDED) {
    const shm::ShardRange sh = shm::ShardOf(numel, world, client_->rank());
    RETURN_IF_ERROR(CopyH2D(dst + sh.begin, src + sh.begin * 2, sh.numel * 2));
    RETURN_IF_CUDA_ERROR(cudaEventRecord(ws.ready.get(), m.h2d.get()), "event record");
    RETURN_IF_CUDA_ERROR(cudaStreamWaitEvent(m.comm.get(), ws.ready.get(), 0),
                         "collective wait for H2D");
    const uint64_t s = shm::ShardElems(numel, world);
    RETURN_IF_ERROR(NcclStatus(ncclAllGather(dst + uint64_t{client_->rank()} * s, dst, s,
                                             ncclBfloat16, m.param_comm, m.comm.get()),
                               absl::StrCat("ncclAllGather of layer ", layer)));
    RETURN_IF_CUDA_ERROR(cudaEventRecord(ws.ready.get(), m.comm.get()), "event record");
    absl::MutexLock l(&m.mu);
    m.stats.h2d_bytes += sh.numel * 2;
  } else {
    RETURN_IF_ERROR(CopyH2D(dst, src, numel * 2));
    RETURN_IF_CUDA_ERROR(cudaEventRecord(ws.ready.get(), m.h2d.get()), "event record");
    absl::MutexLock l(&m.mu);
    m.stats.h2d_bytes += numel * 2;
  }
  {
    absl::MutexLock l(&m.mu);
    m.stats.layers_fetched++;
  }
  ws.held = true;
  ws.layer = layer;
  ws.version = version;
  ws.valid = true;
  fetches_ = index + 1;
  return Slot{index, layer, version, dst, numel};
}

absl::Status GpuDataPlane::BeginSchedule(std::vector<uint32_t> order, uint64_t version) {
  for (uint32_t l : order) {
    if (l >= client_->num_layers()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "order: layer ", l, " does not exist; the model has ", client_->num_layers(), " layers"));
    }
  }
  if (!schedule_ahead_.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the previous schedule still has ", schedule_ahead_.size(), " fetched layers not taken"));
  }
  schedule_ = std::move(order);
  schedule_version_ = version;
  schedule_fetched_ = 0;
  schedule_next_ = 0;
  return absl::OkStatus();
}

absl::StatusOr<GpuDataPlane::Slot> GpuDataPlane::Next(std::chrono::milliseconds timeout) {
  if (schedule_next_ >= schedule_.size()) {
    return absl::OutOfRangeError(
        absl::StrCat("the schedule's ", schedule_.size(), " layers are all taken"));
  }
  // Keep up to prefetch_depth layers beyond the one returned now in flight, while slots allow.
  const size_t want = std::min(schedule_.size(), schedule_next_ + 1 + options_.prefetch_depth);
  while (schedule_fetched_ < want) {
    bool any_free = false;
    for (const WindowSlot& w : impl_->slots) any_free = any_free || !w.held;
    if (!any_free) {
      if (schedule_fetched_ > schedule_next_) break;  // the one needed now is already fetched
      return absl::FailedPreconditionError(
          absl::StrCat("every window slot is held; release slots before taking layer ",
                       schedule_[schedule_next_], " (", impl_->slots.size(), " slots)"));
    }
    ASSIGN_OR_RETURN(Slot s, Fetch(schedule_[schedule_fetched_], schedule_version_, timeout));
    schedule_ahead_.push_back(s);
    ++schedule_fetched_;
  }
  const Slot s = schedule_ahead_.front();
  schedule_ahead_.pop_front();
  ++schedule_next_;
  return s;
}

absl::Status GpuDataPlane::WaitSlot(const Slot& slot, cudaStream_t stream) {
  if (slot.index >= impl_->slots.size() || !impl_->slots[slot.index].held) {
    return absl::FailedPreconditionError(absl::StrCat("slot ", slot.index, " is not held"));
  }
  RETURN_IF_CUDA_ERROR(cudaStreamWaitEvent(stream, impl_->slots[slot.index].ready.get(), 0),
                       "wait for window slot ", slot.index);
  return absl::OkStatus();
}

absl::Status GpuDataPlane::ReleaseSlot(const Slot& slot, cudaStream_t stream) {
  if (slot.index >= impl_->slots.size() || !impl_->slots[slot.index].held) {
    return absl::FailedPreconditionError(absl::StrCat("slot ", slot.index, " is not held"));
  }
  WindowSlot& ws = impl_->slots[slot.index];
  RETURN_IF_CUDA_ERROR(cudaEventRecord(ws.free.get(), stream), "record slot reuse");
  ws.free_recorded = true;
  ws.held = false;
  // The version stamp: the layer must not have changed while it was copied. The copy is done
  // by now in any sane use (the caller computed with it); if not, wait for it.
  RETURN_IF_CUDA_ERROR(cudaEventSynchronize(ws.ready.get()), "wait for window slot ", slot.index);
  return client_->CheckLayerVersion(ws.layer, ws.version);
}

}  // namespace slidedp::rankclient
