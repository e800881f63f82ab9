// ServiceNotifier: hostd's side of systemd's notify protocol (Type=notify, sd_notify(3) through
// libsystemd), and a no-op when NOTIFY_SOCKET is unset (hostd started by hand or by a test).
//   STATUS=...  while the job's state is created (minutes for a large model) and, once serving,
//               every watchdog period: the completed steps, the step state and attached ranks;
//   READY=1     once the control socket listens;
//   WATCHDOG=1  every half WATCHDOG_USEC (sd_watchdog_enabled), only after a status query of
//               the engine returned: an engine stuck on its lock stops the pings and systemd
//               restarts the service (WatchdogSec= in the unit);
//   STOPPING=1  when a stop signal arrives.
// Thread safety: Status/Ready/Stopping from any thread; Start/Stop from the main thread.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

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

  void Status(const std::string& status);
  void Ready(const std::string& status);
  void Stopping();

  // Starts the watchdog/status thread: every half watchdog interval (or every `status_every`
  // when there is no watchdog) it calls `probe`, which returns the STATUS text, then sends it
  // with WATCHDOG=1. No thread when the notifier is disabled.
  void Start(std::function<std::string()> probe,
             std::chrono::milliseconds status_every = std::chrono::seconds(5));
  void Stop();

 private:
  void Send(const std::string& state);

  bool enabled_ = false;
  std::chrono::microseconds watchdog_{0};
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace slidedp::hostd
