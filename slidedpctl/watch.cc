#include "slidedpctl/watch.h"

#include <chrono>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "nlohmann/json.hpp"
#include "slidedpctl/exit_codes.h"

namespace slidedp::ctl {
namespace {

std::string Mib(uint64_t bytes) {
  return absl::StrFormat("%.1f", static_cast<double>(bytes) / (1 << 20));
}

constexpr char kHeaderFormat[] = "%8s  %4s  %9s  %9s  %9s  %10s  %10s  %7s  %5s  %s\n";

}  // namespace

int RunWatch(ControlClient& client, const WatchOptions& o, std::ostream& out, std::ostream& err,
             const std::function<bool()>& stop) {
  bool first = true;
  uint64_t start_completed = 0;
  v1::GetStatsResponse prev;
  const auto interval = std::chrono::duration<double>(o.interval_s);
  if (!o.json) {
    out << absl::StrFormat(kHeaderFormat, "STEP", "NEW", "STEP_S", "UPDATE_S", "GPARAM/S",
                           "GRAD_MIB", "PARAM_MIB", "ABORTED", "RANKS", "STATE");
    out.flush();
  }
  for (;;) {
    absl::StatusOr<v1::GetStatsResponse> stats = client.GetStats("");
    absl::StatusOr<v1::GetStatusResponse> status =
        stats.ok() ? client.GetStatus() : absl::StatusOr<v1::GetStatusResponse>(stats.status());
    if (!stats.ok() || !status.ok()) {
      const absl::Status& s = !stats.ok() ? stats.status() : status.status();
      err << "slidedpctl: watch: " << (IsUnreachable(s) ? "hostd stopped answering: " : "")
          << absl::StatusCodeToString(s.code()) << ": " << s.message() << '\n';
      return IsUnreachable(s) ? kExitUnreachable : kExitRejected;
    }
    if (first) {
      first = false;
      start_completed = stats->steps_completed();
      prev = *stats;
    } else if (stats->steps_completed() > prev.steps_completed()) {
      int attached = 0;
      for (const auto& r : status->ranks()) attached += r.attached() ? 1 : 0;
      const std::string state =
          stats->step_running() != 0
              ? absl::StrCat(status->job().step_state(), " ", stats->step_running())
              : status->job().step_state();
      const uint64_t fresh = stats->steps_completed() - prev.steps_completed();
      const uint64_t grad = stats->grad_bytes_received() - prev.grad_bytes_received();
      const uint64_t param = stats->param_bytes_published() - prev.param_bytes_published();
      const std::string ranks = absl::StrCat(attached, "/", status->job().world_size());
      if (o.json) {
        nlohmann::ordered_json line = {
            {"step", stats->last_step()},
            {"new_steps", fresh},
            {"step_seconds", stats->last_step_seconds()},
            {"update_seconds", stats->last_step_update_seconds()},
            {"update_gparams_per_second", stats->update_gparams_per_second()},
            {"grad_bytes", grad},
            {"param_bytes", param},
            {"steps_aborted", stats->steps_aborted()},
            {"ranks_attached", attached},
            {"world_size", status->job().world_size()},
            {"state", state}};
        out << line.dump() << '\n';
      } else {
        out << absl::StrFormat(
            kHeaderFormat, absl::StrCat(stats->last_step()), absl::StrCat("+", fresh),
            absl::StrFormat("%.3f", stats->last_step_seconds()),
            absl::StrFormat("%.3f", stats->last_step_update_seconds()),
            absl::StrFormat("%.2f", stats->update_gparams_per_second()), Mib(grad), Mib(param),
            absl::StrCat(stats->steps_aborted()), ranks, state);
      }
      out.flush();
      prev = *stats;
    }
    if (o.steps > 0 && prev.steps_completed() - start_completed >= o.steps) return kExitOk;
    const auto deadline = std::chrono::steady_clock::now() + interval;
    while (std::chrono::steady_clock::now() < deadline) {
      if (stop && stop()) return kExitOk;
      std::this_thread::sleep_for(std::min<std::chrono::duration<double>>(
          std::chrono::milliseconds(50), deadline - std::chrono::steady_clock::now()));
    }
    if (stop && stop()) return kExitOk;
  }
}

}  // namespace slidedp::ctl
