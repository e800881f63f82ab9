// hostd: the SlideDP host daemon. Owns the FP32 master weights and Adam state of one training
// job in shared memory, runs the update worker and serves slidedp.v1.Control on a unix socket.
// Runs in the foreground; under systemd (Type=notify, deploy/systemd) it reports STATUS while the
// job's state is created, READY=1 once it serves, WATCHDOG=1 pings and STOPPING=1 (notify.h).
// SIGTERM/SIGINT stop it cleanly: health NOT_SERVING, sessions told, the running step aborted,
// segments removed.
#include <signal.h>

#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <map>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/instance_files.h"
#include "common/tcp_auth.h"
#include "hostd/config.h"
#include "hostd/engine.h"
#include "hostd/metrics.h"
#include "hostd/notify.h"
#include "hostd/service.h"
#include "spdlog/spdlog.h"

extern char** environ;

namespace {

std::map<std::string, std::string> Environment() {
  std::map<std::string, std::string> env;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    std::string kv(*e);
    const size_t eq = kv.find('=');
    if (eq != std::string::npos) env.emplace(kv.substr(0, eq), kv.substr(eq + 1));
  }
  return env;
}

}  // namespace

int main(int argc, char** argv) {
  using slidedp::hostd::ControlServer;
  using slidedp::hostd::Engine;
  using slidedp::hostd::ServiceNotifier;

  auto loaded = slidedp::hostd::LoadConfig(argc, argv, Environment());
  if (!loaded.ok()) {
    std::cerr << "hostd: " << loaded.status().message() << "\n(see hostd --help)\n";
    return 2;
  }
  if (loaded->show_help) {
    std::cout << loaded->help_text;
    return 0;
  }
  if (loaded->print_config) {
    std::cout << slidedp::hostd::ConfigToToml(loaded->entries);
    return 0;
  }
  const slidedp::hostd::HostdConfig& config = loaded->config;
  spdlog::set_level(spdlog::level::from_str(config.log_level));
  spdlog::set_pattern("%Y-%m-%dT%H:%M:%S.%e %^%l%$ hostd: %v");

  // Signals are taken synchronously by this thread; every thread started below inherits the mask.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGTERM);
  sigaddset(&stop_signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);
  signal(SIGPIPE, SIG_IGN);

  // The TCP listener's token first: a bad file fails the start before minutes of job creation.
  std::string tcp_token;
  if (!config.listen_tcp.empty()) {
    auto token = slidedp::ReadServiceToken(config.auth_token_file, /*for_server=*/true);
    if (!token.ok()) {
      spdlog::error("startup failed: auth_token_file: {}", token.status().ToString());
      return 1;
    }
    tcp_token = *std::move(token);
  }
  ServiceNotifier notifier;
  notifier.Status(config.model == "none" ? "starting"
                                         : "creating the job's state for " + config.model);
  // Creating a large model's state takes minutes: systemd's start timeout is extended while it
  // makes progress, and STATUS shows the phase.
  notifier.StartKeepalive();
  auto engine = Engine::Create(config, loaded->entries, std::nullopt,
                               [&notifier](const std::string& line) { notifier.Status(line); });
  notifier.StopKeepalive();
  if (!engine.ok()) {
    spdlog::error("startup failed: {}", engine.status().ToString());
    notifier.Status("startup failed: " + engine.status().ToString());
    return 1;
  }
  // Metrics first: once the control socket exists, everything hostd serves is up.
  std::unique_ptr<slidedp::hostd::MetricsServer> metrics;
  if (!config.metrics_listen.empty() && config.metrics_listen != "off") {
    auto started = slidedp::hostd::MetricsServer::Start(engine->get(), config.metrics_listen);
    if (!started.ok()) {
      spdlog::error("startup failed: {}", started.status().ToString());
      notifier.Status("startup failed: " + started.status().ToString());
      (*engine)->Shutdown(/*remove_state=*/true).IgnoreError();
      return 1;
    }
    metrics = std::move(*started);
    const std::string& l = config.metrics_listen;
    spdlog::info("serving metrics on http://{}:{}/metrics", l.substr(0, l.rfind(':')),
                 metrics->port());
  }
  ControlServer::Options so;
  so.socket_path = config.socket;
  so.listen_tcp = config.listen_tcp;
  so.socket_mode = config.shm_mode == "0660" ? 0660 : 0600;
  // Engine::Create resolved it already (an unknown group failed there).
  auto socket_group = slidedp::ResolveShmGroup(config.shm_group);
  if (!socket_group.ok()) {
    spdlog::error("startup failed: {}", socket_group.status().ToString());
    notifier.Status("startup failed: " + socket_group.status().ToString());
    metrics.reset();
    (*engine)->Shutdown(/*remove_state=*/true).IgnoreError();
    return 1;
  }
  so.socket_group = *socket_group;
  so.tcp_token = tcp_token;
  auto server = ControlServer::Start(engine->get(), so);
  if (!server.ok()) {
    spdlog::error("startup failed: {}", server.status().ToString());
    notifier.Status("startup failed: " + server.status().ToString());
    metrics.reset();
    (*engine)->Shutdown(/*remove_state=*/true).IgnoreError();
    return 1;
  }
  spdlog::info("serving slidedp.v1.Control on unix:{}{}", config.socket,
               config.listen_tcp.empty() ? "" : " and " + config.listen_tcp);
  Engine* e = engine->get();
  // The probe waits at most 10 s for the engine's lock, which no long work holds (a job's
  // creation runs without it): a stuck engine stops the watchdog pings, a busy one does not.
  auto probe = [e]() { return e->StatusLine(absl::Seconds(10)); };
  notifier.Ready(probe().value_or("serving"));
  notifier.Start(probe);

  int sig = 0;
  sigwait(&stop_signals, &sig);
  spdlog::info("received {}, stopping", sig == SIGTERM ? "SIGTERM" : "SIGINT");
  notifier.Stopping();
  notifier.Stop();
  metrics.reset();
  // The final checkpoint can take minutes: the stop timeout is extended meanwhile.
  notifier.Status("stopping: final checkpoint");
  notifier.StartKeepalive();
  const absl::Status stopped = (*engine)->Shutdown(/*remove_state=*/true);
  notifier.StopKeepalive();
  (*server)->Shutdown(2000);
  (*server)->Wait();
  server->reset();
  engine->reset();
  if (!stopped.ok()) {
    // Not a clean stop: the state was kept for the next hostd (the message says how to go on),
    // and the service manager should see the failure.
    spdlog::error("stopped with the training state kept: {}", stopped.ToString());
    notifier.Status("stopped with the training state kept: " + std::string(stopped.message()));
    return 1;
  }
  spdlog::info("stopped");
  return 0;
}
