// GpuDataPlane: creation, teardown, BeginStep and the gradient-path error. The parameter
// window, the gradient pipeline and the communicators are in gpu_plane_{window,grad,comms}.cc;
// gpu_plane_internal.h holds the state they share.
#include "rankclient/gpu_plane.h"

#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cuda/cuda_kernels.h"
#include "kernels/cuda/cuda_status.h"
#include "proto/shm_abi.h"
#include "rankclient/gpu_plane_internal.h"
#include "spdlog/spdlog.h"

namespace slidedp::rankclient {
namespace v1 = slidedp::v1;

namespace {

absl::StatusOr<cuda::CudaEvent> NewEvent(bool blocking) {
  return cuda::CudaEvent::Create(cudaEventDisableTiming | (blocking ? cudaEventBlockingSync : 0));
}

}  // namespace

GpuDataPlane::GpuDataPlane(RankClient* client, const Options& options)
    : client_(client), options_(options), impl_(std::make_unique<Impl>()) {}

absl::StatusOr<std::unique_ptr<GpuDataPlane>> GpuDataPlane::Create(RankClient* client,
                                                                   const Options& options) {
  if (client == nullptr) return absl::InvalidArgumentError("client: must not be null");
  if (options.window_slots < 1 || options.window_slots > 64) {
    return absl::InvalidArgumentError(
        absl::StrCat("window_slots: ", options.window_slots, ", expected 1..64"));
  }
  if (options.h2d_chunk_bytes < 4096) {
    return absl::InvalidArgumentError(
        absl::StrCat("h2d_chunk_bytes: ", options.h2d_chunk_bytes, ", expected >= 4096"));
  }
  if (options.prefetch_depth >= options.window_slots) {
    return absl::InvalidArgumentError(absl::StrCat("prefetch_depth: ", options.prefetch_depth,
                                                   ", expected less than window_slots (",
                                                   options.window_slots, ")"));
  }
  if (options.staging_buffers < 1 || options.staging_buffers > 64) {
    return absl::InvalidArgumentError(
        absl::StrCat("staging_buffers: ", options.staging_buffers, ", expected 1..64"));
  }
  if (options.push_order != Options::PushOrder::kAuto &&
      options.push_order != Options::PushOrder::kFifo) {
    return absl::InvalidArgumentError(absl::StrCat(
        "push_order: ", static_cast<int>(options.push_order), ", expected kAuto or kFifo"));
  }
  if (options.param_route != v1::PARAM_ROUTE_REPLICATED &&
      options.param_route != v1::PARAM_ROUTE_SHARDED &&
      options.param_route != v1::PARAM_ROUTE_UNSPECIFIED) {
    return absl::InvalidArgumentError(
        absl::StrCat("param_route: ", static_cast<int>(options.param_route),
                     ", expected replicated or sharded"));
  }
  std::unique_ptr<GpuDataPlane> p(new GpuDataPlane(client, options));
  RETURN_IF_ERROR(p->Init());
  return p;
}

absl::Status GpuDataPlane::Init() {
  Impl& m = *impl_;
  m.device = options_.device;
  RETURN_IF_CUDA_ERROR(cudaSetDevice(m.device), "cudaSetDevice(", m.device, ")");
  const uint32_t world = client_->world_size();
  const uint32_t layers = client_->num_layers();

  // 1. Register this process's mappings: reads straight from hostd's params, writes straight
  // into the ring slots. The params mapping is read-only (PROT_READ), hence ReadOnly.
  const auto t0 = Clock::now();
  auto reg = [&](const ShmSegment& seg, unsigned flags, const char* what) -> absl::Status {
    auto* base = static_cast<char*>(const_cast<void*>(static_cast<const void*>(seg.data())));
    for (uint64_t off = 0; off < seg.size_bytes(); off += kRegisterPieceBytes) {
      const uint64_t n = std::min<uint64_t>(kRegisterPieceBytes, seg.size_bytes() - off);
      ASSIGN_OR_RETURN(cuda::HostRegistration r,
                       WithContext(cuda::HostRegistration::Register(base + off, n, flags),
                                   absl::StrCat("registering the ", what, " mapping (", n,
                                                " bytes at offset ", off, ")")));
      m.registered.push_back(std::move(r));
    }
    return absl::OkStatus();
  };
  RETURN_IF_ERROR(reg(client_->params_segment(),
                      cudaHostRegisterPortable | cudaHostRegisterReadOnly, "params"));
  RETURN_IF_ERROR(reg(client_->grads_segment(), cudaHostRegisterPortable, "grads"));
  m.params_base =
      static_cast<const char*>(static_cast<const void*>(client_->params_segment().data()));
  m.params_bytes = client_->params_segment().size_bytes();
  const double register_seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  {
    absl::MutexLock l(&m.mu);
    m.stats.register_seconds = register_seconds;
  }
  spdlog::info(
      "rank {}: registered params ({} MiB) and grads ({} MiB) mappings with CUDA in {:.3f} s",
      client_->rank(), client_->params_segment().size_bytes() >> 20,
      client_->grads_segment().size_bytes() >> 20, register_seconds);

  // 2. Streams. The copy streams get the higher priority: a copy waiting behind compute kernels
  // is exposed time.
  int lo = 0, hi = 0;
  RETURN_IF_CUDA_ERROR(cudaDeviceGetStreamPriorityRange(&lo, &hi), "stream priorities");
  ASSIGN_OR_RETURN(m.h2d,
                   WithContext(cuda::CudaStream::Create(cudaStreamNonBlocking, hi), "H2D stream"));
  ASSIGN_OR_RETURN(m.d2h,
                   WithContext(cuda::CudaStream::Create(cudaStreamNonBlocking, hi), "D2H stream"));
  ASSIGN_OR_RETURN(m.comm, WithContext(cuda::CudaStream::Create(cudaStreamNonBlocking, lo),
                                       "collective stream"));

  // 3. The window: k slots, each the largest streamed layer padded to world_size shards (layers
  // the ranks update themselves, client_updated_layers, never pass through the window).
  uint64_t max_padded = 0;
  for (uint32_t l = 0; l < layers; ++l) {
    if (client_->client_updated(l)) continue;
    max_padded = std::max(max_padded, shm::PaddedNumel(client_->layer_numel(l), world));
  }
  slot_elems_ = max_padded;
  m.slot_bytes = max_padded * 2;
  ASSIGN_OR_RETURN(m.window,
                   WithContext(cuda::DeviceBuffer::Allocate(m.slot_bytes * options_.window_slots),
                               absl::StrCat("the GPU window (", options_.window_slots, " slots of ",
                                            m.slot_bytes, " bytes)")));
  m.slots.resize(options_.window_slots);
  for (WindowSlot& s : m.slots) {
    ASSIGN_OR_RETURN(s.ready, NewEvent(false));
    ASSIGN_OR_RETURN(s.free, NewEvent(false));
  }

  // 4. Gradient staging, needed by the collective routes and by dtype casts. On the collective
  // routes every push goes through a buffer, so their device memory is taken here, before the
  // first forward: a batch-size check (python_client's preflight) then sees it in the free
  // memory, instead of a cudaMalloc failing in the middle of the first backward (seen on the
  // H200: 16 buffers of a Qwen3-4B layer, ~1 GB each, after a batch the check had let through).
  // Elsewhere it is taken on a buffer's first use (TakeStaging): the CPU-reduction route in the
  // job's dtype never needs any.
  reduce_dtype_ = options_.reduce_in_fp32 ? 1 : client_->grad_dtype();
  m.staging.resize(options_.staging_buffers);
  {
    absl::MutexLock l(&m.mu);
    m.staging_use.resize(options_.staging_buffers);
  }
  for (StagingBuffer& b : m.staging) {
    ASSIGN_OR_RETURN(b.ready, NewEvent(false));
    ASSIGN_OR_RETURN(b.free, NewEvent(false));
  }
  if (client_->layout().grad_route() == v1::GRAD_ROUTE_GPU_REDUCTION ||
      client_->layout().grad_route() == v1::GRAD_ROUTE_REDUCE_SCATTER) {
    for (StagingBuffer& b : m.staging) RETURN_IF_ERROR(AllocateStaging(b));
  }
  m.consumed.resize(layers);
  m.produced.resize(layers);
  {
    // 0: the consumed event of the layer's latest push is recorded (or there was none yet; a
    // wait on a never-recorded event returns at once).
    absl::MutexLock l(&m.mu);
    m.consumed_pending.assign(layers, 0);
  }
  for (uint32_t l = 0; l < layers; ++l) {
    ASSIGN_OR_RETURN(m.consumed[l], NewEvent(false));
    ASSIGN_OR_RETURN(m.produced[l], NewEvent(false));
  }
  m.chunk_events.resize(client_->layout().grad_ring_slots());
  for (cuda::CudaEvent& ev : m.chunk_events) {
    ASSIGN_OR_RETURN(ev, NewEvent(true));
  }

  // 5. Communicators, when a route needs one.
  const v1::GradRoute route = client_->layout().grad_route();
  // Lowest layer first only where this rank's ring order cannot desynchronize the ranks: hostd
  // reads the other routes' rings in lockstep (CPU reduction) or layer by layer with rank 0's
  // ring leading (reduce-scatter), so there every rank must push the layers in the same order.
  m.lowest_first = options_.push_order == Options::PushOrder::kAuto &&
                   (world == 1 || route == v1::GRAD_ROUTE_GPU_REDUCTION);
  const bool collective =
      route == v1::GRAD_ROUTE_GPU_REDUCTION || route == v1::GRAD_ROUTE_REDUCE_SCATTER;
  if (collective || options_.param_route == v1::PARAM_ROUTE_SHARDED) {
    RETURN_IF_ERROR(InitComms());
  }

  m.copier = std::thread([this] { CopierLoop(); });
  m.publisher = std::thread([this] { PublisherLoop(); });
  return absl::OkStatus();
}

GpuDataPlane::~GpuDataPlane() {
  Impl& m = *impl_;
  // The threads use the handles: stop them before any is released.
  {
    absl::MutexLock l(&m.mu);
    m.stop = true;
    m.cv.SignalAll();
  }
  if (m.copier.joinable()) m.copier.join();
  if (m.publisher.joinable()) m.publisher.join();
  // Destroying a stream, a buffer or a registration does not wait for the copies and
  // collectives still enqueued on the streams, which read and write them: wait here. Impl's
  // owners then release the rest in reverse order of acquisition, on this device.
  if (m.device >= 0) cudaSetDevice(m.device);
  for (const cuda::CudaStream* s : {&m.h2d, &m.d2h, &m.comm}) {
    if (*s) cudaStreamSynchronize(s->get());
  }
}

GpuDataPlane::Stats GpuDataPlane::stats() const {
  absl::MutexLock l(&impl_->mu);
  return impl_->stats;
}

void GpuDataPlane::Impl::SetError(const absl::Status& s) {
  absl::MutexLock l(&mu);
  if (error.ok()) {
    error = s;
    error_reported = false;
  }
  cv.SignalAll();
}

absl::Status GpuDataPlane::Impl::ReportErrorLocked() {
  error_reported = true;
  return error;
}

absl::Status GpuDataPlane::BeginStep(uint64_t step, std::chrono::milliseconds timeout) {
  Impl& m = *impl_;
  bool reset = false;
  {
    // The previous step's pushes are not waited for: the copier goes on with them while the
    // caller's forward of this step runs (Fetch waits per layer for their updates). Only a
    // failed gradient path whose error the caller has seen is reset: its queued jobs are
    // dropped, and the copier and the publisher finish what they hold (without publishing).
    absl::MutexLock l(&m.mu);
    reset = !m.error.ok() && m.error_reported;
    if (reset) {
      m.jobs.clear();
      m.cv.SignalAll();
      const Clock::time_point deadline = Clock::now() + timeout;
      while (m.copier_busy || !m.inflight.empty()) {
        if (!WaitBefore(m.cv, m.mu, deadline)) {
          return absl::DeadlineExceededError(
              "BeginStep: the failed step's gradient pushes did not stop in time");
        }
      }
      m.error = absl::OkStatus();
      m.error_reported = false;
      m.outstanding = 0;
      std::fill(m.consumed_pending.begin(), m.consumed_pending.end(), 0);
    }
  }
  if (reset) {
    // The dropped jobs' staging buffers may still be read by enqueued work.
    RETURN_IF_CUDA_ERROR(cudaStreamSynchronize(m.comm.get()), "sync of the collective stream");
    RETURN_IF_CUDA_ERROR(cudaStreamSynchronize(m.d2h.get()), "sync of the D2H stream");
    absl::MutexLock l(&m.mu);
    for (StagingUse& u : m.staging_use) u.busy = false;
  }
  return client_->BeginStep(step, timeout);
}

}  // namespace slidedp::rankclient
