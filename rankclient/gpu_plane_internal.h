// GpuDataPlane's private state, shared by the files that implement it (not part of the API):
//   gpu_plane.cc         Create/Init (registrations, streams, window, staging, events), the
//                        destructor, BeginStep and the gradient-path error;
//   gpu_plane_window.cc  the parameter window: Fetch, BeginSchedule/Next, WaitSlot, ReleaseSlot;
//   gpu_plane_grad.cc    the gradient pipeline: staging, PushGrad, the copier and the publisher;
//   gpu_plane_comms.cc   the NCCL communicators (taken from the caller or created through hostd).
// Only gpu_plane*.cc include this header.
//
// Ownership: Impl owns every CUDA/NCCL handle of the plane. Its members are declared in the
// order Init acquires them, so they are released in reverse (communicators, events, staging,
// window, streams, registrations) once ~GpuDataPlane has stopped the threads and synchronized
// the streams.
//
// Threads: the caller's thread (the API), the copier and the publisher. The window (`slots`)
// and the schedule are the caller's alone. The gradient queues, the error, the counters and the
// staging buffers' use flags are guarded by `mu`. Everything else is written by Init before the
// threads start and only read afterwards (CUDA handles are used from several threads, as CUDA
// allows).
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/status_macros.h"
#include "kernels/cuda/cuda_handles.h"
#include "kernels/cuda/cuda_kernels.h"
#include "rankclient/gpu_plane.h"

namespace slidedp::rankclient {

using Clock = std::chrono::steady_clock;

// cudaHostRegister is called on pieces of at most this size (issue #4: "chunks <= 64 GiB per
// call"); copies are split at piece boundaries so no copy spans two registrations.
inline constexpr uint64_t kRegisterPieceBytes = 64ull << 30;

// Waits on `cv` until it is signalled or `deadline` passes; false (without waiting) once
// `deadline` has passed. Callers loop on their condition, as with any condition variable.
inline bool WaitBefore(absl::CondVar& cv, absl::Mutex& mu, Clock::time_point deadline)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
  const Clock::time_point now = Clock::now();
  if (now >= deadline) return false;
  cv.WaitWithTimeout(&mu, absl::FromChrono(deadline - now));
  return true;
}

// `r`, or its error with `context` (what the handle was for) prepended.
template <typename T>
absl::StatusOr<T> WithContext(absl::StatusOr<T> r, absl::string_view context) {
  if (!r.ok()) return Annotate(r.status(), context);
  return r;
}

// One gradient push on its way from PushGrad to hostd's ring.
struct PushJob {
  RankClient::PushTicket ticket;  // the step it belongs to
  uint32_t layer = 0;
  const char* src = nullptr;     // device: element `begin` of the layer (or of the shard buffer)
  uint64_t begin = 0;            // first element of the layer pushed
  uint64_t numel = 0;            // elements pushed (0: nothing to push on this rank)
  int dtype = 2;                 // the job's gradient dtype
  cudaEvent_t ready = nullptr;   // the data at src is complete
  int staging = -1;              // staging buffer to free after the D2H (-1: none)
  bool record_consumed = false;  // the copier records the layer's consumed event (no staging)
  const kernels::cuda::GradStatsResult* stats = nullptr;  // pinned host, valid after `ready`
};

// One chunk copied D2H into a ring slot, waiting to be published.
struct InflightChunk {
  RankClient::ChunkSlotRef ref;
  uint32_t layer = 0;
  uint64_t offset = 0;
  uint64_t numel = 0;
  int dtype = 2;
  cudaEvent_t done = nullptr;  // null: nothing was copied (the job pushes no elements)
  const kernels::cuda::GradStatsResult* stats = nullptr;  // first chunk of a layer only
  bool last_of_job = false;
};

// A gradient staging buffer's device memory (allocated by AllocateStaging, by the thread that
// holds the buffer) and events. Whether it is held is StagingUse, under Impl::mu.
struct StagingBuffer {
  cuda::DeviceBuffer in;   // collective input: the gradient in the reduction dtype, padded
  cuda::DeviceBuffer res;  // collective output (reduction dtype)
  cuda::DeviceBuffer out;  // the result cast to the job's dtype (when it differs)
  cuda::DeviceBuffer scratch;
  cuda::PinnedBuffer stats_host;  // one kernels::cuda::GradStatsResult
  cuda::CudaEvent ready;
  cuda::CudaEvent free;  // recorded by the copier after the D2H
};

struct StagingUse {
  bool busy = false;           // taken by a push, until the copier has enqueued its D2H
  bool free_recorded = false;  // the buffer's `free` event is recorded for its last use
};

// A window slot; the caller's thread only.
struct WindowSlot {
  cuda::CudaEvent ready;
  cuda::CudaEvent free;
  bool held = false;
  bool free_recorded = false;
  uint32_t layer = 0;
  uint64_t version = 0;
  bool valid = false;  // holds `layer` at `version` (a fetch filled it; none has begun since)
};

struct GpuDataPlane::Impl {
  // Sets the gradient-path error (the first one wins) and wakes every waiter.
  void SetError(const absl::Status& s) ABSL_LOCKS_EXCLUDED(mu);
  // Marks the gradient-path error as returned to the caller and returns it.
  absl::Status ReportErrorLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // The push of `job.layer` no longer owes the layer's consumed event.
  void ConsumedRecordedLocked(const PushJob& job) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // Hands `c` (a chunk of `job` whose D2H is enqueued) to the publisher. After the job's last
  // chunk it first records on the D2H stream that the job's staging buffer and the caller's
  // gradient buffer are no longer read, then lets the buffer be taken again.
  void HandToPublisher(const PushJob& job, const InflightChunk& c, double copier_wait_seconds,
                       uint64_t d2h_bytes) ABSL_LOCKS_EXCLUDED(mu);
  // Gives `job` up after a gradient-path error: it will not complete, so it no longer counts
  // as outstanding and releases what it holds.
  void AbandonJob(const PushJob& job) ABSL_LOCKS_EXCLUDED(mu);

  int device = 0;
  std::vector<cuda::HostRegistration> registered;  // pieces, in registration order
  const char* params_base = nullptr;
  uint64_t params_bytes = 0;
  cuda::CudaStream h2d;
  cuda::CudaStream d2h;
  cuda::CudaStream comm;
  cuda::DeviceBuffer window;  // window_slots slots of slot_bytes
  uint64_t slot_bytes = 0;
  std::vector<WindowSlot> slots;
  std::vector<StagingBuffer> staging;
  std::vector<cuda::CudaEvent> consumed;  // per layer: the pushed gradient buffer is no longer read
  std::vector<cuda::CudaEvent> produced;  // per layer: PushGrad's producer point
  std::vector<cuda::CudaEvent> chunk_events;  // one per ring slot
  // The communicators the routes use: the owned ones below, or Options::comm for both.
  cuda::NcclComm owned_param_comm;
  cuda::NcclComm owned_grad_comm;
  ncclComm_t param_comm = nullptr;
  ncclComm_t grad_comm = nullptr;
  bool lowest_first = false;  // the copier's push order (Options::push_order)

  absl::Mutex mu;
  absl::CondVar cv;  // signalled on every change of the state below
  std::vector<StagingUse> staging_use ABSL_GUARDED_BY(mu);  // per staging buffer
  // Per layer: pushes whose consumed event the copier has yet to record (the D2H reads the
  // caller's buffer); the other routes record it in PushGrad.
  std::vector<uint32_t> consumed_pending ABSL_GUARDED_BY(mu);
  std::deque<PushJob> jobs ABSL_GUARDED_BY(mu);            // PushGrad -> copier
  std::deque<InflightChunk> inflight ABSL_GUARDED_BY(mu);  // copier -> publisher
  uint64_t outstanding ABSL_GUARDED_BY(mu) = 0;            // jobs not yet fully published
  bool copier_busy ABSL_GUARDED_BY(mu) = false;  // the copier holds a job taken from `jobs`
  absl::Status error ABSL_GUARDED_BY(mu);
  // `error` was returned to the caller (ReportErrorLocked).
  bool error_reported ABSL_GUARDED_BY(mu) = false;
  bool stop ABSL_GUARDED_BY(mu) = false;
  Stats stats ABSL_GUARDED_BY(mu);

  // Started last by Init, joined first by ~GpuDataPlane.
  std::thread copier;
  std::thread publisher;
};

}  // namespace slidedp::rankclient
