// The gRPC front end of hostd: slidedp.v1.Control over the Engine, plus grpc.health.v1 and
// server reflection. The only gRPC-aware layer of hostd. Handlers validate and delegate; they
// never run Adam, casts or copies. Engine statuses are translated once, keeping the message.
//
// Transport: a unix socket (default), and loopback TCP only when configured. A socket file left
// by a dead hostd is removed; one that still accepts connections is FAILED_PRECONDITION. The
// socket's mode and group are its access control; every call that arrives over TCP must carry
// the service token (common/tcp_auth.h), else UNAUTHENTICATED (grpc.health.v1 and reflection,
// which reveal nothing of the job, answer without it).
//
// Thread safety: Start/Shutdown/Wait from the owning thread; handlers run on gRPC's threads.
#pragma once

#include <sys/types.h>

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "hostd/engine.h"

namespace grpc {
class Server;
class Status;
}  // namespace grpc

namespace slidedp::hostd {

grpc::Status ToGrpcStatus(const absl::Status& s);

class ControlServer {
 public:
  struct Options {
    std::string socket_path;                      // unix socket; empty: none
    std::string listen_tcp;                       // loopback host:port; empty: none
    mode_t socket_mode = 0600;                    // shm_mode
    gid_t socket_group = static_cast<gid_t>(-1);  // shm_group's gid; -1: hostd's group
    std::string tcp_token;  // required with listen_tcp (auth_token_file's, ReadServiceToken)
  };
  static absl::StatusOr<std::unique_ptr<ControlServer>> Start(Engine* engine,
                                                              const Options& options);
  ~ControlServer();
  ControlServer(const ControlServer&) = delete;
  ControlServer& operator=(const ControlServer&) = delete;

  // Health NOT_SERVING, then stops accepting calls, cancels open streams and waits for
  // handlers (up to `deadline_ms`).
  void Shutdown(int deadline_ms = 2000);
  // Blocks until Shutdown has completed.
  void Wait();
  int tcp_port() const { return tcp_port_; }

 private:
  class Impl;
  ControlServer() = default;
  std::unique_ptr<Impl> impl_;
  std::unique_ptr<grpc::Server> server_;
  std::string socket_path_;
  int tcp_port_ = 0;
};

}  // namespace slidedp::hostd
