// ControlClient: slidedpctl's connection to hostd's slidedp.v1.Control service.
//
// Every call carries a deadline of `timeout_ms` and returns the daemon's gRPC status translated
// once into absl::Status (same canonical code, same message); a call that runs out of its own
// deadline says so in a payload (kClientDeadlinePayload). Classifying a failure as
// "unreachable" vs "rejected" is the caller's job (see IsUnreachable).
//
// The channel has insecure credentials: over a unix socket the filesystem permissions of the
// socket are the access control; TCP endpoints are limited to loopback addresses by
// MakeTcpEndpoint, and every call over one carries hostd's service token (Endpoint::token).
//
// Thread safety: a ControlClient may be used from several threads (gRPC stubs are thread-safe),
// but slidedpctl uses each one from a single thread.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "slidedp/v1/control.grpc.pb.h"

namespace slidedp::ctl {

// Where hostd listens.
struct Endpoint {
  std::string target;       // gRPC target: "unix:/run/slidedp/hostd.sock" or "127.0.0.1:7070"
  std::string socket_path;  // the unix socket path; empty for TCP
  std::string token;        // TCP: hostd's service token, sent with every call (tcp_auth.h)
};

Endpoint MakeUnixEndpoint(absl::string_view socket_path);

// Parses "HOST:PORT" (IPv6 as "[::1]:PORT"). INVALID_ARGUMENT unless HOST is a loopback address
// (localhost, 127.0.0.0/8, [::1]) and PORT is in 1..65535: the channel has no authentication.
absl::StatusOr<Endpoint> MakeTcpEndpoint(absl::string_view host_port);

// The BuildInfo slidedpctl presents at handshake: component "slidedpctl" and the build's
// version, git revision, protocol and shared-memory ABI versions (common/version.h).
v1::BuildInfo ClientBuildInfo();

// A call that ran out of its own deadline returns DEADLINE_EXCEEDED carrying this payload: the
// deadline it had, in milliseconds (decimal text). A DEADLINE_EXCEEDED without it is hostd's own
// answer (e.g. an export that waited 10 minutes for a step boundary).
inline constexpr char kClientDeadlinePayload[] = "slidedp.dev/client-deadline-ms";

// The deadline that `status` ran out of, when it is a call's own (kClientDeadlinePayload).
std::optional<int64_t> ClientDeadlineMs(const absl::Status& status);

// True for the statuses that mean "no daemon answered" rather than "the daemon said no":
// UNAVAILABLE (no socket, connection refused, daemon went away) and a call's own deadline
// (ClientDeadlineMs).
bool IsUnreachable(const absl::Status& status);

class ControlClient {
 public:
  // Creates the channel; does not contact the daemon (Handshake does). For a unix endpoint the
  // socket must exist and be a socket, else UNAVAILABLE naming the path. `timeout_ms` > 0 is the
  // deadline of each call.
  static absl::StatusOr<ControlClient> Connect(const Endpoint& endpoint, int64_t timeout_ms);

  // For tests: calls go through `stub`.
  ControlClient(std::unique_ptr<v1::Control::StubInterface> stub, int64_t timeout_ms);

  ControlClient(ControlClient&&) = default;
  ControlClient& operator=(ControlClient&&) = default;
  ControlClient(const ControlClient&) = delete;
  ControlClient& operator=(const ControlClient&) = delete;

  // Presents ClientBuildInfo(). A daemon that refuses this client's versions answers
  // FAILED_PRECONDITION with a message naming both sides.
  absl::StatusOr<v1::HandshakeResponse> Handshake();
  absl::StatusOr<v1::GetStatusResponse> GetStatus();
  absl::StatusOr<v1::ListLayersResponse> ListLayers(const std::string& job_id,
                                                    bool checksums = false);
  absl::StatusOr<v1::ListRanksResponse> ListRanks(const std::string& job_id);
  absl::StatusOr<v1::GetStatsResponse> GetStats(const std::string& job_id);
  absl::StatusOr<v1::GetConfigResponse> GetConfig();
  absl::StatusOr<v1::ExportHFResponse> ExportHF(const v1::ExportHFRequest& request);

  // The deadline of the calls that follow (e.g. longer for an export).
  void set_timeout_ms(int64_t timeout_ms) { timeout_ms_ = timeout_ms; }
  // `timeout_ms` replaces the client's deadline (a waiting checkpoint takes as long as the write).
  absl::StatusOr<v1::CheckpointResponse> Checkpoint(const std::string& job_id, bool wait,
                                                    const std::string& dir, int64_t timeout_ms);

 private:
  template <typename Response, typename Request, typename Method>
  absl::StatusOr<Response> Call(Method method, const Request& request, int64_t timeout_ms = 0);

  std::unique_ptr<v1::Control::StubInterface> stub_;
  int64_t timeout_ms_;
  std::string token_;
};

}  // namespace slidedp::ctl
