#include "examples/native_trainer/mlp_task.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "kernels/cpu/bf16.h"
#include "model/manifest.h"

namespace slidedp::examples {
namespace {

MlpConfig Small() {
  MlpConfig c;
  c.layers = 3;
  c.dim = 5;
  c.batch = 4;
  c.seed = 7;
  return c;
}

// FP32 parameters of moderate scale (so gradients are far from rounding noise).
std::vector<std::vector<float>> RandomParams(const MlpConfig& c) {
  std::vector<std::vector<float>> p(c.layers, std::vector<float>(MlpLayerNumel(c.dim)));
  for (uint32_t l = 0; l < c.layers; ++l) {
    for (size_t i = 0; i < p[l].size(); ++i) {
      p[l][i] = model::InitialValue(99, MlpLayerName(l), model::InitKind::kNormal, 0.5, i);
    }
  }
  return p;
}

double LossAt(const MlpTask& task, const std::vector<std::vector<float>>& p, uint64_t begin,
              uint64_t end) {
  ShardPass pass(task, 3, begin, end);
  for (uint32_t l = 0; l < p.size(); ++l) pass.ForwardFp32(l, p[l].data());
  return pass.Loss();
}

std::vector<std::vector<float>> GradAt(const MlpTask& task,
                                       const std::vector<std::vector<float>>& p, uint64_t begin,
                                       uint64_t end) {
  ShardPass pass(task, 3, begin, end);
  for (uint32_t l = 0; l < p.size(); ++l) pass.ForwardFp32(l, p[l].data());
  std::vector<std::vector<float>> g(p.size(), std::vector<float>(p[0].size()));
  for (uint32_t l = static_cast<uint32_t>(p.size()); l-- > 0;) pass.Backward(l, g[l].data());
  return g;
}

TEST(MlpTaskTest, ManifestMatchesTheContract) {
  MlpConfig c = Small();
  const slidedp::v1::ModelManifest m = MlpManifest(c);
  ASSERT_TRUE(model::ValidateManifest(m).ok());
  ASSERT_EQ(m.layers_size(), 3);
  for (int i = 0; i < 3; ++i) {
    const auto& l = m.layers(i);
    EXPECT_EQ(l.name(), "mlp." + std::to_string(i));
    EXPECT_EQ(l.kind(), slidedp::v1::LAYER_KIND_DECODER);
    ASSERT_EQ(l.tensors_size(), 2);
    EXPECT_EQ(l.tensors(0).name(), l.name() + ".weight");
    EXPECT_EQ(l.tensors(0).shape_size(), 2);
    EXPECT_FALSE(l.tensors(0).no_decay());
    EXPECT_EQ(l.tensors(0).dtype(), slidedp::v1::DTYPE_BF16);
    EXPECT_EQ(l.tensors(1).name(), l.name() + ".bias");
    EXPECT_TRUE(l.tensors(1).no_decay());
    EXPECT_EQ(model::LayerNumel(l), MlpLayerNumel(5));
  }
  c.dim = 6;
  EXPECT_NE(model::ManifestHash(MlpManifest(c)), model::ManifestHash(m));
}

TEST(MlpTaskTest, JobSpecAsTheIssueAsks) {
  const auto spec = MlpJobSpec(Small(), MlpOptimizer{}, 2, 4096);
  EXPECT_EQ(spec.world_size(), 2u);
  EXPECT_EQ(spec.seed(), 7u);
  EXPECT_EQ(spec.optimizer().grad_dtype(), slidedp::v1::DTYPE_FP32);
  EXPECT_TRUE(spec.optimizer().scale_by_world_size());
  EXPECT_TRUE(spec.optimizer().no_decay_norms_and_biases());
  EXPECT_DOUBLE_EQ(spec.optimizer().lr(), 1e-2);
  EXPECT_DOUBLE_EQ(spec.optimizer().weight_decay(), 0.01);
  EXPECT_EQ(spec.routes().grad_route(), slidedp::v1::GRAD_ROUTE_CPU_REDUCTION);
  EXPECT_EQ(spec.routes().chunk_bytes(), 4096u);
}

TEST(MlpTaskTest, ValidateConfig) {
  EXPECT_TRUE(ValidateMlpConfig(Small(), 4).ok());
  EXPECT_FALSE(ValidateMlpConfig(Small(), 3).ok());  // batch 4 not divisible by 3
  MlpConfig c = Small();
  c.dim = 0;
  EXPECT_FALSE(ValidateMlpConfig(c, 1).ok());
}

TEST(MlpTaskTest, InputsAreDeterministicPerStepAndIndex) {
  std::vector<float> a(64), b(64), c(64), d(64);
  MlpSampleInput(1, 5, 9, 64, a.data());
  MlpSampleInput(1, 5, 9, 64, b.data());
  MlpSampleInput(1, 5, 10, 64, c.data());
  MlpSampleInput(1, 6, 9, 64, d.data());
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
  EXPECT_NE(a, d);
  for (float x : a) {
    EXPECT_GE(x, -1.0f);
    EXPECT_LT(x, 1.0f);
  }
}

TEST(MlpTaskTest, GradientMatchesFiniteDifferences) {
  const MlpConfig c = Small();
  const MlpTask task(c);
  auto p = RandomParams(c);
  const auto g = GradAt(task, p, 0, c.batch);
  const float h = 1e-2f;
  int checked = 0;
  for (uint32_t l = 0; l < c.layers; ++l) {
    for (size_t i = 0; i < p[l].size(); ++i) {
      const float orig = p[l][i];
      p[l][i] = orig + h;
      const double up = LossAt(task, p, 0, c.batch);
      p[l][i] = orig - h;
      const double down = LossAt(task, p, 0, c.batch);
      p[l][i] = orig;
      const double fd = (up - down) / (2.0 * h);
      EXPECT_NEAR(g[l][i], fd, 2e-3 * std::max(1.0, std::fabs(fd)) + 2e-4)
          << "layer " << l << " element " << i;
      ++checked;
    }
  }
  EXPECT_EQ(checked, 3 * 30);
}

TEST(MlpTaskTest, ShardsSumToTheGlobalBatch) {
  const MlpConfig c = Small();
  const MlpTask task(c);
  const auto p = RandomParams(c);
  const auto full = GradAt(task, p, 0, 4);
  const auto a = GradAt(task, p, 0, 2);
  const auto b = GradAt(task, p, 2, 4);
  for (uint32_t l = 0; l < c.layers; ++l) {
    for (size_t i = 0; i < full[l].size(); ++i) {
      EXPECT_NEAR(a[l][i] + b[l][i], full[l][i], 1e-6 + 1e-5 * std::fabs(full[l][i]));
    }
  }
  EXPECT_NEAR(LossAt(task, p, 0, 2) + LossAt(task, p, 2, 4), LossAt(task, p, 0, 4), 1e-9);
}

TEST(MlpTaskTest, BitIdenticalAcrossRunsAndBf16PathWidensExactly) {
  const MlpConfig c = Small();
  const MlpTask task(c);
  auto p = RandomParams(c);
  std::vector<std::vector<uint16_t>> bf(c.layers);
  for (uint32_t l = 0; l < c.layers; ++l) {
    for (float& x : p[l]) {
      bf[l].push_back(kernels::RoundToBf16(x));
      x = kernels::Bf16ToFp32(bf[l].back());
    }
  }
  ShardPass pass(task, 3, 1, 3);
  for (uint32_t l = 0; l < c.layers; ++l) pass.Forward(l, bf[l].data());
  std::vector<std::vector<float>> g(c.layers, std::vector<float>(MlpLayerNumel(c.dim)));
  for (uint32_t l = c.layers; l-- > 0;) pass.Backward(l, g[l].data());
  const auto again = GradAt(task, p, 1, 3);
  for (uint32_t l = 0; l < c.layers; ++l) {
    EXPECT_EQ(0, std::memcmp(g[l].data(), again[l].data(), g[l].size() * sizeof(float)));
  }
}

TEST(MlpTaskDeathTest, OutOfOrderCallsAbort) {
  const MlpTask task(Small());
  std::vector<float> p(MlpLayerNumel(5), 0.0f);
  std::vector<float> g(MlpLayerNumel(5));
  EXPECT_DEATH(
      {
        ShardPass pass(task, 1, 0, 2);
        pass.ForwardFp32(1, p.data());
      },
      "out of order");
  EXPECT_DEATH(
      {
        ShardPass pass(task, 1, 0, 2);
        pass.ForwardFp32(0, p.data());
        pass.Backward(0, g.data());
      },
      "out of order");
}

}  // namespace
}  // namespace slidedp::examples
