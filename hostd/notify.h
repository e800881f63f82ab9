// ServiceNotifier: hostd's side of systemd's notify protocol (Type=notify, sd_notify(3) through
// libsystemd), and a no-op when NOTIFY_SOCKET is unset (hostd started by hand or by a test).
//   STATUS=...  while the job's state is created (minutes for a large model: the phase and its
//               progress) and, once serving, every watchdog period: the completed steps, the
//               step state and attached ranks (or the creation of a job CreateJob asked for);
//   READY=1     once the control socket listens;
//   WATCHDOG=1  every half WATCHDOG_USEC (sd_watchdog_enabled), only after a status query of
//               the engine answered: the query waits a bounded time for the engine's lock,
//               which no long work holds, so an engine stuck on its lock stops the pings and
//               systemd restarts the service (WatchdogSec= in the unit);
//   EXTEND_TIMEOUT_USEC=...  with WATCHDOG=1 and the latest STATUS, every keepalive period while
//               long work runs outside the service's normal life: the job's state created before
//               READY (TimeoutStartSec=) and the final checkpoint after STOPPING=1
//               (TimeoutStopSec=);
//   STOPPING=1  when a stop signal arrives.
// Thread safety: Status/Ready/Stopping from any thread; Start/Stop and StartKeepalive/StopKeepalive
// from the main thread. The stop flags and the last status are guarded by mu_; the threads are
// owned (started and joined) by the main thread.
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace slidedp::hostd {

class ServiceNotifier {
 public:
  ServiceNotifier();
  ~ServiceNotifier();
  ServiceNotifier(const ServiceNotifier&) = delete;
  ServiceNotifier& operator=(const ServiceNotifier&) = delete;

  // True when a service manager listens (NOTIFY_SOCKET is set).
  bool enabled() const { return enabled_; }
  // The watchdog interval the manager asked for (zero: none).
  std::chrono::microseconds watchdog_interval() const { return watchdog_; }

  void Status(const std::string& status) ABSL_LOCKS_EXCLUDED(mu_);
  void Ready(const std::string& status);
  void Stopping();

  // Starts the watchdog/status thread: every half watchdog interval (or every `status_every`
  // when there is no watchdog) it calls `probe`: its text goes out as STATUS with WATCHDOG=1;
  // an error (the engine did not answer in time) as STATUS alone, without the ping. No thread
  // when the notifier is disabled.
  void Start(std::function<absl::StatusOr<std::string>()> probe,
             std::chrono::milliseconds status_every = std::chrono::seconds(5))
      ABSL_LOCKS_EXCLUDED(mu_);
  void Stop() ABSL_LOCKS_EXCLUDED(mu_);

  // Until StopKeepalive: every `period`, EXTEND_TIMEOUT_USEC (three periods), WATCHDOG=1 and the
  // text of the last Status() call. For long work before Ready or after Stopping.
  void StartKeepalive(std::chrono::milliseconds period = std::chrono::seconds(10))
      ABSL_LOCKS_EXCLUDED(mu_);
  void StopKeepalive() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  void Send(const std::string& state);
  // Runs `tick` every `period` on thread `t` until `*stop` is set; `stop` is stop_ or
  // keepalive_stop_, read and written only under mu_.
  void Loop(std::thread* t, bool* stop, std::chrono::milliseconds period,
            std::function<void()> tick) ABSL_LOCKS_EXCLUDED(mu_);
  // Sets `*stop` (under mu_, which wakes the loop's Await) and joins `t`.
  void Join(std::thread* t, bool* stop) ABSL_LOCKS_EXCLUDED(mu_);

  bool enabled_ = false;
  std::chrono::microseconds watchdog_{0};
  absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  bool keepalive_stop_ ABSL_GUARDED_BY(mu_) = false;
  std::string last_status_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;
  std::thread keepalive_;
};

}  // namespace slidedp::hostd
