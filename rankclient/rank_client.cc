#include "rankclient/rank_client.h"

#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "common/tcp_auth.h"
#include "common/version.h"
#include "proto/doorbell.h"
#include "slidedp/v1/control.grpc.pb.h"

namespace slidedp::rankclient {
namespace v1 = slidedp::v1;
using Clock = std::chrono::steady_clock;

namespace {

absl::Status FromGrpc(const grpc::Status& s, absl::string_view rpc) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()),
                      absl::StrCat(rpc, ": ", s.error_message()));
}

// The shared-memory DType is control.proto's and the C ABI's integer.
static_assert(static_cast<int>(shm::DType::kFp32) == v1::DTYPE_FP32);
static_assert(static_cast<int>(shm::DType::kBf16) == v1::DTYPE_BF16);

// The longest futex sleep of WaitOn: the session's loss (set by its reader thread) rings no
// futex word, so a waiter looks at it this often.
constexpr std::chrono::milliseconds kMaxFutexSleep(100);

}  // namespace

// The session stream: opened after attach, heartbeats from one thread, events read on another.
struct RankClient::Session {
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::Control::Stub> stub;
  grpc::ClientContext ctx;
  std::unique_ptr<grpc::ClientReaderWriter<v1::SessionClientMessage, v1::SessionEvent>> stream;
  std::atomic<bool> lost{false};
  std::atomic<bool> stop{false};
  std::atomic<uint64_t> step{0};
  uint64_t heartbeat_ms = 500;
  std::thread reader;
  std::thread heartbeat;

  ~Session() {
    stop = true;
    ctx.TryCancel();
    if (heartbeat.joinable()) heartbeat.join();
    if (reader.joinable()) reader.join();
  }
};

RankClient::RankClient(Options options) : options_(std::move(options)) {}

absl::StatusOr<std::unique_ptr<RankClient>> RankClient::Attach(const Options& options) {
  std::unique_ptr<RankClient> c(new RankClient(options));
  RETURN_IF_ERROR(c->Init());
  return c;
}

absl::StatusOr<std::unique_ptr<RankClient>> RankClient::AttachWhenReady(
    const Options& options, std::chrono::milliseconds wait) {
  const auto deadline = Clock::now() + wait;
  for (;;) {
    absl::StatusOr<std::unique_ptr<RankClient>> c = Attach(options);
    if (c.ok()) return c;
    const bool not_ready =
        absl::IsUnavailable(c.status()) ||
        (absl::IsFailedPrecondition(c.status()) &&
         absl::StrContains(c.status().message(), "attach before the model exists"));
    if (!not_ready || Clock::now() >= deadline) {
      return Annotate(c.status(), absl::StrCat("attaching rank ", options.rank));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
}

absl::StatusOr<v1::JobSpec> RankClient::CreateJobWhenReady(const std::string& socket,
                                                           const v1::JobSpec& spec,
                                                           std::chrono::milliseconds timeout,
                                                           std::chrono::milliseconds wait) {
  const auto deadline = Clock::now() + wait;
  for (;;) {
    absl::StatusOr<v1::JobSpec> got = CreateJob(socket, spec, timeout);
    if (got.ok() || !absl::IsUnavailable(got.status()) || Clock::now() >= deadline) {
      if (!got.ok()) return Annotate(got.status(), "creating the job");
      return got;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
}

absl::StatusOr<v1::JobSpec> RankClient::CreateJob(const std::string& socket,
                                                  const v1::JobSpec& spec,
                                                  std::chrono::milliseconds timeout) {
  auto channel = grpc::CreateChannel(absl::StartsWith(socket, "unix:") ? socket : "unix:" + socket,
                                     grpc::InsecureChannelCredentials());
  auto stub = v1::Control::NewStub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + timeout);
  v1::CreateJobRequest req;
  *req.mutable_spec() = spec;
  v1::CreateJobResponse resp;
  RETURN_IF_ERROR(FromGrpc(stub->CreateJob(&ctx, req, &resp), "CreateJob"));
  return resp.spec();
}

absl::Status RankClient::Init() {
  if (const char* fp = std::getenv("SLIDEDP_FAILPOINT"); fp != nullptr && *fp != '\0') {
    std::string spec(fp);
    const size_t colon = spec.find(':');
    failpoint_ = spec.substr(0, colon);
    failpoint_at_ =
        colon == std::string::npos ? 1 : std::strtoull(spec.c_str() + colon + 1, nullptr, 10);
  }
  session_ = std::make_unique<Session>();
  std::string target;
  if (!options_.tcp.empty()) {
    target = options_.tcp;
  } else {
    target =
        absl::StartsWith(options_.socket, "unix:") ? options_.socket : "unix:" + options_.socket;
  }
  grpc::ChannelArguments args;
  // ReadClientLayer answers carry up to 16 MiB of layer state.
  args.SetMaxReceiveMessageSize(20 << 20);
  args.SetMaxSendMessageSize(20 << 20);
  if (!options_.tcp.empty()) {
    // Over TCP every call carries hostd's service token (common/tcp_auth.h).
    const std::string file = !options_.token_file.empty()            ? options_.token_file
                             : std::getenv(kTokenFileEnv) != nullptr ? std::getenv(kTokenFileEnv)
                                                                     : "";
    if (file.empty()) {
      return absl::FailedPreconditionError(
          absl::StrCat("tcp: hostd's TCP listener needs its service token: set ", kTokenFileEnv,
                       " (or Options::token_file) to a copy of hostd's auth_token_file"));
    }
    ASSIGN_OR_RETURN(tcp_token_, ReadServiceToken(file, /*for_server=*/false));
  }
  session_->channel = grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args);
  session_->stub = v1::Control::NewStub(session_->channel);
  auto deadline = [&] {
    return std::chrono::system_clock::now() + std::chrono::milliseconds(options_.timeout_ms);
  };
  {
    grpc::ClientContext ctx;
    AddAuth(&ctx);
    ctx.set_deadline(deadline());
    ctx.set_wait_for_ready(false);
    v1::HandshakeRequest req;
    auto* b = req.mutable_client();
    b->set_version(kVersion);
    b->set_git_revision(kGitRevision);
    b->set_protocol_version(kProtocolVersion);
    b->set_shm_abi_version(kShmAbiVersion);
    b->set_component("rankclient");
    v1::HandshakeResponse resp;
    RETURN_IF_ERROR(FromGrpc(session_->stub->Handshake(&ctx, req, &resp), "Handshake"));
  }
  v1::AttachRankResponse attach;
  {
    grpc::ClientContext ctx;
    AddAuth(&ctx);
    ctx.set_deadline(deadline());
    v1::AttachRankRequest req;
    req.set_job_id(options_.job_id);
    req.set_rank(options_.rank);
    req.set_manifest_hash(options_.manifest_hash);
    req.set_pid(getpid());
    char host[256] = {0};
    gethostname(host, sizeof(host) - 1);
    req.set_hostname(host);
    req.set_gpu(options_.gpu);
    for (uint32_t l : options_.client_updated_layers) req.add_client_updated_layers(l);
    RETURN_IF_ERROR(FromGrpc(session_->stub->AttachRank(&ctx, req, &attach), "AttachRank"));
  }
  layout_ = attach.layout();
  next_step_ = attach.next_step();
  token_ = attach.attach_token();
  client_layers_current_ = attach.client_layers_current();
  job_id_ = options_.job_id;
  grad_dtype_ = layout_.grad_dtype() == v1::DTYPE_FP32 ? shm::DType::kFp32 : shm::DType::kBf16;
  pushing_rank_ = layout_.grad_route() == v1::GRAD_ROUTE_CPU_REDUCTION ||
                  options_.rank == layout_.grad_pushing_rank();
  pushed_.assign(layout_.layers_size(), false);
  client_updated_.assign(layout_.layers_size(), false);
  for (uint32_t l : layout_.client_updated_layers()) {
    if (l < client_updated_.size()) client_updated_[l] = true;
  }

  // Map the segments and check every header against the layout.
  uint64_t hash = 0;
  try {
    hash = std::stoull(layout_.manifest_hash(), nullptr, 16);
  } catch (...) {
    return absl::InternalError("hostd sent a malformed manifest_hash: " + layout_.manifest_hash());
  }
  for (const v1::SegmentInfo& seg : layout_.segments()) {
    const bool writable = seg.kind() != v1::SEGMENT_KIND_PARAMS;
    ASSIGN_OR_RETURN(ShmSegment m, ShmSegment::Open(seg.name(), writable));
    const auto* h = m.at<shm::SegmentHeader>(0);
    if (m.size_bytes() < sizeof(shm::SegmentHeader) ||
        shm::Atomic(const_cast<uint64_t&>(h->ready)).load(std::memory_order_acquire) != 1) {
      return absl::FailedPreconditionError(absl::StrCat("segment ", seg.name(), " is not ready"));
    }
    if (const char* bad = shm::ValidateHeader(*h, static_cast<shm::SegmentKind>(seg.kind()),
                                              seg.size_bytes(), hash)) {
      if (absl::string_view(bad) == "abi_version") {
        return absl::FailedPreconditionError(
            absl::StrCat("version skew: segment ", seg.name(), " has shm abi_version ",
                         h->abi_version, " but this rankclient uses shm abi_version ",
                         shm::kAbiVersion, "; install matching versions of hostd and the client"));
      }
      return absl::FailedPreconditionError(
          absl::StrCat("segment ", seg.name(), ": header field '", bad,
                       "' does not match the layout hostd sent (stale or foreign segment?)"));
    }
    switch (seg.kind()) {
      case v1::SEGMENT_KIND_CONTROL:
        control_ = std::move(m);
        break;
      case v1::SEGMENT_KIND_PARAMS:
        params_ = std::move(m);
        break;
      case v1::SEGMENT_KIND_GRADS:
        grads_ = std::move(m);
        break;
      default:
        break;
    }
  }
  if (control_.data() == nullptr || params_.data() == nullptr || grads_.data() == nullptr) {
    return absl::FailedPreconditionError(
        "hostd's layout lacks the control, params or grads segment");
  }
  // Every offset this rank writes or reads must lie inside what it mapped: a layout whose ring or
  // layer regions pass the end of their segment is refused here, not found by a SIGSEGV.
  uint64_t grads_need = 0;
  if (!shm::GradSegmentBytes(layout_.world_size(), layout_.grad_ring_slots(), layout_.chunk_bytes(),
                             &grads_need) ||
      grads_need > grads_.size_bytes() || options_.rank >= layout_.world_size()) {
    return absl::FailedPreconditionError(
        absl::StrCat("hostd's layout does not fit its grads segment: ", layout_.world_size(),
                     " ranks x ", layout_.grad_ring_slots(), " slots of ", layout_.chunk_bytes(),
                     " bytes in ", grads_.size_bytes(), " bytes (rank ", options_.rank, ")"));
  }
  for (const v1::LayerLayout& l : layout_.layers()) {
    if (l.param_offset_bytes() > params_.size_bytes() ||
        l.param_bytes() > params_.size_bytes() - l.param_offset_bytes()) {
      return absl::FailedPreconditionError(
          absl::StrCat("hostd's layout does not fit its params segment: layer ", l.layer(),
                       " at offset ", l.param_offset_bytes(), " with ", l.param_bytes(),
                       " bytes in ", params_.size_bytes(), " bytes"));
    }
  }
  if (control_.size_bytes() < shm::ControlSegmentBytes(static_cast<uint32_t>(layout_.layers_size()),
                                                       layout_.world_size(),
                                                       layout_.grad_ring_slots())) {
    return absl::FailedPreconditionError(absl::StrCat(
        "hostd's layout does not fit its control segment (", control_.size_bytes(), " bytes)"));
  }
  cb_ = control_.at<shm::ControlBlock>(shm::kControlBlockOffset);
  ring_ = shm::GradRing(
      control_.data(), grads_.data(),
      shm::RingShape{static_cast<uint32_t>(layout_.layers_size()), layout_.world_size(),
                     layout_.grad_ring_slots(), layout_.chunk_bytes()});

  // The session stream: liveness for hostd, events for us.
  Session* s = session_.get();
  AddAuth(&s->ctx);
  s->stream = s->stub->Session(&s->ctx);
  v1::SessionClientMessage open;
  open.mutable_open()->set_job_id(options_.job_id);
  open.mutable_open()->set_rank(options_.rank);
  open.mutable_open()->set_attach_token(token_);
  v1::SessionEvent first;
  if (!s->stream->Write(open) || !s->stream->Read(&first) || !first.has_opened()) {
    return FromGrpc(s->stream->Finish(), "Session");
  }
  s->heartbeat_ms = std::max<uint64_t>(10, first.opened().heartbeat_interval_ms());
  s->reader = std::thread([s] {
    v1::SessionEvent ev;
    while (s->stream->Read(&ev)) {
      if (ev.has_shutting_down()) s->lost = true;
    }
    s->lost = true;
  });
  s->heartbeat = std::thread([s] {
    while (!s->stop) {
      v1::SessionClientMessage hb;
      hb.mutable_heartbeat()->set_step(s->step.load());
      if (!s->stream->Write(hb)) break;
      for (uint64_t t = 0; t < s->heartbeat_ms && !s->stop; t += 10) {
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
    }
  });
  return absl::OkStatus();
}

RankClient::~RankClient() { Detach().IgnoreError(); }

void RankClient::AddAuth(grpc::ClientContext* ctx) const {
  if (!tcp_token_.empty()) ctx->AddMetadata(kAuthMetadataKey, BearerValue(tcp_token_));
}

absl::Status RankClient::CheckLayer(uint32_t layer) const {
  if (layer < num_layers()) return absl::OkStatus();
  return absl::NotFoundError(
      absl::StrCat("layer: ", layer, " does not exist; the model has ", num_layers(), " layers"));
}

uint64_t RankClient::layer_numel(uint32_t layer) const {
  return layer < num_layers() ? layout_.layers(static_cast<int>(layer)).numel() : 0;
}

absl::Status RankClient::CheckLive() const {
  if (detached_) return absl::FailedPreconditionError("rank is detached");
  if (shm::Atomic(cb_->shutting_down).load(std::memory_order_acquire) != 0 ||
      session_->lost.load()) {
    return absl::UnavailableError("hostd is gone or shutting down");
  }
  if (step_ != 0 && shm::Atomic(cb_->abort_epoch).load(std::memory_order_acquire) != abort_epoch_) {
    return absl::AbortedError(absl::StrCat("step ", step_, " was aborted by hostd"));
  }
  return absl::OkStatus();
}

absl::Status RankClient::CheckLive(const PushTicket& ticket) const {
  if (detached_) return absl::FailedPreconditionError("rank is detached");
  if (shm::Atomic(cb_->shutting_down).load(std::memory_order_acquire) != 0 ||
      session_->lost.load()) {
    return absl::UnavailableError("hostd is gone or shutting down");
  }
  if (shm::Atomic(cb_->abort_epoch).load(std::memory_order_acquire) != ticket.abort_epoch) {
    return absl::AbortedError(absl::StrCat("step ", ticket.step, " was aborted by hostd"));
  }
  return absl::OkStatus();
}

template <typename Ready>
absl::Status RankClient::WaitOn(uint32_t* word, Ready ready, Clock::time_point deadline,
                                const char* what, const PushTicket* ticket, uint64_t completed_ok) {
  const shm::Doorbell bell(word);
  for (;;) {
    const uint32_t seen = bell.Load();
    // Liveness first: after an abort, versions are sealed and would otherwise look "ready".
    // hostd stores completed_step before it moves the epoch for a later step, so reading it after
    // the epoch tells whether the step waited for completed before that abort.
    if (absl::Status live = ticket != nullptr ? CheckLive(*ticket) : CheckLive(); !live.ok()) {
      if (completed_ok == 0 || live.code() != absl::StatusCode::kAborted ||
          shm::Atomic(cb_->completed_step).load(std::memory_order_acquire) < completed_ok) {
        return live;
      }
    }
    if (ready()) return absl::OkStatus();
    const auto now = Clock::now();
    if (now >= deadline) return absl::DeadlineExceededError(absl::StrCat("timed out ", what));
    bell.Wait(seen, std::min<std::chrono::nanoseconds>(deadline - now, kMaxFutexSleep));
  }
}

absl::Status RankClient::BeginStep(uint64_t step, std::chrono::milliseconds timeout) {
  if (detached_) return absl::FailedPreconditionError("rank is detached");
  grpc::ClientContext ctx;
  AddAuth(&ctx);
  ctx.set_deadline(std::chrono::system_clock::now() + timeout);
  v1::BeginStepRequest req;
  req.set_job_id(job_id_);
  req.set_rank(options_.rank);
  req.set_step(step);
  req.set_attach_token(token_);
  v1::BeginStepResponse resp;
  // The epoch is read before the RPC: an abort of this step after hostd accepted it is seen.
  const uint64_t epoch = shm::Atomic(cb_->abort_epoch).load(std::memory_order_acquire);
  RETURN_IF_ERROR(FromGrpc(session_->stub->BeginStep(&ctx, req, &resp), "BeginStep"));
  step_ = step;
  abort_epoch_ = epoch;
  // The ring's sequence numbers are not reset here: the gradient path may still be pushing the
  // previous step (AcquireChunkSlot restarts them with the first chunk of this step).
  std::fill(pushed_.begin(), pushed_.end(), false);
  session_->step = step;
  return absl::OkStatus();
}

absl::Status RankClient::WaitLayer(uint32_t layer, uint64_t version,
                                   std::chrono::milliseconds timeout) {
  RETURN_IF_ERROR(CheckLayer(layer));
  auto* lc = control_.at<shm::LayerControl>(
      layout_.layers(static_cast<int>(layer)).control_offset_bytes());
  return WaitOn(
      &lc->wake_seq,
      [&] { return shm::Atomic(lc->committed_version).load(std::memory_order_acquire) >= version; },
      Clock::now() + timeout, "waiting for a layer version");
}

absl::StatusOr<uint64_t> RankClient::FetchParams(uint32_t layer, uint64_t version, void* dst,
                                                 size_t dst_bytes,
                                                 std::chrono::milliseconds timeout) {
  RETURN_IF_ERROR(CheckLayer(layer));
  const v1::LayerLayout& ll = layout_.layers(static_cast<int>(layer));
  if (dst == nullptr || dst_bytes != ll.param_bytes()) {
    return absl::InvalidArgumentError(absl::StrCat("dst_bytes: layer ", layer, " has ",
                                                   ll.param_bytes(),
                                                   " bytes of BF16 parameters, got ", dst_bytes));
  }
  auto* lc = control_.at<shm::LayerControl>(ll.control_offset_bytes());
  // Outside a step only the committed version can be read (nothing would produce another).
  const bool committed_now =
      shm::Atomic(lc->committed_version).load(std::memory_order_acquire) == version;
  if (!committed_now && (step_ == 0 || version + 1 > step_)) {
    return absl::OutOfRangeError(absl::StrCat("version: ", version, " cannot come in step ", step_,
                                              "; expected at most ", step_ == 0 ? 0 : step_ - 1,
                                              " (begin the step first)"));
  }
  RETURN_IF_ERROR(WaitLayer(layer, version, timeout));
  const uint64_t before = shm::Atomic(lc->committed_version).load(std::memory_order_acquire);
  if (before != version) {
    return absl::OutOfRangeError(absl::StrCat("version: layer ", layer, " is at version ", before,
                                              ", past the requested ", version));
  }
  ++fetches_;
  if (failpoint_ == "fetch_kill" && fetches_ == failpoint_at_) {
    std::memcpy(dst, params_.at<char>(ll.param_offset_bytes()), dst_bytes / 2);
    raise(SIGKILL);
  }
  std::memcpy(dst, params_.at<char>(ll.param_offset_bytes()), dst_bytes);
  RETURN_IF_ERROR(CheckLayerVersion(layer, version));
  return version;
}

absl::Status RankClient::PushGrad(uint64_t step, uint32_t layer, const void* data, int dtype,
                                  size_t bytes, std::chrono::milliseconds timeout) {
  return PushGrad(step, layer, data, dtype, bytes, nullptr, timeout);
}

absl::Status RankClient::CheckStepAndLayer(uint64_t step, uint32_t layer) const {
  if (step_ == 0 || step != step_) {
    return absl::OutOfRangeError(
        absl::StrCat("step: ", step, " is not the current step (", step_, ")"));
  }
  return CheckLayer(layer);
}

absl::Status RankClient::BeginLayerPush(uint64_t step, uint32_t layer) {
  RETURN_IF_ERROR(CheckStepAndLayer(step, layer));
  if (client_updated_[layer]) {
    return absl::FailedPreconditionError(
        absl::StrCat("layer ", layer,
                     " is updated by the ranks themselves (client_updated_layers); its "
                     "gradient is not pushed to hostd"));
  }
  if (pushed_[layer]) {
    return absl::AlreadyExistsError(
        absl::StrCat("layer ", layer, " was already pushed in step ", step));
  }
  RETURN_IF_ERROR(CheckLive());
  pushed_[layer] = true;
  return absl::OkStatus();
}

shm::ShardRange RankClient::PushRange(uint32_t layer) const {
  const uint64_t numel = layer_numel(layer);
  switch (layout_.grad_route()) {
    case v1::GRAD_ROUTE_GPU_REDUCTION:
      return pushing_rank_ ? shm::ShardRange{0, numel} : shm::ShardRange{0, 0};
    case v1::GRAD_ROUTE_REDUCE_SCATTER:
      return shm::ShardOf(numel, world_size(), options_.rank);
    default:
      return shm::ShardRange{0, numel};
  }
}

const void* RankClient::LayerParams(uint32_t layer) const {
  if (layer >= num_layers()) return nullptr;
  return params_.at<char>(layout_.layers(static_cast<int>(layer)).param_offset_bytes());
}

absl::Status RankClient::CheckLayerVersion(uint32_t layer, uint64_t version) const {
  RETURN_IF_ERROR(CheckLayer(layer));
  std::atomic_thread_fence(std::memory_order_acquire);
  auto* lc = const_cast<ShmSegment&>(control_).at<shm::LayerControl>(
      layout_.layers(static_cast<int>(layer)).control_offset_bytes());
  const uint64_t committed = shm::Atomic(lc->committed_version).load(std::memory_order_acquire);
  const uint64_t pending = shm::Atomic(lc->pending_version).load(std::memory_order_acquire);
  if (committed != version || pending != version) {
    RETURN_IF_ERROR(CheckLive());
    return absl::InternalError(absl::StrCat("layer ", layer, " changed during the copy (version ",
                                            version, " -> ", committed, ", pending ", pending,
                                            ")"));
  }
  return absl::OkStatus();
}

absl::StatusOr<RankClient::ChunkSlotRef> RankClient::AcquireChunkSlot(const PushTicket& ticket,
                                                                      Clock::time_point deadline) {
  if (failpoint_ == "push_stop" && chunks_pushed_ + 1 == failpoint_at_) raise(SIGSTOP);
  const uint32_t slots = layout_.grad_ring_slots();
  if (ticket != ring_ticket_) {
    RETURN_IF_ERROR(CheckLive(ticket));
    if (ticket.abort_epoch == ring_ticket_.abort_epoch && ticket.step < ring_ticket_.step) {
      return absl::FailedPreconditionError(absl::StrCat("a chunk of step ", ticket.step,
                                                        " after chunks of step ", ring_ticket_.step,
                                                        "; a rank pushes its steps in order"));
    }
    // hostd consumes a rank's ring in sequence order, step by step: chunks of this step placed
    // before the previous step's missing ones would never be reached (and the slot of a missing
    // one reads empty, so it could be taken twice). An aborted step's slots are emptied by hostd.
    const bool previous_aborted =
        shm::Atomic(cb_->abort_epoch).load(std::memory_order_acquire) != ring_ticket_.abort_epoch;
    if (publish_seq_ != acquire_seq_ && !previous_aborted) {
      return absl::FailedPreconditionError(
          absl::StrCat("chunks ", publish_seq_.load(), "..", acquire_seq_.load() - 1, " of step ",
                       ring_ticket_.step, " were acquired but not published; step ", ticket.step,
                       "'s chunks cannot go into the ring before them"));
    }
    ring_ticket_ = ticket;
    acquire_seq_ = 0;
    publish_seq_ = 0;
  }
  if (acquire_seq_ >= publish_seq_ + slots) {
    return absl::FailedPreconditionError(absl::StrCat(
        "all ", slots, " gradient ring slots are acquired; publish one before acquiring more"));
  }
  const uint32_t slot = ring_.SlotOf(acquire_seq_);
  shm::ChunkSlot& cs = ring_.slot(options_.rank, slot);
  RETURN_IF_ERROR(WaitOn(
      &cs.wake_seq, [&] { return shm::SlotIsEmpty(cs); }, deadline,
      "waiting for a free gradient slot", &ticket));
  ChunkSlotRef ref;
  ref.ticket = ticket;
  ref.seq = acquire_seq_++;
  ref.slot = slot;
  ref.data = ring_.data(options_.rank, slot);
  return ref;
}

absl::Status RankClient::PublishChunk(const ChunkSlotRef& ref, uint32_t layer, uint64_t offset,
                                      uint64_t numel, int dtype, const LayerStats* stats) {
  if (ref.seq != publish_seq_) {
    return absl::InternalError(absl::StrCat("chunk ", ref.seq, " published out of order; chunk ",
                                            publish_seq_.load(), " is next"));
  }
  shm::ChunkHeader h;
  h.step = ref.ticket.step;
  h.seq = ref.seq;
  h.offset_elements = offset;
  h.numel = numel;
  h.layer = layer;
  h.dtype = static_cast<uint32_t>(dtype);
  if (stats != nullptr) {
    h.flags = shm::kChunkFlagStats | (stats->nonfinite ? shm::kChunkFlagNonFinite : 0u);
    h.stats_sumsq = stats->sumsq;
  }
  RETURN_IF_ERROR(CheckChunk(h));
  RETURN_IF_ERROR(CheckLive(ref.ticket));
  shm::PublishChunk(ring_.slot(options_.rank, ref.slot), h);
  shm::Doorbell(&cb_->doorbell).Ring();
  ++publish_seq_;
  if (++chunks_pushed_ == failpoint_at_ && failpoint_ == "push_kill") raise(SIGKILL);
  return absl::OkStatus();
}

absl::Status RankClient::CheckChunk(const shm::ChunkHeader& h) const {
  const shm::ChunkLimits limits{grad_dtype_, num_layers(), layout_.chunk_bytes()};
  const char* bad = shm::CheckChunkHeader(h, limits);
  if (bad == nullptr) return absl::OkStatus();
  const absl::string_view field(bad);
  if (field == "dtype") {
    return absl::InvalidArgumentError(absl::StrCat("dtype: the job's gradients are ",
                                                   shm::DTypeName(grad_dtype_), " (", grad_dtype(),
                                                   "), got ", h.dtype));
  }
  if (field == "layer") return CheckLayer(h.layer);
  if (field == "numel") {
    if (h.numel == 0) return absl::InvalidArgumentError("numel: a chunk holds 1 element or more");
    return absl::InvalidArgumentError(absl::StrCat(
        "numel: ", h.numel, " elements exceed a slot of ", layout_.chunk_bytes(), " bytes"));
  }
  return absl::InternalError(absl::StrCat("chunk header field ", field, " is malformed"));
}

absl::Status RankClient::PushGrad(uint64_t step, uint32_t layer, const void* data, int dtype,
                                  size_t bytes, const LayerStats* stats,
                                  std::chrono::milliseconds timeout) {
  RETURN_IF_ERROR(CheckStepAndLayer(step, layer));
  if (dtype != grad_dtype()) {
    return absl::InvalidArgumentError(absl::StrCat("dtype: the job's gradients are ",
                                                   shm::DTypeName(grad_dtype_), " (", grad_dtype(),
                                                   "), got ", dtype));
  }
  const uint64_t numel = layer_numel(layer);
  const size_t elem = shm::DTypeBytes(grad_dtype_);
  if (data == nullptr || bytes != numel * elem) {
    return absl::InvalidArgumentError(absl::StrCat("bytes: layer ", layer, " needs ", numel * elem,
                                                   " bytes (", numel, " elements), got ", bytes));
  }
  RETURN_IF_ERROR(BeginLayerPush(step, layer));
  const PushTicket ticket = push_ticket();
  const shm::ShardRange range = PushRange(layer);
  const uint64_t chunk_elems = layout_.chunk_bytes() / elem;
  const auto deadline = Clock::now() + timeout;
  const auto* src = static_cast<const char*>(data);
  for (uint64_t off = range.begin; off < range.begin + range.numel; off += chunk_elems) {
    const uint64_t n = std::min(chunk_elems, range.begin + range.numel - off);
    ASSIGN_OR_RETURN(ChunkSlotRef ref, AcquireChunkSlot(ticket, deadline));
    std::memcpy(ref.data, src + off * elem, n * elem);
    RETURN_IF_ERROR(PublishChunk(ref, layer, off, n, dtype, off == range.begin ? stats : nullptr));
  }
  return absl::OkStatus();
}

absl::Status RankClient::PublishCommId(const std::string& unique_id, uint64_t generation,
                                       std::chrono::milliseconds timeout) {
  grpc::ClientContext ctx;
  AddAuth(&ctx);
  ctx.set_deadline(std::chrono::system_clock::now() + timeout);
  v1::PublishCommIdRequest req;
  req.set_job_id(job_id_);
  req.set_rank(options_.rank);
  req.set_unique_id(unique_id);
  req.set_generation(generation);
  req.set_attach_token(token_);
  v1::PublishCommIdResponse resp;
  return FromGrpc(session_->stub->PublishCommId(&ctx, req, &resp), "PublishCommId");
}

absl::StatusOr<std::string> RankClient::FetchCommId(uint64_t generation,
                                                    std::chrono::milliseconds timeout) {
  grpc::ClientContext ctx;
  AddAuth(&ctx);
  ctx.set_deadline(std::chrono::system_clock::now() + timeout + std::chrono::seconds(5));
  v1::FetchCommIdRequest req;
  req.set_job_id(job_id_);
  req.set_rank(options_.rank);
  req.set_generation(generation);
  req.set_wait_ms(static_cast<uint64_t>(timeout.count()));
  req.set_attach_token(token_);
  v1::FetchCommIdResponse resp;
  RETURN_IF_ERROR(FromGrpc(session_->stub->FetchCommId(&ctx, req, &resp), "FetchCommId"));
  return resp.unique_id();
}

uint64_t RankClient::client_sync_step() const {
  if (cb_ == nullptr) return 0;
  return shm::Atomic(cb_->client_sync_step).load(std::memory_order_acquire);
}

namespace {
constexpr uint64_t kClientPieceElements = uint64_t{1} << 22;  // hostd's limit per message
}  // namespace

absl::StatusOr<bool> RankClient::UploadClientLayer(uint64_t step, uint32_t layer, uint32_t part,
                                                   uint64_t offset, const float* data,
                                                   uint64_t count) {
  if (detached_) return absl::FailedPreconditionError("rank is detached");
  RETURN_IF_ERROR(CheckLayer(layer));
  if (!client_updated(layer)) {
    return absl::FailedPreconditionError(
        absl::StrCat("layer ", layer, " is updated by hostd, not by the ranks"));
  }
  if (data == nullptr && count > 0) return absl::InvalidArgumentError("data is null");
  bool all = false;
  v1::UploadClientLayerRequest req;
  req.set_job_id(options_.job_id);
  req.set_rank(options_.rank);
  req.set_attach_token(token_);
  req.set_step(step);
  req.set_layer(layer);
  req.set_part(part);
  for (uint64_t done = 0; done < count;) {
    const uint64_t n = std::min(kClientPieceElements, count - done);
    req.set_offset(offset + done);
    req.set_data(reinterpret_cast<const char*>(data + done), n * sizeof(float));
    grpc::ClientContext ctx;
    AddAuth(&ctx);
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::milliseconds(options_.timeout_ms));
    v1::UploadClientLayerResponse resp;
    RETURN_IF_ERROR(
        FromGrpc(session_->stub->UploadClientLayer(&ctx, req, &resp), "UploadClientLayer"));
    all = resp.all_complete();
    done += n;
  }
  return all;
}

absl::Status RankClient::ReadClientLayer(uint32_t layer, uint32_t part, uint64_t offset, float* dst,
                                         uint64_t count, uint64_t* version) const {
  RETURN_IF_ERROR(CheckLayer(layer));
  if (dst == nullptr && count > 0) return absl::InvalidArgumentError("dst is null");
  v1::ReadClientLayerRequest req;
  req.set_job_id(options_.job_id);
  req.set_rank(options_.rank);
  req.set_attach_token(token_);
  req.set_layer(layer);
  req.set_part(part);
  for (uint64_t done = 0; done < count;) {
    const uint64_t n = std::min(kClientPieceElements, count - done);
    req.set_offset(offset + done);
    req.set_count(n);
    grpc::ClientContext ctx;
    AddAuth(&ctx);
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::milliseconds(options_.timeout_ms));
    v1::ReadClientLayerResponse resp;
    RETURN_IF_ERROR(FromGrpc(session_->stub->ReadClientLayer(&ctx, req, &resp), "ReadClientLayer"));
    if (resp.data().size() != n * sizeof(float)) {
      return absl::InternalError(absl::StrCat("ReadClientLayer: hostd sent ", resp.data().size(),
                                              " bytes, expected ", n * sizeof(float)));
    }
    std::memcpy(dst + done, resp.data().data(), resp.data().size());
    if (version != nullptr) *version = resp.version();
    done += n;
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::JobStatus> RankClient::JobStatus() const {
  grpc::ClientContext ctx;
  AddAuth(&ctx);
  ctx.set_deadline(std::chrono::system_clock::now() +
                   std::chrono::milliseconds(options_.timeout_ms));
  v1::GetStatusResponse resp;
  RETURN_IF_ERROR(
      FromGrpc(session_->stub->GetStatus(&ctx, v1::GetStatusRequest(), &resp), "GetStatus"));
  if (!resp.has_job()) return absl::FailedPreconditionError("hostd has no job");
  return resp.job();
}

absl::Status RankClient::WaitStep(uint64_t step, std::chrono::milliseconds timeout) {
  if (detached_) return absl::FailedPreconditionError("rank is detached");
  // A step this rank has not begun cannot complete (hostd waits for this rank's gradients, or
  // for its BeginStep): waiting for it could only time out.
  if (step > step_) {
    return absl::OutOfRangeError(absl::StrCat("step: ", step, " was not begun by this rank (its ",
                                              "current step is ", step_,
                                              "); begin the step first"));
  }
  const auto deadline = Clock::now() + timeout;
  // The rank began step + 1 while `step`'s updates ran (steps overlap): the abort epoch it
  // checks is step + 1's, whose abort (or drop, which may come the instant `step` finishes)
  // says nothing about `step` once hostd has marked `step` completed.
  const uint64_t completed_ok = step != 0 && step < step_ ? step : 0;
  for (uint32_t l = 0; l < num_layers(); ++l) {
    auto* lc =
        control_.at<shm::LayerControl>(layout_.layers(static_cast<int>(l)).control_offset_bytes());
    RETURN_IF_ERROR(WaitOn(
        &lc->wake_seq,
        [&] { return shm::Atomic(lc->committed_version).load(std::memory_order_acquire) >= step; },
        deadline, "waiting for a layer version", nullptr, completed_ok));
  }
  return absl::OkStatus();
}

absl::Status RankClient::Detach() {
  if (detached_) return absl::OkStatus();
  detached_ = true;
  absl::Status result;
  if (session_ && session_->stub && !session_->lost.load()) {
    grpc::ClientContext ctx;
    AddAuth(&ctx);
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    v1::DetachRankRequest req;
    req.set_job_id(job_id_);
    req.set_rank(options_.rank);
    req.set_attach_token(token_);
    v1::DetachRankResponse resp;
    result = FromGrpc(session_->stub->DetachRank(&ctx, req, &resp), "DetachRank");
  }
  session_.reset();
  return result;
}

}  // namespace slidedp::rankclient
