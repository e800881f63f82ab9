// RankClient: the one implementation of the rank side of SlideDP (DESIGN.md §3.5). A rank
// process attaches to hostd over gRPC (handshake, AttachRank, a session stream that carries
// heartbeats and is the rank's liveness signal), maps the shared-memory segments by name
// (checking magic, ABI version, sizes and the manifest hash) and then runs the data plane
// through shared memory only:
//   - BeginStep(t): the step t begins for this rank (an RPC; waits for step t-1's updates);
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
// Copies go through a Backend (backend.h): the CPU backend copies into host memory; the CUDA
// backend (issue #4) adds registered mappings, GPU window slots and streams on top of the same
// protocol.
//
// Thread safety: one thread drives the data plane (BeginStep/Fetch/Push/Wait); the session
// runs on internal threads. Destruction detaches.
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
#include "proto/shm_abi.h"
#include "rankclient/backend.h"
#include "slidedp/v1/control.pb.h"

namespace slidedp::rankclient {

class RankClient {
 public:
  struct Options {
    std::string socket;  // hostd's unix socket ("unix:" prefix optional)
    std::string tcp;     // or a loopback host:port
    std::string job_id;  // empty: hostd's job
    uint32_t rank = 0;
    std::string manifest_hash;    // the rank's model; must equal the job's
    int32_t gpu = -1;             // -1: CPU backend
    uint32_t timeout_ms = 30000;  // for RPCs
    // Moves bytes between the mappings and the caller's memory; null: the CPU backend.
    std::shared_ptr<Backend> backend;
  };

  static absl::StatusOr<std::unique_ptr<RankClient>> Attach(const Options& options);

  // Creates hostd's job from `spec` (CreateJob; idempotent for the same manifest), for trainers
  // that bring their own model. Returns the effective spec (defaults filled, manifest_hash set).
  static absl::StatusOr<slidedp::v1::JobSpec> CreateJob(const std::string& socket,
                                                        const slidedp::v1::JobSpec& spec,
                                                        std::chrono::milliseconds timeout);
  ~RankClient();
  RankClient(const RankClient&) = delete;
  RankClient& operator=(const RankClient&) = delete;

  uint32_t rank() const { return options_.rank; }
  uint32_t world_size() const { return layout_.world_size(); }
  uint32_t num_layers() const { return static_cast<uint32_t>(layout_.layers_size()); }
  const slidedp::v1::Layout& layout() const { return layout_; }
  // Elements of a layer (0 for an unknown layer).
  uint64_t layer_numel(uint32_t layer) const;
  // The step BeginStep last began (0 before the first).
  uint64_t current_step() const { return step_; }

  // OUT_OF_RANGE when `step` is not the job's next step.
  absl::Status BeginStep(uint64_t step, std::chrono::milliseconds timeout);

  // Waits for layer `layer` to reach `version` and copies its BF16 parameters into `dst` (memory
  // of the backend)
  // (`dst_bytes` == numel * 2). Returns the version copied (== version). NOT_FOUND: unknown
  // layer; INVALID_ARGUMENT: wrong size; OUT_OF_RANGE: a version that cannot come in this step
  // (> step - 1) or one the layer is already past.
  absl::StatusOr<uint64_t> FetchParams(uint32_t layer, uint64_t version, void* dst,
                                       size_t dst_bytes, std::chrono::milliseconds timeout);
  absl::Status WaitLayer(uint32_t layer, uint64_t version, std::chrono::milliseconds timeout);

  // Pushes this rank's gradient of `layer` for `step` (dtype = the job's grad dtype: 1 FP32,
  // 2 BF16). On the GPU-reduction route only the pushing rank sends data; for the others this
  // records the layer as done. OUT_OF_RANGE: a step other than the current one; NOT_FOUND:
  // unknown layer; INVALID_ARGUMENT: wrong dtype or size; ALREADY_EXISTS: pushed already.
  absl::Status PushGrad(uint64_t step, uint32_t layer, const void* data, int dtype, size_t bytes,
                        std::chrono::milliseconds timeout);

  // Waits until every layer has reached version `step` (the step's updates are published).
  absl::Status WaitStep(uint64_t step, std::chrono::milliseconds timeout);

  // Detaches from hostd (idempotent).
  absl::Status Detach();

 private:
  struct Session;
  explicit RankClient(Options options);
  absl::Status Init();
  absl::Status CheckLive() const;  // ABORTED / UNAVAILABLE when the step can no longer go on
  // Blocks on a futex word until `ready()` or the deadline; returns CheckLive() failures.
  template <typename Ready>
  absl::Status WaitOn(uint32_t* word, Ready ready, std::chrono::steady_clock::time_point deadline,
                      const char* what);

  const Options options_;
  slidedp::v1::Layout layout_;
  std::string job_id_;
  std::string token_;
  std::unique_ptr<Session> session_;
  ShmSegment control_;
  ShmSegment params_;
  ShmSegment grads_;
  shm::ControlBlock* cb_ = nullptr;
  uint64_t step_ = 0;
  uint64_t abort_epoch_ = 0;  // at BeginStep
  uint64_t seq_ = 0;          // next chunk sequence number of the step
  std::vector<bool> pushed_;
  bool pushing_rank_ = true;
  int grad_dtype_ = 2;
  bool detached_ = false;
  std::shared_ptr<Backend> backend_;
  // Failure point (see above): kind and the count at which it fires; counters of this process.
  std::string failpoint_;
  uint64_t failpoint_at_ = 0;
  uint64_t chunks_pushed_ = 0;
  uint64_t fetches_ = 0;
};

}  // namespace slidedp::rankclient
