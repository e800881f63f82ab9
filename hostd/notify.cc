#include "hostd/notify.h"

#include <systemd/sd-daemon.h>

#include <cstdlib>

#include "absl/time/time.h"
#include "spdlog/spdlog.h"

namespace slidedp::hostd {

ServiceNotifier::ServiceNotifier() {
  const char* sock = std::getenv("NOTIFY_SOCKET");
  enabled_ = sock != nullptr && sock[0] != '\0';
  uint64_t usec = 0;
  // > 0 only when WATCHDOG_USEC is set (and WATCHDOG_PID, if set, is this process).
  if (enabled_ && sd_watchdog_enabled(0, &usec) > 0) watchdog_ = std::chrono::microseconds(usec);
}

ServiceNotifier::~ServiceNotifier() {
  StopKeepalive();
  Stop();
}

void ServiceNotifier::Send(const std::string& state) {
  if (!enabled_) return;
  const int r = sd_notify(0, state.c_str());
  if (r < 0) spdlog::warn("sd_notify({}) failed: error {}", state.substr(0, 40), -r);
}

void ServiceNotifier::Status(const std::string& status) {
  {
    absl::MutexLock l(&mu_);
    last_status_ = status;
  }
  Send("STATUS=" + status);
}

void ServiceNotifier::Ready(const std::string& status) { Send("READY=1\nSTATUS=" + status); }

void ServiceNotifier::Stopping() { Send("STOPPING=1\nSTATUS=stopping"); }

void ServiceNotifier::Loop(std::thread* t, bool* stop, std::chrono::milliseconds period,
                           std::function<void()> tick) {
  *t = std::thread([this, stop, period, tick = std::move(tick)] {
    for (;;) {
      {
        absl::MutexLock l(&mu_);
        if (*stop) return;
      }
      tick();
      absl::MutexLock l(&mu_);
      if (mu_.AwaitWithTimeout(absl::Condition(stop), absl::FromChrono(period))) return;
    }
  });
}

void ServiceNotifier::Join(std::thread* t, bool* stop) {
  {
    absl::MutexLock l(&mu_);
    *stop = true;
  }
  if (t->joinable()) t->join();
}

void ServiceNotifier::Start(std::function<absl::StatusOr<std::string>()> probe,
                            std::chrono::milliseconds status_every) {
  if (!enabled_ || thread_.joinable()) return;
  const auto period = watchdog_.count() > 0
                          ? std::chrono::duration_cast<std::chrono::milliseconds>(watchdog_ / 2)
                          : status_every;
  {
    absl::MutexLock l(&mu_);
    stop_ = false;
  }
  Loop(&thread_, &stop_, period, [this, probe = std::move(probe)] {
    const absl::StatusOr<std::string> status = probe();  // bounded: see Engine::StatusLine
    if (!status.ok()) {
      spdlog::warn("no watchdog ping: {}", status.status().ToString());
      Send("STATUS=not answering: " + std::string(status.status().message()));
      return;
    }
    Send((watchdog_.count() > 0 ? "WATCHDOG=1\nSTATUS=" : "STATUS=") + *status);
  });
}

void ServiceNotifier::Stop() { Join(&thread_, &stop_); }

void ServiceNotifier::StartKeepalive(std::chrono::milliseconds period) {
  if (!enabled_ || keepalive_.joinable()) return;
  {
    absl::MutexLock l(&mu_);
    keepalive_stop_ = false;
  }
  const auto extend = std::chrono::duration_cast<std::chrono::microseconds>(3 * period);
  Loop(&keepalive_, &keepalive_stop_, period, [this, extend] {
    std::string status;
    {
      absl::MutexLock l(&mu_);
      status = last_status_;
    }
    Send("EXTEND_TIMEOUT_USEC=" + std::to_string(extend.count()) +
         (watchdog_.count() > 0 ? "\nWATCHDOG=1" : "") + "\nSTATUS=" + status);
  });
}

void ServiceNotifier::StopKeepalive() { Join(&keepalive_, &keepalive_stop_); }

}  // namespace slidedp::hostd
