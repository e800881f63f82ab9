#include "hostd/service.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "common/shm_segment.h"
#include "common/status_macros.h"
#include "common/tcp_auth.h"
#include "common/unique_fd.h"
#include "slidedp/v1/control.grpc.pb.h"
#include "spdlog/spdlog.h"

namespace slidedp::hostd {
namespace v1 = slidedp::v1;

grpc::Status ToGrpcStatus(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  // absl::StatusCode and grpc::StatusCode share their numeric values.
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), std::string(s.message()));
}

namespace {

// Largest request hostd accepts: UploadClientLayer pieces (16 MiB of FP32) plus framing.
constexpr int kMaxMessageBytes = 20 << 20;

template <typename Resp>
grpc::Status Reply(absl::StatusOr<Resp> r, Resp* out) {
  if (!r.ok()) return ToGrpcStatus(r.status());
  *out = std::move(*r);
  return grpc::Status::OK;
}

// Removes a socket file left by a dead process; refuses one that a live server answers on.
absl::Status PrepareSocketPath(const std::string& path) {
  if (path.size() >= sizeof(sockaddr_un::sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat("socket: path '", path, "' is longer than ",
                                                   sizeof(sockaddr_un::sun_path) - 1, " bytes"));
  }
  std::error_code ec;
  const std::filesystem::path p(path);
  if (p.has_parent_path() && !std::filesystem::exists(p.parent_path(), ec)) {
    std::filesystem::create_directories(p.parent_path(), ec);
    if (ec) {
      return absl::FailedPreconditionError(absl::StrCat(
          "socket: cannot create directory ", p.parent_path().string(), ": ", ec.message()));
    }
  }
  struct stat st;
  if (lstat(path.c_str(), &st) != 0) return absl::OkStatus();
  if (!S_ISSOCK(st.st_mode)) {
    return absl::FailedPreconditionError(
        absl::StrCat("socket: ", path, " exists and is not a socket; refusing to replace it"));
  }
  UniqueFd fd(socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd.valid()) return ErrnoStatus("socket(AF_UNIX)");
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
  const int rc = connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  fd.reset();
  if (rc == 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("socket: ", path,
                     " is in use by a running server (another hostd?); stop it or choose "
                     "another --socket"));
  }
  spdlog::warn("removing stale socket {}", path);
  if (unlink(path.c_str()) != 0 && errno != ENOENT) return ErrnoStatus("unlink " + path);
  return absl::OkStatus();
}

// The client's deadline (none: infinite), for handlers that wait on the engine.
absl::Time DeadlineOf(const grpc::ServerContext* ctx) {
  const auto d = ctx->deadline();
  if (d >= std::chrono::system_clock::now() + std::chrono::hours(24 * 365)) {
    return absl::InfiniteFuture();
  }
  return absl::FromChrono(d);
}

// Calls over the TCP listener carry the service token; over the unix socket its mode decides.
absl::Status Authorize(const grpc::ServerContext* ctx, const std::string& token) {
  const std::string peer = ctx->peer();
  if (!absl::StartsWith(peer, "ipv4:") && !absl::StartsWith(peer, "ipv6:")) {
    return absl::OkStatus();
  }
  const auto& md = ctx->client_metadata();
  for (auto it = md.find(kAuthMetadataKey); it != md.end() && it->first == kAuthMetadataKey; ++it) {
    if (BearerMatches(std::string_view(it->second.data(), it->second.size()), token)) {
      return absl::OkStatus();
    }
  }
  return absl::UnauthenticatedError(
      absl::StrCat("this call came over TCP (", peer,
                   ") without hostd's service token: send metadata '", kAuthMetadataKey,
                   ": Bearer <token>' with the token of hostd's auth_token_file (clients "
                   "read it through ",
                   kTokenFileEnv, "; slidedpctl --token-file)"));
}

}  // namespace

class ControlServer::Impl final : public v1::Control::Service {
 public:
  Impl(Engine* engine, std::string tcp_token) : engine_(engine), tcp_token_(std::move(tcp_token)) {}

  grpc::Status Handshake(grpc::ServerContext* ctx, const v1::HandshakeRequest* req,
                         v1::HandshakeResponse* resp) override {
    if (absl::Status a = Authorize(ctx, tcp_token_); !a.ok()) return ToGrpcStatus(a);
    return Reply(engine_->Handshake(*req), resp);
  }
  grpc::Status CreateJob(grpc::ServerContext* ctx, const v1::CreateJobRequest* req,
                         v1::CreateJobResponse* resp) override {
    if (absl::Status a = Authorize(ctx, tcp_token_); !a.ok()) return ToGrpcStatus(a);
    return Reply(engine_->CreateJob(*req), resp);
  }
  grpc::Status AttachRank(grpc::ServerContext* ctx, const v1::AttachRankRequest* req,
                          v1::AttachRankResponse* resp) override {
    if (absl::Status a = Authorize(ctx, tcp_token_); !a.ok()) return ToGrpcStatus(a);
    return Reply(engine_->AttachRank(*req), resp);
  }
  grpc::Status DetachRank(grpc::ServerContext* ctx, const v1::DetachRankRequest* req,
                          v1::DetachRankResponse*) override {
    if (absl::Status a = Authorize(ctx, tcp_token_); !a.ok()) return ToGrpcStatus(a);
    return ToGrpcStatus(engine_->DetachRank(*req));
  }
  grpc::Status BeginStep(grpc::ServerContext* ctx, const v1::BeginStepRequest* req,
                         v1::BeginStepResponse* resp) override {
    if (absl::Status a = Authorize(ctx, tcp_token_); !a.ok()) return ToGrpcStatus(a);
    return Reply(engine_->BeginStep(*req, DeadlineOf(ctx)), resp);
  }
  grpc::Status AbortStep(grpc::ServerContext* ctx, const v1::AbortStepRequest* req,
                         v1::AbortStepResponse*) override {
    if (absl::Status a = Authorize(ctx, tcp_token_); !a.ok()) return ToGrpcStatus(a);
    return ToGrpcStatus(engine_->AbortStep(*req));
  }
  grpc::Status PublishCommId(grpc::ServerContext* ctx, const v1::PublishCommIdRequest* req,
                             v1::PublishCommIdResponse*) override {
    if (absl::Status a = Authorize(ctx, tcp_token_); !a.ok()) return ToGrpcStatus(a);
    return ToGrpcStatus(engine_->PublishCommId(*req));
  }
  grpc::Status FetchCommId(grpc::ServerContext* ctx, const v1::FetchCommIdRequest* req,
                           v1::FetchCommIdResponse* resp) override {
    if (absl::Status a = Authorize(ctx, tcp_token_); !a.ok()) return ToGrpcStatus(a);
    return Reply(engine_->FetchCommId(*req, DeadlineOf(ctx)), resp);
  }
  grpc::Status GetStatus(grpc::ServerContext* ctx, const v1::GetStatusRequest*,
                         v1::GetStatusResponse* resp) override {
    if (absl::Status a = Authorize(ctx, tcp_token_); !a.ok()) return ToGrpcStatus(a);
    return Reply(engine_->GetStatus(), resp);
  }
  grpc::Status ListLayers(grpc::ServerContext* ctx, const v1::ListLayersRequest* req,
                          v1::ListLayersResponse* resp) override {
    if (absl::Status a = Authorize(ctx, tcp_token_); !a.ok()) return ToGrpcStatus(a);
    return Reply(engine_->ListLayers(*req), resp);
  }
  grpc::Status ListRanks(grpc::ServerContext* ctx, const v1::ListRanksRequest* req,
                         v1::ListRanksResponse* resp) override {
    if (absl::Status a = Authorize(ctx, tcp_token_); !a.ok()) return ToGrpcStatus(a);
    return Reply(engine_->ListRanks(*req), resp);
  }
  grpc::Status GetStats(grpc::ServerContext* ctx, const v1::GetStatsRequest* req,
                        v1::GetStatsResponse* resp) override {
    if (absl::Status a = Authorize(ctx, tcp_token_); !a.ok()) return ToGrpcStatus(a);
    return Reply(engine_->GetStats(*req), resp);
  }
  grpc::Status GetConfig(grpc::ServerContext* ctx, const v1::GetConfigRequest*,
                         v1::GetConfigResponse* resp) override {
    if (absl::Status a = Authorize(ctx, tcp_token_); !a.ok()) return ToGrpcStatus(a);
    *resp = engine_->GetConfig();
    return grpc::Status::OK;
  }
  grpc::Status UpdateHyperParams(grpc::ServerContext* ctx, const v1::UpdateHyperParamsRequest* req,
                                 v1::UpdateHyperParamsResponse* resp) override {
    if (absl::Status a = Authorize(ctx, tcp_token_); !a.ok()) return ToGrpcStatus(a);
    return Reply(engine_->UpdateHyperParams(*req), resp);
  }
  grpc::Status ExportHF(grpc::ServerContext* ctx, const v1::ExportHFRequest* req,
                        v1::ExportHFResponse* resp) override {
    if (absl::Status a = Authorize(ctx, tcp_token_); !a.ok()) return ToGrpcStatus(a);
    return Reply(engine_->ExportHF(*req), resp);
  }

  grpc::Status Checkpoint(grpc::ServerContext* ctx, const v1::CheckpointRequest* req,
                          v1::CheckpointResponse* resp) override {
    if (absl::Status a = Authorize(ctx, tcp_token_); !a.ok()) return ToGrpcStatus(a);
    return Reply(engine_->Checkpoint(*req), resp);
  }
  grpc::Status UploadClientLayer(grpc::ServerContext* ctx, const v1::UploadClientLayerRequest* req,
                                 v1::UploadClientLayerResponse* resp) override {
    if (absl::Status a = Authorize(ctx, tcp_token_); !a.ok()) return ToGrpcStatus(a);
    return Reply(engine_->UploadClientLayer(*req), resp);
  }
  grpc::Status ReadClientLayer(grpc::ServerContext* ctx, const v1::ReadClientLayerRequest* req,
                               v1::ReadClientLayerResponse* resp) override {
    if (absl::Status a = Authorize(ctx, tcp_token_); !a.ok()) return ToGrpcStatus(a);
    return Reply(engine_->ReadClientLayer(*req), resp);
  }

  // One stream per rank: the first client message opens it; heartbeats follow. The stream's end
  // (the rank exited, crashed or cancelled) is the rank's death as far as hostd is concerned.
  grpc::Status Session(
      grpc::ServerContext* ctx,
      grpc::ServerReaderWriter<v1::SessionEvent, v1::SessionClientMessage>* stream) override {
    if (absl::Status a = Authorize(ctx, tcp_token_); !a.ok()) return ToGrpcStatus(a);
    v1::SessionClientMessage first;
    if (!stream->Read(&first)) return grpc::Status::OK;
    if (!first.has_open()) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          "session: the first message must be 'open' (job_id, rank, attach_token)");
    }
    auto opened = engine_->OpenSession(first.open());
    if (!opened.ok()) return ToGrpcStatus(opened.status());
    const uint32_t rank = first.open().rank();
    const std::string token = first.open().attach_token();
    v1::SessionEvent hello;
    *hello.mutable_opened() = *opened;
    stream->Write(hello);

    std::atomic<bool> closed{false};
    std::thread reader([&] {
      v1::SessionClientMessage m;
      while (stream->Read(&m)) {
        if (m.has_heartbeat()) engine_->SessionHeartbeat(rank, token, m.heartbeat());
      }
      closed.store(true);
    });
    std::string reason = "stream closed by the rank";
    while (!closed.load()) {
      if (ctx->IsCancelled()) {
        reason = "stream cancelled";
        break;
      }
      if (!engine_->SessionActive(rank, token)) {
        reason = "session ended by hostd (heartbeat deadline or shutdown)";
        break;
      }
      std::optional<v1::SessionEvent> ev =
          engine_->NextSessionEvent(rank, token, std::chrono::milliseconds(100));
      if (ev && !stream->Write(*ev)) {
        reason = "write to the rank failed";
        break;
      }
    }
    engine_->SessionClosed(rank, token, reason);
    ctx->TryCancel();  // unblocks the reader's Read
    reader.join();
    return grpc::Status::OK;
  }

 private:
  Engine* const engine_;
  const std::string tcp_token_;
};

absl::StatusOr<std::unique_ptr<ControlServer>> ControlServer::Start(Engine* engine,
                                                                    const Options& options) {
  if (options.socket_path.empty() && options.listen_tcp.empty()) {
    return absl::InvalidArgumentError("socket: no unix socket and no listen_tcp configured");
  }
  if (!options.listen_tcp.empty() && !IsLoopbackHostPort(options.listen_tcp, true)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "listen_tcp: '", options.listen_tcp,
        "' is not a loopback address; expected 127.0.0.1:PORT, [::1]:PORT or localhost:PORT"));
  }
  if (!options.listen_tcp.empty() && options.tcp_token.size() < kMinTokenChars) {
    return absl::InvalidArgumentError(absl::StrCat(
        "listen_tcp: '", options.listen_tcp,
        "' needs the service token (auth_token_file): every local user can reach a TCP port"));
  }
  std::unique_ptr<ControlServer> s(new ControlServer());
  s->impl_ = std::make_unique<Impl>(engine, options.tcp_token);
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  // UploadClientLayer carries up to 16 MiB of layer state per message.
  builder.SetMaxReceiveMessageSize(kMaxMessageBytes);
  if (!options.socket_path.empty()) {
    RETURN_IF_ERROR(PrepareSocketPath(options.socket_path));
    builder.AddListeningPort("unix:" + options.socket_path, grpc::InsecureServerCredentials());
    s->socket_path_ = options.socket_path;
  }
  if (!options.listen_tcp.empty()) {
    builder.AddListeningPort(options.listen_tcp, grpc::InsecureServerCredentials(), &s->tcp_port_);
  }
  builder.RegisterService(s->impl_.get());
  // Each rank's session stream holds a handler thread for its lifetime.
  builder.SetSyncServerOption(grpc::ServerBuilder::SyncServerOption::MAX_POLLERS, 4);
  s->server_ = builder.BuildAndStart();
  if (!s->server_) {
    return absl::UnavailableError(absl::StrCat(
        "could not listen on ", options.socket_path.empty() ? "" : "unix:" + options.socket_path,
        options.listen_tcp.empty() ? "" : " " + options.listen_tcp,
        " (address in use or permission denied)"));
  }
  if (!options.listen_tcp.empty() && s->tcp_port_ == 0) {
    return absl::UnavailableError(absl::StrCat("listen_tcp: could not bind ", options.listen_tcp));
  }
  // The group first: a group-accessible mode must never apply to the creator's own group.
  if (!s->socket_path_.empty() && options.socket_group != static_cast<gid_t>(-1) &&
      lchown(s->socket_path_.c_str(), static_cast<uid_t>(-1), options.socket_group) != 0) {
    return ErrnoStatus(absl::StrCat("chown ", s->socket_path_, " to ",
                                    DescribeGid(options.socket_group),
                                    " (shm_group: hostd must be root or a member of the group)"));
  }
  if (!s->socket_path_.empty() && chmod(s->socket_path_.c_str(), options.socket_mode) != 0) {
    return ErrnoStatus("chmod " + s->socket_path_);
  }
  s->server_->GetHealthCheckService()->SetServingStatus(true);
  s->server_->GetHealthCheckService()->SetServingStatus("slidedp.v1.Control", true);
  return s;
}

void ControlServer::Shutdown(int deadline_ms) {
  if (!server_) return;
  if (auto* health = server_->GetHealthCheckService()) health->SetServingStatus(false);
  server_->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(deadline_ms));
}

void ControlServer::Wait() {
  if (server_) server_->Wait();
}

ControlServer::~ControlServer() {
  if (server_) {
    Shutdown(0);
    server_->Wait();
  }
  if (!socket_path_.empty()) unlink(socket_path_.c_str());
}

}  // namespace slidedp::hostd
