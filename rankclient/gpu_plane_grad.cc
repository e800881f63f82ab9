// GpuDataPlane's gradient pipeline: staging buffers, PushGrad (collectives and casts on the
// collective stream), the copier (chunked D2H into the ring slots hostd frees) and the
// publisher (hands each chunk to hostd once its copy is done). See gpu_plane.h's overview for
// the routes and the push order, gpu_plane_internal.h for who holds what.
#include <algorithm>
#include <chrono>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cuda/cuda_kernels.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/nccl_status.h"
#include "proto/shm_abi.h"
#include "rankclient/gpu_plane.h"
#include "rankclient/gpu_plane_internal.h"

namespace slidedp::rankclient {
namespace v1 = slidedp::v1;
using cuda::CudaStatus;
using cuda::NcclStatus;

namespace {

size_t DTypeBytes(int dtype) { return shm::DTypeBytes(static_cast<shm::DType>(dtype)); }
ncclDataType_t NcclType(int dtype) { return dtype == 1 ? ncclFloat32 : ncclBfloat16; }

}  // namespace

void GpuDataPlane::Impl::ConsumedRecordedLocked(const PushJob& job) {
  if (job.record_consumed && consumed_pending[job.layer] > 0) consumed_pending[job.layer]--;
}

void GpuDataPlane::Impl::HandToPublisher(const PushJob& job, const InflightChunk& c,
                                         double copier_wait_seconds, uint64_t d2h_bytes) {
  // Recorded behind the job's last D2H: a later user of the buffers waits for these events.
  if (c.last_of_job) {
    if (job.staging >= 0) cudaEventRecord(staging[job.staging].free.get(), d2h.get());
    if (job.record_consumed) cudaEventRecord(consumed[job.layer].get(), d2h.get());
  }
  absl::MutexLock l(&mu);
  stats.copier_wait_seconds += copier_wait_seconds;
  stats.d2h_bytes += d2h_bytes;
  if (c.last_of_job) {
    if (job.staging >= 0) {
      staging_use[job.staging].busy = false;
      staging_use[job.staging].free_recorded = true;
    }
    ConsumedRecordedLocked(job);
  }
  inflight.push_back(c);
  cv.SignalAll();
}

void GpuDataPlane::Impl::AbandonJob(const PushJob& job) {
  // A waiter on the caller's buffer must not wait for a copy that will never be enqueued.
  if (job.record_consumed) cudaEventRecord(consumed[job.layer].get(), d2h.get());
  absl::MutexLock l(&mu);
  if (outstanding > 0) outstanding--;
  if (job.staging >= 0) staging_use[job.staging].busy = false;
  ConsumedRecordedLocked(job);
}

absl::Status GpuDataPlane::AllocateStaging(StagingBuffer& b) {
  if (b.in) return absl::OkStatus();
  const v1::GradRoute route = client_->layout().grad_route();
  const bool rs = route == v1::GRAD_ROUTE_REDUCE_SCATTER;
  const bool collective = rs || route == v1::GRAD_ROUTE_GPU_REDUCTION;
  // `in`: the caller's gradient cast (and on reduce-scatter padded) to the reduction dtype, or
  // cast to the job's dtype on the CPU route. `res`/`out`: this rank's result, the whole layer
  // (GPU reduction) or one shard (reduce-scatter).
  const uint64_t padded = slot_elems_;
  const uint64_t result = rs ? padded / client_->world_size() : padded;
  const uint64_t job_bytes = DTypeBytes(client_->grad_dtype());
  const uint64_t red_bytes = DTypeBytes(reduce_dtype_);
  ASSIGN_OR_RETURN(
      b.in, WithContext(cuda::DeviceBuffer::Allocate(padded * std::max(job_bytes, red_bytes)),
                        absl::StrCat("gradient staging (", padded, " elements)")));
  if (collective) {
    ASSIGN_OR_RETURN(
        b.res, WithContext(cuda::DeviceBuffer::Allocate(result * red_bytes), "gradient staging"));
    ASSIGN_OR_RETURN(
        b.out, WithContext(cuda::DeviceBuffer::Allocate(result * job_bytes), "gradient staging"));
    ASSIGN_OR_RETURN(
        b.scratch,
        WithContext(cuda::DeviceBuffer::Allocate(kernels::cuda::StatsScratchBytes(result)),
                    "statistics scratch"));
    ASSIGN_OR_RETURN(b.stats_host,
                     WithContext(cuda::PinnedBuffer::Allocate(
                                     sizeof(kernels::cuda::GradStatsResult), cudaHostAllocDefault),
                                 "statistics"));
  }
  return absl::OkStatus();
}

absl::StatusOr<int> GpuDataPlane::TakeStaging(Clock::time_point deadline) {
  Impl& m = *impl_;
  int taken = -1;
  bool wait_free = false;
  {
    absl::MutexLock l(&m.mu);
    for (;;) {
      if (!m.error.ok()) return m.ReportErrorLocked();
      for (size_t i = 0; i < m.staging_use.size(); ++i) {
        StagingUse& u = m.staging_use[i];
        if (!u.busy) {
          u.busy = true;
          wait_free = u.free_recorded;
          u.free_recorded = false;
          taken = static_cast<int>(i);
          break;
        }
      }
      if (taken >= 0) break;
      if (!WaitBefore(m.cv, m.mu, deadline)) {
        return absl::DeadlineExceededError("timed out waiting for a gradient staging buffer");
      }
    }
  }
  StagingBuffer& b = m.staging[taken];
  if (absl::Status s = AllocateStaging(b); !s.ok()) {
    absl::MutexLock l(&m.mu);
    m.staging_use[taken].busy = false;
    return s;
  }
  if (wait_free) {
    RETURN_IF_CUDA_ERROR(cudaStreamWaitEvent(m.comm.get(), b.free.get(), 0), "staging reuse wait");
  }
  return taken;
}

absl::Status GpuDataPlane::PushGrad(uint64_t step, uint32_t layer, const void* grad, int dtype,
                                    cudaStream_t producer, std::chrono::milliseconds timeout) {
  Impl& m = *impl_;
  {
    absl::MutexLock l(&m.mu);
    if (!m.error.ok()) return m.ReportErrorLocked();
  }
  if (!shm::IsDType(static_cast<uint32_t>(dtype))) {
    return absl::InvalidArgumentError(
        absl::StrCat("dtype: ", dtype, ", expected 1 (FP32) or 2 (BF16)"));
  }
  if (grad == nullptr) return absl::InvalidArgumentError("grad: must not be null");
  RETURN_IF_ERROR(client_->BeginLayerPush(step, layer));
  const RankClient::PushTicket ticket = client_->push_ticket();
  const auto deadline = Clock::now() + timeout;
  const uint64_t numel = client_->layer_numel(layer);
  const int job_dtype = client_->grad_dtype();
  const uint32_t world = client_->world_size();
  const v1::GradRoute route = client_->layout().grad_route();
  const shm::ShardRange range = client_->PushRange(layer);
  cudaStream_t const comm = m.comm.get();
  cudaEvent_t const produced = m.produced[layer].get();
  cudaEvent_t const consumed = m.consumed[layer].get();

  RETURN_IF_CUDA_ERROR(cudaEventRecord(produced, producer), "record producer");
  PushJob job;
  job.ticket = ticket;
  job.layer = layer;
  job.begin = range.begin;
  job.numel = range.numel;
  job.dtype = job_dtype;

  if (route == v1::GRAD_ROUTE_GPU_REDUCTION || route == v1::GRAD_ROUTE_REDUCE_SCATTER) {
    ASSIGN_OR_RETURN(const int si, TakeStaging(deadline));
    StagingBuffer& b = m.staging[si];
    RETURN_IF_CUDA_ERROR(cudaStreamWaitEvent(comm, produced, 0), "wait producer");
    const bool rs = route == v1::GRAD_ROUTE_REDUCE_SCATTER;
    const uint64_t padded = rs ? shm::PaddedNumel(numel, world) : numel;
    const void* in = grad;
    if (dtype != reduce_dtype_ || rs) {
      RETURN_IF_ERROR(
          kernels::cuda::PackPadded(grad, dtype, numel, b.in.get(), reduce_dtype_, padded, comm));
      in = b.in.get();
    }
    // The caller's buffer is free once the collective (or the pack) has read it.
    const ncclDataType_t t = NcclType(reduce_dtype_);
    if (rs) {
      const uint64_t s = shm::ShardElems(numel, world);
      RETURN_IF_ERROR(
          NcclStatus(ncclReduceScatter(in, b.res.get(), s, t, ncclSum, m.grad_comm, comm),
                     absl::StrCat("ncclReduceScatter of layer ", layer)));
    } else {
      RETURN_IF_ERROR(NcclStatus(
          ncclReduce(in, b.res.get(), numel, t, ncclSum,
                     static_cast<int>(client_->layout().grad_pushing_rank()), m.grad_comm, comm),
          absl::StrCat("ncclReduce of layer ", layer)));
    }
    RETURN_IF_CUDA_ERROR(cudaEventRecord(consumed, comm), "record consumed");
    // res holds this rank's result from element 0: the whole layer (GPU route, pushing rank)
    // or the shard (reduce-scatter).
    const void* result = b.res.get();
    if (range.numel > 0 && job_dtype != reduce_dtype_) {
      RETURN_IF_ERROR(kernels::cuda::Unpack(b.res.get(), reduce_dtype_, b.out.get(), job_dtype,
                                            range.numel, comm));
      result = b.out.get();
    }
    if (range.numel > 0 && options_.send_stats) {
      auto* stats_host = b.stats_host.as<kernels::cuda::GradStatsResult>();
      RETURN_IF_ERROR(kernels::cuda::GradStats(result, job_dtype, range.numel, b.scratch.get(),
                                               stats_host, comm));
      job.stats = stats_host;
    }
    RETURN_IF_CUDA_ERROR(cudaEventRecord(b.ready.get(), comm), "record staging ready");
    job.src = static_cast<const char*>(result);
    job.ready = b.ready.get();
    job.staging = si;
  } else if (dtype != job_dtype) {
    ASSIGN_OR_RETURN(const int si, TakeStaging(deadline));
    StagingBuffer& b = m.staging[si];
    RETURN_IF_CUDA_ERROR(cudaStreamWaitEvent(comm, produced, 0), "wait producer");
    RETURN_IF_ERROR(kernels::cuda::Unpack(grad, dtype, b.in.get(), job_dtype, numel, comm));
    RETURN_IF_CUDA_ERROR(cudaEventRecord(consumed, comm), "record consumed");
    RETURN_IF_CUDA_ERROR(cudaEventRecord(b.ready.get(), comm), "record staging ready");
    job.src = static_cast<const char*>(b.in.get());
    job.ready = b.ready.get();
    job.staging = si;
  } else {
    // CPU reduction in the job's dtype: D2H straight from the caller's buffer.
    job.src = static_cast<const char*>(grad);
    job.ready = produced;
    job.record_consumed = true;
  }
  absl::MutexLock l(&m.mu);
  if (job.record_consumed) m.consumed_pending[layer]++;
  m.outstanding++;
  m.jobs.push_back(job);
  m.cv.SignalAll();
  return absl::OkStatus();
}

absl::Status GpuDataPlane::WaitGradConsumed(uint32_t layer, cudaStream_t stream) {
  Impl& m = *impl_;
  if (layer >= m.consumed.size()) {
    return absl::NotFoundError(absl::StrCat("layer: ", layer, " does not exist"));
  }
  {
    absl::MutexLock l(&m.mu);
    while (m.consumed_pending[layer] != 0 && m.error.ok() && !m.stop) m.cv.Wait(&m.mu);
    if (!m.error.ok()) return m.ReportErrorLocked();
  }
  RETURN_IF_CUDA_ERROR(cudaStreamWaitEvent(stream, m.consumed[layer].get(), 0), "wait consumed");
  return absl::OkStatus();
}

absl::Status GpuDataPlane::WaitPushes(std::chrono::milliseconds timeout) {
  Impl& m = *impl_;
  absl::MutexLock l(&m.mu);
  const Clock::time_point deadline = Clock::now() + timeout;
  while (m.outstanding != 0 && m.error.ok()) {
    if (!WaitBefore(m.cv, m.mu, deadline)) {
      return absl::DeadlineExceededError(
          absl::StrCat("timed out with ", m.outstanding, " gradient pushes still in progress"));
    }
  }
  if (!m.error.ok()) return m.ReportErrorLocked();
  return absl::OkStatus();
}

// The copier: for each job (FIFO, or the lowest layer of the oldest step, Options::push_order),
// wait for hostd to free the next ring slot and enqueue the chunk's D2H into it; the publisher
// hands it over once the copy is done.
void GpuDataPlane::CopierLoop() {
  Impl& m = *impl_;
  cudaSetDevice(m.device);
  const uint64_t chunk_bytes = client_->chunk_bytes();
  RankClient::PushTicket last;  // the step of the job taken last
  for (;;) {
    PushJob job;
    {
      absl::MutexLock l(&m.mu);
      // Jobs queue in step order. The next step's chunks restart the ring's sequence numbers, so
      // they wait until every chunk of the previous step is published (RankClient's rule).
      while (!m.stop && (m.jobs.empty() || !m.error.ok() ||
                         (m.jobs.front().ticket != last && !m.inflight.empty()))) {
        m.cv.Wait(&m.mu);
      }
      if (m.stop) return;
      auto pick = m.jobs.begin();
      if (m.lowest_first) {
        // The layer the next forward needs first, among the gradients the GPU has finished: the
        // CPU queues backward far ahead of the GPU, and committing the ring's slots to a layer
        // still being computed would leave hostd idle while finished gradients wait in staging.
        // Collectives already ran in call order.
        auto lowest = m.jobs.end();
        for (auto it = m.jobs.begin(); it != m.jobs.end() && it->ticket == m.jobs.front().ticket;
             ++it) {
          if ((lowest == m.jobs.end() || it->layer < lowest->layer) &&
              cudaEventQuery(it->ready) == cudaSuccess) {
            lowest = it;
          }
        }
        if (lowest == m.jobs.end()) {
          // None finished yet: look again shortly (new jobs wake the wait too). Synchronizing on
          // the event instead would spin a core that hostd's update threads may need.
          m.cv.WaitWithTimeout(&m.mu, absl::Microseconds(200));
          continue;
        }
        pick = lowest;
      }
      job = *pick;
      m.jobs.erase(pick);
      m.copier_busy = true;
      last = job.ticket;
    }
    struct Idle {
      Impl& m;
      ~Idle() {
        absl::MutexLock l(&m.mu);
        m.copier_busy = false;
        m.cv.SignalAll();
      }
    } idle{m};
    const size_t elem = DTypeBytes(job.dtype);
    const uint64_t chunk_elems = chunk_bytes / elem;
    if (cudaError_t e = cudaStreamWaitEvent(m.d2h.get(), job.ready, 0); e != cudaSuccess) {
      m.SetError(CudaStatus(e, "D2H wait for the gradient"));
      m.AbandonJob(job);
      continue;
    }
    if (job.numel == 0) {
      // Nothing to push on this rank (GPU route, not the pushing rank): the staging buffer is
      // free once the collective is done.
      InflightChunk c;
      c.layer = job.layer;
      c.last_of_job = true;
      c.done = nullptr;
      m.HandToPublisher(job, c, /*copier_wait_seconds=*/0, /*d2h_bytes=*/0);
      continue;
    }
    bool ok = true;
    bool failed_here = false;
    for (uint64_t off = 0; off < job.numel && ok; off += chunk_elems) {
      const uint64_t n = std::min(chunk_elems, job.numel - off);
      const auto w0 = Clock::now();
      {
        // An acquired slot stays kSlotEmpty in shared memory until it is published, so at most
        // grad_ring_slots chunks may be between acquire and publish.
        absl::MutexLock l(&m.mu);
        while (!m.stop && m.error.ok() && m.inflight.size() >= m.chunk_events.size()) {
          m.cv.Wait(&m.mu);
        }
        if (m.stop || !m.error.ok()) {
          ok = false;
          break;
        }
      }
      absl::StatusOr<RankClient::ChunkSlotRef> ref =
          client_->AcquireChunkSlot(job.ticket, Clock::now() + std::chrono::minutes(10));
      const double waited = std::chrono::duration<double>(Clock::now() - w0).count();
      if (!ref.ok()) {
        m.SetError(ref.status());
        m.AbandonJob(job);
        failed_here = true;
        ok = false;
        break;
      }
      const size_t ev = ref->seq % m.chunk_events.size();
      cudaError_t e = cudaMemcpyAsync(ref->data, job.src + off * elem, n * elem,
                                      cudaMemcpyDeviceToHost, m.d2h.get());
      if (e == cudaSuccess) e = cudaEventRecord(m.chunk_events[ev].get(), m.d2h.get());
      if (e != cudaSuccess) {
        m.SetError(CudaStatus(e, absl::StrCat("D2H of a gradient chunk of layer ", job.layer)));
        m.AbandonJob(job);
        failed_here = true;
        ok = false;
        break;
      }
      InflightChunk c;
      c.ref = *ref;
      c.layer = job.layer;
      c.offset = job.begin + off;
      c.numel = n;
      c.dtype = job.dtype;
      c.done = m.chunk_events[ev].get();
      c.stats = off == 0 ? job.stats : nullptr;
      c.last_of_job = off + n >= job.numel;
      m.HandToPublisher(job, c, waited, n * elem);
    }
    // Stopped by another thread's error: this job will not complete.
    if (!ok && !failed_here) m.AbandonJob(job);
  }
}

// The publisher: waits for each chunk's copy in order and publishes it at once.
void GpuDataPlane::PublisherLoop() {
  Impl& m = *impl_;
  cudaSetDevice(m.device);
  for (;;) {
    InflightChunk c;
    {
      absl::MutexLock l(&m.mu);
      while (!m.stop && m.inflight.empty()) m.cv.Wait(&m.mu);
      if (m.stop) return;
      c = m.inflight.front();
    }
    absl::Status st;
    if (c.done != nullptr) {
      if (cudaError_t e = cudaEventSynchronize(c.done); e != cudaSuccess) {
        st = CudaStatus(e, "wait for a gradient chunk's D2H");
      }
      bool failed = false;
      {
        absl::MutexLock l(&m.mu);
        failed = !m.error.ok();
      }
      if (st.ok() && !failed) {
        RankClient::LayerStats stats;
        const RankClient::LayerStats* sp = nullptr;
        if (c.stats != nullptr) {
          stats.sumsq = c.stats->sumsq;
          stats.nonfinite = c.stats->nonfinite != 0;
          sp = &stats;
        }
        st = client_->PublishChunk(c.ref, c.layer, c.offset, c.numel, c.dtype, sp);
      }
    }
    if (!st.ok()) m.SetError(st);
    absl::MutexLock l(&m.mu);
    if (!m.inflight.empty()) m.inflight.pop_front();
    if (c.done != nullptr) m.stats.chunks_pushed++;
    if (c.last_of_job && m.outstanding > 0) m.outstanding--;
    m.cv.SignalAll();
  }
}

}  // namespace slidedp::rankclient
