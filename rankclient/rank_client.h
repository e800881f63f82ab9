// RankClient: the one implementation of the rank side of SlideDP (DESIGN.md §3.5). A rank
// process attaches to hostd over gRPC (handshake, AttachRank, a session stream that carries
// heartbeats and is the rank's liveness signal), maps the shared-memory segments by name
// (checking magic, ABI version, sizes and the manifest hash) and then runs the data plane
// through shared memory only:
//   - BeginStep(t): the step t begins for this rank (an RPC; hostd accepts it at once while step
//     t-1's updates are still applied, and nothing waits for them here: FetchParams' version
//     gate waits per layer);
//   - FetchParams(l, v): the per-layer version gate (futex) until layer l reaches version v,
//     then a copy of its BF16 parameters, verified against a concurrent write (seqlock-style);
//   - PushGrad(t, l, ...): the layer's gradient, chunk by chunk, through this rank's ring;
//   - WaitStep(t): every layer at version t.
// Every wait wakes with ABORTED when hostd aborts the step (a rank died, a protocol error),
// with UNAVAILABLE when hostd shuts down, and with DEADLINE_EXCEEDED at its timeout.
//
// Fault injection for tests (failure points, off unless the environment sets them):
// SLIDEDP_FAILPOINT=push_kill:N   SIGKILL this process right after its N-th gradient chunk;
//                   fetch_kill:N  SIGKILL it halfway through the copy of its N-th FetchParams;
//                   push_stop:N   SIGSTOP it before its N-th gradient chunk.
//
// FetchParams and PushGrad copy to and from host memory. The GPU data plane (gpu_plane.h)
// builds asynchronous, chunked H2D/D2H on the slot-level API below instead: it registers
// the mappings with CUDA, copies parameters straight out of the params mapping into GPU window
// slots, and copies gradient chunks straight into this rank's ring slots.
//
// Routes (Layout::grad_route): CPU reduction - every rank pushes its whole gradient; GPU
// reduction - only grad_pushing_rank pushes (the aggregated gradient), the others only mark the
// layer done; reduce-scatter - every rank pushes its shard shm::ShardOf() of the aggregated
// gradient. PushRange() says which elements this rank pushes.
//
// Steps overlap on the gradient path: after BeginStep(t + 1) the slot-level API may still push
// step t's chunks, under the PushTicket taken when step t's push began; the ring's sequence
// numbers restart at 0 with the first chunk of the next ticket (see AcquireChunkSlot).
//
// Thread safety: one thread drives BeginStep/Fetch/WaitLayer/WaitStep; BeginLayerPush,
// push_ticket and PushGrad may run on a second thread, provided BeginStep does not run
// concurrently with them. AcquireChunkSlot may run on a further thread and PublishChunk on yet
// another (the GPU plane's copier and publisher), concurrently with BeginStep. The session runs
// on internal threads. Destruction detaches.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "common/shm_segment.h"
#include "proto/grad_ring.h"
#include "proto/shm_abi.h"
#include "slidedp/v1/control.pb.h"

namespace grpc {
class ClientContext;
}  // namespace grpc

namespace slidedp::rankclient {

class RankClient {
 public:
  struct Options {
    std::string socket;  // hostd's unix socket ("unix:" prefix optional)
    std::string tcp;     // or a loopback host:port
    // With `tcp`: the file holding hostd's service token (common/tcp_auth.h); empty:
    // $SLIDEDP_TOKEN_FILE.
    std::string token_file;
    std::string job_id;  // empty: hostd's job
    uint32_t rank = 0;
    std::string manifest_hash;    // the rank's model; must equal the job's
    int32_t gpu = -1;             // the rank's CUDA device (reported to hostd); -1: none
    uint32_t timeout_ms = 30000;  // for RPCs
    // Layers this rank keeps resident and updates itself; see AttachRankRequest. Every rank of
    // the job must pass the same set. Their gradients are never pushed (PushGrad refuses them).
    std::vector<uint32_t> client_updated_layers;
  };

  static absl::StatusOr<std::unique_ptr<RankClient>> Attach(const Options& options);
  // Attach, retried every 100 ms for up to `wait` while hostd is not listening yet (UNAVAILABLE)
  // or has no job yet (a rank that starts before the one creating the job).
  static absl::StatusOr<std::unique_ptr<RankClient>> AttachWhenReady(
      const Options& options, std::chrono::milliseconds wait);

  // Creates hostd's job from `spec` (CreateJob; idempotent for the same manifest), for trainers
  // that bring their own model. Returns the effective spec (defaults filled, manifest_hash set).
  static absl::StatusOr<slidedp::v1::JobSpec> CreateJob(const std::string& socket,
                                                        const slidedp::v1::JobSpec& spec,
                                                        std::chrono::milliseconds timeout);
  // CreateJob, retried every 100 ms for up to `wait` while hostd is not listening yet.
  static absl::StatusOr<slidedp::v1::JobSpec> CreateJobWhenReady(const std::string& socket,
                                                                 const slidedp::v1::JobSpec& spec,
                                                                 std::chrono::milliseconds timeout,
                                                                 std::chrono::milliseconds wait);
  ~RankClient();
  RankClient(const RankClient&) = delete;
  RankClient& operator=(const RankClient&) = delete;

  uint32_t rank() const { return options_.rank; }
  // The token AttachRank issued to this attachment (every rank RPC carries it).
  const std::string& attach_token() const { return token_; }
  uint32_t world_size() const { return layout_.world_size(); }
  uint32_t num_layers() const { return static_cast<uint32_t>(layout_.layers_size()); }
  const slidedp::v1::Layout& layout() const { return layout_; }
  // True when the ranks update `layer` themselves (Layout.client_updated_layers).
  bool client_updated(uint32_t layer) const {
    return layer < client_updated_.size() && client_updated_[layer];
  }
  // The job's status from hostd (GetStatus): optimizer config, steps completed, ...
  absl::StatusOr<slidedp::v1::JobStatus> JobStatus() const;
  // NOT_FOUND naming the layer and the model's layer count for an unknown layer, else OK.
  absl::Status CheckLayer(uint32_t layer) const;
  // Elements of a layer (0 for an unknown layer).
  uint64_t layer_numel(uint32_t layer) const;
  // The step BeginStep last began (0 before the first).
  uint64_t current_step() const { return step_; }
  // The job's next step when this rank attached (1 for a fresh job).
  uint64_t next_step_at_attach() const { return next_step_; }

  // OUT_OF_RANGE when `step` is not the job's next step.
  absl::Status BeginStep(uint64_t step, std::chrono::milliseconds timeout);

  // Waits for layer `layer` to reach `version` and copies its BF16 parameters into `dst` (host
  // memory, `dst_bytes` == numel * 2). Returns the version copied (== version). NOT_FOUND: unknown
  // layer; INVALID_ARGUMENT: wrong size; OUT_OF_RANGE: a version that cannot come in this step
  // (> step - 1) or one the layer is already past. The layer's committed version can be read
  // outside a step too (e.g. before the first BeginStep).
  absl::StatusOr<uint64_t> FetchParams(uint32_t layer, uint64_t version, void* dst,
                                       size_t dst_bytes, std::chrono::milliseconds timeout);
  absl::Status WaitLayer(uint32_t layer, uint64_t version, std::chrono::milliseconds timeout);

  // Pushes this rank's gradient of `layer` for `step` (dtype = the job's grad dtype: 1 FP32,
  // 2 BF16). On the GPU-reduction route only the pushing rank sends data; for the others this
  // records the layer as done. OUT_OF_RANGE: a step other than the current one; NOT_FOUND:
  // unknown layer; INVALID_ARGUMENT: wrong dtype or size; ALREADY_EXISTS: pushed already.
  absl::Status PushGrad(uint64_t step, uint32_t layer, const void* data, int dtype, size_t bytes,
                        std::chrono::milliseconds timeout);

  // Optional statistics of what this rank pushes for a layer (its whole push range), sent with
  // the layer's first chunk; with them hostd can apply AdamW chunk by chunk (shm_abi.h).
  struct LayerStats {
    double sumsq = 0;
    bool nonfinite = false;
  };
  // As above, with `stats` of the layer's push range (may be null).
  absl::Status PushGrad(uint64_t step, uint32_t layer, const void* data, int dtype, size_t bytes,
                        const LayerStats* stats, std::chrono::milliseconds timeout);

  // ---- Slot-level API (used by the GPU data plane) ----
  const ShmSegment& params_segment() const { return params_; }
  const ShmSegment& grads_segment() const { return grads_; }
  // Address of a layer's BF16 parameters in this process's params mapping (null: unknown layer).
  const void* LayerParams(uint32_t layer) const;
  // OK iff the layer is at `version` and not being rewritten (committed == pending == version);
  // INTERNAL naming both versions otherwise (after CheckLive: ABORTED/UNAVAILABLE first).
  absl::Status CheckLayerVersion(uint32_t layer, uint64_t version) const;
  // The elements of `layer` this rank pushes on the job's route (numel 0: none).
  shm::ShardRange PushRange(uint32_t layer) const;
  // The job's gradient DType as its integer (SLIDEDP_DTYPE_* of the C ABI).
  int grad_dtype() const { return static_cast<int>(grad_dtype_); }
  uint64_t chunk_bytes() const { return layout_.chunk_bytes(); }
  // Starts this rank's push of `layer` in `step`: checks the step, the layer and that it was not
  // pushed before (same codes as PushGrad), and marks it pushed.
  absl::Status BeginLayerPush(uint64_t step, uint32_t layer);
  // The step a push belongs to: the current step and the abort epoch read at its BeginStep.
  // Taken when the push begins (after BeginLayerPush), it lets the gradient path finish a step's
  // pushes after BeginStep began the next one; an abort of that step (epoch moved) fails them.
  struct PushTicket {
    uint64_t step = 0;
    uint64_t abort_epoch = 0;
    bool operator==(const PushTicket& o) const {
      return step == o.step && abort_epoch == o.abort_epoch;
    }
    bool operator!=(const PushTicket& o) const { return !(*this == o); }
  };
  PushTicket push_ticket() const { return PushTicket{step_, abort_epoch_}; }
  // The ring slot of this rank's next chunk sequence number of `ticket`'s step, once hostd has
  // emptied it. Up to grad_ring_slots slots may be acquired before the first of them is
  // published. Chunks go into the ring ticket by ticket: the first slot of a new ticket restarts
  // the sequence at 0, and needs every slot acquired under the previous ticket published first,
  // or that ticket's step aborted (FAILED_PRECONDITION otherwise: hostd would wait forever for
  // the missing chunk). ABORTED when `ticket`'s step was aborted, UNAVAILABLE when hostd is gone.
  struct ChunkSlotRef {
    uint64_t seq = 0;
    uint32_t slot = 0;
    void* data = nullptr;  // chunk_bytes() bytes in the grads mapping
    PushTicket ticket;     // the step the chunk belongs to
  };
  absl::StatusOr<ChunkSlotRef> AcquireChunkSlot(const PushTicket& ticket,
                                                std::chrono::steady_clock::time_point deadline);
  // Hands an acquired slot, holding elements [offset, offset + numel) of `layer`, to hostd as a
  // chunk of ref.ticket's step. Slots are published in the order they were acquired (INTERNAL
  // otherwise). `stats` only on the rank's first chunk of the layer.
  absl::Status PublishChunk(const ChunkSlotRef& ref, uint32_t layer, uint64_t offset,
                            uint64_t numel, int dtype, const LayerStats* stats);
  // Rendezvous for an NCCL unique id through hostd (rank 0 publishes, the others fetch, waiting
  // up to `timeout` for it). `generation` distinguishes re-created communicators.
  absl::Status PublishCommId(const std::string& unique_id, uint64_t generation,
                             std::chrono::milliseconds timeout);
  absl::StatusOr<std::string> FetchCommId(uint64_t generation, std::chrono::milliseconds timeout);

  // Waits until every layer has reached version `step` (the step's updates are published). For
  // a step before the current one (BeginStep(step + 1) came first), an abort or drop of the
  // current step is no error once `step` completed.
  absl::Status WaitStep(uint64_t step, std::chrono::milliseconds timeout);

  // ---- The layers the ranks update themselves (client_updated_layers) ----
  // The version hostd asks rank 0 to upload them at (ControlBlock::client_sync_step; 0: none):
  // a checkpoint of that step waits for them.
  uint64_t client_sync_step() const;
  // hostd's copy of them was the job's state when this rank attached (fresh, resumed, or
  // uploaded): a rank resuming a job reads it with ReadClientLayer.
  bool client_layers_current() const { return client_layers_current_; }
  // Uploads `count` elements of `part` (0 master, 1 m, 2 v) of client-updated `layer` at
  // version `step`, starting at element `offset`, in pieces of at most 2^18 elements (parts go
  // in order; see UploadClientLayerRequest). Returns true once hostd holds every client-updated
  // layer at `step`. Rank 0 only.
  absl::StatusOr<bool> UploadClientLayer(uint64_t step, uint32_t layer, uint32_t part,
                                         uint64_t offset, const float* data, uint64_t count);
  // Reads `count` elements of `part` of hostd's copy of client-updated `layer` from `offset`
  // into `dst` while it is current; `version` (may be null) receives its version.
  absl::Status ReadClientLayer(uint32_t layer, uint32_t part, uint64_t offset, float* dst,
                               uint64_t count, uint64_t* version) const;

  // Detaches from hostd (idempotent).
  absl::Status Detach();

 private:
  struct Session;
  explicit RankClient(Options options);
  absl::Status Init();
  // Adds the service token to a call over TCP (none over the unix socket).
  void AddAuth(grpc::ClientContext* ctx) const;
  // For the current step (step_, abort_epoch_).
  absl::Status CheckLive() const;
  // For the step of a push ticket (the gradient path).
  absl::Status CheckLive(const PushTicket& ticket) const;
  // The header PublishChunk is about to publish against the job (shm::CheckChunkHeader):
  // INVALID_ARGUMENT (NOT_FOUND for the layer) naming the field.
  absl::Status CheckChunk(const shm::ChunkHeader& h) const;
  // OUT_OF_RANGE for a step other than the current one, NOT_FOUND for an unknown layer.
  absl::Status CheckStepAndLayer(uint64_t step, uint32_t layer)
      const;  // ABORTED / UNAVAILABLE when the step can no longer go on
  // Blocks on a futex word until `ready()` or the deadline; returns CheckLive() failures (of
  // `ticket`'s step when given), except an ABORTED once hostd marked step `completed_ok` (when
  // not 0) completed: the abort was of a later step.
  template <typename Ready>
  absl::Status WaitOn(uint32_t* word, Ready ready, std::chrono::steady_clock::time_point deadline,
                      const char* what, const PushTicket* ticket = nullptr,
                      uint64_t completed_ok = 0);

  const Options options_;
  slidedp::v1::Layout layout_;
  std::string job_id_;
  std::string token_;
  std::string tcp_token_;  // hostd's service token, sent on every call over TCP
  std::unique_ptr<Session> session_;
  ShmSegment control_;
  ShmSegment params_;
  ShmSegment grads_;
  shm::ControlBlock* cb_ = nullptr;
  shm::GradRing ring_;  // this job's rings in control_ and grads_
  uint64_t step_ = 0;
  uint64_t next_step_ = 0;
  bool client_layers_current_ = false;
  uint64_t abort_epoch_ = 0;  // at BeginStep
  // The gradient path's ring position: the ticket of the chunks being acquired (AcquireChunkSlot's
  // thread only) and the sequence numbers within it.
  PushTicket ring_ticket_;
  std::atomic<uint64_t> acquire_seq_{0};  // next chunk sequence number to acquire
  std::atomic<uint64_t> publish_seq_{0};  // next chunk sequence number to publish
  std::vector<bool> pushed_;
  std::vector<bool> client_updated_;  // per layer, from the layout
  bool pushing_rank_ = true;
  shm::DType grad_dtype_ = shm::DType::kBf16;
  bool detached_ = false;
  // Failure point (see above): kind and the count at which it fires; counters of this process.
  std::string failpoint_;
  uint64_t failpoint_at_ = 0;
  uint64_t chunks_pushed_ = 0;
  uint64_t fetches_ = 0;
};

}  // namespace slidedp::rankclient
