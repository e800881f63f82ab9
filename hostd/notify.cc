#include "hostd/notify.h"

#include <systemd/sd-daemon.h>

#include <cstdlib>

#include "spdlog/spdlog.h"

namespace slidedp::hostd {

ServiceNotifier::ServiceNotifier() {
  const char* sock = std::getenv("NOTIFY_SOCKET");
  enabled_ = sock != nullptr && sock[0] != '\0';
  uint64_t usec = 0;
  // > 0 only when WATCHDOG_USEC is set (and WATCHDOG_PID, if set, is this process).
  if (enabled_ && sd_watchdog_enabled(0, &usec) > 0) watchdog_ = std::chrono::microseconds(usec);
}

ServiceNotifier::~ServiceNotifier() { Stop(); }

void ServiceNotifier::Send(const std::string& state) {
  if (!enabled_) return;
  const int r = sd_notify(0, state.c_str());
  if (r < 0) spdlog::warn("sd_notify({}) failed: error {}", state.substr(0, 40), -r);
}

void ServiceNotifier::Status(const std::string& status) { Send("STATUS=" + status); }

void ServiceNotifier::Ready(const std::string& status) { Send("READY=1\nSTATUS=" + status); }

void ServiceNotifier::Stopping() { Send("STOPPING=1\nSTATUS=stopping"); }

void ServiceNotifier::Start(std::function<std::string()> probe,
                            std::chrono::milliseconds status_every) {
  if (!enabled_ || thread_.joinable()) return;
  const auto period = watchdog_.count() > 0
                          ? std::chrono::duration_cast<std::chrono::milliseconds>(watchdog_ / 2)
                          : status_every;
  thread_ = std::thread([this, probe = std::move(probe), period] {
    std::unique_lock<std::mutex> l(mu_);
    while (!stop_) {
      l.unlock();
      const std::string status = probe();  // blocks while the engine is stuck: no ping
      Send((watchdog_.count() > 0 ? "WATCHDOG=1\nSTATUS=" : "STATUS=") + status);
      l.lock();
      cv_.wait_for(l, period, [this] { return stop_; });
    }
  });
}

void ServiceNotifier::Stop() {
  {
    std::lock_guard<std::mutex> l(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

}  // namespace slidedp::hostd
