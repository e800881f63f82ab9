#include "slidedpctl/client.h"

#include <sys/stat.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <utility>

#include "absl/strings/cord.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/tcp_auth.h"
#include "common/version.h"
#include "grpcpp/grpcpp.h"

namespace slidedp::ctl {
namespace {

absl::Status FromGrpc(const grpc::Status& status) {
  // grpc::StatusCode and absl::StatusCode share the canonical numbering.
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

absl::Status CheckSocket(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    const int err = errno;
    if (err == ENOENT) return absl::UnavailableError(absl::StrCat("no socket at ", path));
    return absl::UnavailableError(absl::StrCat("stat ", path, ": ", std::strerror(err)));
  }
  if (!S_ISSOCK(st.st_mode)) {
    return absl::UnavailableError(absl::StrCat(path, " exists but is not a socket"));
  }
  return absl::OkStatus();
}

}  // namespace

Endpoint MakeUnixEndpoint(absl::string_view socket_path) {
  return Endpoint{absl::StrCat("unix:", socket_path), std::string(socket_path)};
}

absl::StatusOr<Endpoint> MakeTcpEndpoint(absl::string_view host_port) {
  const size_t colon = host_port.rfind(':');
  if (colon == absl::string_view::npos || colon == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--tcp: expected HOST:PORT (e.g. 127.0.0.1:7070), got \"", host_port, "\""));
  }
  const absl::string_view host = host_port.substr(0, colon);
  int port = 0;
  if (!absl::SimpleAtoi(host_port.substr(colon + 1), &port) || port < 1 || port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("--tcp: port must be in 1..65535, got \"", host_port.substr(colon + 1), "\""));
  }
  if (!IsLoopbackHostPort(std::string_view(host_port.data(), host_port.size()), false)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--tcp: host must be a loopback address (localhost, 127.0.0.0/8, [::1]) "
                     "because the channel is unauthenticated, got \"",
                     host, "\""));
  }
  return Endpoint{std::string(host_port), ""};
}

v1::BuildInfo ClientBuildInfo() {
  v1::BuildInfo info;
  info.set_component("slidedpctl");
  info.set_version(kVersion);
  info.set_git_revision(kGitRevision);
  info.set_protocol_version(kProtocolVersion);
  info.set_shm_abi_version(kShmAbiVersion);
  return info;
}

std::optional<int64_t> ClientDeadlineMs(const absl::Status& status) {
  if (status.code() != absl::StatusCode::kDeadlineExceeded) return std::nullopt;
  const auto payload = status.GetPayload(kClientDeadlinePayload);
  int64_t ms = 0;
  if (!payload || !absl::SimpleAtoi(std::string(*payload), &ms)) return std::nullopt;
  return ms;
}

bool IsUnreachable(const absl::Status& status) {
  return status.code() == absl::StatusCode::kUnavailable || ClientDeadlineMs(status).has_value();
}

absl::StatusOr<ControlClient> ControlClient::Connect(const Endpoint& endpoint, int64_t timeout_ms) {
  if (!endpoint.socket_path.empty()) {
    if (absl::Status s = CheckSocket(endpoint.socket_path); !s.ok()) return s;
  }
  grpc::ChannelArguments args;
  args.SetUserAgentPrefix(absl::StrCat("slidedpctl/", kVersion));
  std::shared_ptr<grpc::Channel> channel =
      grpc::CreateCustomChannel(endpoint.target, grpc::InsecureChannelCredentials(), args);
  ControlClient client(v1::Control::NewStub(channel), timeout_ms);
  client.token_ = endpoint.token;
  return client;
}

ControlClient::ControlClient(std::unique_ptr<v1::Control::StubInterface> stub, int64_t timeout_ms)
    : stub_(std::move(stub)), timeout_ms_(timeout_ms) {}

template <typename Response, typename Request, typename Method>
absl::StatusOr<Response> ControlClient::Call(Method method, const Request& request,
                                             int64_t timeout_ms) {
  const int64_t deadline_ms = timeout_ms > 0 ? timeout_ms : timeout_ms_;
  const auto deadline = std::chrono::system_clock::now() + std::chrono::milliseconds(deadline_ms);
  grpc::ClientContext context;
  context.set_deadline(deadline);
  if (!token_.empty()) context.AddMetadata(kAuthMetadataKey, BearerValue(token_));
  Response response;
  const grpc::Status grpc_status = ((*stub_).*method)(&context, request, &response);
  if (grpc_status.ok()) return response;
  absl::Status status = FromGrpc(grpc_status);
  // Ours when the deadline has passed (give or take the clocks' granularity); hostd's own
  // DEADLINE_EXCEEDED answers arrive before it.
  if (status.code() == absl::StatusCode::kDeadlineExceeded &&
      std::chrono::system_clock::now() + std::chrono::milliseconds(20) >= deadline) {
    status.SetPayload(kClientDeadlinePayload, absl::Cord(absl::StrCat(deadline_ms)));
  }
  return status;
}

absl::StatusOr<v1::HandshakeResponse> ControlClient::Handshake() {
  v1::HandshakeRequest request;
  *request.mutable_client() = ClientBuildInfo();
  return Call<v1::HandshakeResponse>(&v1::Control::StubInterface::Handshake, request);
}

absl::StatusOr<v1::GetStatusResponse> ControlClient::GetStatus() {
  return Call<v1::GetStatusResponse>(&v1::Control::StubInterface::GetStatus,
                                     v1::GetStatusRequest());
}

absl::StatusOr<v1::ListLayersResponse> ControlClient::ListLayers(const std::string& job_id,
                                                                 bool checksums) {
  v1::ListLayersRequest request;
  request.set_job_id(job_id);
  request.set_checksums(checksums);
  return Call<v1::ListLayersResponse>(&v1::Control::StubInterface::ListLayers, request);
}

absl::StatusOr<v1::ListRanksResponse> ControlClient::ListRanks(const std::string& job_id) {
  v1::ListRanksRequest request;
  request.set_job_id(job_id);
  return Call<v1::ListRanksResponse>(&v1::Control::StubInterface::ListRanks, request);
}

absl::StatusOr<v1::GetStatsResponse> ControlClient::GetStats(const std::string& job_id) {
  v1::GetStatsRequest request;
  request.set_job_id(job_id);
  return Call<v1::GetStatsResponse>(&v1::Control::StubInterface::GetStats, request);
}

absl::StatusOr<v1::CheckpointResponse> ControlClient::Checkpoint(const std::string& job_id,
                                                                 bool wait, const std::string& dir,
                                                                 int64_t timeout_ms) {
  v1::CheckpointRequest request;
  request.set_job_id(job_id);
  request.set_wait(wait);
  request.set_dir(dir);
  return Call<v1::CheckpointResponse>(&v1::Control::StubInterface::Checkpoint, request, timeout_ms);
}

absl::StatusOr<v1::GetConfigResponse> ControlClient::GetConfig() {
  return Call<v1::GetConfigResponse>(&v1::Control::StubInterface::GetConfig,
                                     v1::GetConfigRequest());
}

absl::StatusOr<v1::ExportHFResponse> ControlClient::ExportHF(const v1::ExportHFRequest& request) {
  return Call<v1::ExportHFResponse>(&v1::Control::StubInterface::ExportHF, request);
}

}  // namespace slidedp::ctl
