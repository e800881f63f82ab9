#include "slidedpctl/fake_control_service.h"

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <stdexcept>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/version.h"

namespace slidedp::ctl::testing {
namespace {

v1::LayerStatus Layer(uint32_t index, const std::string& name, v1::LayerKind kind, uint64_t numel,
                      uint64_t version, int32_t numa_node, uint64_t skipped) {
  v1::LayerStatus layer;
  layer.set_layer(index);
  layer.set_name(name);
  layer.set_kind(kind);
  layer.set_numel(numel);
  layer.set_version(version);
  layer.set_state_bytes(numel * 12);  // FP32 master + m + v
  layer.set_param_bytes(numel * 2);   // BF16
  layer.set_numa_node(numa_node);
  layer.set_skipped_steps(skipped);
  layer.set_last_grad_norm(0.5 + index);
  return layer;
}

v1::RankStatus Rank(uint32_t index, int32_t pid, int32_t gpu, bool connected, uint64_t last_step,
                    uint64_t ms_since_heartbeat) {
  v1::RankStatus rank;
  rank.set_rank(index);
  rank.set_pid(pid);
  rank.set_hostname("node-a");
  rank.set_gpu(gpu);
  rank.set_connected(connected);
  rank.set_attached(true);
  rank.set_last_step(last_step);
  rank.set_ms_since_heartbeat(ms_since_heartbeat);
  return rank;
}

bool KnownJob(const std::string& job_id) { return job_id.empty() || job_id == kCannedJobId; }

grpc::Status UnknownJob(const std::string& job_id) {
  return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                      absl::StrCat("job_id: unknown job \"", job_id, "\"; expected \"",
                                   kCannedJobId, "\" or empty for the daemon's job"));
}

}  // namespace

v1::GetStatusResponse CannedStatus() {
  v1::GetStatusResponse status;
  v1::BuildInfo* daemon = status.mutable_daemon();
  daemon->set_component("hostd");
  daemon->set_version("0.1.0");
  daemon->set_git_revision("abc1234");
  daemon->set_protocol_version(kProtocolVersion);
  daemon->set_shm_abi_version(1);
  daemon->add_features("cpu_reduction");
  daemon->add_features("global_clip");
  status.set_instance("default");
  status.set_socket("/run/slidedp/hostd.sock");
  status.set_uptime_ms(3'723'000);
  v1::JobStatus* job = status.mutable_job();
  job->set_job_id(kCannedJobId);
  job->set_model_name("tiny-llama");
  job->set_family("llama");
  job->set_world_size(2);
  job->set_step(42);
  job->set_step_state("idle");
  job->set_total_params(4'300'000'000);
  job->set_manifest_hash("deadbeef");
  job->mutable_routes()->set_param_route(v1::PARAM_ROUTE_REPLICATED);
  job->mutable_routes()->set_grad_route(v1::GRAD_ROUTE_CPU_REDUCTION);
  job->mutable_routes()->set_chunk_bytes(4 << 20);
  job->mutable_optimizer()->set_lr(3e-4);
  job->mutable_optimizer()->set_beta1(0.9);
  job->mutable_optimizer()->set_beta2(0.95);
  job->mutable_optimizer()->set_eps(1e-8);
  job->mutable_optimizer()->set_schedule(v1::LR_SCHEDULE_COSINE);
  job->mutable_optimizer()->set_clip(v1::CLIP_POLICY_GLOBAL);
  job->mutable_optimizer()->set_max_grad_norm(1.0);
  job->set_current_lr(2.5e-4);
  // Sizes chosen so that PARAMS and BYTES have different widths per row, and the embedding's
  // state exceeds 2^32 bytes (exact 64-bit numbers in JSON).
  *status.add_layers() =
      Layer(0, "model.embed_tokens", v1::LAYER_KIND_EMBEDDING, 1'048'576'000, 42, 0, 0);
  *status.add_layers() = Layer(1, "model.layers.0", v1::LAYER_KIND_DECODER, 2048, 41, 1, 1);
  *status.add_layers() = Layer(2, "lm_head", v1::LAYER_KIND_LM_HEAD, 524'288, 42, -1, 12);
  *status.add_ranks() = Rank(0, 4242, 0, true, 42, 120);
  *status.add_ranks() = Rank(1, 4243, -1, false, 41, 75'000);
  v1::SegmentInfo* segment = status.add_segments();
  segment->set_name("slidedp.default.state");
  segment->set_kind(v1::SEGMENT_KIND_STATE);
  segment->set_size_bytes(12'589'056'000);
  segment->set_numa_node(0);
  v1::TopologyInfo* topology = status.mutable_topology();
  topology->set_numa_nodes(2);
  topology->set_cores(64);
  topology->set_state_numa_node(0);
  topology->add_worker_cpus(2);
  topology->add_worker_cpus(3);
  status.set_shm_bytes(12'589'056'000);
  status.set_locked_bytes(12'589'056'000);
  return status;
}

v1::ListRanksResponse CannedRanks() {
  v1::ListRanksResponse ranks;
  *ranks.mutable_ranks() = CannedStatus().ranks();
  return ranks;
}

v1::GetStatsResponse CannedStats() {
  v1::GetStatsResponse stats;
  stats.set_steps_completed(42);
  stats.set_steps_aborted(1);
  stats.set_layer_updates(126);
  stats.set_layer_updates_skipped(13);
  stats.set_update_seconds_total(12.3456789);
  stats.set_last_step_update_seconds(0.25);
  stats.set_update_params_total(44'048'449'536);
  stats.set_update_gparams_per_second(4.2);
  stats.set_update_gbytes_per_second(58.8);
  stats.set_isa("avx512");
  stats.set_update_threads(16);
  return stats;
}

v1::GetConfigResponse CannedConfig() {
  v1::GetConfigResponse config;
  auto add = [&config](const char* key, const char* value, const char* source) {
    v1::ConfigEntry* entry = config.add_entries();
    entry->set_key(key);
    entry->set_value(value);
    entry->set_source(source);
  };
  add("socket", "/run/slidedp/hostd.sock", "default");
  add("instance", "default", "file");
  add("numa.state_node", "0", "env");
  add("update_threads", "16", "flag");
  config.set_toml("socket = \"/run/slidedp/hostd.sock\"\ninstance = \"default\"\n");
  return config;
}

grpc::Status FakeControlService::Handshake(grpc::ServerContext*,
                                           const v1::HandshakeRequest* request,
                                           v1::HandshakeResponse* response) {
  absl::MutexLock lock(&mu_);
  ++handshake_count_;
  last_handshake_ = *request;
  if (refuse_handshake_) {
    return grpc::Status(
        grpc::StatusCode::FAILED_PRECONDITION,
        absl::StrCat("client protocol_version ", request->client().protocol_version(),
                     " is not supported; hostd 9.0.0 speaks protocol 9"));
  }
  *response->mutable_daemon() = CannedStatus().daemon();
  response->set_instance("default");
  return grpc::Status::OK;
}

grpc::Status FakeControlService::GetStatus(grpc::ServerContext*, const v1::GetStatusRequest*,
                                           v1::GetStatusResponse* response) {
  int64_t delay_ms = 0;
  bool no_job = false;
  {
    absl::MutexLock lock(&mu_);
    delay_ms = status_delay_ms_;
    no_job = no_job_;
  }
  if (delay_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
  *response = CannedStatus();
  if (no_job) {
    response->clear_job();
    response->clear_layers();
    response->clear_ranks();
  }
  return grpc::Status::OK;
}

grpc::Status FakeControlService::ListLayers(grpc::ServerContext*,
                                            const v1::ListLayersRequest* request,
                                            v1::ListLayersResponse* response) {
  if (!KnownJob(request->job_id())) return UnknownJob(request->job_id());
  *response->mutable_layers() = CannedStatus().layers();
  return grpc::Status::OK;
}

grpc::Status FakeControlService::ListRanks(grpc::ServerContext*,
                                           const v1::ListRanksRequest* request,
                                           v1::ListRanksResponse* response) {
  if (!KnownJob(request->job_id())) return UnknownJob(request->job_id());
  absl::MutexLock lock(&mu_);
  if (no_rank_attached_) {
    // hostd's answer for a world size of 1 and no rank: the slot, default-valued.
    v1::RankStatus* slot = response->add_ranks();
    slot->set_rank(0);
    return grpc::Status::OK;
  }
  *response = CannedRanks();
  return grpc::Status::OK;
}

grpc::Status FakeControlService::GetStats(grpc::ServerContext*, const v1::GetStatsRequest* request,
                                          v1::GetStatsResponse* response) {
  if (!KnownJob(request->job_id())) return UnknownJob(request->job_id());
  *response = CannedStats();
  return grpc::Status::OK;
}

grpc::Status FakeControlService::GetConfig(grpc::ServerContext*, const v1::GetConfigRequest*,
                                           v1::GetConfigResponse* response) {
  *response = CannedConfig();
  return grpc::Status::OK;
}

grpc::Status FakeControlService::ExportHF(grpc::ServerContext* context,
                                          const v1::ExportHFRequest* request,
                                          v1::ExportHFResponse* response) {
  int64_t delay_ms = 0;
  grpc::Status status;
  {
    absl::MutexLock lock(&mu_);
    last_export_ = *request;
    delay_ms = operation_delay_ms_;
    status = export_status_;
  }
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(delay_ms);
  while (std::chrono::steady_clock::now() < until && !context->IsCancelled()) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  if (!status.ok()) return status;
  response->set_out_dir(request->out_dir());
  response->set_version(42);
  response->add_files("model.safetensors");
  response->add_files("config.json");
  response->set_tensor_bytes(1 << 20);
  response->set_tensors(7);
  response->set_seconds(0.5);
  response->set_dtype(v1::DTYPE_BF16);
  return grpc::Status::OK;
}

grpc::Status FakeControlService::Checkpoint(grpc::ServerContext* context,
                                            const v1::CheckpointRequest* request,
                                            v1::CheckpointResponse* response) {
  int64_t delay_ms = 0;
  {
    absl::MutexLock lock(&mu_);
    last_checkpoint_ = *request;
    delay_ms = operation_delay_ms_;
  }
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(delay_ms);
  while (std::chrono::steady_clock::now() < until && !context->IsCancelled()) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  response->set_step(42);
  response->set_path(absl::StrCat(request->dir().empty() ? "/ckpt" : request->dir(), "/step-42"));
  response->set_committed(request->wait());
  return grpc::Status::OK;
}

void FakeControlService::set_operation_delay_ms(int64_t delay_ms) {
  absl::MutexLock lock(&mu_);
  operation_delay_ms_ = delay_ms;
}

void FakeControlService::set_export_status(grpc::Status status) {
  absl::MutexLock lock(&mu_);
  export_status_ = std::move(status);
}

void FakeControlService::set_no_rank_attached(bool none) {
  absl::MutexLock lock(&mu_);
  no_rank_attached_ = none;
}

v1::ExportHFRequest FakeControlService::last_export() const {
  absl::MutexLock lock(&mu_);
  return last_export_;
}

v1::CheckpointRequest FakeControlService::last_checkpoint() const {
  absl::MutexLock lock(&mu_);
  return last_checkpoint_;
}

void FakeControlService::set_refuse_handshake(bool refuse) {
  absl::MutexLock lock(&mu_);
  refuse_handshake_ = refuse;
}

void FakeControlService::set_no_job(bool no_job) {
  absl::MutexLock lock(&mu_);
  no_job_ = no_job;
}

void FakeControlService::set_status_delay_ms(int64_t delay_ms) {
  absl::MutexLock lock(&mu_);
  status_delay_ms_ = delay_ms;
}

int FakeControlService::handshake_count() const {
  absl::MutexLock lock(&mu_);
  return handshake_count_;
}

v1::HandshakeRequest FakeControlService::last_handshake() const {
  absl::MutexLock lock(&mu_);
  return last_handshake_;
}

std::string MakeTempDir() {
  std::string pattern = "/tmp/slidedpctl_test.XXXXXX";
  if (::mkdtemp(pattern.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
  return pattern;
}

FakeDaemon::FakeDaemon(bool tcp) : dir_(MakeTempDir()), socket_path_(dir_ + "/hostd.sock") {
  grpc::ServerBuilder builder;
  builder.AddListeningPort("unix:" + socket_path_, grpc::InsecureServerCredentials());
  if (tcp) builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &tcp_port_);
  builder.RegisterService(&service_);
  server_ = builder.BuildAndStart();
  if (server_ == nullptr) throw std::runtime_error("FakeDaemon: BuildAndStart failed");
}

FakeDaemon::~FakeDaemon() {
  server_->Shutdown();
  server_->Wait();
  std::error_code ignored;
  std::filesystem::remove_all(dir_, ignored);
}

}  // namespace slidedp::ctl::testing
