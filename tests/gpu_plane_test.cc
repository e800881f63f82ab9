// The GPU data plane against a real hostd engine in process (its gRPC service on a temporary
// unix socket, its shared-memory segments): parameter routes deliver byte-identical layers into
// the GPU window, and every gradient route leaves hostd's state bit-identical to the same
// gradients pushed from host memory. One GPU: R = 1 (NCCL's routes run on a one-rank
// communicator; R > 1 on one GPU is the CPU-reduction route, covered by tests/gpu_trainer_test.py).
#include "rankclient/gpu_plane.h"

#include <cuda_runtime_api.h>
#include <grpcpp/grpcpp.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <map>
#include <random>
#include <thread>
#include <tuple>

#include "gtest/gtest.h"
#include "hostd/engine.h"
#include "hostd/service.h"
#include "hostd/test_util.h"
#include "kernels/cpu/bf16.h"

namespace slidedp::rankclient {
namespace {

namespace v1 = slidedp::v1;
using hostd::testing::UniqueInstance;
using std::chrono::milliseconds;
constexpr milliseconds kTimeout(60000);

#define ASSERT_OK(expr)                          \
  do {                                           \
    const absl::Status _s = (expr);              \
    ASSERT_TRUE(_s.ok()) << #expr << ": " << _s; \
  } while (0)
#define ASSERT_CUDA(expr) ASSERT_EQ((expr), cudaSuccess) << #expr

struct Hostd {
  std::filesystem::path dir;
  hostd::HostdConfig config;
  std::unique_ptr<hostd::Engine> engine;
  std::unique_ptr<hostd::ControlServer> server;

  ~Hostd() {
    server.reset();
    if (engine) engine->Shutdown(/*remove_state=*/true).IgnoreError();
    engine.reset();
    std::filesystem::remove_all(dir);
  }
  std::string Hash() const { return engine->state()->model().manifest.manifest_hash(); }
};

std::unique_ptr<Hostd> StartHostd(v1::GradRoute route, uint64_t chunk_bytes) {
  auto h = std::make_unique<Hostd>();
  h->dir = std::filesystem::temp_directory_path() / UniqueInstance("gpu");
  std::filesystem::create_directories(h->dir);
  h->config.instance = UniqueInstance("gpl");
  h->config.socket = (h->dir / "hostd.sock").string();
  h->config.model = "tiny";
  h->config.seed = 7;
  h->config.update_threads = 2;
  h->config.mlock = "best_effort";
  h->config.optimizer.set_lr(1e-3);
  h->config.optimizer.set_grad_dtype(v1::DTYPE_FP32);
  h->config.routes.set_grad_route(route);
  h->config.routes.set_chunk_bytes(chunk_bytes);
  auto e = hostd::Engine::Create(h->config);
  EXPECT_TRUE(e.ok()) << e.status();
  if (!e.ok()) return nullptr;
  h->engine = std::move(*e);
  auto s = hostd::ControlServer::Start(h->engine.get(), {h->config.socket, "", 0600});
  EXPECT_TRUE(s.ok()) << s.status();
  if (!s.ok()) return nullptr;
  h->server = std::move(*s);
  return h;
}

std::unique_ptr<RankClient> AttachRank(const Hostd& h) {
  RankClient::Options o;
  o.socket = h.config.socket;
  o.rank = 0;
  o.gpu = 0;
  o.manifest_hash = h.Hash();
  auto c = RankClient::Attach(o);
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? std::move(*c) : nullptr;
}

// A deterministic FP32 gradient for (layer, step): the same in every run.
std::vector<float> Gradient(uint32_t layer, uint64_t step, uint64_t numel) {
  std::mt19937_64 rng(layer * 1000003ull + step);
  std::normal_distribution<float> d(0.0f, 1e-2f);
  std::vector<float> g(numel);
  for (float& x : g) x = d(rng);
  return g;
}

class GpuPlaneTest : public ::testing::TestWithParam<int> {};

// Every layer through the window: the bytes in the slot equal hostd's BF16 parameters. Small
// H2D chunks (4 KiB) so each layer is cut into many copies; window of 2 slots, prefetch 1.
TEST(GpuPlane, ParameterRoutesDeliverByteIdenticalLayers) {
  for (v1::ParamRoute route : {v1::PARAM_ROUTE_REPLICATED, v1::PARAM_ROUTE_SHARDED}) {
    SCOPED_TRACE(v1::ParamRoute_Name(route));
    auto h = StartHostd(v1::GRAD_ROUTE_CPU_REDUCTION, 1 << 20);
    ASSERT_NE(h, nullptr);
    auto client = AttachRank(*h);
    ASSERT_NE(client, nullptr);
    GpuDataPlane::Options o;
    o.window_slots = 2;
    o.prefetch_depth = 1;
    o.h2d_chunk_bytes = 4096;
    o.param_route = route;
    auto plane = GpuDataPlane::Create(client.get(), o);
    ASSERT_TRUE(plane.ok()) << plane.status();
    cudaStream_t stream;
    ASSERT_CUDA(cudaStreamCreate(&stream));
    ASSERT_OK((*plane)->BeginStep(1, kTimeout));
    float* dgrad = nullptr;
    uint64_t max_numel = 0;
    for (uint32_t l = 0; l < client->num_layers(); ++l) {
      max_numel = std::max(max_numel, client->layer_numel(l));
    }
    ASSERT_CUDA(cudaMalloc(&dgrad, max_numel * 4));
    ASSERT_CUDA(cudaMemset(dgrad, 0, max_numel * 4));
    for (uint32_t l = 0; l < client->num_layers(); ++l) {
      const uint64_t n = client->layer_numel(l);
      auto slot = (*plane)->Fetch(l, 0, kTimeout);
      ASSERT_TRUE(slot.ok()) << slot.status();
      ASSERT_EQ(slot->numel, n);
      std::vector<uint16_t> got(n, 0xFFFF);
      ASSERT_OK((*plane)->WaitSlot(*slot, stream));
      ASSERT_CUDA(cudaMemcpyAsync(got.data(), slot->data, n * 2, cudaMemcpyDeviceToHost, stream));
      ASSERT_OK((*plane)->ReleaseSlot(*slot, stream));
      ASSERT_CUDA(cudaStreamSynchronize(stream));
      ASSERT_EQ(std::memcmp(got.data(), client->LayerParams(l), n * 2), 0) << "layer " << l;
    }
    // Finish the step (zero gradients) so hostd's state stays consistent.
    for (uint32_t l = client->num_layers(); l-- > 0;) {
      ASSERT_OK((*plane)->PushGrad(1, l, dgrad, 1, stream, kTimeout));
    }
    ASSERT_OK((*plane)->WaitPushes(kTimeout));
    ASSERT_OK(client->WaitStep(1, kTimeout));
    const GpuDataPlane::Stats st = (*plane)->stats();
    EXPECT_EQ(st.layers_fetched, client->num_layers());
    EXPECT_GT(st.d2h_bytes, 0u);
    plane->reset();
    cudaFree(dgrad);
    cudaStreamDestroy(stream);
  }
}

// A window with room for every layer: the backward's second fetch of a layer (recompute) takes
// the slot that still holds it, with no copy; a fetch of a newer version copies again.
TEST(GpuPlane, FreeSlotStillHoldingTheLayerIsReusedWithoutACopy) {
  auto h = StartHostd(v1::GRAD_ROUTE_CPU_REDUCTION, 1 << 20);
  ASSERT_NE(h, nullptr);
  auto client = AttachRank(*h);
  ASSERT_NE(client, nullptr);
  const uint32_t layers = client->num_layers();
  GpuDataPlane::Options o;
  o.window_slots = layers + 1;
  o.prefetch_depth = 1;
  auto plane = GpuDataPlane::Create(client.get(), o);
  ASSERT_TRUE(plane.ok()) << plane.status();
  cudaStream_t stream;
  ASSERT_CUDA(cudaStreamCreate(&stream));
  ASSERT_OK((*plane)->BeginStep(1, kTimeout));
  auto fetch_check = [&](uint32_t l, uint64_t version) {
    auto slot = (*plane)->Fetch(l, version, kTimeout);
    ASSERT_TRUE(slot.ok()) << slot.status();
    const uint64_t n = client->layer_numel(l);
    std::vector<uint16_t> got(n, 0xFFFF);
    ASSERT_OK((*plane)->WaitSlot(*slot, stream));
    ASSERT_CUDA(cudaMemcpyAsync(got.data(), slot->data, n * 2, cudaMemcpyDeviceToHost, stream));
    ASSERT_OK((*plane)->ReleaseSlot(*slot, stream));
    ASSERT_CUDA(cudaStreamSynchronize(stream));
    ASSERT_EQ(std::memcmp(got.data(), client->LayerParams(l), n * 2), 0) << "layer " << l;
  };
  for (uint32_t l = 0; l < layers; ++l) fetch_check(l, 0);
  const GpuDataPlane::Stats fwd = (*plane)->stats();
  for (uint32_t l = layers; l-- > 0;) fetch_check(l, 0);
  const GpuDataPlane::Stats bwd = (*plane)->stats();
  EXPECT_EQ(bwd.h2d_bytes, fwd.h2d_bytes);
  EXPECT_EQ(bwd.window_hits, layers);
  std::vector<float*> grads(layers, nullptr);
  for (uint32_t l = layers; l-- > 0;) {
    const std::vector<float> g = Gradient(l, 1, client->layer_numel(l));
    ASSERT_CUDA(cudaMalloc(&grads[l], g.size() * 4));
    ASSERT_CUDA(cudaMemcpy(grads[l], g.data(), g.size() * 4, cudaMemcpyHostToDevice));
    ASSERT_OK((*plane)->PushGrad(1, l, grads[l], 1, stream, kTimeout));
  }
  ASSERT_OK((*plane)->WaitPushes(kTimeout));
  ASSERT_OK(client->WaitStep(1, kTimeout));
  ASSERT_OK((*plane)->BeginStep(2, kTimeout));
  for (uint32_t l = 0; l < layers; ++l) fetch_check(l, 1);  // version 1: copied again
  EXPECT_GT((*plane)->stats().h2d_bytes, bwd.h2d_bytes);
  EXPECT_EQ((*plane)->stats().window_hits, layers);
  plane->reset();
  for (float* g : grads) cudaFree(g);
  cudaStreamDestroy(stream);
}

// A schedule (forward 0..L-1, then backward L-1..0) through a window of 3 slots with 2 layers
// fetched ahead: every slot handed out holds its layer's bytes; a schedule that holds every slot
// without releasing is refused; prefetch_depth must leave a slot free.
TEST(GpuPlane, ScheduleKeepsLayersAheadAndDeliversThem) {
  auto h = StartHostd(v1::GRAD_ROUTE_CPU_REDUCTION, 1 << 20);
  ASSERT_NE(h, nullptr);
  auto client = AttachRank(*h);
  ASSERT_NE(client, nullptr);
  GpuDataPlane::Options bad;
  bad.window_slots = 2;
  bad.prefetch_depth = 2;
  EXPECT_EQ(GpuDataPlane::Create(client.get(), bad).status().code(),
            absl::StatusCode::kInvalidArgument);
  GpuDataPlane::Options o;
  o.window_slots = 3;
  o.prefetch_depth = 2;
  o.h2d_chunk_bytes = 8192;
  auto plane = GpuDataPlane::Create(client.get(), o);
  ASSERT_TRUE(plane.ok()) << plane.status();
  cudaStream_t stream;
  ASSERT_CUDA(cudaStreamCreate(&stream));
  ASSERT_OK((*plane)->BeginStep(1, kTimeout));
  const uint32_t layers = client->num_layers();
  std::vector<uint32_t> order;
  for (uint32_t l = 0; l < layers; ++l) order.push_back(l);
  for (uint32_t l = layers; l-- > 0;) order.push_back(l);
  EXPECT_EQ((*plane)->BeginSchedule({layers}, 0).code(), absl::StatusCode::kInvalidArgument);
  ASSERT_OK((*plane)->BeginSchedule(order, 0));
  for (size_t i = 0; i < order.size(); ++i) {
    auto slot = (*plane)->Next(kTimeout);
    ASSERT_TRUE(slot.ok()) << i << ": " << slot.status();
    ASSERT_EQ(slot->layer, order[i]);
    // Two more layers are in flight behind this one (fewer at the end); at the forward/backward
    // turn the last layer is still in a free slot and is taken without a copy (a window hit).
    const GpuDataPlane::Stats st = (*plane)->stats();
    EXPECT_EQ(st.layers_fetched + st.window_hits, std::min(order.size(), i + 3)) << i;
    const uint64_t n = slot->numel;
    std::vector<uint16_t> got(n, 0xFFFF);
    ASSERT_OK((*plane)->WaitSlot(*slot, stream));
    ASSERT_CUDA(cudaMemcpyAsync(got.data(), slot->data, n * 2, cudaMemcpyDeviceToHost, stream));
    ASSERT_OK((*plane)->ReleaseSlot(*slot, stream));
    ASSERT_CUDA(cudaStreamSynchronize(stream));
    ASSERT_EQ(std::memcmp(got.data(), client->LayerParams(order[i]), n * 2), 0) << i;
  }
  EXPECT_EQ((*plane)->Next(kTimeout).status().code(), absl::StatusCode::kOutOfRange);
  // Holding every slot: the schedule cannot go on.
  ASSERT_OK((*plane)->BeginSchedule(order, 0));
  std::vector<GpuDataPlane::Slot> held;
  absl::Status refused;
  for (int i = 0; i < 5 && refused.ok(); ++i) {
    auto slot = (*plane)->Next(kTimeout);
    if (slot.ok()) {
      held.push_back(*slot);
    } else {
      refused = slot.status();
    }
  }
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
  EXPECT_EQ(held.size(), 3u);
  for (const auto& s : held) ASSERT_OK((*plane)->ReleaseSlot(s, stream));
  ASSERT_CUDA(cudaStreamSynchronize(stream));
  plane->reset();
  cudaStreamDestroy(stream);
}

// Bad input through the plane gets the specific code and a message naming the field, and leaves
// hostd's state untouched.
TEST(GpuPlane, BadInputGetsSpecificCodesAndLeavesStateUntouched) {
  auto h = StartHostd(v1::GRAD_ROUTE_CPU_REDUCTION, 1 << 20);
  ASSERT_NE(h, nullptr);
  auto client = AttachRank(*h);
  ASSERT_NE(client, nullptr);
  const uint64_t before = h->engine->state()->Checksum();
  auto code_of = [](const GpuDataPlane::Options& o, RankClient* c) {
    return GpuDataPlane::Create(c, o).status();
  };
  GpuDataPlane::Options o;
  o.window_slots = 0;
  absl::Status s = code_of(o, client.get());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("window_slots"), std::string::npos) << s;
  o = {};
  o.h2d_chunk_bytes = 100;
  s = code_of(o, client.get());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("h2d_chunk_bytes"), std::string::npos) << s;
  o = {};
  o.device = 99;
  s = code_of(o, client.get());
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("cudaSetDevice(99)"), std::string::npos) << s;
  EXPECT_EQ(GpuDataPlane::Create(nullptr, {}).status().code(), absl::StatusCode::kInvalidArgument);

  auto plane = GpuDataPlane::Create(client.get(), {});
  ASSERT_TRUE(plane.ok()) << plane.status();
  GpuDataPlane& p = **plane;
  cudaStream_t stream;
  ASSERT_CUDA(cudaStreamCreate(&stream));
  float* grad = nullptr;
  const uint64_t n = client->layer_numel(0);
  ASSERT_CUDA(cudaMalloc(&grad, n * 4));
  // Before the step: nothing can be fetched or pushed.
  EXPECT_EQ(p.Fetch(0, 0, kTimeout).status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(p.PushGrad(1, 0, grad, 1, stream, kTimeout).code(), absl::StatusCode::kOutOfRange);
  ASSERT_OK(p.BeginStep(1, kTimeout));
  const uint32_t layers = client->num_layers();
  s = p.Fetch(layers, 0, kTimeout).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_NE(s.message().find("layer"), std::string::npos) << s;
  EXPECT_EQ(p.Fetch(0, 1, kTimeout).status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(p.ReleaseSlot(GpuDataPlane::Slot{1, 0, 0, nullptr, 0}, stream).code(),
            absl::StatusCode::kFailedPrecondition);
  s = p.PushGrad(1, 0, grad, 3, stream, kTimeout);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("dtype"), std::string::npos) << s;
  s = p.PushGrad(1, 0, nullptr, 1, stream, kTimeout);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("grad"), std::string::npos) << s;
  EXPECT_EQ(p.PushGrad(1, layers, grad, 1, stream, kTimeout).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(p.PushGrad(2, 0, grad, 1, stream, kTimeout).code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(p.WaitGradConsumed(layers, stream).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(p.BeginSchedule({0, layers}, 0).code(), absl::StatusCode::kInvalidArgument);
  // None of it touched hostd's state.
  EXPECT_EQ(h->engine->state()->Checksum(), before);
  // A layer pushed twice in one step: ALREADY_EXISTS.
  ASSERT_CUDA(cudaMemset(grad, 0, n * 4));
  ASSERT_OK(p.PushGrad(1, 0, grad, 1, stream, kTimeout));
  EXPECT_EQ(p.PushGrad(1, 0, grad, 1, stream, kTimeout).code(), absl::StatusCode::kAlreadyExists);
  ASSERT_OK(p.WaitPushes(kTimeout));
  plane->reset();
  cudaFree(grad);
  cudaStreamDestroy(stream);
}

// Runs `steps` steps pushing Gradient(l, t) and returns hostd's state checksum. via_gpu: the
// plane from device memory (as FP32, or as BF16 when bf16_input; the job's dtype is FP32, so the
// plane widens on the GPU); else RankClient::PushGrad from host memory (BF16-rounded values
// when bf16_input, so both runs see the same numbers).
uint64_t Train(v1::GradRoute route, bool via_gpu, bool bf16_input, uint64_t chunk_bytes,
               uint64_t* streamed_hint) {
  auto h = StartHostd(route, chunk_bytes);
  if (h == nullptr) return 0;
  auto client = AttachRank(*h);
  if (client == nullptr) return 0;
  std::unique_ptr<GpuDataPlane> plane;
  cudaStream_t stream = nullptr;
  if (via_gpu) {
    GpuDataPlane::Options o;
    o.window_slots = 2;
    o.prefetch_depth = 1;
    auto p = GpuDataPlane::Create(client.get(), o);
    EXPECT_TRUE(p.ok()) << p.status();
    if (!p.ok()) return 0;
    plane = std::move(*p);
    EXPECT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  }
  const uint32_t layers = client->num_layers();
  std::vector<void*> dev(layers, nullptr);
  for (uint64_t t = 1; t <= 3; ++t) {
    absl::Status s = via_gpu ? plane->BeginStep(t, kTimeout) : client->BeginStep(t, kTimeout);
    EXPECT_TRUE(s.ok()) << s;
    for (uint32_t l = layers; l-- > 0;) {
      const uint64_t n = client->layer_numel(l);
      std::vector<float> g = Gradient(l, t, n);
      std::vector<uint16_t> gb(n);
      if (bf16_input) {
        for (uint64_t i = 0; i < n; ++i) {
          gb[i] = kernels::RoundToBf16(g[i]);
          g[i] = kernels::Bf16ToFp32(gb[i]);
        }
      }
      if (via_gpu) {
        if (dev[l] == nullptr) {
          EXPECT_EQ(cudaMalloc(&dev[l], n * 4), cudaSuccess);
        }
        EXPECT_TRUE(plane->WaitGradConsumed(l, stream).ok());
        const void* src = bf16_input ? static_cast<const void*>(gb.data()) : g.data();
        EXPECT_EQ(
            cudaMemcpyAsync(dev[l], src, n * (bf16_input ? 2 : 4), cudaMemcpyHostToDevice, stream),
            cudaSuccess);
        EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
        s = plane->PushGrad(t, l, dev[l], bf16_input ? 2 : 1, stream, kTimeout);
      } else {
        s = client->PushGrad(t, l, g.data(), 1, n * 4, kTimeout);
      }
      EXPECT_TRUE(s.ok()) << s;
    }
    if (via_gpu) {
      s = plane->WaitPushes(kTimeout);
      EXPECT_TRUE(s.ok()) << s;
    }
    s = client->WaitStep(t, kTimeout);
    EXPECT_TRUE(s.ok()) << s;
  }
  if (plane != nullptr) *streamed_hint = plane->stats().chunks_pushed;
  plane.reset();
  for (void* p : dev) cudaFree(p);
  if (stream != nullptr) cudaStreamDestroy(stream);
  return h->engine->state()->Checksum();
}

// Every gradient route, FP32 and BF16 input, with chunks that cut layers unevenly: hostd's
// state after 3 steps is bit-identical to host pushes of the same gradients.
TEST(GpuPlane, GradientRoutesMatchHostPushes) {
  uint64_t unused = 0;
  const uint64_t chunk = 64 << 10;
  const uint64_t ref = Train(v1::GRAD_ROUTE_CPU_REDUCTION, false, false, chunk, &unused);
  const uint64_t ref_bf16 = Train(v1::GRAD_ROUTE_CPU_REDUCTION, false, true, chunk, &unused);
  ASSERT_NE(ref, 0u);
  ASSERT_NE(ref, ref_bf16);
  for (v1::GradRoute route : {v1::GRAD_ROUTE_CPU_REDUCTION, v1::GRAD_ROUTE_GPU_REDUCTION,
                              v1::GRAD_ROUTE_REDUCE_SCATTER}) {
    for (bool bf16 : {false, true}) {
      SCOPED_TRACE(absl::StrCat(v1::GradRoute_Name(route), bf16 ? " bf16 input" : " fp32 input"));
      uint64_t chunks = 0;
      const uint64_t got = Train(route, true, bf16, chunk, &chunks);
      EXPECT_EQ(got, bf16 ? ref_bf16 : ref);
      EXPECT_GT(chunks, 7u * 3u);  // several chunks per layer went through the rings
    }
  }
}

// Push order. Step 1 runs with layers 0..4 submitted in process, layer 5 pushed through the plane
// behind a blocked stream (so the copier holds step 1's chunk in flight and cannot start step 2)
// and layer 6 held back (so step 1 stays open and hostd keeps step 2's chunks in the ring).
// BeginStep(2) returns at once; pushes of layers 3, 2, 1 of step 2 queue up; once the stream runs
// the ring shows the copier's order: lowest layer first on kAuto (world size 1 on the CPU route,
// the GPU-reduction route), call order on kFifo. Then step 1 completes and step 2 finishes.
class PushOrderTest
    : public ::testing::TestWithParam<std::tuple<v1::GradRoute, GpuDataPlane::Options::PushOrder>> {
};

TEST_P(PushOrderTest, CopierTakesTheLowestLayerFirstUnlessFifo) {
  const auto [route, order] = GetParam();
  auto h = StartHostd(route, 1 << 20);  // one chunk per layer
  ASSERT_NE(h, nullptr);
  auto client = AttachRank(*h);
  ASSERT_NE(client, nullptr);
  hostd::Engine& e = *h->engine;
  hostd::TrainingState* st = e.state();
  const uint32_t layers = client->num_layers();
  ASSERT_EQ(layers, 7u);
  GpuDataPlane::Options o;
  o.window_slots = 2;
  o.prefetch_depth = 1;
  o.staging_buffers = 8;
  o.push_order = order;
  auto created = GpuDataPlane::Create(client.get(), o);
  ASSERT_TRUE(created.ok()) << created.status();
  GpuDataPlane& plane = **created;
  cudaStream_t stream;
  ASSERT_CUDA(cudaStreamCreate(&stream));
  std::vector<void*> dev(layers, nullptr);
  for (uint32_t l = 0; l < layers; ++l) {
    const uint64_t n = client->layer_numel(l);
    ASSERT_LE(n * 4, client->chunk_bytes());
    ASSERT_CUDA(cudaMalloc(&dev[l], n * 4));
    const std::vector<float> g = Gradient(l, 2, n);
    ASSERT_CUDA(cudaMemcpy(dev[l], g.data(), n * 4, cudaMemcpyHostToDevice));
  }
  auto submit = [&](uint32_t l, uint64_t step) {
    const std::vector<float> g = Gradient(l, step, client->layer_numel(l));
    ASSERT_OK(e.SubmitGradient(l, step, {g.data(), kernels::GradType::kFp32, g.size()}));
    ASSERT_OK(e.WaitLayerVersion(l, step, kTimeout));
  };

  ASSERT_OK(plane.BeginStep(1, kTimeout));
  for (uint32_t l = 0; l <= 4; ++l) submit(l, 1);
  std::atomic<bool> go{false};
  ASSERT_CUDA(cudaLaunchHostFunc(
      stream,
      [](void* flag) {
        while (!static_cast<std::atomic<bool>*>(flag)->load()) {
          std::this_thread::sleep_for(std::chrono::milliseconds(1));
        }
      },
      &go));
  ASSERT_OK(plane.PushGrad(1, 5, dev[5], 1, stream, kTimeout));
  ASSERT_OK(plane.BeginStep(2, kTimeout));
  for (uint32_t l : {3u, 2u, 1u}) ASSERT_OK(plane.PushGrad(2, l, dev[l], 1, stream, kTimeout));
  go = true;

  // Step 1's layer 5 arrives; step 2's three chunks wait in the ring in the copier's order.
  ASSERT_OK(client->WaitLayer(5, 1, kTimeout));
  std::map<uint64_t, uint32_t> ring;  // seq -> layer
  const auto deadline = std::chrono::steady_clock::now() + kTimeout;
  while (ring.size() < 3 && std::chrono::steady_clock::now() < deadline) {
    ring.clear();
    for (uint32_t s = 0; s < st->grad_ring_slots(); ++s) {
      const shm::ChunkSlot& cs = st->chunk_slot(0, s);
      if (shm::Atomic(cs.state).load() == shm::kSlotFull && cs.step == 2) ring[cs.seq] = cs.layer;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  std::vector<uint32_t> got;
  for (const auto& [seq, layer] : ring) got.push_back(layer);
  const std::vector<uint32_t> want = order == GpuDataPlane::Options::PushOrder::kFifo
                                         ? std::vector<uint32_t>{3, 2, 1}
                                         : std::vector<uint32_t>{1, 2, 3};
  EXPECT_EQ(got, want);

  // Step 1 completes; step 2 takes its waiting chunks and finishes.
  submit(6, 1);
  for (uint32_t l : {6u, 5u, 4u, 0u}) ASSERT_OK(plane.PushGrad(2, l, dev[l], 1, stream, kTimeout));
  ASSERT_OK(plane.WaitPushes(kTimeout));
  ASSERT_OK(client->WaitStep(2, kTimeout));
  auto stats = e.GetStats(v1::GetStatsRequest());
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->steps_aborted(), 0u);
  created->reset();
  for (void* p : dev) cudaFree(p);
  cudaStreamDestroy(stream);
}

INSTANTIATE_TEST_SUITE_P(
    Orders, PushOrderTest,
    ::testing::Values(
        std::make_tuple(v1::GRAD_ROUTE_CPU_REDUCTION, GpuDataPlane::Options::PushOrder::kAuto),
        std::make_tuple(v1::GRAD_ROUTE_GPU_REDUCTION, GpuDataPlane::Options::PushOrder::kAuto),
        std::make_tuple(v1::GRAD_ROUTE_CPU_REDUCTION, GpuDataPlane::Options::PushOrder::kFifo)),
    [](const auto& info) {
      return absl::StrCat(
          v1::GradRoute_Name(std::get<0>(info.param)),
          std::get<1>(info.param) == GpuDataPlane::Options::PushOrder::kFifo ? "_Fifo" : "_Auto");
    });

// The CPU queues backward far ahead of the GPU: a lower layer whose gradient is still being
// computed must not hold the ring while a finished gradient waits (hostd would sit idle).
TEST(PushOrderTest, FinishedGradientsGoBeforeUnfinishedLowerLayers) {
  auto h = StartHostd(v1::GRAD_ROUTE_CPU_REDUCTION, 1 << 20);  // one chunk per layer
  ASSERT_NE(h, nullptr);
  auto client = AttachRank(*h);
  ASSERT_NE(client, nullptr);
  hostd::TrainingState* st = h->engine->state();
  const uint32_t layers = client->num_layers();
  GpuDataPlane::Options o;
  o.window_slots = 2;
  o.prefetch_depth = 1;
  o.staging_buffers = 8;
  o.push_order = GpuDataPlane::Options::PushOrder::kAuto;
  auto created = GpuDataPlane::Create(client.get(), o);
  ASSERT_TRUE(created.ok()) << created.status();
  GpuDataPlane& plane = **created;
  cudaStream_t slow, fast;
  ASSERT_CUDA(cudaStreamCreate(&slow));
  ASSERT_CUDA(cudaStreamCreate(&fast));
  std::vector<void*> dev(layers, nullptr);
  for (uint32_t l = 0; l < layers; ++l) {
    const uint64_t n = client->layer_numel(l);
    ASSERT_CUDA(cudaMalloc(&dev[l], n * 4));
    const std::vector<float> g = Gradient(l, 1, n);
    ASSERT_CUDA(cudaMemcpy(dev[l], g.data(), n * 4, cudaMemcpyHostToDevice));
  }
  ASSERT_OK(plane.BeginStep(1, kTimeout));
  std::atomic<bool> go{false};
  ASSERT_CUDA(cudaLaunchHostFunc(
      slow,
      [](void* flag) {
        while (!static_cast<std::atomic<bool>*>(flag)->load()) {
          std::this_thread::sleep_for(std::chrono::milliseconds(1));
        }
      },
      &go));
  ASSERT_OK(plane.PushGrad(1, 1, dev[1], 1, slow, kTimeout));  // still being computed
  ASSERT_OK(plane.PushGrad(1, 3, dev[3], 1, fast, kTimeout));  // finished
  const absl::Status got3 = client->WaitLayer(3, 1, std::chrono::seconds(10));
  EXPECT_TRUE(got3.ok()) << "layer 3 waited behind unfinished layer 1: " << got3;
  EXPECT_EQ(st->committed_version(1), 0u);
  go = true;
  for (uint32_t l = 0; l < layers; ++l) {
    if (l == 1 || l == 3) continue;
    ASSERT_OK(plane.PushGrad(1, l, dev[l], 1, fast, kTimeout));
  }
  ASSERT_OK(plane.WaitPushes(kTimeout));
  ASSERT_OK(client->WaitStep(1, kTimeout));
  EXPECT_EQ(st->committed_version(1), 1u);
  created->reset();
  for (void* p : dev) cudaFree(p);
  cudaStreamDestroy(slow);
  cudaStreamDestroy(fast);
}

}  // namespace
}  // namespace slidedp::rankclient
