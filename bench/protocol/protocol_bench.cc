// protocol_bench: one rank process measuring the per-layer cost of the data-plane protocol
// itself (version gate, chunk signals, hostd's reduce-and-publish turnaround) on layers so small
// that copies and AdamW cost next to nothing. run_protocol_bench.py starts hostd and R of these.
//
// Per step: BeginStep; FetchParams of every layer (the gate is already open: this is the check
// + the copy); PushGrad of every layer in backward order (one chunk each: slot wait, copy,
// signal); WaitStep (from the last push until hostd has reduced, updated and published every
// layer). Prints one JSON object with medians in microseconds.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "model/manifest.h"
#include "rankclient/rank_client.h"

namespace {

using Clock = std::chrono::steady_clock;
namespace v1 = slidedp::v1;

double Us(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::micro>(b - a).count();
}

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

v1::JobSpec Spec(uint32_t layers, uint64_t numel, uint32_t world) {
  v1::JobSpec spec;
  auto* m = spec.mutable_manifest();
  m->set_family("bench");
  m->set_name("protocol");
  for (uint32_t l = 0; l < layers; ++l) {
    auto* layer = m->add_layers();
    layer->set_name(absl::StrCat("layer.", l));
    layer->set_kind(v1::LAYER_KIND_DECODER);
    auto* t = layer->add_tensors();
    t->set_name(absl::StrCat("layer.", l, ".weight"));
    t->add_shape(static_cast<int64_t>(numel));
    t->set_dtype(v1::DTYPE_BF16);
  }
  spec.set_world_size(world);
  spec.mutable_optimizer()->set_lr(1e-4);
  spec.mutable_optimizer()->set_grad_dtype(v1::DTYPE_BF16);
  spec.mutable_routes()->set_chunk_bytes(4096);
  return spec;
}

int Fail(const absl::Status& s, const char* what) {
  std::fprintf(stderr, "protocol_bench: %s: %s\n", what, s.ToString().c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  std::string socket;
  uint32_t rank = 0, world = 1, layers = 64, steps = 50;
  uint64_t numel = 1024;
  bool create = false;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&]() -> std::string { return i + 1 < argc ? argv[++i] : ""; };
    if (a == "--socket")
      socket = next();
    else if (a == "--rank")
      rank = static_cast<uint32_t>(std::stoul(next()));
    else if (a == "--world")
      world = static_cast<uint32_t>(std::stoul(next()));
    else if (a == "--layers")
      layers = static_cast<uint32_t>(std::stoul(next()));
    else if (a == "--numel")
      numel = std::stoull(next());
    else if (a == "--steps")
      steps = static_cast<uint32_t>(std::stoul(next()));
    else if (a == "--create-job")
      create = true;
    else {
      std::fprintf(stderr,
                   "usage: protocol_bench --socket S [--rank r] [--world R] [--layers L] "
                   "[--numel N] [--steps T] [--create-job]\n");
      return 2;
    }
  }
  const v1::JobSpec spec = Spec(layers, numel, world);
  const auto timeout = std::chrono::milliseconds(30000);
  if (create) {
    auto s = slidedp::rankclient::RankClient::CreateJob(socket, spec, timeout);
    if (!s.ok()) return Fail(s.status(), "CreateJob");
  }
  slidedp::rankclient::RankClient::Options o;
  o.socket = socket;
  o.rank = rank;
  o.manifest_hash = slidedp::model::ManifestHashHex(slidedp::model::ManifestHash(spec.manifest()));
  absl::StatusOr<std::unique_ptr<slidedp::rankclient::RankClient>> client;
  for (int tries = 0; tries < 300; ++tries) {  // the job may not exist yet
    client = slidedp::rankclient::RankClient::Attach(o);
    if (client.ok() || !absl::IsFailedPrecondition(client.status())) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  if (!client.ok()) return Fail(client.status(), "Attach");
  auto& c = **client;
  std::vector<uint16_t> params(numel), grad(numel, 0x3c00);  // grad = 0.0078125 in BF16
  std::vector<double> fetch_us, push_us, wait_us, step_us;
  for (uint64_t t = 1; t <= steps; ++t) {
    const auto s0 = Clock::now();
    if (auto s = c.BeginStep(t, timeout); !s.ok()) return Fail(s, "BeginStep");
    for (uint32_t l = 0; l < layers; ++l) {
      const auto a = Clock::now();
      auto v = c.FetchParams(l, t - 1, params.data(), params.size() * 2, timeout);
      if (!v.ok()) return Fail(v.status(), "FetchParams");
      fetch_us.push_back(Us(a, Clock::now()));
    }
    for (uint32_t l = layers; l-- > 0;) {
      const auto a = Clock::now();
      if (auto s = c.PushGrad(t, l, grad.data(), 2, grad.size() * 2, timeout); !s.ok()) {
        return Fail(s, "PushGrad");
      }
      push_us.push_back(Us(a, Clock::now()));
    }
    const auto w = Clock::now();
    if (auto s = c.WaitStep(t, timeout); !s.ok()) return Fail(s, "WaitStep");
    const auto e = Clock::now();
    wait_us.push_back(Us(w, e));
    step_us.push_back(Us(s0, e));
  }
  std::printf(
      "{\"rank\": %u, \"world\": %u, \"layers\": %u, \"numel\": %llu, \"steps\": %u, "
      "\"fetch_us_per_layer\": %.3f, \"push_us_per_layer\": %.3f, "
      "\"step_end_wait_us\": %.3f, \"step_us\": %.3f, \"step_us_per_layer\": %.3f}\n",
      rank, world, layers, static_cast<unsigned long long>(numel), steps, Median(fetch_us),
      Median(push_us), Median(wait_us), Median(step_us), Median(step_us) / layers);
  (void)c.Detach();
  return 0;
}
