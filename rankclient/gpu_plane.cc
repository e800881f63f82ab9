#include "rankclient/gpu_plane.h"

#include <algorithm>
#include <condition_variable>
#include <cstdlib>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cuda/cuda_kernels.h"
#include "kernels/cuda/cuda_status.h"
#include "proto/shm_abi.h"
#include "spdlog/spdlog.h"

namespace slidedp::rankclient {
namespace v1 = slidedp::v1;
using Clock = std::chrono::steady_clock;
using cuda::CudaStatus;

namespace {

// cudaHostRegister is called on pieces of at most this size (issue #4: "chunks <= 64 GiB per
// call"); copies are split at piece boundaries so no copy spans two registrations.
constexpr uint64_t kRegisterPieceBytes = 64ull << 30;

absl::Status NcclStatus(ncclResult_t r, absl::string_view what) {
  if (r == ncclSuccess) return absl::OkStatus();
  const absl::StatusCode code = r == ncclInvalidArgument || r == ncclInvalidUsage
                                    ? absl::StatusCode::kInvalidArgument
                                    : absl::StatusCode::kInternal;
  return absl::Status(code, absl::StrCat(what, ": NCCL error ", static_cast<int>(r), " (",
                                         ncclGetErrorString(r), "): ", ncclGetLastError(nullptr)));
}

size_t DTypeBytes(int dtype) { return shm::DTypeBytes(static_cast<shm::DType>(dtype)); }
ncclDataType_t NcclType(int dtype) { return dtype == 1 ? ncclFloat32 : ncclBfloat16; }

absl::StatusOr<cudaEvent_t> NewEvent(bool blocking) {
  cudaEvent_t e = nullptr;
  RETURN_IF_CUDA_ERROR(
      cudaEventCreateWithFlags(&e, cudaEventDisableTiming | (blocking ? cudaEventBlockingSync : 0)),
      "cudaEventCreate");
  return e;
}

}  // namespace

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
  cudaEvent_t done = nullptr;
  const kernels::cuda::GradStatsResult* stats = nullptr;  // first chunk of a layer only
  bool last_of_job = false;
};

struct StagingBuffer {
  void* in = nullptr;   // collective input: the gradient in the reduction dtype, padded
  void* res = nullptr;  // collective output (reduction dtype)
  void* out = nullptr;  // the result cast to the job's dtype (when it differs)
  void* scratch = nullptr;
  kernels::cuda::GradStatsResult* stats_host = nullptr;  // pinned
  cudaEvent_t ready = nullptr;
  cudaEvent_t free = nullptr;  // recorded by the copier after the D2H
  bool busy = false;           // guarded by Impl::mu
  bool free_recorded = false;  // guarded by Impl::mu: `free` recorded for the last use
};

struct WindowSlot {
  cudaEvent_t ready = nullptr;
  cudaEvent_t free = nullptr;
  bool held = false;
  bool free_recorded = false;
  uint32_t layer = 0;
  uint64_t version = 0;
  bool valid = false;  // holds `layer` at `version` (a fetch filled it; none has begun since)
};

struct GpuDataPlane::Impl {
  int device = 0;
  std::vector<std::pair<void*, uint64_t>> registered;  // pieces, in registration order
  const char* params_base = nullptr;
  uint64_t params_bytes = 0;
  cudaStream_t h2d = nullptr;
  cudaStream_t d2h = nullptr;
  cudaStream_t comm = nullptr;
  uint16_t* window = nullptr;
  std::vector<WindowSlot> slots;
  std::vector<StagingBuffer> staging;
  std::vector<cudaEvent_t> consumed;  // per layer: the pushed gradient buffer is no longer read
  // Per layer (guarded by mu): pushes whose consumed event the copier has yet to record (the
  // D2H reads the caller's buffer); the other routes record it in PushGrad.
  std::vector<uint32_t> consumed_pending;
  std::vector<cudaEvent_t> chunk_events;  // one per ring slot
  std::vector<cudaEvent_t> produced;      // per layer: PushGrad's producer point
  ncclComm_t param_comm = nullptr;
  ncclComm_t grad_comm = nullptr;
  bool owns_comms = false;
  uint64_t slot_bytes = 0;

  std::mutex mu;
  std::condition_variable cv;
  std::deque<PushJob> jobs;            // PushGrad -> copier
  std::deque<InflightChunk> inflight;  // copier -> publisher
  uint64_t outstanding = 0;            // jobs not yet fully published
  bool copier_busy = false;            // the copier holds a job taken from `jobs`
  absl::Status error;
  bool error_reported = false;  // `error` was returned to the caller (ReportErrorLocked)
  bool lowest_first = false;    // the copier's push order (Options::push_order)
  bool stop = false;
  Stats stats;
  std::thread copier;
  std::thread publisher;
};

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
      RETURN_IF_CUDA_ERROR(cudaHostRegister(base + off, n, flags), "cudaHostRegister of the ", what,
                           " mapping (", n, " bytes at offset ", off, ")");
      m.registered.emplace_back(base + off, n);
    }
    return absl::OkStatus();
  };
  RETURN_IF_ERROR(reg(client_->params_segment(),
                      cudaHostRegisterPortable | cudaHostRegisterReadOnly, "params"));
  RETURN_IF_ERROR(reg(client_->grads_segment(), cudaHostRegisterPortable, "grads"));
  m.params_base =
      static_cast<const char*>(static_cast<const void*>(client_->params_segment().data()));
  m.params_bytes = client_->params_segment().size_bytes();
  impl_->stats.register_seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  spdlog::info(
      "rank {}: registered params ({} MiB) and grads ({} MiB) mappings with CUDA in {:.3f} s",
      client_->rank(), client_->params_segment().size_bytes() >> 20,
      client_->grads_segment().size_bytes() >> 20, impl_->stats.register_seconds);

  // 2. Streams. The copy streams get the higher priority: a copy waiting behind compute kernels
  // is exposed time.
  int lo = 0, hi = 0;
  RETURN_IF_CUDA_ERROR(cudaDeviceGetStreamPriorityRange(&lo, &hi), "stream priorities");
  RETURN_IF_CUDA_ERROR(cudaStreamCreateWithPriority(&m.h2d, cudaStreamNonBlocking, hi),
                       "H2D stream");
  RETURN_IF_CUDA_ERROR(cudaStreamCreateWithPriority(&m.d2h, cudaStreamNonBlocking, hi),
                       "D2H stream");
  RETURN_IF_CUDA_ERROR(cudaStreamCreateWithPriority(&m.comm, cudaStreamNonBlocking, lo),
                       "collective stream");

  // 3. The window: k slots, each the largest streamed layer padded to world_size shards (layers
  // the ranks update themselves, client_updated_layers, never pass through the window).
  uint64_t max_padded = 0;
  for (uint32_t l = 0; l < layers; ++l) {
    if (client_->client_updated(l)) continue;
    max_padded = std::max(max_padded, shm::PaddedNumel(client_->layer_numel(l), world));
  }
  slot_elems_ = max_padded;
  m.slot_bytes = max_padded * 2;
  RETURN_IF_CUDA_ERROR(cudaMalloc(&m.window, m.slot_bytes * options_.window_slots),
                       "cudaMalloc of the GPU window (", options_.window_slots, " slots of ",
                       m.slot_bytes, " bytes)");
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
  // 0: the consumed event of the layer's latest push is recorded (or there was none yet; a wait
  // on a never-recorded event returns at once).
  m.consumed_pending.assign(layers, 0);
  for (uint32_t l = 0; l < layers; ++l) {
    ASSIGN_OR_RETURN(m.consumed[l], NewEvent(false));
    ASSIGN_OR_RETURN(m.produced[l], NewEvent(false));
  }
  m.chunk_events.resize(client_->layout().grad_ring_slots());
  for (cudaEvent_t& ev : m.chunk_events) {
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

absl::Status GpuDataPlane::InitComms() {
  Impl& m = *impl_;
  if (options_.comm != nullptr) {
    int n = 0, r = 0;
    RETURN_IF_ERROR(NcclStatus(ncclCommCount(options_.comm, &n), "ncclCommCount"));
    RETURN_IF_ERROR(NcclStatus(ncclCommUserRank(options_.comm, &r), "ncclCommUserRank"));
    if (static_cast<uint32_t>(n) != client_->world_size() ||
        static_cast<uint32_t>(r) != client_->rank()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "comm: the communicator has ", n, " ranks and this process is rank ", r,
          "; the job expects ", client_->world_size(), " ranks and rank ", client_->rank()));
    }
    m.param_comm = options_.comm;
    m.grad_comm = options_.comm;
    return absl::OkStatus();
  }
  // NVLink multicast (NVLS) can take GPUs out of service on shared hosts; off unless the user
  // set it explicitly.
  setenv("NCCL_NVLS_ENABLE", "0", /*overwrite=*/0);
  const auto t0 = Clock::now();
  const auto timeout = std::chrono::milliseconds(120000);
  auto make = [&](uint64_t generation, ncclComm_t* out) -> absl::Status {
    ncclUniqueId id;
    if (client_->rank() == 0) {
      RETURN_IF_ERROR(NcclStatus(ncclGetUniqueId(&id), "ncclGetUniqueId"));
      RETURN_IF_ERROR(client_->PublishCommId(
          std::string(reinterpret_cast<const char*>(&id), sizeof(id)), generation, timeout));
    } else {
      ASSIGN_OR_RETURN(std::string bytes, client_->FetchCommId(generation, timeout));
      if (bytes.size() != sizeof(id)) {
        return absl::InternalError(absl::StrCat("hostd handed out a ", bytes.size(),
                                                "-byte NCCL id; expected ", sizeof(id)));
      }
      std::memcpy(&id, bytes.data(), sizeof(id));
    }
    return NcclStatus(ncclCommInitRank(out, static_cast<int>(client_->world_size()), id,
                                       static_cast<int>(client_->rank())),
                      absl::StrCat("ncclCommInitRank (", client_->world_size(), " ranks, rank ",
                                   client_->rank(), ", device ", m.device, ")"));
  };
  RETURN_IF_ERROR(make(options_.comm_generation, &m.param_comm));
  RETURN_IF_ERROR(make(options_.comm_generation + 1, &m.grad_comm));
  m.owns_comms = true;
  m.stats.nccl_init_seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  spdlog::info("rank {}: NCCL communicators ready in {:.3f} s", client_->rank(),
               m.stats.nccl_init_seconds);
  return absl::OkStatus();
}

GpuDataPlane::~GpuDataPlane() {
  Impl& m = *impl_;
  {
    std::lock_guard<std::mutex> l(m.mu);
    m.stop = true;
  }
  m.cv.notify_all();
  if (m.copier.joinable()) m.copier.join();
  if (m.publisher.joinable()) m.publisher.join();
  if (m.device >= 0) cudaSetDevice(m.device);
  for (cudaStream_t s : {m.h2d, m.d2h, m.comm}) {
    if (s != nullptr) cudaStreamSynchronize(s);
  }
  if (m.owns_comms) {
    if (m.grad_comm != nullptr) ncclCommDestroy(m.grad_comm);
    if (m.param_comm != nullptr) ncclCommDestroy(m.param_comm);
  }
  for (cudaEvent_t e : m.chunk_events) cudaEventDestroy(e);
  for (cudaEvent_t e : m.consumed) cudaEventDestroy(e);
  for (cudaEvent_t e : m.produced) cudaEventDestroy(e);
  for (StagingBuffer& b : m.staging) {
    cudaEventDestroy(b.ready);
    cudaEventDestroy(b.free);
    cudaFreeHost(b.stats_host);
    cudaFree(b.scratch);
    cudaFree(b.out);
    cudaFree(b.res);
    cudaFree(b.in);
  }
  for (WindowSlot& s : m.slots) {
    cudaEventDestroy(s.ready);
    cudaEventDestroy(s.free);
  }
  cudaFree(m.window);
  for (cudaStream_t s : {m.comm, m.d2h, m.h2d}) {
    if (s != nullptr) cudaStreamDestroy(s);
  }
  for (auto it = m.registered.rbegin(); it != m.registered.rend(); ++it) {
    cudaHostUnregister(it->first);
  }
}

GpuDataPlane::Stats GpuDataPlane::stats() const {
  std::lock_guard<std::mutex> l(impl_->mu);
  return impl_->stats;
}

void GpuDataPlane::SetError(const absl::Status& s) {
  {
    std::lock_guard<std::mutex> l(impl_->mu);
    if (impl_->error.ok()) {
      impl_->error = s;
      impl_->error_reported = false;
    }
  }
  impl_->cv.notify_all();
}

absl::Status GpuDataPlane::ReportErrorLocked() {
  impl_->error_reported = true;
  return impl_->error;
}

absl::Status GpuDataPlane::BeginStep(uint64_t step, std::chrono::milliseconds timeout) {
  Impl& m = *impl_;
  bool reset = false;
  {
    // The previous step's pushes are not waited for: the copier goes on with them while the
    // caller's forward of this step runs (Fetch waits per layer for their updates). Only a
    // failed gradient path whose error the caller has seen is reset: its queued jobs are
    // dropped, and the copier and the publisher finish what they hold (without publishing).
    std::unique_lock<std::mutex> l(m.mu);
    reset = !m.error.ok() && m.error_reported;
    if (reset) {
      m.jobs.clear();
      m.cv.notify_all();
      if (!m.cv.wait_for(l, timeout, [&] { return !m.copier_busy && m.inflight.empty(); })) {
        return absl::DeadlineExceededError(
            "BeginStep: the failed step's gradient pushes did not stop in time");
      }
      m.error = absl::OkStatus();
      m.error_reported = false;
      m.outstanding = 0;
      std::fill(m.consumed_pending.begin(), m.consumed_pending.end(), 0);
    }
  }
  if (reset) {
    // The dropped jobs' staging buffers may still be read by enqueued work.
    RETURN_IF_CUDA_ERROR(cudaStreamSynchronize(m.comm), "sync of the collective stream");
    RETURN_IF_CUDA_ERROR(cudaStreamSynchronize(m.d2h), "sync of the D2H stream");
    std::lock_guard<std::mutex> l(m.mu);
    for (StagingBuffer& b : m.staging) b.busy = false;
  }
  return client_->BeginStep(step, timeout);
}

absl::Status GpuDataPlane::CopyH2D(void* dst, const char* src, uint64_t bytes) {
  Impl& m = *impl_;
  char* d = static_cast<char*>(dst);
  uint64_t done = 0;
  while (done < bytes) {
    const uint64_t src_off = static_cast<uint64_t>(src + done - m.params_base);
    const uint64_t to_piece = kRegisterPieceBytes - src_off % kRegisterPieceBytes;
    const uint64_t n = std::min({options_.h2d_chunk_bytes, bytes - done, to_piece});
    RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(d + done, src + done, n, cudaMemcpyHostToDevice, m.h2d),
                         "H2D of ", n, " parameter bytes");
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
  // A free slot that still holds this layer at this version -- the recompute in backward of a
  // layer the forward fetched, when the window has room for them all -- is taken as it is.
  for (uint32_t i = 0; i < m.slots.size(); ++i) {
    WindowSlot& c = m.slots[i];
    if (!c.held && c.valid && c.layer == layer && c.version == version) {
      RETURN_IF_ERROR(client_->CheckLayerVersion(layer, version));
      c.held = true;
      {
        std::lock_guard<std::mutex> l(m.mu);
        m.stats.window_hits++;
      }
      return Slot{i, layer, version, m.window + uint64_t{i} * slot_elems_,
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
  uint16_t* dst = m.window + uint64_t{index} * slot_elems_;
  ws.valid = false;
  if (ws.free_recorded) {
    RETURN_IF_CUDA_ERROR(cudaStreamWaitEvent(m.h2d, ws.free, 0), "H2D wait for slot reuse");
  }
  const uint32_t world = client_->world_size();
  if (options_.param_route == v1::PARAM_ROUTE_SHARDED) {
    const shm::ShardRange sh = shm::ShardOf(numel, world, client_->rank());
    RETURN_IF_ERROR(CopyH2D(dst + sh.begin, src + sh.begin * 2, sh.numel * 2));
    RETURN_IF_CUDA_ERROR(cudaEventRecord(ws.ready, m.h2d), "event record");
    RETURN_IF_CUDA_ERROR(cudaStreamWaitEvent(m.comm, ws.ready, 0), "collective wait for H2D");
    const uint64_t s = shm::ShardElems(numel, world);
    RETURN_IF_ERROR(NcclStatus(ncclAllGather(dst + uint64_t{client_->rank()} * s, dst, s,
                                             ncclBfloat16, m.param_comm, m.comm),
                               absl::StrCat("ncclAllGather of layer ", layer)));
    RETURN_IF_CUDA_ERROR(cudaEventRecord(ws.ready, m.comm), "event record");
    std::lock_guard<std::mutex> l(m.mu);
    m.stats.h2d_bytes += sh.numel * 2;
  } else {
    RETURN_IF_ERROR(CopyH2D(dst, src, numel * 2));
    RETURN_IF_CUDA_ERROR(cudaEventRecord(ws.ready, m.h2d), "event record");
    std::lock_guard<std::mutex> l(m.mu);
    m.stats.h2d_bytes += numel * 2;
  }
  {
    std::lock_guard<std::mutex> l(m.mu);
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
  RETURN_IF_CUDA_ERROR(cudaStreamWaitEvent(stream, impl_->slots[slot.index].ready, 0),
                       "wait for window slot ", slot.index);
  return absl::OkStatus();
}

absl::Status GpuDataPlane::ReleaseSlot(const Slot& slot, cudaStream_t stream) {
  if (slot.index >= impl_->slots.size() || !impl_->slots[slot.index].held) {
    return absl::FailedPreconditionError(absl::StrCat("slot ", slot.index, " is not held"));
  }
  WindowSlot& ws = impl_->slots[slot.index];
  RETURN_IF_CUDA_ERROR(cudaEventRecord(ws.free, stream), "record slot reuse");
  ws.free_recorded = true;
  ws.held = false;
  // The version stamp: the layer must not have changed while it was copied. The copy is done
  // by now in any sane use (the caller computed with it); if not, wait for it.
  RETURN_IF_CUDA_ERROR(cudaEventSynchronize(ws.ready), "wait for window slot ", slot.index);
  return client_->CheckLayerVersion(ws.layer, ws.version);
}

absl::Status GpuDataPlane::AllocateStaging(StagingBuffer& b) {
  if (b.in != nullptr) return absl::OkStatus();
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
  RETURN_IF_CUDA_ERROR(cudaMalloc(&b.in, padded * std::max(job_bytes, red_bytes)),
                       "cudaMalloc of gradient staging (", padded, " elements)");
  if (collective) {
    RETURN_IF_CUDA_ERROR(cudaMalloc(&b.res, result * red_bytes), "cudaMalloc of gradient staging");
    RETURN_IF_CUDA_ERROR(cudaMalloc(&b.out, result * job_bytes), "cudaMalloc of gradient staging");
    RETURN_IF_CUDA_ERROR(cudaMalloc(&b.scratch, kernels::cuda::StatsScratchBytes(result)),
                         "cudaMalloc of statistics scratch");
    RETURN_IF_CUDA_ERROR(
        cudaHostAlloc(reinterpret_cast<void**>(&b.stats_host),
                      sizeof(kernels::cuda::GradStatsResult), cudaHostAllocDefault),
        "cudaHostAlloc of statistics");
  }
  return absl::OkStatus();
}

absl::StatusOr<int> GpuDataPlane::TakeStaging(Clock::time_point deadline) {
  Impl& m = *impl_;
  std::unique_lock<std::mutex> l(m.mu);
  for (;;) {
    if (!m.error.ok()) return ReportErrorLocked();
    for (size_t i = 0; i < m.staging.size(); ++i) {
      StagingBuffer& b = m.staging[i];
      if (!b.busy) {
        b.busy = true;
        const bool wait_free = b.free_recorded;
        b.free_recorded = false;
        l.unlock();
        if (absl::Status s = AllocateStaging(b); !s.ok()) {
          std::lock_guard<std::mutex> relock(m.mu);
          b.busy = false;
          return s;
        }
        if (wait_free) {
          RETURN_IF_CUDA_ERROR(cudaStreamWaitEvent(m.comm, b.free, 0), "staging reuse wait");
        }
        return static_cast<int>(i);
      }
    }
    if (m.cv.wait_until(l, deadline) == std::cv_status::timeout) {
      return absl::DeadlineExceededError("timed out waiting for a gradient staging buffer");
    }
  }
}

absl::Status GpuDataPlane::PushGrad(uint64_t step, uint32_t layer, const void* grad, int dtype,
                                    cudaStream_t producer, std::chrono::milliseconds timeout) {
  Impl& m = *impl_;
  {
    std::lock_guard<std::mutex> l(m.mu);
    if (!m.error.ok()) return ReportErrorLocked();
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

  RETURN_IF_CUDA_ERROR(cudaEventRecord(m.produced[layer], producer), "record producer");
  PushJob job;
  job.ticket = ticket;
  job.layer = layer;
  job.begin = range.begin;
  job.numel = range.numel;
  job.dtype = job_dtype;

  if (route == v1::GRAD_ROUTE_GPU_REDUCTION || route == v1::GRAD_ROUTE_REDUCE_SCATTER) {
    ASSIGN_OR_RETURN(const int si, TakeStaging(deadline));
    StagingBuffer& b = m.staging[si];
    RETURN_IF_CUDA_ERROR(cudaStreamWaitEvent(m.comm, m.produced[layer], 0), "wait producer");
    const bool rs = route == v1::GRAD_ROUTE_REDUCE_SCATTER;
    const uint64_t padded = rs ? shm::PaddedNumel(numel, world) : numel;
    const void* in = grad;
    if (dtype != reduce_dtype_ || rs) {
      RETURN_IF_ERROR(
          kernels::cuda::PackPadded(grad, dtype, numel, b.in, reduce_dtype_, padded, m.comm));
      in = b.in;
    }
    // The caller's buffer is free once the collective (or the pack) has read it.
    const ncclDataType_t t = NcclType(reduce_dtype_);
    if (rs) {
      const uint64_t s = shm::ShardElems(numel, world);
      RETURN_IF_ERROR(NcclStatus(ncclReduceScatter(in, b.res, s, t, ncclSum, m.grad_comm, m.comm),
                                 absl::StrCat("ncclReduceScatter of layer ", layer)));
    } else {
      RETURN_IF_ERROR(NcclStatus(
          ncclReduce(in, b.res, numel, t, ncclSum,
                     static_cast<int>(client_->layout().grad_pushing_rank()), m.grad_comm, m.comm),
          absl::StrCat("ncclReduce of layer ", layer)));
    }
    RETURN_IF_CUDA_ERROR(cudaEventRecord(m.consumed[layer], m.comm), "record consumed");
    // res holds this rank's result from element 0: the whole layer (GPU route, pushing rank)
    // or the shard (reduce-scatter).
    const void* result = b.res;
    if (range.numel > 0 && job_dtype != reduce_dtype_) {
      RETURN_IF_ERROR(
          kernels::cuda::Unpack(b.res, reduce_dtype_, b.out, job_dtype, range.numel, m.comm));
      result = b.out;
    }
    if (range.numel > 0 && options_.send_stats) {
      RETURN_IF_ERROR(kernels::cuda::GradStats(result, job_dtype, range.numel, b.scratch,
                                               b.stats_host, m.comm));
      job.stats = b.stats_host;
    }
    RETURN_IF_CUDA_ERROR(cudaEventRecord(b.ready, m.comm), "record staging ready");
    job.src = static_cast<const char*>(result);
    job.ready = b.ready;
    job.staging = si;
  } else if (dtype != job_dtype) {
    ASSIGN_OR_RETURN(const int si, TakeStaging(deadline));
    StagingBuffer& b = m.staging[si];
    RETURN_IF_CUDA_ERROR(cudaStreamWaitEvent(m.comm, m.produced[layer], 0), "wait producer");
    RETURN_IF_ERROR(kernels::cuda::Unpack(grad, dtype, b.in, job_dtype, numel, m.comm));
    RETURN_IF_CUDA_ERROR(cudaEventRecord(m.consumed[layer], m.comm), "record consumed");
    RETURN_IF_CUDA_ERROR(cudaEventRecord(b.ready, m.comm), "record staging ready");
    job.src = static_cast<const char*>(b.in);
    job.ready = b.ready;
    job.staging = si;
  } else {
    // CPU reduction in the job's dtype: D2H straight from the caller's buffer.
    job.src = static_cast<const char*>(grad);
    job.ready = m.produced[layer];
    job.record_consumed = true;
  }
  {
    std::lock_guard<std::mutex> l(m.mu);
    if (job.record_consumed) m.consumed_pending[layer]++;
    m.outstanding++;
    m.jobs.push_back(job);
  }
  m.cv.notify_all();
  return absl::OkStatus();
}

absl::Status GpuDataPlane::WaitGradConsumed(uint32_t layer, cudaStream_t stream) {
  Impl& m = *impl_;
  if (layer >= m.consumed.size()) {
    return absl::NotFoundError(absl::StrCat("layer: ", layer, " does not exist"));
  }
  std::unique_lock<std::mutex> l(m.mu);
  m.cv.wait(l, [&] { return m.consumed_pending[layer] == 0 || !m.error.ok() || m.stop; });
  if (!m.error.ok()) return ReportErrorLocked();
  l.unlock();
  RETURN_IF_CUDA_ERROR(cudaStreamWaitEvent(stream, m.consumed[layer], 0), "wait consumed");
  return absl::OkStatus();
}

absl::Status GpuDataPlane::WaitPushes(std::chrono::milliseconds timeout) {
  Impl& m = *impl_;
  std::unique_lock<std::mutex> l(m.mu);
  if (!m.cv.wait_for(l, timeout, [&] { return m.outstanding == 0 || !m.error.ok(); })) {
    return absl::DeadlineExceededError(
        absl::StrCat("timed out with ", m.outstanding, " gradient pushes still in progress"));
  }
  if (!m.error.ok()) return ReportErrorLocked();
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
      std::unique_lock<std::mutex> l(m.mu);
      // Jobs queue in step order. The next step's chunks restart the ring's sequence numbers, so
      // they wait until every chunk of the previous step is published (RankClient's rule).
      m.cv.wait(l, [&] {
        return m.stop || (!m.jobs.empty() && m.error.ok() &&
                          (m.jobs.front().ticket == last || m.inflight.empty()));
      });
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
          m.cv.wait_for(l, std::chrono::microseconds(200));
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
        {
          std::lock_guard<std::mutex> l(m.mu);
          m.copier_busy = false;
        }
        m.cv.notify_all();
      }
    } idle{m};
    auto consumed_recorded = [&]() {  // under m.mu
      if (job.record_consumed && m.consumed_pending[job.layer] > 0) m.consumed_pending[job.layer]--;
    };
    auto fail = [&](const absl::Status& s) {
      SetError(s);
      if (job.record_consumed) cudaEventRecord(m.consumed[job.layer], m.d2h);
      std::lock_guard<std::mutex> l(m.mu);
      if (m.outstanding > 0) m.outstanding--;
      if (job.staging >= 0) m.staging[job.staging].busy = false;
      consumed_recorded();
    };
    const size_t elem = DTypeBytes(job.dtype);
    const uint64_t chunk_elems = chunk_bytes / elem;
    if (cudaError_t e = cudaStreamWaitEvent(m.d2h, job.ready, 0); e != cudaSuccess) {
      fail(CudaStatus(e, "D2H wait for the gradient"));
      continue;
    }
    if (job.numel == 0) {
      // Nothing to push on this rank (GPU route, not the pushing rank): the staging buffer is
      // free once the collective is done.
      InflightChunk c;
      c.layer = job.layer;
      c.last_of_job = true;
      c.done = nullptr;
      if (job.staging >= 0) cudaEventRecord(m.staging[job.staging].free, m.d2h);
      if (job.record_consumed) cudaEventRecord(m.consumed[job.layer], m.d2h);
      std::lock_guard<std::mutex> l(m.mu);
      if (job.staging >= 0) {
        m.staging[job.staging].busy = false;
        m.staging[job.staging].free_recorded = true;
      }
      consumed_recorded();
      m.inflight.push_back(c);
      m.cv.notify_all();
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
        std::unique_lock<std::mutex> l(m.mu);
        m.cv.wait(l, [&] {
          return m.stop || !m.error.ok() || m.inflight.size() < m.chunk_events.size();
        });
        if (m.stop || !m.error.ok()) {
          ok = false;
          break;
        }
      }
      absl::StatusOr<RankClient::ChunkSlotRef> ref =
          client_->AcquireChunkSlot(job.ticket, Clock::now() + std::chrono::minutes(10));
      const double waited = std::chrono::duration<double>(Clock::now() - w0).count();
      if (!ref.ok()) {
        fail(ref.status());
        failed_here = true;
        ok = false;
        break;
      }
      const size_t ev = ref->seq % m.chunk_events.size();
      cudaError_t e =
          cudaMemcpyAsync(ref->data, job.src + off * elem, n * elem, cudaMemcpyDeviceToHost, m.d2h);
      if (e == cudaSuccess) e = cudaEventRecord(m.chunk_events[ev], m.d2h);
      if (e != cudaSuccess) {
        fail(CudaStatus(e, absl::StrCat("D2H of a gradient chunk of layer ", job.layer)));
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
      c.done = m.chunk_events[ev];
      c.stats = off == 0 ? job.stats : nullptr;
      c.last_of_job = off + n >= job.numel;
      if (c.last_of_job) {
        if (job.staging >= 0) cudaEventRecord(m.staging[job.staging].free, m.d2h);
        if (job.record_consumed) cudaEventRecord(m.consumed[job.layer], m.d2h);
      }
      std::lock_guard<std::mutex> l(m.mu);
      m.stats.copier_wait_seconds += waited;
      m.stats.d2h_bytes += n * elem;
      if (c.last_of_job) {
        if (job.staging >= 0) {
          m.staging[job.staging].busy = false;
          m.staging[job.staging].free_recorded = true;
        }
        consumed_recorded();
      }
      m.inflight.push_back(c);
      m.cv.notify_all();
    }
    if (!ok && !failed_here) {
      // Stopped by another thread's error: this job will not complete.
      if (job.record_consumed) cudaEventRecord(m.consumed[job.layer], m.d2h);
      std::lock_guard<std::mutex> l(m.mu);
      if (m.outstanding > 0) m.outstanding--;
      if (job.staging >= 0) m.staging[job.staging].busy = false;
      consumed_recorded();
    }
  }
}

// The publisher: waits for each chunk's copy in order and publishes it at once.
void GpuDataPlane::PublisherLoop() {
  Impl& m = *impl_;
  cudaSetDevice(m.device);
  for (;;) {
    InflightChunk c;
    {
      std::unique_lock<std::mutex> l(m.mu);
      m.cv.wait(l, [&] { return m.stop || !m.inflight.empty(); });
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
        std::lock_guard<std::mutex> l(m.mu);
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
    if (!st.ok()) SetError(st);
    {
      std::lock_guard<std::mutex> l(m.mu);
      if (!m.inflight.empty()) m.inflight.pop_front();
      if (c.done != nullptr) m.stats.chunks_pushed++;
      if (c.last_of_job && m.outstanding > 0) m.outstanding--;
    }
    m.cv.notify_all();
  }
}

}  // namespace slidedp::rankclient
