// Test-only: an in-process slidedp.v1.Control service with canned answers, and FakeDaemon, which
// serves it on a fresh unix socket (and optionally loopback TCP) so slidedpctl's commands run
// end to end without hostd.
//
// Canned data: one job "job-7" (tiny-llama, world size 2) with three layers of different name
// lengths and sizes (one with numa_node -1), two ranks (one on CPU, one disconnected), four config
// entries (one per source) and stats. Knobs make Handshake refuse (version skew), GetStatus,
// ExportHF and Checkpoint slow, ExportHF answer an error, and ListRanks answer hostd's list for a
// job no rank has attached to (one empty slot). ExportHF and Checkpoint record their requests and
// succeed. ListLayers/ListRanks/GetStats answer INVALID_ARGUMENT for a job_id other than "" or
// "job-7".
//
// Thread safety: the service's knobs and records are guarded by a mutex; RPCs run on gRPC threads.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/grpcpp.h"
#include "slidedp/v1/control.grpc.pb.h"

namespace slidedp::ctl::testing {

inline constexpr char kCannedJobId[] = "job-7";

v1::GetStatusResponse CannedStatus();
v1::ListRanksResponse CannedRanks();
v1::GetStatsResponse CannedStats();
v1::GetConfigResponse CannedConfig();

class FakeControlService final : public v1::Control::Service {
 public:
  grpc::Status Handshake(grpc::ServerContext* context, const v1::HandshakeRequest* request,
                         v1::HandshakeResponse* response) override;
  grpc::Status GetStatus(grpc::ServerContext* context, const v1::GetStatusRequest* request,
                         v1::GetStatusResponse* response) override;
  grpc::Status ListLayers(grpc::ServerContext* context, const v1::ListLayersRequest* request,
                          v1::ListLayersResponse* response) override;
  grpc::Status ListRanks(grpc::ServerContext* context, const v1::ListRanksRequest* request,
                         v1::ListRanksResponse* response) override;
  grpc::Status GetStats(grpc::ServerContext* context, const v1::GetStatsRequest* request,
                        v1::GetStatsResponse* response) override;
  grpc::Status GetConfig(grpc::ServerContext* context, const v1::GetConfigRequest* request,
                         v1::GetConfigResponse* response) override;
  grpc::Status ExportHF(grpc::ServerContext* context, const v1::ExportHFRequest* request,
                        v1::ExportHFResponse* response) override;
  grpc::Status Checkpoint(grpc::ServerContext* context, const v1::CheckpointRequest* request,
                          v1::CheckpointResponse* response) override;

  // Handshake answers FAILED_PRECONDITION as hostd does on version skew.
  void set_refuse_handshake(bool refuse);
  // GetStatus reports no job.
  void set_no_job(bool no_job);
  // GetStatus sleeps this long before answering.
  void set_status_delay_ms(int64_t delay_ms);
  // ExportHF and Checkpoint wait this long (or until the client gives up) before answering.
  void set_operation_delay_ms(int64_t delay_ms);
  // ExportHF answers this status (when not OK) instead of a response.
  void set_export_status(grpc::Status status);
  // ListRanks answers one slot that no rank has attached to.
  void set_no_rank_attached(bool none);
  v1::ExportHFRequest last_export() const;
  v1::CheckpointRequest last_checkpoint() const;

  int handshake_count() const;
  v1::HandshakeRequest last_handshake() const;

 private:
  mutable absl::Mutex mu_;
  bool refuse_handshake_ ABSL_GUARDED_BY(mu_) = false;
  bool no_job_ ABSL_GUARDED_BY(mu_) = false;
  int64_t status_delay_ms_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t operation_delay_ms_ ABSL_GUARDED_BY(mu_) = 0;
  grpc::Status export_status_ ABSL_GUARDED_BY(mu_);
  bool no_rank_attached_ ABSL_GUARDED_BY(mu_) = false;
  v1::ExportHFRequest last_export_ ABSL_GUARDED_BY(mu_);
  v1::CheckpointRequest last_checkpoint_ ABSL_GUARDED_BY(mu_);
  int handshake_count_ ABSL_GUARDED_BY(mu_) = 0;
  v1::HandshakeRequest last_handshake_ ABSL_GUARDED_BY(mu_);
};

// Serves a FakeControlService on <fresh temp dir>/hostd.sock and, with `tcp`, also on
// 127.0.0.1:<ephemeral port>. Shuts the server down and removes the directory on destruction.
class FakeDaemon {
 public:
  explicit FakeDaemon(bool tcp = false);
  ~FakeDaemon();
  FakeDaemon(const FakeDaemon&) = delete;
  FakeDaemon& operator=(const FakeDaemon&) = delete;

  const std::string& socket_path() const { return socket_path_; }
  int tcp_port() const { return tcp_port_; }
  FakeControlService& service() { return service_; }

 private:
  std::string dir_;
  std::string socket_path_;
  int tcp_port_ = 0;
  FakeControlService service_;
  std::unique_ptr<grpc::Server> server_;
};

// A fresh temporary directory (mkdtemp under /tmp: unix socket paths are limited to 107 bytes).
std::string MakeTempDir();

}  // namespace slidedp::ctl::testing
