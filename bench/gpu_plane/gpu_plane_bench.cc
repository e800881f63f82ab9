// gpu_plane_bench: the GPU data plane measured against the physical limits (issue #4 item 8).
// One rank process against a running hostd (started with --model none --world_size 1 by
// run_gpu_plane_bench.py, a fresh one per mode); the bench creates the job it needs.
//
//   --mode h2d            (a) parameter delivery through the window (Fetch + WaitSlot) against
//                         raw chunked cudaMemcpyAsync from cudaHostAlloc memory, same chunk
//                         sizes, same run;
//   --mode d2h_adam       (b) one big layer: from PushGrad to the layer's new version published
//                         (D2H + hostd's AdamW); run once with hostd --update_granularity layer
//                         and once with chunk;
//   --mode h2d_under_load (c) parameter delivery alone, then while a big layer's gradient goes
//                         D2H and hostd runs its AdamW;
//   --mode pipeline       (d) a step of L layers with synthetic compute of set duration per layer
//                         (forward, and backward = 2x forward, on the GPU), parameters streamed
//                         (forward and again in backward), gradients pushed per layer; exposed
//                         host time = step time - the same compute alone.
// Writes one JSON object on stdout.
#include <cuda_runtime_api.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <deque>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "bench/gpu_plane/spin.h"
#include "common/status_macros.h"
#include "kernels/cuda/cuda_kernels.h"
#include "kernels/cuda/cuda_status.h"
#include "model/manifest.h"
#include "nlohmann/json.hpp"
#include "rankclient/gpu_plane.h"
#include "rankclient/rank_client.h"

namespace slidedp::bench {
namespace {

namespace v1 = slidedp::v1;
using Clock = std::chrono::steady_clock;
using json = nlohmann::json;
using rankclient::GpuDataPlane;
using rankclient::RankClient;
constexpr std::chrono::milliseconds kTimeout(600000);

struct Flags {
  std::string socket;
  std::string mode = "h2d";
  uint32_t layers = 8;
  uint64_t layer_params = 128ull << 20;
  uint64_t chunk_bytes = 64ull << 20;  // gradient ring slot
  std::vector<uint64_t> h2d_chunk_mib = {4, 16, 64, 256};
  uint32_t reps = 3;
  uint32_t steps = 4;
  std::string grad_route = "gpu_reduction";
  std::vector<double> fwd_ms = {2, 4, 8};
  uint32_t window_slots = 3;
  uint32_t prefetch = 2;
};

double Sec(Clock::duration d) { return std::chrono::duration<double>(d).count(); }
double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

v1::JobSpec BenchJob(const Flags& f) {
  v1::JobSpec spec;
  v1::ModelManifest* m = spec.mutable_manifest();
  m->set_family("bench");
  m->set_name(absl::StrCat("bench-L", f.layers, "-P", f.layer_params));
  for (uint32_t l = 0; l < f.layers; ++l) {
    v1::LayerSpec* ls = m->add_layers();
    ls->set_name(absl::StrCat("layer.", l));
    ls->set_kind(v1::LAYER_KIND_DECODER);
    v1::TensorSpec* t = ls->add_tensors();
    t->set_name(absl::StrCat("layer.", l, ".weight"));
    t->add_shape(static_cast<int64_t>(f.layer_params));
    t->set_dtype(v1::DTYPE_BF16);
  }
  spec.set_world_size(1);
  v1::OptimizerConfig* o = spec.mutable_optimizer();
  o->set_lr(1e-5);
  o->set_beta1(0.9);
  o->set_beta2(0.999);
  o->set_eps(1e-8);
  o->set_weight_decay(0.0);
  o->set_schedule(v1::LR_SCHEDULE_CONSTANT);
  o->set_clip(v1::CLIP_POLICY_NONE);
  o->set_grad_dtype(v1::DTYPE_BF16);
  o->set_scale_by_world_size(true);
  v1::Routes* r = spec.mutable_routes();
  r->set_param_route(v1::PARAM_ROUTE_REPLICATED);
  r->set_grad_route(f.grad_route == "cpu_reduction"    ? v1::GRAD_ROUTE_CPU_REDUCTION
                    : f.grad_route == "reduce_scatter" ? v1::GRAD_ROUTE_REDUCE_SCATTER
                                                       : v1::GRAD_ROUTE_GPU_REDUCTION);
  r->set_chunk_bytes(f.chunk_bytes);
  return spec;
}

absl::StatusOr<std::unique_ptr<RankClient>> Connect(const Flags& f) {
  const v1::JobSpec spec = BenchJob(f);
  ASSIGN_OR_RETURN(v1::JobSpec got, RankClient::CreateJob(f.socket, spec, kTimeout));
  RankClient::Options o;
  o.socket = f.socket;
  o.rank = 0;
  o.gpu = 0;
  o.manifest_hash = got.manifest().manifest_hash();
  o.timeout_ms = 600000;
  return RankClient::Attach(o);
}

// Random BF16 gradients (small normal values) on the device.
absl::StatusOr<uint16_t*> DeviceGrad(uint64_t n) {
  uint16_t* d = nullptr;
  RETURN_IF_CUDA_ERROR(cudaMalloc(&d, n * 2), "cudaMalloc of a gradient");
  std::vector<float> h(std::min<uint64_t>(n, 1 << 24));
  std::mt19937 rng(1);
  std::normal_distribution<float> nd(0.f, 1e-3f);
  for (float& x : h) x = nd(rng);
  float* tmp = nullptr;
  RETURN_IF_CUDA_ERROR(cudaMalloc(&tmp, h.size() * 4), "cudaMalloc");
  RETURN_IF_CUDA_ERROR(cudaMemcpy(tmp, h.data(), h.size() * 4, cudaMemcpyHostToDevice), "H2D");
  for (uint64_t off = 0; off < n; off += h.size()) {
    const uint64_t k = std::min<uint64_t>(h.size(), n - off);
    RETURN_IF_ERROR(kernels::cuda::Fp32ToBf16(tmp, d + off, k, nullptr));
  }
  RETURN_IF_CUDA_ERROR(cudaDeviceSynchronize(), "sync");
  cudaFree(tmp);
  return d;
}

// Delivers layers [0, count) `reps` times through the window (prefetch ahead, release right
// after the stream has waited): bytes / seconds.
absl::StatusOr<double> Deliver(GpuDataPlane* plane, uint32_t count, uint32_t reps,
                               uint32_t prefetch, cudaStream_t stream) {
  RankClient* c = plane->client();
  const uint64_t version = c->current_step() - 1;
  uint64_t bytes = 0;
  const auto t0 = Clock::now();
  for (uint32_t r = 0; r < reps; ++r) {
    std::deque<GpuDataPlane::Slot> ahead;
    uint32_t next = 0;
    while (next < count && ahead.size() < prefetch) {
      ASSIGN_OR_RETURN(GpuDataPlane::Slot s, plane->Fetch(next++, version, kTimeout));
      ahead.push_back(s);
    }
    while (!ahead.empty()) {
      const GpuDataPlane::Slot s = ahead.front();
      ahead.pop_front();
      RETURN_IF_ERROR(plane->WaitSlot(s, stream));
      RETURN_IF_ERROR(plane->ReleaseSlot(s, stream));
      bytes += s.numel * 2;
      if (next < count) {
        ASSIGN_OR_RETURN(GpuDataPlane::Slot n, plane->Fetch(next++, version, kTimeout));
        ahead.push_back(n);
      }
    }
  }
  RETURN_IF_CUDA_ERROR(cudaStreamSynchronize(stream), "sync");
  return bytes / Sec(Clock::now() - t0);
}

// Raw: the same bytes, chunked the same way, from cudaHostAlloc memory with cudaMemcpyAsync.
absl::StatusOr<double> RawPinned(uint64_t layer_bytes, uint32_t count, uint32_t reps,
                                 uint64_t chunk, void* host, void* dev, cudaStream_t stream) {
  const auto t0 = Clock::now();
  for (uint32_t r = 0; r < reps; ++r) {
    for (uint32_t l = 0; l < count; ++l) {
      for (uint64_t off = 0; off < layer_bytes; off += chunk) {
        const uint64_t n = std::min(chunk, layer_bytes - off);
        RETURN_IF_CUDA_ERROR(
            cudaMemcpyAsync(static_cast<char*>(dev) + off, static_cast<char*>(host) + off, n,
                            cudaMemcpyHostToDevice, stream),
            "raw H2D");
      }
    }
  }
  RETURN_IF_CUDA_ERROR(cudaStreamSynchronize(stream), "sync");
  return static_cast<double>(layer_bytes) * count * reps / Sec(Clock::now() - t0);
}

absl::Status ModeH2d(const Flags& f, json* out) {
  ASSIGN_OR_RETURN(std::unique_ptr<RankClient> c, Connect(f));
  RETURN_IF_ERROR(c->BeginStep(1, kTimeout));
  cudaStream_t stream;
  RETURN_IF_CUDA_ERROR(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
  const uint64_t layer_bytes = f.layer_params * 2;
  void* host = nullptr;
  void* dev = nullptr;
  RETURN_IF_CUDA_ERROR(cudaHostAlloc(&host, layer_bytes, cudaHostAllocDefault), "cudaHostAlloc");
  std::memset(host, 1, layer_bytes);
  RETURN_IF_CUDA_ERROR(cudaMalloc(&dev, layer_bytes), "cudaMalloc");
  json rows = json::array();
  uint64_t generation = 1;
  for (uint64_t mib : f.h2d_chunk_mib) {
    GpuDataPlane::Options o;
    o.prefetch_depth = f.window_slots - 1;
    o.comm_generation = generation;  // each plane creates fresh communicators, if any
    generation += 2;
    o.window_slots = f.window_slots;
    o.h2d_chunk_bytes = mib << 20;
    ASSIGN_OR_RETURN(std::unique_ptr<GpuDataPlane> plane, GpuDataPlane::Create(c.get(), o));
    RETURN_IF_ERROR(Deliver(plane.get(), f.layers, 1, f.prefetch, stream).status());  // warm-up
    RETURN_IF_ERROR(
        RawPinned(layer_bytes, f.layers, 1, mib << 20, host, dev, stream).status());  // warm-up
    std::vector<double> ours, raw;
    for (uint32_t i = 0; i < 3; ++i) {  // interleaved, so drift hits both alike
      ASSIGN_OR_RETURN(double a, Deliver(plane.get(), f.layers, f.reps, f.prefetch, stream));
      ASSIGN_OR_RETURN(double b,
                       RawPinned(layer_bytes, f.layers, f.reps, mib << 20, host, dev, stream));
      ours.push_back(a);
      raw.push_back(b);
    }
    const double o_gb = Median(ours) / 1e9, r_gb = Median(raw) / 1e9;
    rows.push_back({{"h2d_chunk_mib", mib},
                    {"delivery_gb_per_s", o_gb},
                    {"raw_pinned_gb_per_s", r_gb},
                    {"ratio", o_gb / r_gb},
                    {"delivery_samples_gb_per_s", ours},
                    {"raw_samples_gb_per_s", raw},
                    {"register_seconds", plane->stats().register_seconds}});
    std::fprintf(stderr, "h2d chunk %4llu MiB: delivery %.1f GB/s, raw pinned %.1f GB/s (%.3f)\n",
                 static_cast<unsigned long long>(mib), o_gb, r_gb, o_gb / r_gb);
  }
  (*out)["h2d"] = rows;
  cudaFreeHost(host);
  cudaFree(dev);
  cudaStreamDestroy(stream);
  return c->Detach();
}

absl::Status ModeD2hAdam(const Flags& f, json* out) {
  ASSIGN_OR_RETURN(std::unique_ptr<RankClient> c, Connect(f));
  GpuDataPlane::Options o;
  o.window_slots = 1;
  o.prefetch_depth = 0;
  ASSIGN_OR_RETURN(std::unique_ptr<GpuDataPlane> plane, GpuDataPlane::Create(c.get(), o));
  cudaStream_t stream;
  RETURN_IF_CUDA_ERROR(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
  ASSIGN_OR_RETURN(uint16_t * grad, DeviceGrad(f.layer_params));
  std::vector<double> ms, d2h_ms;
  for (uint64_t t = 1; t <= f.steps; ++t) {
    RETURN_IF_ERROR(plane->BeginStep(t, kTimeout));
    const auto t0 = Clock::now();
    for (uint32_t l = f.layers; l-- > 0;) {
      RETURN_IF_ERROR(plane->PushGrad(t, l, grad, 2, stream, kTimeout));
    }
    RETURN_IF_ERROR(plane->WaitPushes(kTimeout));
    const auto t1 = Clock::now();
    RETURN_IF_ERROR(c->WaitStep(t, kTimeout));
    const auto t2 = Clock::now();
    ms.push_back(Sec(t2 - t0) * 1e3);
    d2h_ms.push_back(Sec(t1 - t0) * 1e3);
    std::fprintf(stderr, "step %llu: push %.1f ms, push+update %.1f ms\n",
                 static_cast<unsigned long long>(t), d2h_ms.back(), ms.back());
  }
  // The first step pays first-use costs; the median of the rest.
  std::vector<double> rest(ms.begin() + (ms.size() > 1 ? 1 : 0), ms.end());
  std::vector<double> rest_d2h(d2h_ms.begin() + (d2h_ms.size() > 1 ? 1 : 0), d2h_ms.end());
  (*out)["d2h_adam"] = {{"layer_params", f.layer_params},
                        {"layers", f.layers},
                        {"chunk_bytes", f.chunk_bytes},
                        {"step_ms", ms},
                        {"push_ms", d2h_ms},
                        {"median_ms", Median(rest)},
                        {"median_push_ms", Median(rest_d2h)}};
  cudaFree(grad);
  plane.reset();
  cudaStreamDestroy(stream);
  return c->Detach();
}

absl::Status ModeH2dUnderLoad(const Flags& f, json* out) {
  // Layers 0..L-2 are delivered; layer L-1's gradient is pushed meanwhile.
  ASSIGN_OR_RETURN(std::unique_ptr<RankClient> c, Connect(f));
  GpuDataPlane::Options o;
  o.window_slots = f.window_slots;
  o.prefetch_depth = f.window_slots - 1;
  ASSIGN_OR_RETURN(std::unique_ptr<GpuDataPlane> plane, GpuDataPlane::Create(c.get(), o));
  cudaStream_t stream, gstream;
  RETURN_IF_CUDA_ERROR(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
  RETURN_IF_CUDA_ERROR(cudaStreamCreateWithFlags(&gstream, cudaStreamNonBlocking), "stream");
  ASSIGN_OR_RETURN(uint16_t * grad, DeviceGrad(f.layer_params));
  const uint32_t big = f.layers - 1;
  json rows = json::array();
  for (uint64_t t = 1; t <= f.steps; ++t) {
    RETURN_IF_ERROR(plane->BeginStep(t, kTimeout));
    ASSIGN_OR_RETURN(const double alone, Deliver(plane.get(), big, 1, f.prefetch, stream));
    const auto t0 = Clock::now();
    RETURN_IF_ERROR(plane->PushGrad(t, big, grad, 2, gstream, kTimeout));
    uint64_t bytes = 0;
    double busy_s = 0;
    for (;;) {
      const auto d0 = Clock::now();
      ASSIGN_OR_RETURN(const double rate, Deliver(plane.get(), 1, 1, 1, stream));
      const double s = Sec(Clock::now() - d0);
      bytes += static_cast<uint64_t>(rate * s);
      busy_s += s;
      if (c->WaitLayer(big, t, std::chrono::milliseconds(0)).ok()) break;
    }
    const double total_ms = Sec(Clock::now() - t0) * 1e3;
    // The other layers must reach version t too before the next step.
    for (uint32_t l = 0; l < big; ++l) {
      RETURN_IF_ERROR(plane->PushGrad(t, l, grad, 2, gstream, kTimeout));
    }
    RETURN_IF_ERROR(plane->WaitPushes(kTimeout));
    RETURN_IF_ERROR(c->WaitStep(t, kTimeout));
    const double loaded = bytes / busy_s;
    rows.push_back({{"step", t},
                    {"alone_gb_per_s", alone / 1e9},
                    {"under_load_gb_per_s", loaded / 1e9},
                    {"ratio", loaded / alone},
                    {"push_and_update_ms", total_ms}});
    std::fprintf(stderr, "step %llu: H2D alone %.1f GB/s, under D2H+AdamW %.1f GB/s (%.3f)\n",
                 static_cast<unsigned long long>(t), alone / 1e9, loaded / 1e9, loaded / alone);
  }
  (*out)["h2d_under_load"] = rows;
  cudaFree(grad);
  plane.reset();
  cudaStreamDestroy(stream);
  cudaStreamDestroy(gstream);
  return c->Detach();
}

absl::Status ModePipeline(const Flags& f, json* out) {
  ASSIGN_OR_RETURN(std::unique_ptr<RankClient> c, Connect(f));
  GpuDataPlane::Options o;
  o.window_slots = f.window_slots;
  o.prefetch_depth = f.window_slots - 1;
  ASSIGN_OR_RETURN(std::unique_ptr<GpuDataPlane> plane, GpuDataPlane::Create(c.get(), o));
  cudaStream_t stream;
  RETURN_IF_CUDA_ERROR(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
  uint16_t* grads[2];
  for (auto& g : grads) {
    ASSIGN_OR_RETURN(g, DeviceGrad(f.layer_params));
  }
  ASSIGN_OR_RETURN(const double cycles_per_ms, SpinCyclesPerMs(stream));
  const uint32_t L = f.layers;
  json rows = json::array();
  uint64_t t = 0;
  for (double fwd : f.fwd_ms) {
    const double bwd = 2 * fwd;
    // The compute alone, same kernels, no data plane.
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    cudaEventRecord(e0, stream);
    for (uint32_t l = 0; l < L; ++l) RETURN_IF_ERROR(Spin(fwd * cycles_per_ms, stream));
    for (uint32_t l = 0; l < L; ++l) RETURN_IF_ERROR(Spin(bwd * cycles_per_ms, stream));
    cudaEventRecord(e1, stream);
    cudaEventSynchronize(e1);
    float compute_ms = 0;
    cudaEventElapsedTime(&compute_ms, e0, e1);
    std::vector<double> step_ms, boundary_ms;
    for (uint32_t s = 0; s < f.steps; ++s) {
      ++t;
      const auto s0 = Clock::now();
      RETURN_IF_ERROR(plane->BeginStep(t, kTimeout));
      std::deque<GpuDataPlane::Slot> ahead;
      // Forward 0..L-1, then backward L-1..0; each visit fetches the layer (prefetched).
      std::vector<uint32_t> order;
      for (uint32_t l = 0; l < L; ++l) order.push_back(l);
      for (uint32_t l = L; l-- > 0;) order.push_back(l);
      size_t next = 0;
      while (next < order.size() && ahead.size() < f.prefetch) {
        ASSIGN_OR_RETURN(GpuDataPlane::Slot sl, plane->Fetch(order[next++], t - 1, kTimeout));
        ahead.push_back(sl);
      }
      for (size_t i = 0; i < order.size(); ++i) {
        const uint32_t l = order[i];
        const bool backward = i >= L;
        const GpuDataPlane::Slot sl = ahead.front();
        ahead.pop_front();
        RETURN_IF_ERROR(plane->WaitSlot(sl, stream));
        if (backward) {
          // The gradient buffer of two layers ago must be free before it is "written".
          if (i >= L + 2) RETURN_IF_ERROR(plane->WaitGradConsumed(order[i - 2], stream));
        }
        RETURN_IF_ERROR(Spin((backward ? bwd : fwd) * cycles_per_ms, stream));
        RETURN_IF_ERROR(plane->ReleaseSlot(sl, stream));
        if (backward) RETURN_IF_ERROR(plane->PushGrad(t, l, grads[i % 2], 2, stream, kTimeout));
        if (next < order.size()) {
          ASSIGN_OR_RETURN(GpuDataPlane::Slot n, plane->Fetch(order[next++], t - 1, kTimeout));
          ahead.push_back(n);
        }
      }
      RETURN_IF_CUDA_ERROR(cudaStreamSynchronize(stream), "sync");
      const auto b0 = Clock::now();
      RETURN_IF_ERROR(plane->WaitPushes(kTimeout));
      RETURN_IF_ERROR(c->WaitStep(t, kTimeout));
      const auto s1 = Clock::now();
      step_ms.push_back(Sec(s1 - s0) * 1e3);
      boundary_ms.push_back(Sec(s1 - b0) * 1e3);
    }
    std::vector<double> rest(step_ms.begin() + 1, step_ms.end());
    std::vector<double> rest_b(boundary_ms.begin() + 1, boundary_ms.end());
    const double med = Median(rest);
    rows.push_back({{"fwd_ms_per_layer", fwd},
                    {"bwd_ms_per_layer", bwd},
                    {"compute_ms", compute_ms},
                    {"step_ms", step_ms},
                    {"median_step_ms", med},
                    {"exposed_ms", med - compute_ms},
                    {"exposed_fraction", (med - compute_ms) / compute_ms},
                    {"boundary_drain_ms", Median(rest_b)}});
    std::fprintf(stderr,
                 "fwd %.1f ms/layer: compute %.1f ms, step %.1f ms, exposed %.1f ms (%.2f%%), "
                 "boundary drain %.1f ms\n",
                 fwd, compute_ms, med, med - compute_ms, 100 * (med - compute_ms) / compute_ms,
                 Median(rest_b));
  }
  (*out)["pipeline"] = rows;
  for (auto* g : grads) cudaFree(g);
  plane.reset();
  cudaStreamDestroy(stream);
  return c->Detach();
}

}  // namespace
}  // namespace slidedp::bench

int main(int argc, char** argv) {
  slidedp::bench::Flags f;
  CLI::App app{"gpu_plane_bench: the GPU data plane against the physical limits"};
  app.add_option("--socket", f.socket, "hostd's unix socket")->required();
  app.add_option("--mode", f.mode, "h2d | d2h_adam | h2d_under_load | pipeline")
      ->capture_default_str();
  app.add_option("--layers", f.layers)->capture_default_str();
  app.add_option("--layer-params", f.layer_params)->capture_default_str();
  app.add_option("--chunk-bytes", f.chunk_bytes, "gradient ring slot")->capture_default_str();
  app.add_option("--h2d-chunk-mib", f.h2d_chunk_mib)->capture_default_str();
  app.add_option("--reps", f.reps)->capture_default_str();
  app.add_option("--steps", f.steps)->capture_default_str();
  app.add_option("--grad-route", f.grad_route)->capture_default_str();
  app.add_option("--fwd-ms", f.fwd_ms, "pipeline: forward ms per layer (backward 2x)")
      ->capture_default_str();
  app.add_option("--window-slots", f.window_slots)->capture_default_str();
  app.add_option("--prefetch", f.prefetch)->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  if (cudaSetDevice(0) != cudaSuccess) {
    std::fprintf(stderr, "gpu_plane_bench: no CUDA device\n");
    return 77;
  }
  nlohmann::json out;
  out["mode"] = f.mode;
  absl::Status s;
  if (f.mode == "h2d") {
    s = slidedp::bench::ModeH2d(f, &out);
  } else if (f.mode == "d2h_adam") {
    s = slidedp::bench::ModeD2hAdam(f, &out);
  } else if (f.mode == "h2d_under_load") {
    s = slidedp::bench::ModeH2dUnderLoad(f, &out);
  } else if (f.mode == "pipeline") {
    s = slidedp::bench::ModePipeline(f, &out);
  } else {
    std::fprintf(stderr, "--mode: '%s', expected h2d, d2h_adam, h2d_under_load or pipeline\n",
                 f.mode.c_str());
    return 2;
  }
  if (!s.ok()) {
    std::fprintf(stderr, "gpu_plane_bench %s: %s\n", f.mode.c_str(), s.ToString().c_str());
    return 1;
  }
  std::fflush(stdout);
  std::printf("\n%s\n", out.dump(1).c_str());
  return 0;
}
