// GpuDataPlane: the CUDA side of a rank's data plane (DESIGN.md §3.5, issue #4), built on
// RankClient's slot-level API. It owns
//   - CUDA registrations of this process's params and grads mappings (so H2D reads straight out
//     of hostd's BF16 parameters and D2H writes straight into this rank's gradient ring slots:
//     no staging copies on the host);
//   - a GPU window of `window_slots` BF16 layer slots, each sized for the largest layer padded to
//     world_size shards, with a ready event (parameters present) and a reuse event (the caller's
//     compute no longer reads it);
//   - three streams: H2D, D2H and collectives;
//   - the NCCL communicators the routes need (one for parameters, one for gradients, so the two
//     directions never order against each other), created from unique ids handed out through
//     hostd (rank 0 publishes, the others fetch) or taken from the caller;
//   - two gradient threads: a copier (waits for free ring slots, enqueues chunked D2H) and a
//     publisher (waits for each chunk's copy, then hands the slot to hostd at once, so hostd's
//     update of chunk k overlaps the D2H of chunk k+1).
//
// Push order (Options::push_order): the collectives of PushGrad run in call order on every rank;
// what the copier chooses is the order of the D2H copies into this rank's ring. kFifo: call
// order. kAuto: where this rank's ring order cannot desynchronize the ranks -- world size 1 on
// any route, or the GPU-reduction route (only the pushing rank writes a ring; the others' jobs
// push nothing) -- the copier takes, among the queued pushes of the oldest step, the one with
// the lowest layer index (layers are in forward order: the one the next forward needs first);
// otherwise (CPU reduction or reduce-scatter with world size > 1, where hostd needs every rank's
// layers in the same order) call order. Pushes of one step always reach the ring before any of
// the next step's.
//
// Parameter routes (Options::param_route; a collective choice, equal on every rank):
//   replicated - every rank copies the whole layer H2D, in chunks of h2d_chunk_bytes;
//   sharded    - rank r copies its shard shm::ShardOf(numel, R, r), then ncclAllGather fills the
//                slot (the slot is padded to R * ShardElems).
// Gradient routes (the job's Layout::grad_route):
//   CPU reduction  - every rank D2H's its own gradient (cast to the job's dtype on the GPU first
//                    if needed); hostd sums in rank order;
//   GPU reduction  - ncclReduce to grad_pushing_rank, which D2H's the aggregated gradient;
//   reduce-scatter - ncclReduceScatter, then every rank D2H's its shard (every PCIe link works).
// With reduce_in_fp32, BF16 gradients are widened before the collective and the result is cast
// to the job's dtype after it. On the GPU and reduce-scatter routes the pushing ranks compute
// their part's statistics (sum of squares, non-finite) on the GPU and send them with the first
// chunk, which lets hostd apply AdamW chunk by chunk.
//
// A step on this API (compute = the caller's stream):
//   plane->BeginStep(t);  // at once: step t-1's pushes may still be on their way to hostd
//   forward:  s = Fetch(l, t - 1) a few layers ahead (waits until t-1's update of layer l is
//             published); WaitSlot(s, compute); compute layer l;
//             ReleaseSlot(s, compute) once nothing enqueued later reads the slot;
//   backward: compute layer l's gradient into g_l; PushGrad(t, l, g_l, dtype, compute);
//             before reusing g_l: WaitGradConsumed(l, stream);
//   then the next BeginStep(t + 1) right away; WaitPushes() (and RankClient::WaitStep(t)) only
//   where the gradients must be in hostd (or the update done), e.g. before a checkpoint.
//
// Errors: Create returns FAILED_PRECONDITION/RESOURCE_EXHAUSTED/INTERNAL naming what failed
// (registration, allocation, NCCL init). A gradient-path failure (ABORTED when hostd aborts the
// step a push belongs to, UNAVAILABLE when it goes away, a CUDA error) stops the gradient path
// (queued pushes are not sent) and is returned from then on by every PushGrad, WaitGradConsumed
// and WaitPushes; a PushGrad that returns it enqueues nothing. BeginStep never waits for earlier
// pushes and never drops an error the caller has not been given: with such an error pending it
// begins the step all the same, and the error surfaces at the step's first PushGrad or
// WaitPushes (it may belong to the previous step; its message names that step). The first
// BeginStep after the error was returned resets the gradient path: the failed step's queued
// pushes are dropped, what the threads hold is let go (waiting up to `timeout`), and pushes go
// through again.
//
// Thread safety: one caller thread uses the plane (and its RankClient's step API); the plane's
// own threads touch only the gradient half of the RankClient. Destruction stops the threads,
// synchronizes the streams, then releases the communicators, events, buffers, streams and the
// mappings' registrations (in that order).
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "rankclient/rank_client.h"
#include "slidedp/v1/control.pb.h"

namespace slidedp::rankclient {

struct StagingBuffer;  // gpu_plane_internal.h

class GpuDataPlane {
 public:
  struct Options {
    int device = 0;
    uint32_t window_slots = 3;               // k >= 1
    uint32_t prefetch_depth = 2;             // schedule: fetches kept ahead, < window_slots
    uint64_t h2d_chunk_bytes = 64ull << 20;  // parameter copies are cut at this size
    slidedp::v1::ParamRoute param_route = slidedp::v1::PARAM_ROUTE_REPLICATED;
    bool reduce_in_fp32 = true;  // widen BF16 gradients before a collective
    bool send_stats = true;      // GPU/reduce-scatter routes: stats with the first chunk
    // An existing communicator of world_size ranks in which this process is rank client->rank()
    // (not owned; used for both directions, so the caller must not run collectives on it
    // concurrently). Null: create communicators through hostd when a route needs them.
    ncclComm_t comm = nullptr;
    // Gradient staging buffers (GPU / reduce-scatter / casts), 1..64, each of the largest
    // layer's size (allocated on first use). Each push on those routes holds one until its D2H
    // is enqueued: more let the backward run further ahead of hostd.
    uint32_t staging_buffers = 2;
    // The copier's order of pushes into the ring; see the overview.
    enum class PushOrder { kAuto, kFifo };
    PushOrder push_order = PushOrder::kAuto;
    uint64_t comm_generation = 1;  // hostd rendezvous generation of the first communicator
  };

  struct Slot {
    uint32_t index = 0;
    uint32_t layer = 0;
    uint64_t version = 0;
    uint16_t* data = nullptr;  // device, the layer's BF16 parameters (numel valid elements)
    uint64_t numel = 0;
  };

  struct Stats {
    uint64_t h2d_bytes = 0;
    uint64_t d2h_bytes = 0;
    uint64_t chunks_pushed = 0;
    uint64_t layers_fetched = 0;
    uint64_t window_hits = 0;  // fetches served by a slot that still held the layer (no copy)
    double register_seconds = 0;
    double nccl_init_seconds = 0;
    double copier_wait_seconds = 0;  // copier blocked on hostd freeing ring slots
  };

  // `client` must outlive the plane. Sets the current device of the calling thread.
  static absl::StatusOr<std::unique_ptr<GpuDataPlane>> Create(RankClient* client,
                                                              const Options& options);
  ~GpuDataPlane();
  GpuDataPlane(const GpuDataPlane&) = delete;
  GpuDataPlane& operator=(const GpuDataPlane&) = delete;

  // Begins `step` on the RankClient without waiting for the previous step's pushes (they go on
  // behind it). Resets a failed gradient path whose error was returned to the caller; see Errors
  // above. DEADLINE_EXCEEDED when that reset does not finish within `timeout`.
  absl::Status BeginStep(uint64_t step, std::chrono::milliseconds timeout);

  // Takes the next window slot (FAILED_PRECONDITION when it is still held: release slots
  // first), waits until `layer` is at `version`, and enqueues its parameters into the slot by the
  // parameter route. Returns at once after enqueueing.
  absl::StatusOr<Slot> Fetch(uint32_t layer, uint64_t version, std::chrono::milliseconds timeout);
  // A fetch schedule: the layers in the order the caller computes them (e.g. forward 0..L-1,
  // then backward L-1..0), all at `version`. Next() returns the next layer's slot after
  // enqueueing the fetches of up to prefetch_depth further layers of the schedule (as window
  // slots are released). INVALID_ARGUMENT for an unknown layer in `order`.
  absl::Status BeginSchedule(std::vector<uint32_t> order, uint64_t version);
  // OUT_OF_RANGE when the schedule is exhausted; FAILED_PRECONDITION when its next layer cannot
  // be fetched because every window slot is held (release slots as you go).
  absl::StatusOr<Slot> Next(std::chrono::milliseconds timeout);

  // Makes `stream` wait until the slot holds the parameters.
  absl::Status WaitSlot(const Slot& slot, cudaStream_t stream);
  // The slot may be reused once the work enqueued on `stream` so far is done. Verifies that the
  // layer's version did not change while it was copied (INTERNAL otherwise).
  absl::Status ReleaseSlot(const Slot& slot, cudaStream_t stream);

  // Pushes this rank's gradient of `layer` for `step` (device memory, `dtype` 1 FP32 or 2 BF16,
  // the layer's numel elements) once the work enqueued on `producer` so far is done. Returns
  // after enqueueing; the buffer must not change until WaitGradConsumed(layer, ...) or
  // WaitPushes. Same argument codes as RankClient::PushGrad.
  absl::Status PushGrad(uint64_t step, uint32_t layer, const void* grad, int dtype,
                        cudaStream_t producer, std::chrono::milliseconds timeout);
  // Makes `stream` wait until the gradient buffers pushed for `layer` are no longer read.
  absl::Status WaitGradConsumed(uint32_t layer, cudaStream_t stream);
  // Every pushed gradient (of this step and earlier ones) is in hostd's rings; returns the
  // first gradient-path error.
  absl::Status WaitPushes(std::chrono::milliseconds timeout);

  RankClient* client() const { return client_; }
  uint32_t window_slots() const { return options_.window_slots; }
  uint64_t slot_elems() const { return slot_elems_; }
  Stats stats() const;

 private:
  struct Impl;  // gpu_plane_internal.h: CUDA/NCCL handles, window and staging, gradient queues
  GpuDataPlane(RankClient* client, const Options& options);
  absl::Status Init();
  absl::Status InitComms();
  absl::Status CopyH2D(void* dst, const char* src, uint64_t bytes);
  absl::StatusOr<int> TakeStaging(std::chrono::steady_clock::time_point deadline);
  absl::Status AllocateStaging(StagingBuffer& b);
  void CopierLoop();
  void PublisherLoop();

  RankClient* const client_;
  const Options options_;
  std::unique_ptr<Impl> impl_;
  uint64_t slot_elems_ = 0;
  uint64_t fetches_ = 0;
  std::vector<uint32_t> schedule_;
  uint64_t schedule_version_ = 0;
  size_t schedule_fetched_ = 0;  // positions of schedule_ fetched so far
  size_t schedule_next_ = 0;     // position Next() returns next
  std::deque<Slot> schedule_ahead_;
  int reduce_dtype_ = 1;  // dtype the collectives run in (1 FP32, 2 BF16)
};

}  // namespace slidedp::rankclient
