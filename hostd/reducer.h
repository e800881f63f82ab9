// GradientReducer: hostd's side of the gradient push protocol (proto/shm_abi.h). One thread
// watches the ranks' chunk rings and turns the chunks of the running step into layer updates on
// the UpdateWorker. Two routes:
//
//   kSum (CPU reduction): every pushing rank pushes the whole layer. When chunk `seq` of the step
//     is present in the ring of every pushing rank the reducer validates the headers, reduces the
//     chunks in fixed rank order (r = 0, 1, ..., R-1, FP32 adds, so the result is deterministic)
//     into the layer's FP32 gradient buffer and empties the slots (waking the ranks).
//   kShards (reduce-scatter; GPU reduction as its one-rank case): pushing_ranks[i] pushes only
//     shard i of the already-aggregated gradient, shm::ShardOf(numel, pushing_ranks.size(), i),
//     in chunks at absolute layer offsets, and nothing for an empty shard. Nothing is summed:
//     each rank's ring is consumed independently (a cursor per rank), every header is checked
//     against that rank's expected (step, seq, layer, offset, numel, dtype), and a layer is
//     complete when every shard is. The layer the ranks are on is the one rank pushing_ranks[0]
//     (whose shard is never empty) sends next; all ranks push layers in the same order.
//
// On the kShards route a layer is updated in one of two ways, chosen when it starts:
//   streamed (chunk-granular): when the first chunk of every rank with a non-empty shard carries
//     kChunkFlagStats (and the granularity allows it, and clip is not global), the layer's norm
//     and finiteness are known up front (the sum of the ranks' stats_sumsq; non-finite if any
//     rank flags it), so each chunk is handed to the worker as a range (UpdateWorker::SubmitRange)
//     that reads the gradient straight from the ring slot -- no copy -- and the slot is emptied
//     only when the worker has written that range. AdamW of chunk k thus overlaps the transfer of
//     chunk k+1. Before the layer starts the reducer waits until every contributing rank's first
//     chunk is present, to read the stats. The cost: a step aborted in the middle of such a layer
//     leaves it torn (see UpdateWorker), and the job cannot continue without a checkpoint restore.
//   buffered: the chunks are copied into a layer-sized FP32 buffer and the complete layer goes to
//     the worker (UpdateWorker::Submit), exactly as on the kSum route. Never tears.
// Results are bit-identical either way when the stats sent equal what the worker would compute.
//
// Bounded memory: two layer-sized FP32 buffers (allocated at first use). While both are held by the
// update worker the reducer stops consuming, the rings fill, and the ranks block (backpressure). A
// streamed layer needs no buffer; its ranks are held back by their ring slots, which stay full
// until the worker has updated them.
//
// Overlap of steps: while step t is armed, a rank that has pushed all of t may already push step
// t + 1 (the engine accepts BeginStep(t + 1) while t's updates run). Such a chunk can only show
// up where t has nothing more of that rank, so it is left in its slot, neither consumed nor an
// error, until Arm(t + 1). Chunks of earlier steps are discarded (left over from an abort).
//
// A rank owns its ChunkSlots and may rewrite a header at any time, also after publishing it. So
// every header field the reducer uses is read from shared memory once, after the acquire load of
// the slot's state, into a ChunkHeader (shm::ReadFullSlot, for both routes); only that
// copy is validated and used. A second read could see another length or offset than the one
// validated and overflow hostd's buffers.
//
// A header that breaks the protocol (wrong step or sequence, unknown layer, out-of-order or
// duplicate chunk, wrong dtype, a chunk outside the rank's shard, oversize chunk, ranks
// disagreeing, stats that are not a finite sum of squares) calls `on_error` with a message naming
// the rank, the field, what it got and what was expected; the caller aborts the step. Nothing of
// a partial buffered layer ever reaches the worker.
//
// Thread safety: Arm/Abort/Stop/stats from any thread; the reduction runs on the reducer's
// thread; slots lent to the worker come back through a callback on the worker's thread. Lock
// order: the engine's lock, then the reducer's, then the worker's; no callback runs under the
// reducer's lock.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "hostd/optimizer.h"
#include "hostd/state.h"
#include "proto/grad_ring.h"

namespace slidedp {
class ThreadPool;
}

namespace slidedp::hostd {

class GradientReducer {
 public:
  enum class Route {
    kSum,     // every pushing rank pushes the whole layer; hostd sums (CPU reduction)
    kShards,  // pushing_ranks[i] pushes shard i of the aggregated gradient (RS; GPU with one rank)
  };
  // When a kShards layer may be updated chunk by chunk (config key update_granularity).
  enum class Granularity {
    kAuto,   // streamed whenever the ranks send stats and clip is not global
    kLayer,  // always buffered: whole-layer updates, never torn
    kChunk,  // as kAuto, and warn when a layer falls back to the buffered path
  };
  struct Options {
    Route route = Route::kSum;
    // kSum: every rank (CPU reduction). kShards: the ranks owning shards 0, 1, ...: every rank
    // in order (reduce-scatter) or the one designated rank (GPU reduction).
    std::vector<uint32_t> pushing_ranks;
    kernels::GradType grad_type = kernels::GradType::kBf16;
    Granularity granularity = Granularity::kAuto;  // kShards only
  };
  using ErrorFn = std::function<void(uint64_t step, const std::string& reason)>;

  struct Stats {
    uint64_t chunks_reduced = 0;   // chunks consumed, summed or copied or streamed
    uint64_t bytes_reduced = 0;    // gradient bytes read from the rings
    double reduce_seconds = 0;     // summing and copying (streamed chunks are not counted)
    uint64_t layers_buffered = 0;  // layers handed to the worker whole
    uint64_t layers_streamed = 0;  // layers handed to the worker chunk by chunk
    uint64_t chunks_streamed = 0;  // chunks lent to the worker in place
  };

  // `worker` and `state` must outlive the reducer, and the worker must stop (run its queue dry)
  // before the reducer is destroyed, since lent slots come back through callbacks into it.
  // `pool` (may be null) splits each chunk's sum or copy across threads (element-wise, so the
  // result does not depend on the split; ThreadPool serializes its callers). `on_layer_done`
  // (may be null) runs for every layer the reducer submitted, on the worker's thread.
  GradientReducer(TrainingState* state, ThreadPool* pool, UpdateWorker* worker, Options options,
                  UpdateWorker::DoneFn on_layer_done, ErrorFn on_error);
  ~GradientReducer();
  GradientReducer(const GradientReducer&) = delete;
  GradientReducer& operator=(const GradientReducer&) = delete;

  void Start();
  void Stop();
  // `step` is running: chunk 0 of every pushing rank's ring belongs to it. When `step` follows
  // the armed step directly (armed + 1, the armed one not aborted) the chunks of `step` that
  // ranks already pushed stay in the rings and are consumed now (the engine starts a queued step
  // the moment its predecessor completes). Otherwise every full slot not lent to the worker is
  // emptied first: a rank pushes a step only after BeginStep, which arms it, so whatever is in a
  // ring then is left over -- possibly of a dropped attempt of this very step number.
  void Arm(uint64_t step);
  // Changes the route (and the ranks that push) between steps -- hostd's grad_route auto picks it
  // when the first rank attaches. FAILED_PRECONDITION while a layer of the armed step is being
  // reduced or the worker holds gradient slots; the next Arm then clears every ring.
  absl::Status SetRoute(Route route, std::vector<uint32_t> pushing_ranks);
  // Drops the partial layers of `step`, empties every ring slot not lent to the worker and wakes
  // the ranks (lent slots are emptied when the worker returns them).
  void Abort(uint64_t step);
  // Empties every full slot (not lent) holding a chunk of `step`, a step that was begun but will
  // not run (the engine's queued step, dropped); the armed step is untouched.
  void DiscardStep(uint64_t step);

  Stats stats() const;
  // Full slots of `rank`'s ring holding a chunk of `step` (lent ones included). Read under the
  // reducer's lock, which every emptying of a slot holds, so the count never reads a slot the
  // rank is refilling: what a test observes of the rings while ranks push.
  uint32_t FullSlotsOfStep(uint32_t rank, uint64_t step) const;

  // Runs one round of the reduction on the calling thread, as the reducer's thread does, and
  // returns whether it made progress. For fuzzers (fuzz/fuzz_shm.cc) and tests that drive the
  // rings synchronously; never on a reducer that was Start()ed.
  bool PollOnce() { return TryReduceOne(); }

 private:
  struct Buffer {
    std::vector<float> data;
    bool busy = false;
  };
  // A ring slot's header, copied out of shared memory once (see the overview).
  using ChunkHeader = shm::ChunkHeader;
  // kShards: where pushing_ranks[i] is in its ring and in its shard of the current layer.
  struct Cursor {
    uint64_t next_seq = 0;
    uint64_t begin = 0;  // the shard: [begin, end) of the current layer
    uint64_t end = 0;
    uint64_t done = 0;  // elements of the shard consumed
  };

  void Run();
  // A free layer buffer (marked busy), or -1 while the worker holds them all.
  int AcquireBufferLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Makes progress on the armed step if it can; returns true if it did.
  bool TryReduceOne();
  bool TrySumLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool TryShardsLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // kShards: picks the next layer from pushing_ranks[0]'s next chunk and decides streamed or
  // buffered. False while waiting (or after FailLocked); sets *progress on a discarded slot.
  bool StartShardLayerLocked(bool* progress) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // kShards: whether the slot at pushing_ranks[i]'s cursor is full with a chunk to look at; if
  // so its header is copied into *h. Empties a stale slot (of an earlier step) that is not lent,
  // setting *progress.
  bool PeekLocked(size_t i, bool* progress, ChunkHeader* h) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // kShards: checks the header of the chunk at pushing_ranks[i]'s cursor against the current
  // shard of `layer`; calls FailLocked and returns false on a violation.
  bool CheckShardChunkLocked(size_t i, const ChunkHeader& h, uint32_t layer)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // kShards: consumes the checked chunk at pushing_ranks[i]'s cursor, as `h` (the header that
  // was checked) describes it. False after FailLocked.
  bool ConsumeShardChunkLocked(size_t i, const ChunkHeader& h) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Submits the complete buffered layer `current_layer_` (FailLocked on refusal).
  void SubmitBufferLocked(uint64_t numel) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Empties a slot and wakes its rank, unless the slot is lent to the worker.
  void EmptySlotLocked(uint32_t rank, uint32_t slot) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ReleaseSlots(uint32_t slot) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ClearAllSlotsLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ResetLayerLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void FailLocked(const std::string& reason) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A lent slot is back from the worker (its range is written or dropped).
  void ReturnSlot(uint32_t rank, uint32_t slot);
  void Ring();

  TrainingState* const state_;
  ThreadPool* const pool_;
  UpdateWorker* const worker_;
  const Options options_;
  const UpdateWorker::DoneFn on_layer_done_;
  const ErrorFn on_error_;
  const size_t elem_bytes_;
  const uint64_t chunk_elems_;

  mutable absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t armed_step_ ABSL_GUARDED_BY(mu_) = 0;              // 0: no step running
  uint64_t next_seq_ ABSL_GUARDED_BY(mu_) = 0;                // kSum: the lockstep cursor
  Route route_ ABSL_GUARDED_BY(mu_);                          // options_.route, or SetRoute's
  std::vector<uint32_t> pushing_ranks_ ABSL_GUARDED_BY(mu_);  // likewise
  std::vector<Cursor> cursors_ ABSL_GUARDED_BY(mu_);          // kShards: per pushing rank
  std::vector<ChunkHeader> sum_heads_ ABSL_GUARDED_BY(mu_);   // kSum: per pushing rank
  int64_t current_layer_ ABSL_GUARDED_BY(mu_) = -1;
  uint64_t current_done_ ABSL_GUARDED_BY(mu_) = 0;  // kSum: elements of current_layer_ reduced
  bool current_streamed_ ABSL_GUARDED_BY(mu_) = false;
  int current_buffer_ ABSL_GUARDED_BY(mu_) = -1;
  std::vector<bool> reduced_ ABSL_GUARDED_BY(mu_);  // layers complete in the armed step
  // Slots lent to the worker (streamed ranges), [rank * grad_ring_slots + slot]: their data is
  // being read, so nothing may empty them until ReturnSlot.
  std::vector<bool> lent_ ABSL_GUARDED_BY(mu_);
  bool warned_fallback_ ABSL_GUARDED_BY(mu_) = false;
  // Two layer buffers; with global clipping the worker holds every layer of the step until the
  // last one arrives, so more are added on demand, up to one per layer (+4 B per parameter).
  std::vector<Buffer> buffers_ ABSL_GUARDED_BY(mu_);
  uint64_t buffer_elems_ = 0;
  Stats stats_ ABSL_GUARDED_BY(mu_);
  // Set by FailLocked; reported through on_error_ once mu_ is released.
  std::pair<uint64_t, std::string> pending_error_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;  // started by Start, joined by Stop
};

}  // namespace slidedp::hostd
