#include "hostd/optimizer.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <future>
#include <limits>
#include <numbers>
#include <random>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "common/thread_pool.h"
#include "gtest/gtest.h"
#include "hostd/test_util.h"
#include "kernels/cpu/bf16.h"

namespace slidedp::hostd {
namespace {

using testing::SmallModel;
using testing::UniqueInstance;
namespace v1 = slidedp::v1;

v1::OptimizerConfig BaseConfig() {
  v1::OptimizerConfig c;
  c.set_lr(1e-3);
  c.set_beta1(0.9);
  c.set_beta2(0.999);
  c.set_eps(1e-8);
  c.set_weight_decay(0.1);
  c.set_no_decay_norms_and_biases(true);
  c.set_scale_by_world_size(true);
  return *model::NormalizeOptimizerConfig(c);
}

struct Fixture {
  std::unique_ptr<ThreadPool> pool;
  std::unique_ptr<TrainingState> state;
  std::unique_ptr<UpdateWorker> worker;
};

Fixture Make(int threads, v1::OptimizerConfig cfg, uint32_t world_size = 1,
             uint64_t chunk_elements = 8192) {
  Fixture f;
  f.pool = std::move(*ThreadPool::Create({.num_threads = threads}));
  TrainingState::Options o;
  o.instance = UniqueInstance("opt");
  o.model = SmallModel();
  o.seed = 3;
  o.world_size = world_size;
  f.state = std::move(*TrainingState::Create(o, f.pool.get()));
  f.state->set_remove_on_destroy(true);
  f.worker = std::make_unique<UpdateWorker>(
      f.state.get(), f.pool.get(), UpdateWorker::Options{kernels::BestIsa(), chunk_elements}, cfg);
  return f;
}

std::vector<uint16_t> RandomBf16(uint64_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<uint16_t> g(n);
  for (auto& x : g) x = kernels::RoundToBf16(d(rng));
  return g;
}

// The expected state after one update of `layer`, computed tensor by tensor with the scalar
// reference kernel and the scalars the worker should have used.
struct Expected {
  std::vector<float> master, m, v;
  std::vector<uint16_t> params;
};
Expected Reference(const TrainingState& s, uint32_t layer, const std::vector<uint16_t>& g,
                   const v1::OptimizerConfig& cfg, uint64_t step, double grad_scale) {
  const LayerInfo& info = s.layers()[layer];
  Expected e;
  e.master.assign(s.master(layer), s.master(layer) + info.numel);
  e.m.assign(s.exp_avg(layer), s.exp_avg(layer) + info.numel);
  e.v.assign(s.exp_avg_sq(layer), s.exp_avg_sq(layer) + info.numel);
  e.params.resize(info.numel);
  for (const TensorRange& t : info.tensors) {
    const double wd = t.no_decay && cfg.no_decay_norms_and_biases() ? 0 : cfg.weight_decay();
    auto sc = kernels::MakeAdamWScalars(model::LearningRate(cfg, step), cfg.beta1(), cfg.beta2(),
                                        cfg.eps(), wd, grad_scale, step);
    kernels::AdamWUpdate(kernels::Isa::kScalar, sc, g.data() + t.offset, kernels::GradType::kBf16,
                         e.master.data() + t.offset, e.m.data() + t.offset, e.v.data() + t.offset,
                         e.params.data() + t.offset, t.numel);
  }
  return e;
}

void ExpectState(const TrainingState& s, uint32_t layer, const Expected& e) {
  const uint64_t n = s.layers()[layer].numel;
  ASSERT_EQ(std::memcmp(s.master(layer), e.master.data(), n * 4), 0);
  ASSERT_EQ(std::memcmp(s.exp_avg(layer), e.m.data(), n * 4), 0);
  ASSERT_EQ(std::memcmp(s.exp_avg_sq(layer), e.v.data(), n * 4), 0);
  ASSERT_EQ(std::memcmp(s.params(layer), e.params.data(), n * 2), 0);
}

double Norm(const std::vector<uint16_t>& g) {
  double s = 0;
  for (uint16_t b : g) s += double{kernels::Bf16ToFp32(b)} * kernels::Bf16ToFp32(b);
  return std::sqrt(s);
}

TEST(LearningRateTest, Schedules) {
  v1::OptimizerConfig c = BaseConfig();
  EXPECT_DOUBLE_EQ(model::LearningRate(c, 1), 1e-3);
  EXPECT_DOUBLE_EQ(model::LearningRate(c, 1000), 1e-3);
  c.set_warmup_steps(10);
  EXPECT_DOUBLE_EQ(model::LearningRate(c, 1), 0.0);  // HF: step 0 of warm-up is lr * 0
  EXPECT_DOUBLE_EQ(model::LearningRate(c, 6), 1e-3 * 5 / 10);
  EXPECT_DOUBLE_EQ(model::LearningRate(c, 11), 1e-3);
  c.set_schedule(v1::LR_SCHEDULE_LINEAR);
  c.set_total_steps(110);
  EXPECT_DOUBLE_EQ(model::LearningRate(c, 11), 1e-3);
  EXPECT_DOUBLE_EQ(model::LearningRate(c, 61), 1e-3 * 0.5);
  EXPECT_DOUBLE_EQ(model::LearningRate(c, 111), 0.0);
  EXPECT_DOUBLE_EQ(model::LearningRate(c, 500), 0.0);
  c.set_schedule(v1::LR_SCHEDULE_COSINE);
  EXPECT_DOUBLE_EQ(model::LearningRate(c, 61), 1e-3 * 0.5 * (1 + std::cos(std::numbers::pi * 0.5)));
  EXPECT_NEAR(model::LearningRate(c, 111), 0.0, 1e-18);
  c.set_min_lr_ratio(0.1);
  EXPECT_NEAR(model::LearningRate(c, 111), 1e-4, 1e-15);
  EXPECT_DOUBLE_EQ(model::LearningRate(c, 11), 1e-3);
}

TEST(NormalizeOptimizerConfigTest, DefaultsAndRangeErrorsNameTheField) {
  v1::OptimizerConfig empty;
  auto n = model::NormalizeOptimizerConfig(empty);
  ASSERT_TRUE(n.ok());
  EXPECT_EQ(n->beta1(), 0.9);
  EXPECT_EQ(n->clip(), v1::CLIP_POLICY_NONE);
  EXPECT_EQ(n->grad_dtype(), v1::DTYPE_BF16);
  struct Case {
    void (*mutate)(v1::OptimizerConfig&);
    const char* field;
  } cases[] = {
      {[](v1::OptimizerConfig& c) { c.set_lr(-1); }, "optimizer.lr"},
      {[](v1::OptimizerConfig& c) { c.set_beta1(1.0); }, "optimizer.beta1"},
      {[](v1::OptimizerConfig& c) { c.set_beta2(-0.1); }, "optimizer.beta2"},
      {[](v1::OptimizerConfig& c) { c.set_eps(0); }, "optimizer.eps"},
      {[](v1::OptimizerConfig& c) { c.set_weight_decay(std::nan("")); }, "optimizer.weight_decay"},
      {[](v1::OptimizerConfig& c) { c.set_min_lr_ratio(2); }, "optimizer.min_lr_ratio"},
      {[](v1::OptimizerConfig& c) {
         c.set_clip(v1::CLIP_POLICY_GLOBAL);
         c.set_max_grad_norm(0);
       },
       "optimizer.max_grad_norm"},
      {[](v1::OptimizerConfig& c) {
         c.set_schedule(v1::LR_SCHEDULE_LINEAR);
         c.set_total_steps(5);
         c.set_warmup_steps(6);
       },
       "optimizer.warmup_steps"},
  };
  for (const Case& c : cases) {
    v1::OptimizerConfig cfg = BaseConfig();
    c.mutate(cfg);
    auto r = model::NormalizeOptimizerConfig(cfg);
    ASSERT_FALSE(r.ok()) << c.field;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find(c.field), std::string::npos) << r.status();
  }
}

TEST(UpdateWorkerTest, MatchesScalarReferenceWithNoDecayAndWorldScale) {
  v1::OptimizerConfig cfg = BaseConfig();
  Fixture f = Make(3, cfg, /*world_size=*/4);
  for (uint64_t step = 1; step <= 3; ++step) {
    for (uint32_t l = 0; l < 2; ++l) {
      auto g = RandomBf16(f.state->layers()[l].numel, 100 * step + l);
      Expected e = Reference(*f.state, l, g, cfg, step, 0.25);
      auto r = f.worker->UpdateLayerNow(l, step, {g.data(), kernels::GradType::kBf16, g.size()});
      EXPECT_TRUE(r.applied);
      EXPECT_NEAR(r.grad_norm, Norm(g) * 0.25, 1e-9 * Norm(g));
      ExpectState(*f.state, l, e);
      EXPECT_EQ(f.state->committed_version(l), step);
      EXPECT_EQ(f.state->layer_control(l).pending_version, step);
    }
  }
  // The norm tensor (no decay) differs from what decay would have produced.
  EXPECT_EQ(f.worker->stats().layer_updates, 6u);
}

TEST(UpdateWorkerTest, BitIdenticalForAnyThreadCountAndChunk) {
  v1::OptimizerConfig cfg = BaseConfig();
  cfg.set_clip(v1::CLIP_POLICY_PER_LAYER);
  cfg.set_max_grad_norm(0.5);
  std::vector<uint64_t> checksums;
  for (auto [threads, chunk] :
       std::vector<std::pair<int, uint64_t>>{{1, 1 << 20}, {2, 4096}, {3, 8192}, {7, 12288}}) {
    Fixture f = Make(threads, cfg, 1, chunk);
    for (uint64_t step = 1; step <= 2; ++step) {
      for (uint32_t l = 0; l < 2; ++l) {
        auto g = RandomBf16(f.state->layers()[l].numel, 7 * step + l);
        f.worker->UpdateLayerNow(l, step, {g.data(), kernels::GradType::kBf16, g.size()});
      }
    }
    checksums.push_back(f.state->Checksum());
  }
  for (uint64_t c : checksums) EXPECT_EQ(c, checksums[0]);
}

TEST(UpdateWorkerTest, PerLayerClipScalesToMaxNorm) {
  v1::OptimizerConfig cfg = BaseConfig();
  cfg.set_clip(v1::CLIP_POLICY_PER_LAYER);
  cfg.set_max_grad_norm(0.5);
  Fixture f = Make(2, cfg);
  auto g = RandomBf16(f.state->layers()[1].numel, 5, 1.0f);  // norm ~122 >> 0.5
  const double norm = Norm(g);
  const double coef = 0.5 / (norm + 1e-6);
  Expected e = Reference(*f.state, 1, g, cfg, 1, coef);
  auto r = f.worker->UpdateLayerNow(1, 1, {g.data(), kernels::GradType::kBf16, g.size()});
  EXPECT_NEAR(r.clip_coef, coef, 1e-12);
  ExpectState(*f.state, 1, e);
}

TEST(UpdateWorkerTest, GlobalClipWaitsForEveryLayerAndUsesTheGlobalNorm) {
  v1::OptimizerConfig cfg = BaseConfig();
  cfg.set_clip(v1::CLIP_POLICY_GLOBAL);
  cfg.set_max_grad_norm(1.0);
  Fixture f = Make(2, cfg);
  f.worker->Start();
  auto g0 = RandomBf16(f.state->layers()[0].numel, 1);
  auto g1 = RandomBf16(f.state->layers()[1].numel, 2);
  const double global = std::sqrt(Norm(g0) * Norm(g0) + Norm(g1) * Norm(g1));
  const double coef = 1.0 / (global + 1e-6);
  Expected e0 = Reference(*f.state, 0, g0, cfg, 1, coef);
  Expected e1 = Reference(*f.state, 1, g1, cfg, 1, coef);
  std::promise<void> done0, done1;
  ASSERT_TRUE(f.worker
                  ->Submit(1, 1, {g1.data(), kernels::GradType::kBf16, g1.size()},
                           [&](const LayerUpdateResult&) { done1.set_value(); })
                  .ok());
  // With one layer's gradient missing, nothing may be updated.
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_EQ(f.state->committed_version(1), 0u);
  ASSERT_TRUE(f.worker
                  ->Submit(0, 1, {g0.data(), kernels::GradType::kBf16, g0.size()},
                           [&](const LayerUpdateResult& r) {
                             EXPECT_NEAR(r.clip_coef, coef, 1e-12);
                             done0.set_value();
                           })
                  .ok());
  done0.get_future().wait();
  done1.get_future().wait();
  ExpectState(*f.state, 0, e0);
  ExpectState(*f.state, 1, e1);
  f.worker->Stop();
}

// A change of the clip policy while a step runs (UpdateHyperParams) takes effect with the next
// step, both ways: switched to global halfway, the step waited for the gradients of the layers
// it had updated already; switched away from global, it never released the layers it held.
TEST(UpdateWorkerTest, ClipChangeWhileAStepRunsTakesEffectWithTheNextStep) {
  for (const bool to_global : {true, false}) {
    SCOPED_TRACE(to_global ? "none -> global" : "global -> none");
    v1::OptimizerConfig first = BaseConfig();
    first.set_clip(to_global ? v1::CLIP_POLICY_NONE : v1::CLIP_POLICY_GLOBAL);
    v1::OptimizerConfig second = first;
    second.set_clip(to_global ? v1::CLIP_POLICY_GLOBAL : v1::CLIP_POLICY_NONE);
    Fixture f = Make(2, first);
    f.worker->Start();
    std::vector<std::vector<uint16_t>> g;
    for (uint32_t l = 0; l < 2; ++l) g.push_back(RandomBf16(f.state->layers()[l].numel, 7 + l));
    auto submit = [&](uint32_t layer, uint64_t step) {
      return f.worker->Submit(
          layer, step, {g[layer].data(), kernels::GradType::kBf16, g[layer].size()}, nullptr);
    };
    ASSERT_TRUE(submit(0, 1).ok());
    if (to_global) {
      // Under "none" layer 0 is updated at once.
      for (int i = 0; i < 2000 && f.state->committed_version(0) < 1; ++i) {
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
      ASSERT_EQ(f.state->committed_version(0), 1u);
    }
    f.worker->SetOptimizer(second);
    ASSERT_TRUE(submit(1, 1).ok());
    for (uint32_t l = 0; l < 2; ++l) {
      for (int i = 0; i < 2000 && f.state->committed_version(l) < 1; ++i) {
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
      EXPECT_EQ(f.state->committed_version(l), 1u) << "step 1 never completed layer " << l;
    }
    // Step 2 runs under the new policy: under global, one layer alone is held.
    ASSERT_TRUE(submit(1, 2).ok());
    if (to_global) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      EXPECT_EQ(f.state->committed_version(1), 1u) << "global clipping updated a layer alone";
    } else {
      for (int i = 0; i < 2000 && f.state->committed_version(1) < 2; ++i) {
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
      EXPECT_EQ(f.state->committed_version(1), 2u) << "no clipping held a layer";
    }
    ASSERT_TRUE(submit(0, 2).ok());
    for (uint32_t l = 0; l < 2; ++l) {
      for (int i = 0; i < 2000 && f.state->committed_version(l) < 2; ++i) {
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
      EXPECT_EQ(f.state->committed_version(l), 2u);
    }
    f.worker->Stop();
  }
}

TEST(UpdateWorkerTest, NonFiniteGradientSkipsLayerLeavesStateAndAdvancesVersion) {
  Fixture f = Make(2, BaseConfig());
  for (float bad :
       {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
    const uint64_t step = f.state->committed_version(1) + 1;
    auto g = RandomBf16(f.state->layers()[1].numel, 9);
    g[12345] = kernels::RoundToBf16(bad);
    const uint64_t before = f.state->LayerChecksum(1);
    auto r = f.worker->UpdateLayerNow(1, step, {g.data(), kernels::GradType::kBf16, g.size()});
    EXPECT_FALSE(r.applied);
    EXPECT_EQ(r.nonfinite, 1u);
    EXPECT_TRUE(std::isnan(r.grad_norm));
    EXPECT_EQ(f.state->LayerChecksum(1), before);
    EXPECT_EQ(f.state->committed_version(1), step);
  }
  EXPECT_EQ(f.state->layer_control(1).skipped_steps, 2u);
  EXPECT_EQ(f.worker->stats().layer_updates_skipped, 2u);
}

TEST(UpdateWorkerTest, Fp32GradientsAreSupported) {
  v1::OptimizerConfig cfg = BaseConfig();
  Fixture f = Make(2, cfg);
  auto gb = RandomBf16(f.state->layers()[1].numel, 4);
  std::vector<float> gf(gb.size());
  for (size_t i = 0; i < gb.size(); ++i) gf[i] = kernels::Bf16ToFp32(gb[i]);
  // BF16 values widened to FP32 are the same numbers: the result must be the same bits.
  Expected e = Reference(*f.state, 1, gb, cfg, 1, 1.0);
  f.worker->UpdateLayerNow(1, 1, {gf.data(), kernels::GradType::kFp32, gf.size()});
  ExpectState(*f.state, 1, e);
}

TEST(UpdateWorkerTest, SubmitRejectsBadInputAndLeavesStateUntouched) {
  Fixture f = Make(1, BaseConfig());
  f.worker->Start();
  const uint64_t before = f.state->Checksum();
  auto g = RandomBf16(f.state->layers()[1].numel, 1);
  GradientRef ok{g.data(), kernels::GradType::kBf16, g.size()};
  auto s = f.worker->Submit(9, 1, ok, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_NE(s.message().find("layer"), std::string::npos);
  s = f.worker->Submit(1, 1, {g.data(), kernels::GradType::kBf16, g.size() - 1}, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("expected 15000 elements"), std::string::npos) << s;
  s = f.worker->Submit(1, 1, {nullptr, kernels::GradType::kBf16, g.size()}, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  s = f.worker->Submit(1, 2, ok, nullptr);  // future step
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("version 0"), std::string::npos) << s;
  f.worker->Stop();
  EXPECT_EQ(f.state->Checksum(), before);
  EXPECT_EQ(f.state->committed_version(1), 0u);
}

TEST(UpdateWorkerTest, DuplicateSubmitIsAlreadyExistsAndPastStepIsRejected) {
  Fixture f = Make(1, BaseConfig());
  auto g = RandomBf16(f.state->layers()[1].numel, 1);
  GradientRef ok{g.data(), kernels::GradType::kBf16, g.size()};
  // Not started: the first submit stays queued, so the second is a duplicate.
  ASSERT_TRUE(f.worker->Submit(1, 1, ok, nullptr).ok());
  EXPECT_EQ(f.worker->Submit(1, 1, ok, nullptr).code(), absl::StatusCode::kAlreadyExists);
  f.worker->Start();
  f.worker->Stop();
  EXPECT_EQ(f.state->committed_version(1), 1u);
  f.worker->Start();
  EXPECT_EQ(f.worker->Submit(1, 1, ok, nullptr).code(), absl::StatusCode::kFailedPrecondition);
  f.worker->Stop();
}

TEST(UpdateWorkerTest, AbortDropsQueuedLayersAndSealsVersions) {
  Fixture f = Make(1, BaseConfig());
  auto g0 = RandomBf16(f.state->layers()[0].numel, 1);
  auto g1 = RandomBf16(f.state->layers()[1].numel, 2);
  const uint64_t before0 = f.state->LayerChecksum(0);
  bool aborted = false;
  ASSERT_TRUE(f.worker
                  ->Submit(0, 1, {g0.data(), kernels::GradType::kBf16, g0.size()},
                           [&](const LayerUpdateResult& r) { aborted = r.aborted; })
                  .ok());
  std::promise<void> sealed;
  f.worker->AbortStep(1, [&] { sealed.set_value(); });
  f.worker->Start();
  sealed.get_future().wait();
  EXPECT_TRUE(aborted);
  EXPECT_EQ(f.state->LayerChecksum(0), before0);  // no partial update
  EXPECT_EQ(f.state->committed_version(0), 1u);   // well-defined version
  EXPECT_EQ(f.state->committed_version(1), 1u);
  EXPECT_EQ(
      f.worker->Submit(1, 1, {g1.data(), kernels::GradType::kBf16, g1.size()}, nullptr).code(),
      absl::StatusCode::kAborted);
  ASSERT_TRUE(
      f.worker->Submit(1, 2, {g1.data(), kernels::GradType::kBf16, g1.size()}, nullptr).ok());
  f.worker->Stop();
  EXPECT_EQ(f.state->committed_version(1), 2u);
}

// A second abort before the first one's seal ran (the reducer's protocol error, then the
// engine's abort) kept the first seal out of the queue: its callback never ran, and whoever
// counted pending seals waited forever (found by fuzz_shm).
TEST(UpdateWorkerTest, EverySealOfBackToBackAbortsRunsInStepOrder) {
  Fixture f = Make(1, BaseConfig());
  auto g0 = RandomBf16(f.state->layers()[0].numel, 1);
  ASSERT_TRUE(
      f.worker->Submit(0, 1, {g0.data(), kernels::GradType::kBf16, g0.size()}, nullptr).ok());
  struct {
    absl::Mutex mu;
    std::vector<int> order ABSL_GUARDED_BY(mu);
  } seals;
  auto note = [&](int tag) {
    return [&, tag] {
      absl::MutexLock lock(&seals.mu);
      seals.order.push_back(tag);
    };
  };
  // Not started: every seal is still queued when the next abort comes.
  f.worker->AbortStep(1, note(1));
  f.worker->AbortStep(1, note(2));
  f.worker->AbortStep(2, note(3));
  f.worker->Start();
  f.worker->Stop();
  {
    absl::MutexLock lock(&seals.mu);
    EXPECT_EQ(seals.order, (std::vector<int>{1, 2, 3}));
  }
  EXPECT_EQ(f.state->committed_version(0), 2u);
  EXPECT_EQ(f.state->committed_version(1), 2u);
}

// The sum of squares exactly as the worker's statistics pass computes it (kStatsBlock blocks
// added in block order), so a streamed layer gets the same clip coefficient as a whole one.
double WorkerSumSquares(const std::vector<uint16_t>& g) {
  double total = 0;
  for (size_t b = 0; b < g.size(); b += kernels::kStatsBlock) {
    const size_t n = std::min<size_t>(kernels::kStatsBlock, g.size() - b);
    total +=
        kernels::ComputeGradStats(kernels::BestIsa(), g.data() + b, kernels::GradType::kBf16, n)
            .sum_squares;
  }
  return total;
}

// Cuts [0, n) into uneven ranges (not aligned to anything) and shuffles them.
std::vector<std::pair<uint64_t, uint64_t>> ShuffledRanges(uint64_t n, uint32_t seed) {
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  std::mt19937 rng(seed);
  for (uint64_t b = 0; b < n;) {
    const uint64_t len = std::min<uint64_t>(n - b, 1 + rng() % 3000);
    ranges.emplace_back(b, len);
    b += len;
  }
  std::shuffle(ranges.begin(), ranges.end(), rng);
  return ranges;
}

void WaitFor(const std::function<bool()>& pred) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!pred() && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

TEST(UpdateWorkerStreamTest, RangesInAnyOrderAreBitIdenticalToTheWholeLayer) {
  v1::OptimizerConfig cfg = BaseConfig();
  cfg.set_clip(v1::CLIP_POLICY_PER_LAYER);
  cfg.set_max_grad_norm(0.5);  // active: the norms are ~1e2
  Fixture whole = Make(3, cfg, /*world_size=*/2, /*chunk_elements=*/4096);
  Fixture streamed = Make(2, cfg, /*world_size=*/2, /*chunk_elements=*/8192);
  streamed.worker->Start();
  for (uint64_t step = 1; step <= 2; ++step) {
    for (uint32_t l = 0; l < 2; ++l) {
      auto g = RandomBf16(whole.state->layers()[l].numel, 31 * step + l);
      const LayerUpdateResult want =
          whole.worker->UpdateLayerNow(l, step, {g.data(), kernels::GradType::kBf16, g.size()});
      ASSERT_LT(want.clip_coef, 1.0);
      std::promise<LayerUpdateResult> got;
      auto began = streamed.worker->BeginStreamedLayer(
          l, step, WorkerSumSquares(g), false,
          [&](const LayerUpdateResult& r) { got.set_value(r); });
      ASSERT_TRUE(began.ok() && *began) << began.status();
      std::atomic<int> released{0};
      const auto ranges = ShuffledRanges(g.size(), static_cast<uint32_t>(step * 7 + l));
      for (auto [b, n] : ranges) {
        ASSERT_TRUE(streamed.worker
                        ->SubmitRange(l, step, b, {g.data() + b, kernels::GradType::kBf16, n},
                                      [&] { released++; })
                        .ok());
      }
      const LayerUpdateResult r = got.get_future().get();
      EXPECT_TRUE(r.applied);
      EXPECT_TRUE(r.streamed);
      EXPECT_EQ(r.clip_coef, want.clip_coef);
      EXPECT_EQ(released.load(), static_cast<int>(ranges.size()));
      EXPECT_EQ(streamed.state->committed_version(l), step);
      EXPECT_EQ(streamed.state->LayerChecksum(l), whole.state->LayerChecksum(l))
          << "layer " << l << " step " << step;
    }
  }
  streamed.worker->Stop();
  const UpdateStats st = streamed.worker->stats();
  EXPECT_EQ(st.layer_updates_streamed, 4u);
  EXPECT_EQ(st.layer_updates_buffered, 0u);
  EXPECT_EQ(st.layer_updates, 4u);
  EXPECT_EQ(whole.worker->stats().layer_updates_buffered, 4u);
}

TEST(UpdateWorkerStreamTest, NonFiniteSkipsTheLayerAndGlobalClipCannotStream) {
  Fixture f = Make(2, BaseConfig());
  f.worker->Start();
  auto g = RandomBf16(f.state->layers()[1].numel, 3);
  const uint64_t before = f.state->LayerChecksum(1);
  std::promise<LayerUpdateResult> got;
  auto began = f.worker->BeginStreamedLayer(1, 1, 0, /*nonfinite=*/true,
                                            [&](const LayerUpdateResult& r) { got.set_value(r); });
  ASSERT_TRUE(began.ok() && *began);
  ASSERT_TRUE(
      f.worker->SubmitRange(1, 1, 0, {g.data(), kernels::GradType::kBf16, 5000}, nullptr).ok());
  ASSERT_TRUE(
      f.worker->SubmitRange(1, 1, 5000, {g.data() + 5000, kernels::GradType::kBf16, 10000}, nullptr)
          .ok());
  const LayerUpdateResult r = got.get_future().get();
  EXPECT_FALSE(r.applied);
  EXPECT_EQ(r.nonfinite, 1u);
  EXPECT_EQ(f.state->LayerChecksum(1), before);
  EXPECT_EQ(f.state->committed_version(1), 1u);
  EXPECT_EQ(f.state->layer_control(1).skipped_steps, 1u);
  EXPECT_EQ(f.worker->stats().layer_updates_skipped, 1u);
  EXPECT_EQ(f.worker->stats().layer_updates_streamed, 1u);

  v1::OptimizerConfig global = BaseConfig();
  global.set_clip(v1::CLIP_POLICY_GLOBAL);
  global.set_max_grad_norm(1.0);
  f.worker->SetOptimizer(global);
  auto refused = f.worker->BeginStreamedLayer(1, 2, 1.0, false, nullptr);
  ASSERT_TRUE(refused.ok());
  EXPECT_FALSE(*refused);
  // Nothing was recorded: the layer can still be submitted whole.
  EXPECT_TRUE(f.worker->Submit(1, 2, {g.data(), kernels::GradType::kBf16, g.size()}, nullptr).ok());
  f.worker->Stop();
}

TEST(UpdateWorkerStreamTest, SubmitRangeRejectsBadInput) {
  Fixture f = Make(1, BaseConfig());
  auto g = RandomBf16(f.state->layers()[1].numel, 3);
  auto s = f.worker->SubmitRange(1, 1, 0, {g.data(), kernels::GradType::kBf16, 10}, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  auto began = f.worker->BeginStreamedLayer(1, 1, -1.0, false, nullptr);
  EXPECT_EQ(began.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(began.status().message().find("sum_squares"), std::string::npos);
  ASSERT_TRUE(*f.worker->BeginStreamedLayer(1, 1, 1.0, false, nullptr));
  EXPECT_EQ(f.worker->BeginStreamedLayer(1, 1, 1.0, false, nullptr).status().code(),
            absl::StatusCode::kAlreadyExists);
  s = f.worker->SubmitRange(1, 1, 14995, {g.data(), kernels::GradType::kBf16, 10}, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kOutOfRange) << s;
  ASSERT_TRUE(
      f.worker->SubmitRange(1, 1, 0, {g.data(), kernels::GradType::kBf16, 15000}, nullptr).ok());
  s = f.worker->SubmitRange(1, 1, 0, {g.data(), kernels::GradType::kBf16, 1}, nullptr);
  EXPECT_NE(s.code(), absl::StatusCode::kOk) << "the layer is fully submitted";
  f.worker->Start();
  f.worker->Stop();
  EXPECT_EQ(f.state->committed_version(1), 1u);
}

TEST(UpdateWorkerStreamTest, AbortAfterSomeRangesTearsTheLayerAndLeavesItUnpublished) {
  Fixture f = Make(2, BaseConfig());
  f.worker->Start();
  auto g = RandomBf16(f.state->layers()[1].numel, 5);
  LayerUpdateResult last;
  std::atomic<int> dones{0};
  // Layer 0: begun, no range yet (not torn). Layer 1: one range applied (torn).
  ASSERT_TRUE(*f.worker->BeginStreamedLayer(0, 1, 1.0, false, [&](const LayerUpdateResult& r) {
    EXPECT_TRUE(r.aborted);
    EXPECT_FALSE(r.torn);
    dones++;
  }));
  ASSERT_TRUE(*f.worker->BeginStreamedLayer(1, 1, 1.0, false, [&](const LayerUpdateResult& r) {
    last = r;
    dones++;
  }));
  const uint64_t before0 = f.state->LayerChecksum(0);
  const uint64_t before1 = f.state->LayerChecksum(1);
  ASSERT_TRUE(
      f.worker->SubmitRange(1, 1, 0, {g.data(), kernels::GradType::kBf16, 7000}, nullptr).ok());
  WaitFor([&] { return f.worker->stats().ranges_streamed == 1; });
  ASSERT_EQ(f.worker->stats().ranges_streamed, 1u);
  std::promise<void> sealed;
  f.worker->AbortStep(1, [&] { sealed.set_value(); });
  sealed.get_future().wait();
  EXPECT_EQ(dones.load(), 2);
  EXPECT_TRUE(last.aborted);
  EXPECT_TRUE(last.torn);
  EXPECT_EQ(f.worker->TornLayers(), std::vector<uint32_t>{1});
  EXPECT_EQ(f.worker->stats().layers_torn, 1u);
  // Layer 1: written in part, never published: pending 1 != committed 0.
  EXPECT_NE(f.state->LayerChecksum(1), before1);
  EXPECT_EQ(f.state->committed_version(1), 0u);
  EXPECT_EQ(f.state->layer_control(1).pending_version, 1u);
  // Layer 0: untouched and sealed at the aborted step like any whole layer.
  EXPECT_EQ(f.state->LayerChecksum(0), before0);
  EXPECT_EQ(f.state->committed_version(0), 1u);
  EXPECT_EQ(
      f.worker->SubmitRange(1, 1, 7000, {g.data() + 7000, kernels::GradType::kBf16, 8000}, nullptr)
          .code(),
      absl::StatusCode::kAborted);
  f.worker->Stop();
}

}  // namespace
}  // namespace slidedp::hostd
