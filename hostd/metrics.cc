#include "hostd/metrics.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <exception>
#include <limits>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/version.h"
#include "prometheus/client_metric.h"
#include "prometheus/collectable.h"
#include "prometheus/exposer.h"
#include "prometheus/metric_family.h"
#include "spdlog/spdlog.h"

namespace slidedp::hostd {

using prometheus::ClientMetric;
using prometheus::MetricFamily;
using prometheus::MetricType;

// Renders the engine's figures at each scrape.
class MetricsCollector final : public prometheus::Collectable {
 public:
  explicit MetricsCollector(Engine* engine) : engine_(engine) {}

  std::vector<MetricFamily> Collect() const override {
    std::vector<MetricFamily> out;
    ClientMetric build;
    build.label = {{"version", kVersion},
                   {"git_revision", kGitRevision},
                   {"protocol", absl::StrCat(kProtocolVersion)},
                   {"shm_abi", absl::StrCat(kShmAbiVersion)}};
    build.gauge.value = 1;
    out.push_back({"slidedp_build_info",
                   "hostd's build: version, git revision, protocol and "
                   "shared-memory ABI (value 1)",
                   MetricType::Gauge,
                   {build}});

    auto status = engine_->GetStatus();
    if (!status.ok()) return out;
    Gauge(out, "slidedp_uptime_seconds", "seconds since hostd started",
          static_cast<double>(status->uptime_ms()) / 1e3);
    if (!status->has_job()) return out;
    auto stats = engine_->GetStats(slidedp::v1::GetStatsRequest());
    if (!stats.ok()) return out;
    const auto& s = *stats;

    Counter(out, "slidedp_steps_completed_total", "training steps completed",
            static_cast<double>(s.steps_completed()));
    Counter(out, "slidedp_steps_aborted_total", "training steps aborted",
            static_cast<double>(s.steps_aborted()));
    Gauge(out, "slidedp_step_running", "the step running now (0: idle)",
          static_cast<double>(s.step_running()));
    Gauge(out, "slidedp_last_step", "number of the last completed step",
          static_cast<double>(s.last_step()));
    Gauge(out, "slidedp_last_step_seconds", "wall time of the last completed step",
          s.last_step_seconds());

    ClientMetric hist;
    uint64_t cumulative = 0;
    for (int i = 0; i < s.step_seconds_buckets_size(); ++i) {
      cumulative += s.step_seconds_buckets(i);
      const double bound = i < s.step_seconds_bounds_size()
                               ? s.step_seconds_bounds(i)
                               : std::numeric_limits<double>::infinity();
      hist.histogram.bucket.push_back({cumulative, bound});
    }
    hist.histogram.sample_count = cumulative;
    hist.histogram.sample_sum = s.step_seconds_sum();
    out.push_back({"slidedp_step_seconds",
                   "wall time of each completed step, from its start to its last layer's publish",
                   MetricType::Histogram,
                   {hist}});

    Counter(out, "slidedp_update_seconds_total", "seconds the update worker spent in AdamW",
            s.update_seconds_total());
    Gauge(out, "slidedp_last_step_update_seconds", "AdamW seconds of the last completed step",
          s.last_step_update_seconds());
    Counter(out, "slidedp_layer_updates_total", "layer updates applied",
            static_cast<double>(s.layer_updates()));
    Counter(out, "slidedp_layer_updates_skipped_total",
            "layer updates skipped for a non-finite gradient",
            static_cast<double>(s.layer_updates_skipped()));
    Counter(out, "slidedp_update_params_total", "parameters updated",
            static_cast<double>(s.update_params_total()));
    Counter(out, "slidedp_grad_bytes_received_total",
            "gradient bytes hostd read from the ranks' shared-memory rings (their D2H)",
            static_cast<double>(s.grad_bytes_received()));
    Counter(out, "slidedp_param_bytes_published_total",
            "BF16 bytes of new parameter versions published (what the ranks copy H2D)",
            static_cast<double>(s.param_bytes_published()));
    Counter(out, "slidedp_exports_completed_total", "HF exports completed",
            static_cast<double>(s.exports_completed()));
    const bool checkpointed = s.checkpoint_age_seconds() >= 0;
    const double nan = std::numeric_limits<double>::quiet_NaN();
    Gauge(out, "slidedp_checkpoint_last_step", "step of the last checkpoint (NaN: none yet)",
          checkpointed ? static_cast<double>(s.checkpoint_last_step()) : nan);
    Gauge(out, "slidedp_checkpoint_age_seconds", "seconds since the last checkpoint (NaN: none)",
          checkpointed ? s.checkpoint_age_seconds() : nan);

    Gauge(out, "slidedp_shm_bytes", "shared memory of the job's segments",
          static_cast<double>(status->shm_bytes()));
    Gauge(out, "slidedp_locked_bytes", "shared memory locked (pinned) in RAM",
          static_cast<double>(status->locked_bytes()));
    int attached = 0;
    for (const auto& r : status->ranks()) attached += r.attached() ? 1 : 0;
    Gauge(out, "slidedp_ranks_attached", "ranks attached to the job", attached);
    Gauge(out, "slidedp_world_size", "ranks per step", status->job().world_size());

    MetricFamily versions{
        "slidedp_layer_version", "committed version of each layer", MetricType::Gauge, {}};
    uint64_t vmin = UINT64_MAX;
    uint64_t vmax = 0;
    for (const auto& l : status->layers()) {
      ClientMetric m;
      m.label = {{"layer", l.name()}};
      m.gauge.value = static_cast<double>(l.version());
      versions.metric.push_back(std::move(m));
      vmin = std::min<uint64_t>(vmin, l.version());
      vmax = std::max<uint64_t>(vmax, l.version());
    }
    out.push_back(std::move(versions));
    if (status->layers_size() > 0) {
      Gauge(out, "slidedp_layer_version_min", "lowest committed layer version",
            static_cast<double>(vmin));
      Gauge(out, "slidedp_layer_version_max", "highest committed layer version",
            static_cast<double>(vmax));
    }
    return out;
  }

 private:
  static void Gauge(std::vector<MetricFamily>& out, std::string name, std::string help,
                    double value) {
    ClientMetric m;
    m.gauge.value = value;
    out.push_back({std::move(name), std::move(help), MetricType::Gauge, {m}});
  }
  static void Counter(std::vector<MetricFamily>& out, std::string name, std::string help,
                      double value) {
    ClientMetric m;
    m.counter.value = value;
    out.push_back({std::move(name), std::move(help), MetricType::Counter, {m}});
  }

  Engine* const engine_;
};

absl::StatusOr<std::unique_ptr<MetricsServer>> MetricsServer::Start(Engine* engine,
                                                                    const std::string& listen) {
  std::unique_ptr<MetricsServer> s(new MetricsServer());
  s->collector_ = std::make_shared<MetricsCollector>(engine);
  // civetweb takes "[::1]:PORT" for IPv6 and "HOST:PORT" with a numeric host; resolve localhost.
  std::string address = listen;
  if (address.rfind("localhost:", 0) == 0) address = "127.0.0.1" + address.substr(9);
  try {
    s->exposer_ = std::make_unique<prometheus::Exposer>(address, /*num_threads=*/2);
  } catch (const std::exception& e) {
    return absl::UnavailableError(
        absl::StrCat("metrics.listen: cannot serve on '", listen, "': ", e.what()));
  }
  s->exposer_->RegisterCollectable(s->collector_);
  const std::vector<int> ports = s->exposer_->GetListeningPorts();
  s->port_ = ports.empty() ? 0 : ports.front();
  return s;
}

MetricsServer::~MetricsServer() = default;

}  // namespace slidedp::hostd
