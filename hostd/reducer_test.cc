// The reducer's shard route (reduce-scatter, and the GPU-reduction route as its one-rank case)
// driven through the rings directly: fake ranks on threads fill ChunkSlot headers and the grads
// segment as rankclient would. Every result is compared bit for bit with the per-layer update of
// the full gradient (UpdateWorker::UpdateLayerNow on a second state with the same seed), for 1, 2
// and 3 ranks, layers that do not divide into R * 64, chunks that cut shards unevenly and empty
// shards; buffered and streamed (chunk-granular) alike. Then the failure paths: non-finite
// flags, header violations, and an abort in the middle of a streamed layer (reducer and engine).
#include "hostd/reducer.h"

#include <signal.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <functional>
#include <future>
#include <limits>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/thread_pool.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "hostd/engine.h"
#include "hostd/test_util.h"
#include "kernels/cpu/bf16.h"
#include "proto/doorbell.h"
#include "proto/grad_ring.h"

namespace slidedp::hostd {
namespace {

namespace v1 = slidedp::v1;
using ::testing::HasSubstr;
using Granularity = GradientReducer::Granularity;
using Clock = std::chrono::steady_clock;

constexpr uint64_t kChunkBytes = 4096;  // 1024 FP32 / 2048 BF16 elements per chunk
constexpr auto kTimeout = std::chrono::seconds(10);
// Backward order, as ranks push.
const std::vector<uint32_t> kOrder = {2, 1, 0};

// SmallModel (layers of 9970 and 15000 elements) plus a 50-element layer: with 2 or 3 ranks its
// shards are [0, 50) and empty ones (ShardElems rounds up to 64).
model::LoadedModel ShardModel() {
  model::LoadedModel m = testing::SmallModel();
  auto* l2 = m.manifest.add_layers();
  l2->set_name("tiny");
  l2->set_kind(v1::LAYER_KIND_DECODER);
  auto* t = l2->add_tensors();
  t->set_name("tiny.bias");
  t->add_shape(50);
  t->set_dtype(v1::DTYPE_BF16);
  t->set_no_decay(true);
  return m;
}

v1::OptimizerConfig BaseConfig() {
  v1::OptimizerConfig c;
  c.set_lr(1e-3);
  c.set_weight_decay(0.1);
  c.set_no_decay_norms_and_biases(true);
  c.set_scale_by_world_size(true);
  return *model::NormalizeOptimizerConfig(c);
}

// The aggregated gradient of (step, layer): BF16-representable values, so FP32 and BF16 pushes
// carry the same numbers.
std::vector<float> Gradient(uint64_t step, uint32_t layer, uint64_t n) {
  std::mt19937 rng(static_cast<uint32_t>(1000 * step + layer));
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> g(n);
  for (float& x : g) x = kernels::Bf16ToFp32(kernels::RoundToBf16(d(rng)));
  return g;
}

// The sum of squares exactly as the worker's statistics pass computes it (kStatsBlock blocks
// added in block order).
double WorkerSumSquares(const float* g, uint64_t n) {
  double total = 0;
  for (uint64_t b = 0; b < n; b += kernels::kStatsBlock) {
    const uint64_t len = std::min<uint64_t>(kernels::kStatsBlock, n - b);
    total += kernels::ComputeGradStats(kernels::BestIsa(), g + b, kernels::GradType::kFp32, len)
                 .sum_squares;
  }
  return total;
}

bool WaitUntil(const std::function<bool()>& pred) {
  const auto deadline = Clock::now() + kTimeout;
  while (!pred()) {
    if (Clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  return true;
}

// What a rank sends with its first chunk of a layer.
struct FirstChunk {
  bool stats = true;       // kChunkFlagStats
  bool nonfinite = false;  // kChunkFlagNonFinite
  double sumsq = -1;       // < 0: the plain sum of squares of the rank's part
};

// One rank's side of the push protocol (proto/shm_abi.h), written against the shared structs.
class FakeRank {
 public:
  FakeRank(TrainingState* state, uint32_t rank, kernels::GradType type)
      : state_(state), rank_(rank), type_(type) {}

  void BeginStep() { seq_ = 0; }
  uint64_t seq() const { return seq_; }
  uint64_t chunk_elems() const { return kChunkBytes / kernels::GradTypeBytes(type_); }

  // Pushes one chunk with an arbitrary header; `data` holds its min(numel, chunk_elems())
  // elements.
  absl::Status PushChunk(uint64_t step, uint32_t layer, uint64_t offset, uint64_t numel,
                         const float* data, uint32_t flags, double sumsq) {
    const uint32_t slots = state_->grad_ring_slots();
    const auto slot = static_cast<uint32_t>(seq_ % slots);
    shm::ChunkSlot& cs = state_->chunk_slot(rank_, slot);
    const auto deadline = Clock::now() + kTimeout;
    while (!shm::SlotIsEmpty(cs)) {
      if (Clock::now() > deadline) {
        return absl::DeadlineExceededError(
            absl::StrCat("rank ", rank_, ": slot ", slot, " stayed full (seq ", seq_, ")"));
      }
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    char* dst = static_cast<char*>(state_->grad_slot_data(rank_, slot));
    const uint64_t n = std::min(numel, chunk_elems());
    if (type_ == kernels::GradType::kFp32) {
      std::memcpy(dst, data, n * sizeof(float));
    } else {
      auto* d = reinterpret_cast<uint16_t*>(dst);
      for (uint64_t i = 0; i < n; ++i) d[i] = kernels::RoundToBf16(data[i]);
    }
    shm::ChunkHeader h;
    h.step = step;
    h.seq = seq_;
    h.offset_elements = offset;
    h.numel = numel;
    h.layer = layer;
    h.dtype = static_cast<uint32_t>(type_ == kernels::GradType::kFp32 ? shm::DType::kFp32
                                                                      : shm::DType::kBf16);
    h.flags = flags;
    h.stats_sumsq = sumsq;
    shm::PublishChunk(cs, h);
    shm::Doorbell(&state_->control().doorbell).Ring();
    ++seq_;
    return absl::OkStatus();
  }

  // Pushes elements [begin, end) of the layer's gradient `full` in chunks at absolute offsets,
  // the first `max_chunks` of them (-1: all).
  absl::Status PushRange(uint64_t step, uint32_t layer, uint64_t begin, uint64_t end,
                         const float* full, const FirstChunk& first, int max_chunks = -1) {
    double sumsq = first.sumsq;
    if (sumsq < 0) {
      sumsq = 0;
      for (uint64_t i = begin; i < end; ++i) sumsq += double{full[i]} * full[i];
    }
    int pushed = 0;
    for (uint64_t off = begin; off < end; off += chunk_elems()) {
      if (max_chunks >= 0 && pushed == max_chunks) break;
      uint32_t flags = 0;
      if (off == begin && first.stats) {
        flags = shm::kChunkFlagStats | (first.nonfinite ? shm::kChunkFlagNonFinite : 0u);
      }
      const absl::Status s = PushChunk(step, layer, off, std::min(chunk_elems(), end - off),
                                       full + off, flags, off == begin ? sumsq : 0.0);
      if (!s.ok()) return s;
      ++pushed;
    }
    return absl::OkStatus();
  }

 private:
  TrainingState* const state_;
  const uint32_t rank_;
  const kernels::GradType type_;
  uint64_t seq_ = 0;
};

// A state, its worker and a reducer on the shard route, plus a reference state (same seed, same
// world size) updated whole with UpdateLayerNow.
struct Rig {
  struct Options {
    uint32_t world = 2;
    bool gpu_route = false;  // one pushing rank (0) sends the whole layer
    Granularity granularity = Granularity::kAuto;
    kernels::GradType type = kernels::GradType::kFp32;
    v1::OptimizerConfig cfg = BaseConfig();
  };

  explicit Rig(Options o) : options(std::move(o)) {
    pool = std::move(*ThreadPool::Create({.num_threads = 2}));
    state = MakeState();
    reference = MakeState();
    worker = std::make_unique<UpdateWorker>(
        state.get(), pool.get(), UpdateWorker::Options{kernels::BestIsa(), 8192}, options.cfg);
    reference_worker = std::make_unique<UpdateWorker>(
        reference.get(), pool.get(), UpdateWorker::Options{kernels::BestIsa(), 8192}, options.cfg);
    GradientReducer::Options ro;
    ro.route = GradientReducer::Route::kShards;
    ro.grad_type = options.type;
    ro.granularity = options.granularity;
    for (uint32_t r = 0; r < (options.gpu_route ? 1 : options.world); ++r) {
      ro.pushing_ranks.push_back(r);
    }
    parts = static_cast<uint32_t>(ro.pushing_ranks.size());
    worker->Start();
    reducer = std::make_unique<GradientReducer>(
        state.get(), pool.get(), worker.get(), ro,
        [this](const LayerUpdateResult& r) {
          if (!r.aborted) layers_done++;
        },
        [this](uint64_t step, const std::string& reason) {
          {
            absl::MutexLock l(&mu);
            errors.push_back(reason);
          }
          // What the engine does: abort the step in the reducer and the worker.
          reducer->Abort(step);
          worker->AbortStep(step, [this] { sealed++; });
        });
    reducer->Start();
    for (uint32_t r = 0; r < options.world; ++r) {
      ranks.emplace_back(state.get(), r, options.type);
    }
    for (uint32_t l = 0; l < state->num_layers(); ++l) initial.push_back(state->LayerChecksum(l));
  }
  ~Rig() {
    reducer->Stop();
    worker->Stop();  // runs the queue dry: lent slots come back before the reducer goes
    reducer.reset();
  }

  std::unique_ptr<TrainingState> MakeState() {
    TrainingState::Options so;
    so.instance = testing::UniqueInstance("red");
    so.model = ShardModel();
    so.seed = 11;
    so.world_size = options.world;
    so.mlock = MlockPolicy::kBestEffort;
    so.chunk_bytes = kChunkBytes;
    so.grad_ring_slots = 4;
    so.grad_dtype = options.type == kernels::GradType::kFp32 ? 1 : 2;
    so.grad_route = options.gpu_route ? 2 : 3;
    auto s = TrainingState::Create(so, pool.get());
    EXPECT_TRUE(s.ok()) << s.status();
    (*s)->set_remove_on_destroy(true);
    return std::move(*s);
  }

  uint64_t numel(uint32_t layer) const { return state->layers()[layer].numel; }
  shm::ShardRange Shard(uint32_t layer, uint32_t index) const {
    return shm::ShardOf(numel(layer), parts, index);
  }

  // Runs `steps` steps: each pushing rank on its own thread pushes its shard of every layer in
  // backward order; `first(step, layer, index)` says what its first chunk carries and
  // `mutate(step, layer, g)` may poison the gradient. The reference state gets UpdateLayerNow of
  // the full gradients. Returns false if a step did not complete.
  bool Run(int steps,
           const std::function<FirstChunk(uint64_t, uint32_t, uint32_t)>& first = nullptr,
           const std::function<void(uint64_t, uint32_t, std::vector<float>&)>& mutate = nullptr) {
    for (uint64_t step = 1; step <= static_cast<uint64_t>(steps); ++step) {
      std::vector<std::vector<float>> grads;
      for (uint32_t l = 0; l < state->num_layers(); ++l) {
        grads.push_back(Gradient(step, l, numel(l)));
        if (mutate) mutate(step, l, grads.back());
      }
      reducer->Arm(step);
      std::vector<std::thread> threads;
      for (uint32_t i = 0; i < parts; ++i) {
        threads.emplace_back([&, i] {
          FakeRank& rank = ranks[i];
          rank.BeginStep();
          for (uint32_t l : kOrder) {
            const shm::ShardRange sh = Shard(l, i);
            if (sh.numel == 0) continue;  // an empty shard pushes nothing
            const FirstChunk fc = first ? first(step, l, i) : FirstChunk{};
            const absl::Status s =
                rank.PushRange(step, l, sh.begin, sh.begin + sh.numel, grads[l].data(), fc);
            EXPECT_TRUE(s.ok()) << s;
          }
        });
      }
      for (std::thread& t : threads) t.join();
      const bool done = WaitUntil([&] {
        for (uint32_t l = 0; l < state->num_layers(); ++l) {
          if (state->committed_version(l) < step) return false;
        }
        return true;
      });
      // The done callbacks (which follow the stats) close the step.
      if (!done || !WaitUntil([&] {
            return layers_done.load() == static_cast<int>(step * state->num_layers());
          })) {
        return false;
      }
      for (uint32_t l : kOrder) {
        reference_worker->UpdateLayerNow(
            l, step, {grads[l].data(), kernels::GradType::kFp32, grads[l].size()});
      }
    }
    return true;
  }

  // `skipped`: a layer whose update the reference skipped too (so it is not expected to change).
  void ExpectMatchesReference(int skipped = -1) {
    for (uint32_t l = 0; l < state->num_layers(); ++l) {
      EXPECT_EQ(state->committed_version(l), reference->committed_version(l)) << "layer " << l;
      EXPECT_EQ(state->layer_control(l).pending_version, state->committed_version(l));
      EXPECT_EQ(state->LayerChecksum(l), reference->LayerChecksum(l)) << "layer " << l;
      if (static_cast<int>(l) == skipped) continue;
      EXPECT_NE(state->LayerChecksum(l), initial[l]) << "layer " << l << " was never updated";
    }
  }

  std::vector<std::string> Errors() {
    absl::MutexLock l(&mu);
    return errors;
  }

  Options options;
  uint32_t parts = 0;
  std::unique_ptr<ThreadPool> pool;
  std::unique_ptr<TrainingState> state;
  std::unique_ptr<TrainingState> reference;
  std::unique_ptr<UpdateWorker> worker;
  std::unique_ptr<UpdateWorker> reference_worker;
  std::unique_ptr<GradientReducer> reducer;
  std::vector<FakeRank> ranks;
  std::vector<uint64_t> initial;
  std::atomic<int> layers_done{0};
  std::atomic<int> sealed{0};
  absl::Mutex mu;
  std::vector<std::string> errors ABSL_GUARDED_BY(mu);
};

// Chunks in one step of every layer's shards.
uint64_t ChunksPerStep(const TrainingState& state, uint32_t parts, kernels::GradType type) {
  uint64_t chunks = 0;
  const uint64_t ce = kChunkBytes / kernels::GradTypeBytes(type);
  for (const LayerInfo& l : state.layers()) {
    for (uint32_t i = 0; i < parts; ++i)
      chunks += (shm::ShardOf(l.numel, parts, i).numel + ce - 1) / ce;
  }
  return chunks;
}

uint64_t ChunksOf(const Rig& rig) { return ChunksPerStep(*rig.state, rig.parts, rig.options.type); }

TEST(ShardOfTest, TestLayersHaveUnevenAndEmptyShards) {
  // The premises of the tests below.
  EXPECT_EQ(shm::ShardOf(50, 2, 1).numel, 0u);
  EXPECT_EQ(shm::ShardOf(50, 3, 2).numel, 0u);
  EXPECT_EQ(shm::ShardOf(15000, 3, 2).numel, 15000u - 2 * 5056u);
  EXPECT_NE(9970u % (3 * 64), 0u);
  EXPECT_NE(shm::ShardOf(9970, 3, 1).numel % 1024, 0u);
}

class ShardRouteTest : public ::testing::TestWithParam<std::tuple<uint32_t, kernels::GradType>> {
 protected:
  Rig::Options Opts(Granularity g) {
    Rig::Options o;
    o.world = std::get<0>(GetParam());
    o.type = std::get<1>(GetParam());
    o.granularity = g;
    return o;
  }
};

// (a) Buffered: every rank pushes its shard, hostd places them and updates each layer whole.
TEST_P(ShardRouteTest, BufferedEqualsPerLayerUpdateOfTheFullGradient) {
  Rig rig(Opts(Granularity::kLayer));  // the ranks send stats, but layer granularity wins
  ASSERT_TRUE(rig.Run(3));
  rig.ExpectMatchesReference();
  const GradientReducer::Stats st = rig.reducer->stats();
  EXPECT_EQ(st.layers_buffered, 3u * rig.state->num_layers());
  EXPECT_EQ(st.layers_streamed, 0u);
  EXPECT_EQ(st.chunks_reduced, 3 * ChunksOf(rig));
  EXPECT_EQ(rig.worker->stats().layer_updates_buffered, 3u * rig.state->num_layers());
  EXPECT_EQ(rig.layers_done.load(), 3 * static_cast<int>(rig.state->num_layers()));
  EXPECT_TRUE(rig.Errors().empty());
}

// (b) Streamed: each chunk is updated in place as it arrives; bit-identical to the whole layer.
TEST_P(ShardRouteTest, StreamedEqualsPerLayerUpdateOfTheFullGradient) {
  Rig rig(Opts(Granularity::kAuto));
  ASSERT_TRUE(rig.Run(3));
  rig.ExpectMatchesReference();
  const GradientReducer::Stats st = rig.reducer->stats();
  EXPECT_EQ(st.layers_streamed, 3u * rig.state->num_layers());
  EXPECT_EQ(st.layers_buffered, 0u);
  EXPECT_EQ(st.chunks_streamed, 3 * ChunksOf(rig));
  const UpdateStats ws = rig.worker->stats();
  EXPECT_EQ(ws.layer_updates_streamed, 3u * rig.state->num_layers());
  EXPECT_EQ(ws.layer_updates_buffered, 0u);
  EXPECT_EQ(ws.ranges_streamed, 3 * ChunksOf(rig));
  EXPECT_TRUE(rig.Errors().empty());
}

// A layer streams only if every contributing rank's first chunk carries stats.
TEST_P(ShardRouteTest, FirstChunkWithoutStatsFallsBackToBuffered) {
  Rig rig(Opts(Granularity::kChunk));
  const uint32_t last = rig.parts - 1;
  ASSERT_TRUE(rig.Run(2, [&](uint64_t, uint32_t layer, uint32_t index) {
    FirstChunk fc;
    fc.stats = !(layer == 1 && index == last);
    return fc;
  }));
  rig.ExpectMatchesReference();
  const GradientReducer::Stats st = rig.reducer->stats();
  EXPECT_EQ(st.layers_buffered, 2u);  // layer 1 of each step
  EXPECT_EQ(st.layers_streamed, 2u * (rig.state->num_layers() - 1));
}

// (c) A rank flags its part non-finite: the layer is skipped (state untouched, counted), its
// version still advances, its chunks are still consumed, and the other layers are updated.
TEST_P(ShardRouteTest, NonFiniteFlagSkipsTheLayer) {
  for (Granularity g : {Granularity::kAuto, Granularity::kLayer}) {
    SCOPED_TRACE(g == Granularity::kAuto ? "streamed" : "buffered");
    Rig rig(Opts(g));
    const uint32_t bad = rig.parts - 1;  // the last rank's shard of layer 1 holds the NaN
    const uint64_t at = rig.Shard(1, bad).begin + 5;
    ASSERT_TRUE(rig.Run(
        1,
        [&](uint64_t, uint32_t layer, uint32_t index) {
          FirstChunk fc;
          fc.nonfinite = layer == 1 && index == bad;
          return fc;
        },
        [&](uint64_t, uint32_t layer, std::vector<float>& grad) {
          if (layer == 1) grad[at] = std::numeric_limits<float>::quiet_NaN();
        }));
    rig.ExpectMatchesReference(/*skipped=*/1);               // the reference skipped layer 1 too
    EXPECT_EQ(rig.state->LayerChecksum(1), rig.initial[1]);  // untouched
    EXPECT_EQ(rig.state->committed_version(1), 1u);
    EXPECT_EQ(rig.state->layer_control(1).skipped_steps, 1u);
    EXPECT_EQ(rig.worker->stats().layer_updates_skipped, 1u);
    EXPECT_EQ(rig.worker->stats().layer_updates, rig.state->num_layers() - 1);
  }
}

// (d) Per-layer clipping streamed equals buffered when the sum of squares sent equals the one the
// worker computes; the sent value is what the streamed path uses (a wrong one changes the result).
TEST_P(ShardRouteTest, PerLayerClipStreamedEqualsBuffered) {
  auto run = [&](double sumsq_factor) {
    Rig::Options o = Opts(Granularity::kAuto);
    o.cfg.set_clip(v1::CLIP_POLICY_PER_LAYER);
    o.cfg.set_max_grad_norm(0.5);  // the gradients' norms are ~1e2: clipping is active
    auto rig = std::make_unique<Rig>(o);
    std::vector<std::vector<double>> exact(3);
    for (uint64_t step = 1; step <= 2; ++step) {
      for (uint32_t l = 0; l < rig->state->num_layers(); ++l) {
        const std::vector<float> g = Gradient(step, l, rig->numel(l));
        exact[step].push_back(WorkerSumSquares(g.data(), g.size()));
      }
    }
    // The whole layer's value from the first rank, 0 from the others: the sum is exact.
    EXPECT_TRUE(rig->Run(2, [&](uint64_t step, uint32_t layer, uint32_t index) {
      FirstChunk fc;
      fc.sumsq = index == 0 ? exact[step][layer] * sumsq_factor : 0.0;
      return fc;
    }));
    EXPECT_EQ(rig->reducer->stats().layers_streamed, 2u * rig->state->num_layers());
    return rig;
  };
  auto rig = run(1.0);
  rig->ExpectMatchesReference();
  auto wrong = run(4.0);
  EXPECT_NE(wrong->state->LayerChecksum(1), wrong->reference->LayerChecksum(1));
}

// Overlapping steps: every pushing rank pushes all of step 1 and then, before Arm(2), the first
// chunks of step 2 (layers in push order) until its ring is full, as a rank whose forward of step
// 2 ran ahead. Those chunks wait in the rings -- no error, not discarded; the slot hostd reads next
// holds one of them -- while step 1 is reduced and applied; after Arm(2) they are consumed with
// the rest, and the state equals the per-layer reference. Returns false if a step did not
// complete.
bool RunOverlapped(Rig& rig) {
  const uint32_t layers = rig.state->num_layers();
  const uint32_t slots = rig.state->grad_ring_slots();
  std::vector<std::vector<float>> g1, g2;
  for (uint32_t l = 0; l < layers; ++l) {
    g1.push_back(Gradient(1, l, rig.numel(l)));
    g2.push_back(Gradient(2, l, rig.numel(l)));
  }
  // early[i][l]: chunks of layer l that pushing rank i sends before Arm(2).
  const uint64_t ce = rig.ranks[0].chunk_elems();
  std::vector<std::vector<uint64_t>> early(rig.parts, std::vector<uint64_t>(layers, 0));
  uint64_t early_chunks = 0;
  for (uint32_t i = 0; i < rig.parts; ++i) {
    uint64_t left = slots;
    for (uint32_t l : kOrder) {
      const uint64_t chunks = (rig.Shard(l, i).numel + ce - 1) / ce;
      early[i][l] = std::min(chunks, left);
      left -= early[i][l];
      early_chunks += early[i][l];
    }
  }
  rig.reducer->Arm(1);
  std::vector<std::thread> threads;
  for (uint32_t i = 0; i < rig.parts; ++i) {
    threads.emplace_back([&, i] {
      FakeRank& rank = rig.ranks[i];
      rank.BeginStep();
      for (uint32_t l : kOrder) {
        const shm::ShardRange sh = rig.Shard(l, i);
        if (sh.numel == 0) continue;
        EXPECT_TRUE(rank.PushRange(1, l, sh.begin, sh.begin + sh.numel, g1[l].data(), {}).ok());
      }
      rank.BeginStep();
      for (uint32_t l : kOrder) {
        const shm::ShardRange sh = rig.Shard(l, i);
        if (early[i][l] == 0) continue;
        EXPECT_TRUE(rank.PushRange(2, l, sh.begin, sh.begin + sh.numel, g2[l].data(), {},
                                   static_cast<int>(early[i][l]))
                        .ok());
      }
    });
  }
  for (std::thread& t : threads) t.join();
  auto step_done = [&](uint64_t step) {
    return WaitUntil([&] {
      for (uint32_t l = 0; l < layers; ++l) {
        if (rig.state->committed_version(l) < step) return false;
      }
      return rig.layers_done.load() == static_cast<int>(step * layers);
    });
  };
  if (!step_done(1)) return false;
  std::this_thread::sleep_for(std::chrono::milliseconds(50));  // time to misread them
  EXPECT_TRUE(rig.Errors().empty());
  uint64_t waiting = 0;
  for (uint32_t r = 0; r < rig.options.world; ++r) {
    for (uint32_t s = 0; s < slots; ++s) {
      const shm::ChunkSlot& cs = rig.state->chunk_slot(r, s);
      if (shm::Atomic(cs.state).load() == shm::kSlotFull) {
        EXPECT_EQ(cs.step, 2u) << "rank " << r << " slot " << s;
        waiting++;
      }
    }
  }
  EXPECT_EQ(waiting, early_chunks);
  EXPECT_EQ(rig.state->committed_version(2), 1u);
  for (uint32_t l : kOrder) {
    rig.reference_worker->UpdateLayerNow(l, 1,
                                         {g1[l].data(), kernels::GradType::kFp32, g1[l].size()});
  }

  rig.reducer->Arm(2);
  threads.clear();
  for (uint32_t i = 0; i < rig.parts; ++i) {
    threads.emplace_back([&, i] {
      FakeRank& rank = rig.ranks[i];
      for (uint32_t l : kOrder) {
        const shm::ShardRange sh = rig.Shard(l, i);
        const uint64_t from = sh.begin + early[i][l] * ce;
        if (from >= sh.begin + sh.numel) continue;
        FirstChunk rest;
        rest.stats = early[i][l] == 0;  // the stats went with the layer's first chunk
        EXPECT_TRUE(rank.PushRange(2, l, from, sh.begin + sh.numel, g2[l].data(), rest).ok());
      }
    });
  }
  for (std::thread& t : threads) t.join();
  if (!step_done(2)) return false;
  for (uint32_t l : kOrder) {
    rig.reference_worker->UpdateLayerNow(l, 2,
                                         {g2[l].data(), kernels::GradType::kFp32, g2[l].size()});
  }
  EXPECT_TRUE(rig.Errors().empty());
  EXPECT_EQ(rig.reducer->stats().chunks_reduced, 2 * ChunksOf(rig));
  return true;
}

TEST_P(ShardRouteTest, NextStepChunksWaitForArm) {
  for (Granularity g : {Granularity::kAuto, Granularity::kLayer}) {
    SCOPED_TRACE(g == Granularity::kAuto ? "streamed" : "buffered");
    Rig rig(Opts(g));
    ASSERT_TRUE(RunOverlapped(rig));
    rig.ExpectMatchesReference();
  }
}

INSTANTIATE_TEST_SUITE_P(
    Ranks, ShardRouteTest,
    ::testing::Combine(::testing::Values(1u, 2u, 3u),
                       ::testing::Values(kernels::GradType::kFp32, kernels::GradType::kBf16)),
    [](const auto& info) {
      return absl::StrCat("R", std::get<0>(info.param),
                          std::get<1>(info.param) == kernels::GradType::kFp32 ? "Fp32" : "Bf16");
    });

// (b) The GPU-reduction route: one rank pushes the whole aggregated gradient; streamed and
// buffered both equal the per-layer update (world size 2: the gradient is scaled by 1/2).
TEST(GpuRouteTest, StreamedAndBufferedEqualPerLayerUpdate) {
  for (Granularity g : {Granularity::kAuto, Granularity::kLayer}) {
    Rig::Options o;
    o.world = 2;
    o.gpu_route = true;
    o.granularity = g;
    Rig rig(o);
    ASSERT_TRUE(rig.Run(2));
    rig.ExpectMatchesReference();
    const GradientReducer::Stats st = rig.reducer->stats();
    const uint64_t layers = 2u * rig.state->num_layers();
    EXPECT_EQ(st.layers_streamed, g == Granularity::kAuto ? layers : 0u);
    EXPECT_EQ(st.layers_buffered, g == Granularity::kAuto ? 0u : layers);
  }
}

// SetRoute (hostd's grad_route auto, when the first rank attaches): a reducer made for
// reduce-scatter over two ranks, switched to GPU reduction (rank 0 pushes every layer whole),
// completes steps on that route alone -- on the old route it would wait for rank 1's shards.
// Bad pushing ranks are refused naming the field, and the reducer keeps working.
TEST(GpuRouteTest, SetRouteBetweenStepsTakesEffect) {
  Rig::Options o;
  o.world = 2;
  Rig rig(o);
  ASSERT_EQ(rig.parts, 2u);
  absl::Status none = rig.reducer->SetRoute(GradientReducer::Route::kShards, {});
  EXPECT_EQ(none.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(none.message()), HasSubstr("pushing_ranks"));
  absl::Status beyond = rig.reducer->SetRoute(GradientReducer::Route::kShards, {0, 5});
  EXPECT_EQ(beyond.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(beyond.message()), HasSubstr("pushing_ranks: rank 5 of world size 2"));
  ASSERT_TRUE(rig.reducer->SetRoute(GradientReducer::Route::kShards, {0}).ok());
  rig.parts = 1;
  ASSERT_TRUE(rig.Run(2));
  rig.ExpectMatchesReference();
  EXPECT_TRUE(rig.Errors().empty());
}

// The same overlap on the GPU-reduction route (one pushing rank of two).
TEST(GpuRouteTest, NextStepChunksWaitForArm) {
  for (Granularity g : {Granularity::kAuto, Granularity::kLayer}) {
    SCOPED_TRACE(g == Granularity::kAuto ? "streamed" : "buffered");
    Rig::Options o;
    o.world = 2;
    o.gpu_route = true;
    o.granularity = g;
    Rig rig(o);
    ASSERT_TRUE(RunOverlapped(rig));
    rig.ExpectMatchesReference();
  }
}

// Global clipping needs every layer before any update: the reducer falls back to whole layers
// even though the ranks send stats. (Only two layers are pushed: the worker holds the buffered
// layers of a globally clipped step until the last one, and the reducer has two buffers.)
TEST(GpuRouteTest, GlobalClipFallsBackToBuffered) {
  Rig::Options o;
  o.gpu_route = true;
  o.cfg.set_clip(v1::CLIP_POLICY_GLOBAL);
  o.cfg.set_max_grad_norm(0.5);
  Rig rig(o);
  rig.reducer->Arm(1);
  rig.ranks[0].BeginStep();
  // Every layer: the worker holds each layer's gradient until the last one arrives (the global
  // norm), so the reducer needs a buffer per layer, not two.
  for (uint32_t l : {2u, 1u, 0u}) {
    const std::vector<float> g = Gradient(1, l, rig.numel(l));
    ASSERT_TRUE(rig.ranks[0].PushRange(1, l, 0, g.size(), g.data(), {}).ok());
  }
  ASSERT_TRUE(WaitUntil([&] { return rig.reducer->stats().layers_buffered == 3; }));
  ASSERT_TRUE(WaitUntil([&] { return rig.worker->stats().layer_updates == 3; }));
  EXPECT_EQ(rig.reducer->stats().layers_streamed, 0u);
  EXPECT_EQ(rig.worker->stats().ranges_streamed, 0u);
  EXPECT_TRUE(rig.Errors().empty());
}

// (e) Header violations abort the step with a message naming the rank, the field, what it got
// and what was expected; nothing is published and every slot is emptied.
TEST(ShardRouteErrorTest, HeaderViolationsAbortNamingTheRank) {
  struct Case {
    std::string name;
    // Pushes through rank 1 after rank 0 has pushed its first chunk of layer 1.
    std::function<absl::Status(FakeRank&, const float*, uint64_t shard_begin)> push;
    std::vector<std::string> needles;
  };
  const std::vector<Case> cases = {
      {"wrong offset",
       [](FakeRank& r, const float* g, uint64_t b) {
         return r.PushChunk(1, 1, b + 1024, 1024, g + b + 1024, shm::kChunkFlagStats, 1.0);
       },
       {"rank 1", "offset_elements: got 8576, expected 7552", "[7552, 15000)"}},
      {"wrong layer",
       [](FakeRank& r, const float* g, uint64_t) {
         return r.PushChunk(1, 0, 4992, 1024, g, shm::kChunkFlagStats, 1.0);
       },
       {"rank 1", "layer: got 0, expected 1"}},
      {"oversize numel",
       [](FakeRank& r, const float* g, uint64_t b) {
         return r.PushChunk(1, 1, b, 1025, g + b, shm::kChunkFlagStats, 1.0);
       },
       {"rank 1", "numel: got 1025, expected 1024", "at most 1024"}},
      // (Step 2, the next one, would wait in the ring for Arm(2): see NextStepChunksWaitForArm.)
      {"wrong step",
       [](FakeRank& r, const float* g, uint64_t b) {
         return r.PushChunk(3, 1, b, 1024, g + b, shm::kChunkFlagStats, 1.0);
       },
       {"rank 1", "(step 3, seq 0)", "(step 1, seq 0) was expected"}},
      {"nan sumsq without the flag",
       [](FakeRank& r, const float* g, uint64_t b) {
         return r.PushChunk(1, 1, b, 1024, g + b, shm::kChunkFlagStats, std::nan(""));
       },
       {"rank 1", "stats_sumsq: got nan"}},
  };
  for (const Case& c : cases) {
    for (Granularity g : {Granularity::kAuto, Granularity::kLayer}) {
      if (c.name == "nan sumsq without the flag" && g == Granularity::kLayer) continue;
      SCOPED_TRACE(c.name + (g == Granularity::kAuto ? " (streamed)" : " (buffered)"));
      Rig::Options o;
      o.world = 2;
      o.granularity = g;
      Rig rig(o);
      const std::vector<float> grad = Gradient(1, 1, rig.numel(1));
      rig.reducer->Arm(1);
      rig.ranks[0].BeginStep();
      rig.ranks[1].BeginStep();
      ASSERT_EQ(rig.Shard(1, 1).begin, 7552u);
      ASSERT_TRUE(rig.ranks[0].PushRange(1, 1, 0, 7552, grad.data(), {}, /*max_chunks=*/1).ok());
      ASSERT_TRUE(c.push(rig.ranks[1], grad.data(), rig.Shard(1, 1).begin).ok());
      ASSERT_TRUE(WaitUntil([&] { return !rig.Errors().empty(); }));
      ASSERT_TRUE(WaitUntil([&] { return rig.sealed.load() == 1; }));
      const std::string msg = rig.Errors()[0];
      for (const std::string& n : c.needles) EXPECT_THAT(msg, HasSubstr(n));
      EXPECT_EQ(rig.state->LayerChecksum(1), rig.initial[1]);  // nothing of it was updated
      EXPECT_TRUE(rig.worker->TornLayers().empty());
      for (uint32_t r = 0; r < 2; ++r) {
        for (uint32_t s = 0; s < rig.state->grad_ring_slots(); ++s) {
          EXPECT_EQ(shm::Atomic(rig.state->chunk_slot(r, s).state).load(), shm::kSlotEmpty);
        }
      }
    }
  }
}

// A rank that pushes beyond its (complete) shard is caught too.
TEST(ShardRouteErrorTest, ChunkBeyondACompleteShardAborts) {
  Rig::Options o;
  o.world = 2;
  o.granularity = Granularity::kLayer;
  Rig rig(o);
  const std::vector<float> grad = Gradient(1, 2, rig.numel(2));
  rig.reducer->Arm(1);
  rig.ranks[0].BeginStep();
  // Layer 2 has 50 elements: rank 0's shard is all of it, in one chunk; then a second one.
  ASSERT_TRUE(rig.ranks[0].PushRange(1, 2, 0, 50, grad.data(), {}).ok());
  const std::vector<float> extra(64, 1.0f);
  ASSERT_TRUE(rig.ranks[0].PushChunk(1, 2, 50, 10, extra.data(), 0, 0).ok());
  ASSERT_TRUE(WaitUntil([&] { return !rig.Errors().empty(); }));
  EXPECT_THAT(rig.Errors()[0], HasSubstr("rank 0"));
  EXPECT_THAT(rig.Errors()[0], HasSubstr("layer 2"));
}

// (f) An abort after part of a streamed layer was written: the layer is torn, never published
// (pending_version != committed_version) and reported; the untouched layers are sealed.
TEST(ShardRouteAbortTest, AbortMidStreamedLayerTearsIt) {
  Rig::Options o;
  o.world = 2;
  Rig rig(o);
  const std::vector<float> grad = Gradient(1, 1, rig.numel(1));
  rig.reducer->Arm(1);
  rig.ranks[0].BeginStep();
  rig.ranks[1].BeginStep();
  ASSERT_TRUE(rig.ranks[0].PushRange(1, 1, 0, 7552, grad.data(), {}, /*max_chunks=*/2).ok());
  ASSERT_TRUE(rig.ranks[1].PushRange(1, 1, 7552, 15000, grad.data(), {}, /*max_chunks=*/1).ok());
  ASSERT_TRUE(WaitUntil([&] { return rig.worker->stats().ranges_streamed == 3; }));
  rig.reducer->Abort(1);
  std::promise<void> sealed;
  rig.worker->AbortStep(1, [&] { sealed.set_value(); });
  sealed.get_future().wait();
  EXPECT_EQ(rig.worker->TornLayers(), std::vector<uint32_t>{1});
  EXPECT_NE(rig.state->LayerChecksum(1), rig.initial[1]);
  EXPECT_EQ(rig.state->committed_version(1), 0u);
  EXPECT_EQ(rig.state->layer_control(1).pending_version, 1u);
  for (uint32_t l : {0u, 2u}) {
    EXPECT_EQ(rig.state->committed_version(l), 1u) << l;
    EXPECT_EQ(rig.state->LayerChecksum(l), rig.initial[l]) << l;
  }
  // Every lent slot came back and was emptied.
  ASSERT_TRUE(WaitUntil([&] {
    for (uint32_t r = 0; r < 2; ++r) {
      for (uint32_t s = 0; s < rig.state->grad_ring_slots(); ++s) {
        if (shm::Atomic(rig.state->chunk_slot(r, s).state).load() != shm::kSlotEmpty) return false;
      }
    }
    return true;
  }));
}

// (f) at the engine: a job on the reduce-scatter route streams its layers; an abort in the middle
// of a streamed layer makes BeginStep (and SubmitGradient) fail with FAILED_PRECONDITION naming
// the torn layer and asking for a checkpoint restore.
TEST(EngineShardRouteTest, StreamedStepsThenAbortMidLayerRefusesFurtherSteps) {
  HostdConfig c;
  c.instance = testing::UniqueInstance("rseng");
  c.socket = "/nonexistent/unused.sock";  // the engine alone; no server is started
  c.model = "none";
  c.update_threads = 2;
  c.mlock = "best_effort";
  auto created = Engine::Create(c);
  ASSERT_TRUE(created.ok()) << created.status();
  std::unique_ptr<Engine> engine = std::move(*created);
  v1::CreateJobRequest cj;
  *cj.mutable_spec()->mutable_manifest() = ShardModel().manifest;
  cj.mutable_spec()->set_world_size(2);
  cj.mutable_spec()->set_seed(11);
  cj.mutable_spec()->mutable_optimizer()->set_lr(1e-3);
  cj.mutable_spec()->mutable_optimizer()->set_grad_dtype(v1::DTYPE_FP32);
  cj.mutable_spec()->mutable_routes()->set_grad_route(v1::GRAD_ROUTE_REDUCE_SCATTER);
  cj.mutable_spec()->mutable_routes()->set_chunk_bytes(kChunkBytes);
  ASSERT_TRUE(engine->CreateJob(cj).ok());
  TrainingState* state = engine->state();
  std::string tokens[2];
  for (uint32_t r = 0; r < 2; ++r) {
    v1::AttachRankRequest a;
    a.set_rank(r);
    a.set_manifest_hash(model::ManifestHashHex(model::ManifestHash(ShardModel().manifest)));
    a.set_pid(getpid());
    auto attached = engine->AttachRank(a);
    ASSERT_TRUE(attached.ok()) << attached.status();
    EXPECT_EQ(attached->layout().grad_route(), v1::GRAD_ROUTE_REDUCE_SCATTER);
    tokens[r] = attached->attach_token();
  }
  auto begin = [&](uint32_t rank, uint64_t step) {
    v1::BeginStepRequest b;
    b.set_rank(rank);
    b.set_step(step);
    b.set_attach_token(tokens[rank]);
    return engine->BeginStep(b).status();
  };
  std::vector<FakeRank> ranks;
  for (uint32_t r = 0; r < 2; ++r) ranks.emplace_back(state, r, kernels::GradType::kFp32);

  // Step 1: complete, streamed, every rank pushing its shard.
  for (uint32_t r = 0; r < 2; ++r) ASSERT_TRUE(begin(r, 1).ok());
  std::vector<std::thread> threads;
  for (uint32_t r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      ranks[r].BeginStep();
      for (uint32_t l : kOrder) {
        const std::vector<float> g = Gradient(1, l, state->layers()[l].numel);
        const shm::ShardRange sh = shm::ShardOf(g.size(), 2, r);
        if (sh.numel == 0) continue;
        EXPECT_TRUE(ranks[r].PushRange(1, l, sh.begin, sh.begin + sh.numel, g.data(), {}).ok());
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (uint32_t l = 0; l < state->num_layers(); ++l) {
    ASSERT_TRUE(engine->WaitLayerVersion(l, 1, kTimeout).ok());
  }
  ASSERT_TRUE(WaitUntil(
      [&] { return engine->worker()->stats().layer_updates_streamed == state->num_layers(); }));
  EXPECT_EQ(engine->reducer()->stats().layers_streamed, state->num_layers());

  // Step 2: layer 2 complete, layer 1 half written, then the abort.
  for (uint32_t r = 0; r < 2; ++r) ASSERT_TRUE(begin(r, 2).ok());
  const std::vector<float> g2 = Gradient(2, 2, 50);
  const std::vector<float> g1 = Gradient(2, 1, 15000);
  ranks[0].BeginStep();
  ranks[1].BeginStep();
  ASSERT_TRUE(ranks[0].PushRange(2, 2, 0, 50, g2.data(), {}).ok());
  ASSERT_TRUE(ranks[0].PushRange(2, 1, 0, 7552, g1.data(), {}, /*max_chunks=*/1).ok());
  ASSERT_TRUE(ranks[1].PushRange(2, 1, 7552, 15000, g1.data(), {}, /*max_chunks=*/1).ok());
  ASSERT_TRUE(engine->WaitLayerVersion(2, 2, kTimeout).ok());
  ASSERT_TRUE(WaitUntil([&] {
    return engine->worker()->stats().ranges_streamed ==
           ChunksPerStep(*state, 2, kernels::GradType::kFp32) + 3;
  }));
  v1::AbortStepRequest ab;
  ab.set_step(2);
  ab.set_reason("test: abort mid-layer");
  ASSERT_TRUE(engine->AbortStep(ab).ok());

  const absl::Status refused = begin(0, 3);
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
  EXPECT_THAT(std::string(refused.message()), HasSubstr("torn"));
  EXPECT_THAT(std::string(refused.message()), HasSubstr("layer 1 'block1'"));
  EXPECT_THAT(std::string(refused.message()), HasSubstr("committed_version 1, pending_version 2"));
  EXPECT_THAT(std::string(refused.message()), HasSubstr("checkpoint"));
  EXPECT_EQ(state->committed_version(1), 1u);
  EXPECT_EQ(state->layer_control(1).pending_version, 2u);
  EXPECT_EQ(state->committed_version(0), 2u);  // untouched, sealed at the aborted step
  EXPECT_EQ(state->committed_version(2), 2u);  // completed before the abort
  auto status = engine->GetStatus();
  ASSERT_TRUE(status.ok());
  EXPECT_EQ(status->job().step_state(), "torn");
  std::vector<float> whole(state->layers()[0].numel);
  EXPECT_EQ(
      engine->SubmitGradient(0, 3, {whole.data(), kernels::GradType::kFp32, whole.size()}).code(),
      absl::StatusCode::kFailedPrecondition);
  engine->Shutdown(/*remove_state=*/true).IgnoreError();
}

// (g) A rank owns its ChunkSlot headers and may rewrite one at any moment, also between two reads
// of hostd. FieldFlip makes that moment deterministic without a hook in hostd: it rewrites a
// header field in shared memory right after this process's N-th access to it. The page holding
// the field is made inaccessible; each access to the page faults, the SIGSEGV handler opens the
// page and single-steps the faulting instruction (the x86 trap flag), and the SIGTRAP handler
// counts the access if it touched the field (any access of up to 16 bytes that covers it),
// writes the new value after the N-th, and closes the page again. x86-64 Linux only.
// (Not under ThreadSanitizer, whose signal handling and shadow memory it would race with.)
#if defined(__SANITIZE_THREAD__)
#define SLIDEDP_UNDER_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define SLIDEDP_UNDER_TSAN 1
#endif
#endif
#if defined(__x86_64__) && defined(__linux__) && !defined(SLIDEDP_UNDER_TSAN)
#define SLIDEDP_FIELD_FLIP 1
#endif

#ifdef SLIDEDP_FIELD_FLIP
// FieldFlip's state: the signal handlers reach it without locks.
struct FieldFlipState {
  std::atomic<char*> page{nullptr};
  uintptr_t page_bytes = 4096;
  char* field = nullptr;
  size_t size = 0;
  uint64_t value = 0;
  int after = 0;
  std::atomic<int> count{0};
  std::atomic<bool> flipped{false};
  std::atomic<bool> armed{false};
  std::atomic<int> in_flight{0};  // threads between their fault and their trap
  struct sigaction old_segv {};
};
FieldFlipState g_flip;
thread_local char* t_flip_fault_addr = nullptr;  // the access this thread single-steps

class FieldFlip {
 public:
  // From now on, accesses to the `size`-byte field at `field` are counted; right after access
  // number `after` (1-based; 0: now) the field holds `value`. False when the page cannot be
  // protected.
  static bool Arm(void* field, size_t size, uint64_t value, int after) {
    static bool installed = [] {
      struct sigaction sa {};
      sa.sa_sigaction = OnSegv;
      sa.sa_flags = SA_SIGINFO;
      sigemptyset(&sa.sa_mask);
      sigaction(SIGSEGV, &sa, &g_flip.old_segv);
      sa.sa_sigaction = OnTrap;
      sigaction(SIGTRAP, &sa, nullptr);
      return true;
    }();
    (void)installed;
    const auto page_bytes = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
    char* f = static_cast<char*>(field);
    g_flip.field = f;
    g_flip.size = size;
    g_flip.value = value;
    g_flip.after = after;
    g_flip.count = 0;
    g_flip.flipped = false;
    g_flip.page_bytes = page_bytes;
    if (after == 0) {
      std::memcpy(f, &value, size);
      g_flip.flipped = true;
    }
    char* page = reinterpret_cast<char*>(reinterpret_cast<uintptr_t>(f) & ~(page_bytes - 1));
    g_flip.page.store(page);
    g_flip.armed.store(true);
    if (mprotect(page, page_bytes, PROT_NONE) != 0) {
      g_flip.armed.store(false);
      g_flip.page.store(nullptr);
      return false;
    }
    return true;
  }
  // Stops counting and opens the page for good.
  static void Disarm() {
    g_flip.armed.store(false);
    // A thread between its fault and its trap may still close the page: wait for it.
    while (g_flip.in_flight.load() != 0) std::this_thread::yield();
    mprotect(g_flip.page.load(), g_flip.page_bytes, PROT_READ | PROT_WRITE);
    g_flip.page.store(nullptr);
  }
  static int accesses() { return g_flip.count.load(); }
  static bool flipped() { return g_flip.flipped.load(); }

 private:
  static constexpr greg_t kTrapFlag = 0x100;

  static void OnSegv(int, siginfo_t* si, void* ctx) {
    char* addr = static_cast<char*>(si->si_addr);
    char* page = g_flip.page.load();
    if (page == nullptr || addr < page || addr >= page + g_flip.page_bytes) {
      // Not the watched page (e.g. hostd overflowing a buffer): the previous handler, or the
      // default action, gets the fault when the instruction runs again.
      sigaction(SIGSEGV, &g_flip.old_segv, nullptr);
      return;
    }
    g_flip.in_flight.fetch_add(1);
    mprotect(page, g_flip.page_bytes, PROT_READ | PROT_WRITE);
    t_flip_fault_addr = addr;
    static_cast<ucontext_t*>(ctx)->uc_mcontext.gregs[REG_EFL] |= kTrapFlag;
  }
  static void OnTrap(int, siginfo_t*, void* ctx) {
    if (t_flip_fault_addr == nullptr) {  // not a step of ours
      signal(SIGTRAP, SIG_DFL);
      raise(SIGTRAP);
      return;
    }
    static_cast<ucontext_t*>(ctx)->uc_mcontext.gregs[REG_EFL] &= ~kTrapFlag;
    char* addr = t_flip_fault_addr;
    t_flip_fault_addr = nullptr;
    if (g_flip.armed.load() && addr + 16 > g_flip.field && addr < g_flip.field + g_flip.size) {
      if (g_flip.count.fetch_add(1) + 1 == g_flip.after) {
        std::memcpy(g_flip.field, &g_flip.value, g_flip.size);
        g_flip.flipped.store(true);
      }
    }
    if (g_flip.armed.load()) mprotect(g_flip.page.load(), g_flip.page_bytes, PROT_NONE);
    g_flip.in_flight.fetch_sub(1);
  }
};
#endif  // SLIDEDP_FIELD_FLIP

// One layer of 3000 elements, FP32 chunks of 1024: on the sum route each of 2 ranks pushes 3
// chunks (the last one of 952 elements), on the shard route each pushes its shard of 1536 or
// 1464 elements in 2 chunks, on the GPU route one rank pushes 3. Every chunk of the step fits
// the 4-slot rings, so the whole step is pushed first; then the reducer runs on the test thread
// (PollOnce) and the worker starts only afterwards: while a field is watched nothing else
// touches shared memory.
struct FlipRig {
  enum class Route { kSum, kShards, kGpu };
  static constexpr uint64_t kNumel = 3000;
  static constexpr uint64_t kStep = 1;

  FlipRig(Route r, Granularity g) : route(r) {
    static ThreadPool* shared_pool = ThreadPool::Create({.num_threads = 1}).value().release();
    world = route == Route::kGpu ? 1 : 2;
    TrainingState::Options so;
    so.instance = testing::UniqueInstance("flip");
    auto* l = so.model.manifest.add_layers();
    so.model.manifest.set_family("test");
    so.model.manifest.set_name("flip");
    l->set_name("block0");
    l->set_kind(v1::LAYER_KIND_DECODER);
    auto* t = l->add_tensors();
    t->set_name("block0.weight");
    t->add_shape(kNumel);
    t->set_dtype(v1::DTYPE_BF16);
    so.seed = 5;
    so.world_size = world;
    so.mlock = MlockPolicy::kOff;
    so.chunk_bytes = kChunkBytes;
    so.grad_ring_slots = 4;
    so.grad_dtype = 1;
    so.grad_route = route == Route::kSum ? 1 : route == Route::kGpu ? 2 : 3;
    auto created = TrainingState::Create(so, shared_pool);
    EXPECT_TRUE(created.ok()) << created.status();
    state = std::move(*created);
    state->set_remove_on_destroy(true);
    worker = std::make_unique<UpdateWorker>(
        state.get(), shared_pool, UpdateWorker::Options{kernels::BestIsa(), 8192}, BaseConfig());
    GradientReducer::Options ro;
    ro.route =
        route == Route::kSum ? GradientReducer::Route::kSum : GradientReducer::Route::kShards;
    ro.grad_type = kernels::GradType::kFp32;
    ro.granularity = g;
    for (uint32_t i = 0; i < world; ++i) ro.pushing_ranks.push_back(i);
    reducer =
        std::make_unique<GradientReducer>(state.get(), nullptr, worker.get(), ro, nullptr,
                                          [this](uint64_t step, const std::string& reason) {
                                            errors.push_back(reason);
                                            reducer->Abort(step);
                                            worker->AbortStep(step, [this] { sealed = true; });
                                          });
    for (uint32_t i = 0; i < world; ++i)
      ranks.emplace_back(state.get(), i, kernels::GradType::kFp32);
    initial = state->LayerChecksum(0);
  }
  ~FlipRig() {
    worker->Stop();
    reducer.reset();
  }

  void PushStep() {
    reducer->Arm(kStep);
    for (uint32_t i = 0; i < world; ++i) {
      ranks[i].BeginStep();
      const std::vector<float> g = Gradient(kStep, route == Route::kSum ? 10 + i : 0, kNumel);
      const shm::ShardRange sh =
          route == Route::kShards ? shm::ShardOf(kNumel, world, i) : shm::ShardRange{0, kNumel};
      ASSERT_TRUE(ranks[i].PushRange(kStep, 0, sh.begin, sh.begin + sh.numel, g.data(), {}).ok());
    }
  }
  static uint32_t ChunksOfRank(Route route, uint32_t i) {
    const uint64_t n = route == Route::kShards ? shm::ShardOf(kNumel, 2, i).numel : kNumel;
    return static_cast<uint32_t>((n + 1023) / 1024);
  }
  void Poll() {
    for (int idle = 0; idle < 3;) idle = reducer->PollOnce() ? 0 : idle + 1;
  }
  // Starts the worker and waits for the step to end: published, or aborted and sealed.
  bool Finish() {
    worker->Start();
    return WaitUntil([&] {
      Poll();  // lent slots come back as the worker writes them
      return state->committed_version(0) == kStep || (!errors.empty() && sealed.load());
    });
  }

  Route route;
  uint32_t world = 2;
  std::unique_ptr<TrainingState> state;
  std::unique_ptr<UpdateWorker> worker;
  std::unique_ptr<GradientReducer> reducer;
  std::vector<FakeRank> ranks;
  std::vector<std::string> errors;  // on the polling thread only
  std::atomic<bool> sealed{false};
  uint64_t initial = 0;
};

// Every header field the reducer uses for a length, a destination or an index (offset_elements,
// numel, layer) of every chunk of every route is rewritten to a value that breaks the layer,
// before the reducer reads it and right after each of its accesses to it in turn. Whatever the
// moment, hostd either refuses the chunk (a protocol error, the step aborted, the layer not
// updated or torn) or uses the header it validated: the step completes with exactly the result
// of the unchanged run. A reducer that reads a field again after validating it updates the
// layer with misplaced data, or writes past its gradient buffer (a crash).
struct FlipRoute {
  const char* name;
  FlipRig::Route route;
  Granularity granularity;
};
class ChunkHeaderRaceTest : public ::testing::TestWithParam<FlipRoute> {};

TEST_P(ChunkHeaderRaceTest, HeaderRewrittenBetweenReadsIsRefusedOrIgnored) {
#ifndef SLIDEDP_FIELD_FLIP
  GTEST_SKIP() << "FieldFlip needs x86-64 Linux without TSan";
#else
  struct Field {
    const char* name;
    size_t offset;
    size_t size;
    std::vector<uint64_t> bad;
  };
  const std::vector<Field> fields = {
      {"offset_elements", offsetof(shm::ChunkSlot, offset_elements), 8, {1, uint64_t{1} << 40}},
      {"numel", offsetof(shm::ChunkSlot, numel), 8, {1536, FlipRig::kNumel, uint64_t{1} << 40}},
      {"layer", offsetof(shm::ChunkSlot, layer), 4, {1, 0x7fffffff}},
  };
  const FlipRoute& rc = GetParam();
  int scenarios = 0, refused = 0, ignored = 0;
  {
    // The unchanged step's result.
    uint64_t expected = 0;
    {
      FlipRig rig(rc.route, rc.granularity);
      rig.PushStep();
      rig.Poll();
      ASSERT_TRUE(rig.Finish());
      ASSERT_TRUE(rig.errors.empty()) << rig.errors[0];
      expected = rig.state->LayerChecksum(0);
      ASSERT_NE(expected, rig.initial);
    }
    for (uint32_t rank = 0; rank < (rc.route == FlipRig::Route::kGpu ? 1u : 2u); ++rank) {
      for (uint32_t seq = 0; seq < FlipRig::ChunksOfRank(rc.route, rank); ++seq) {
        for (const Field& f : fields) {
          // How often the reducer touches the field of this chunk in an unchanged run.
          int accesses = 0;
          {
            FlipRig rig(rc.route, rc.granularity);
            rig.PushStep();
            char* field = reinterpret_cast<char*>(&rig.state->chunk_slot(rank, seq)) + f.offset;
            ASSERT_TRUE(FieldFlip::Arm(field, f.size, 0, std::numeric_limits<int>::max()));
            rig.Poll();
            FieldFlip::Disarm();
            accesses = FieldFlip::accesses();
            ASSERT_TRUE(rig.Finish());
            ASSERT_TRUE(rig.errors.empty()) << rig.errors[0];
            ASSERT_EQ(rig.state->LayerChecksum(0), expected);
          }
          ASSERT_GE(accesses, 1) << f.name << " of rank " << rank << " chunk " << seq;
          for (uint64_t bad : f.bad) {
            for (int after = 0; after <= accesses; ++after) {
              SCOPED_TRACE(absl::StrCat(f.name, " of rank ", rank, " chunk ", seq, " set to ", bad,
                                        " after access ", after, " of ", accesses));
              FlipRig rig(rc.route, rc.granularity);
              rig.PushStep();
              char* field = reinterpret_cast<char*>(&rig.state->chunk_slot(rank, seq)) + f.offset;
              ASSERT_TRUE(FieldFlip::Arm(field, f.size, bad, after));
              rig.Poll();
              FieldFlip::Disarm();
              ASSERT_TRUE(FieldFlip::flipped());
              ASSERT_TRUE(rig.Finish());
              ++scenarios;
              if (rig.errors.empty()) {
                ++ignored;
                EXPECT_EQ(rig.state->committed_version(0), FlipRig::kStep);
                EXPECT_EQ(rig.state->LayerChecksum(0), expected) << "a rewritten header was used";
              } else {
                // The abort seals the layer untouched; a streamed layer may have had validated
                // chunks written before the refused one: then it is torn, never published.
                ++refused;
                if (rc.granularity == Granularity::kLayer || rig.worker->TornLayers().empty()) {
                  EXPECT_EQ(rig.state->LayerChecksum(0), rig.initial);
                } else {
                  EXPECT_NE(rig.state->layer_control(0).pending_version,
                            rig.state->committed_version(0));
                }
              }
            }
          }
        }
      }
    }
  }
  // Both outcomes occur: a rewrite before the reducer's read is refused, one after it ignored.
  EXPECT_GT(refused, 0);
  EXPECT_GT(ignored, 0);
  std::printf("%s: %d rewrites: %d refused, %d ignored\n", rc.name, scenarios, refused, ignored);
#endif
}

INSTANTIATE_TEST_SUITE_P(
    Routes, ChunkHeaderRaceTest,
    ::testing::Values(FlipRoute{"Sum", FlipRig::Route::kSum, Granularity::kLayer},
                      FlipRoute{"ShardsBuffered", FlipRig::Route::kShards, Granularity::kLayer},
                      FlipRoute{"ShardsStreamed", FlipRig::Route::kShards, Granularity::kAuto},
                      FlipRoute{"GpuStreamed", FlipRig::Route::kGpu, Granularity::kAuto}),
    [](const auto& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace slidedp::hostd
