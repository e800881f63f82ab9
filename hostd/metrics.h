// The Prometheus endpoint of hostd (config [metrics] listen, e.g. 127.0.0.1:9464): GET /metrics
// in the text exposition format, served by prometheus-cpp's exposer (civetweb threads).
//
// No counter is kept here: each scrape reads the engine's own figures (Engine::GetStats and
// GetStatus, the same as slidedpctl) and renders them, so the endpoint, `slidedpctl stats` and
// `slidedpctl watch` can never disagree. Metrics (all prefixed slidedp_):
//   build_info{version,git_revision,protocol,shm_abi} 1
//   steps_completed_total, steps_aborted_total, step_running (0: idle), last_step
//   step_seconds (histogram: a step's wall time, armed to last layer published)
//   last_step_seconds, update_seconds_total, last_step_update_seconds
//   layer_updates_total, layer_updates_skipped_total, update_params_total
//   grad_bytes_received_total (ranks' D2H), param_bytes_published_total (what ranks H2D)
//   shm_bytes, locked_bytes (pinned), ranks_attached, world_size
//   layer_version{layer="model.layers.0"}, layer_version_min, layer_version_max
//   checkpoint_last_step and checkpoint_age_seconds (the last committed checkpoint; NaN before one)
//   exports_completed_total, uptime_seconds
// Before a job exists only build_info and uptime_seconds are exposed.
//
// Thread safety: scrapes run on the exposer's threads and only call the engine's thread-safe
// queries. The server owns its exposer; destroying it stops serving (joins those threads), and
// must happen before the engine is destroyed.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "hostd/engine.h"

namespace prometheus {
class Exposer;
}

namespace slidedp::hostd {

class MetricsCollector;

class MetricsServer {
 public:
  // Listens on `listen` ("HOST:PORT"; PORT 0 picks a free port). Validation of the address
  // (loopback unless allowed) is ValidateConfig's. UNAVAILABLE naming the address when it cannot
  // be bound.
  static absl::StatusOr<std::unique_ptr<MetricsServer>> Start(Engine* engine,
                                                              const std::string& listen);
  ~MetricsServer();
  MetricsServer(const MetricsServer&) = delete;
  MetricsServer& operator=(const MetricsServer&) = delete;

  int port() const { return port_; }

 private:
  MetricsServer() = default;
  std::shared_ptr<MetricsCollector> collector_;
  std::unique_ptr<prometheus::Exposer> exposer_;
  int port_ = 0;
};

}  // namespace slidedp::hostd
