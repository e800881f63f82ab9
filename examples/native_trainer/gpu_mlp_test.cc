// GpuShardPass against the CPU ShardPass (label gpu; skipped without a device).
//
// Tolerances. The GPU pass differs from the CPU's only in rounding: cuBLAS sums the D (forward,
// W^T delta) or n (weight gradient) products of each output in its own blocked order with FMAs,
// where the CPU sums rounded products in eight fixed partial sums (forward) or sequentially, and
// tanhf may differ in its last ulp or two. The bias gradient and the deltas are computed as on
// the CPU (same order, no contraction) and differ only through their inputs. Each FP32 sum is off
// by a few units of u = 2^-24 ~ 6e-8 relative to sum|terms|; with no preferred sign the roundings
// add up like a random walk over the D terms and the layers, far below the worst-case bound
// gamma_D = D u (1.5e-5 at D = 256, and that bounds one sum, not a norm over 10^4 elements).
// The parameters here give unit-scale pre-activations (W ~ N(0, 1/D), b ~ N(0, 0.01)): no tanh
// saturation, so 1 - h^2 has no cancellation. Measured with a CPU emulation of the GPU's
// arithmetic (FMA sums in three other orders, correctly rounded tanh), same task and shard:
//   gradients, norm-wise relative, per layer: 2.3e-7 .. 3.6e-7 at D = 64, 3.3e-7 .. 6.5e-7 at
//   D = 256 (ShardPass vs FP64 itself: 1.6e-7 .. 4.2e-7); loss: <= 5e-8 (the loss averages the
//   independent output errors over n * D squared residuals of O(1)).
// The limits, 1e-5 for gradients and 1e-6 for the loss, keep a margin of 15x or more over that and
// still catch any real error (a wrong transpose, scale, layer or sample is off by O(1)).
#include "examples/native_trainer/gpu_mlp.h"

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "examples/native_trainer/mlp_task.h"
#include "kernels/cpu/bf16.h"
#include "model/manifest.h"

namespace slidedp::examples {
namespace {

constexpr double kGradRelTol = 1e-5;
constexpr double kLossRelTol = 1e-6;
constexpr uint64_t kStep = 3;
constexpr uint64_t kBegin = 8;  // a shard in the middle of the global batch of 32
constexpr uint64_t kEnd = 16;

#define ASSERT_CUDA_OK(expr) ASSERT_EQ((expr), cudaSuccess) << #expr
#define ASSERT_OK(expr)                            \
  do {                                             \
    const absl::Status _st = (expr);               \
    ASSERT_TRUE(_st.ok()) << #expr << ": " << _st; \
  } while (0)

template <typename T>
class DeviceArray {
 public:
  explicit DeviceArray(uint64_t n) : n_(n) {
    if (cudaMalloc(&p_, n * sizeof(T)) != cudaSuccess) p_ = nullptr;
  }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  ~DeviceArray() {
    if (p_ != nullptr) cudaFree(p_);
  }
  T* get() const { return static_cast<T*>(p_); }
  uint64_t size() const { return n_; }

 private:
  void* p_ = nullptr;
  uint64_t n_;
};

MlpConfig Config(uint32_t dim) {
  MlpConfig c;
  c.layers = 3;
  c.dim = dim;
  c.batch = 32;
  c.seed = 5;
  return c;
}

// Random BF16 parameters of unit-scale pre-activations: W ~ N(0, 1/D), b ~ N(0, 0.1^2).
std::vector<std::vector<uint16_t>> RandomParams(const MlpConfig& c) {
  const uint64_t dd = uint64_t{c.dim} * c.dim;
  const double w_std = 1.0 / std::sqrt(static_cast<double>(c.dim));
  std::vector<std::vector<uint16_t>> p(c.layers, std::vector<uint16_t>(MlpLayerNumel(c.dim)));
  for (uint32_t l = 0; l < c.layers; ++l) {
    for (uint64_t i = 0; i < p[l].size(); ++i) {
      const bool weight = i < dd;
      p[l][i] = kernels::RoundToBf16(
          model::InitialValue(1234, MlpLayerName(l) + (weight ? ".weight" : ".bias"),
                              model::InitKind::kNormal, weight ? w_std : 0.1, weight ? i : i - dd));
    }
  }
  return p;
}

struct PassResult {
  double loss = 0;
  std::vector<std::vector<float>> grads;       // FP32 runs
  std::vector<std::vector<uint16_t>> grads16;  // BF16 runs
};

PassResult RunCpu(const MlpTask& task, const std::vector<std::vector<uint16_t>>& params,
                  uint64_t step) {
  const uint32_t layers = task.config().layers;
  ShardPass pass(task, step, kBegin, kEnd);
  for (uint32_t l = 0; l < layers; ++l) pass.Forward(l, params[l].data());
  PassResult r;
  r.loss = pass.Loss();
  r.grads.assign(layers, std::vector<float>(MlpLayerNumel(task.config().dim)));
  for (uint32_t l = layers; l-- > 0;) pass.Backward(l, r.grads[l].data());
  return r;
}

class GpuMlpTest : public ::testing::TestWithParam<uint32_t> {
 protected:
  void SetUp() override {
    ASSERT_CUDA_OK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  }
  void TearDown() override {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  // One GPU pass through `pass` with a single parameter window slot for all layers: each layer
  // is uploaded into the slot right before its Forward, and the slot is poisoned (NaN) after the
  // last Forward, so a Backward that read the caller's parameters would produce NaNs. The
  // gradient buffers are poisoned (NaN) before the pass.
  void RunGpu(GpuShardPass& pass, const std::vector<std::vector<uint16_t>>& params, uint64_t step,
              bool bf16_grads, PassResult* r) {
    const MlpConfig& c = task_config_;
    const uint64_t numel = MlpLayerNumel(c.dim);
    DeviceArray<uint16_t> slot(numel);
    DeviceArray<float> grad(uint64_t{c.layers} * numel);
    DeviceArray<uint16_t> grad16(uint64_t{c.layers} * numel);
    ASSERT_NE(slot.get(), nullptr);
    ASSERT_NE(grad.get(), nullptr);
    ASSERT_NE(grad16.get(), nullptr);
    ASSERT_CUDA_OK(cudaMemsetAsync(grad.get(), 0xFF, grad.size() * sizeof(float), stream_));
    ASSERT_CUDA_OK(cudaMemsetAsync(grad16.get(), 0xFF, grad16.size() * sizeof(uint16_t), stream_));

    ASSERT_OK(pass.Reset(step, kBegin, kEnd));
    for (uint32_t l = 0; l < c.layers; ++l) {
      ASSERT_CUDA_OK(cudaMemcpyAsync(slot.get(), params[l].data(), numel * sizeof(uint16_t),
                                     cudaMemcpyHostToDevice, stream_));
      ASSERT_OK(pass.Forward(l, slot.get()));
    }
    ASSERT_CUDA_OK(cudaMemsetAsync(slot.get(), 0xFF, numel * sizeof(uint16_t), stream_));
    const absl::StatusOr<double> loss = pass.Loss();
    ASSERT_TRUE(loss.ok()) << loss.status();
    r->loss = *loss;
    for (uint32_t l = c.layers; l-- > 0;) {
      if (bf16_grads) {
        ASSERT_OK(pass.BackwardBf16(l, grad16.get() + l * numel));
      } else {
        ASSERT_OK(pass.Backward(l, grad.get() + l * numel));
      }
    }
    ASSERT_CUDA_OK(cudaStreamSynchronize(stream_));
    r->grads.assign(c.layers, std::vector<float>(numel));
    r->grads16.assign(c.layers, std::vector<uint16_t>(numel));
    for (uint32_t l = 0; l < c.layers; ++l) {
      ASSERT_CUDA_OK(cudaMemcpy(r->grads[l].data(), grad.get() + l * numel, numel * sizeof(float),
                                cudaMemcpyDeviceToHost));
      ASSERT_CUDA_OK(cudaMemcpy(r->grads16[l].data(), grad16.get() + l * numel,
                                numel * sizeof(uint16_t), cudaMemcpyDeviceToHost));
    }
  }

  MlpConfig task_config_ = Config(GetParam());
  MlpTask task_{task_config_};
  std::vector<std::vector<uint16_t>> params_ = RandomParams(task_config_);
  cudaStream_t stream_ = nullptr;
};

// ||a - b|| / ||b|| in FP64.
double RelErr(const std::vector<float>& a, const std::vector<float>& b) {
  double diff = 0;
  double ref = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double d = static_cast<double>(a[i]) - b[i];
    diff += d * d;
    ref += static_cast<double>(b[i]) * b[i];
  }
  return std::sqrt(diff) / std::sqrt(ref);
}

bool AllFinite(const std::vector<float>& v) {
  for (float x : v) {
    if (!std::isfinite(x)) return false;
  }
  return true;
}

TEST_P(GpuMlpTest, MatchesCpuShardPass) {
  const PassResult cpu = RunCpu(task_, params_, kStep);
  absl::StatusOr<GpuShardPass> pass = GpuShardPass::Create(task_, kEnd - kBegin, stream_);
  ASSERT_TRUE(pass.ok()) << pass.status();
  PassResult gpu;
  RunGpu(*pass, params_, kStep, /*bf16_grads=*/false, &gpu);
  if (HasFatalFailure()) return;

  ASSERT_GT(cpu.loss, 0);
  const double loss_rel = std::fabs(gpu.loss - cpu.loss) / cpu.loss;
  std::printf("D=%u loss cpu %.9g gpu %.9g rel %.3g\n", GetParam(), cpu.loss, gpu.loss, loss_rel);
  EXPECT_LT(loss_rel, kLossRelTol);
  for (uint32_t l = 0; l < task_config_.layers; ++l) {
    ASSERT_TRUE(AllFinite(gpu.grads[l])) << "layer " << l;
    const double rel = RelErr(gpu.grads[l], cpu.grads[l]);
    std::printf("D=%u layer %u gradient rel err %.3g\n", GetParam(), l, rel);
    EXPECT_LT(rel, kGradRelTol) << "layer " << l;
  }
}

TEST_P(GpuMlpTest, RunsAreBitIdentical) {
  absl::StatusOr<GpuShardPass> a = GpuShardPass::Create(task_, kEnd - kBegin, stream_);
  ASSERT_TRUE(a.ok()) << a.status();
  PassResult first, other, again, fresh;
  RunGpu(*a, params_, kStep, false, &first);
  RunGpu(*a, params_, kStep + 1, false, &other);  // the buffers now hold another step
  RunGpu(*a, params_, kStep, false, &again);
  absl::StatusOr<GpuShardPass> b = GpuShardPass::Create(task_, kStep, kBegin, kEnd, stream_);
  ASSERT_TRUE(b.ok()) << b.status();
  RunGpu(*b, params_, kStep, false, &fresh);
  if (HasFatalFailure()) return;

  EXPECT_NE(first.loss, other.loss);
  EXPECT_EQ(std::memcmp(&first.loss, &again.loss, sizeof(double)), 0);
  EXPECT_EQ(std::memcmp(&first.loss, &fresh.loss, sizeof(double)), 0);
  const size_t bytes = first.grads[0].size() * sizeof(float);
  for (uint32_t l = 0; l < task_config_.layers; ++l) {
    ASSERT_TRUE(AllFinite(first.grads[l])) << "layer " << l;
    EXPECT_EQ(std::memcmp(first.grads[l].data(), again.grads[l].data(), bytes), 0) << "layer " << l;
    EXPECT_EQ(std::memcmp(first.grads[l].data(), fresh.grads[l].data(), bytes), 0) << "layer " << l;
  }
}

TEST_P(GpuMlpTest, Bf16GradientsAreTheRoundedFp32Ones) {
  absl::StatusOr<GpuShardPass> pass = GpuShardPass::Create(task_, kEnd - kBegin, stream_);
  ASSERT_TRUE(pass.ok()) << pass.status();
  PassResult fp32, bf16;
  RunGpu(*pass, params_, kStep, /*bf16_grads=*/false, &fp32);
  RunGpu(*pass, params_, kStep, /*bf16_grads=*/true, &bf16);
  if (HasFatalFailure()) return;
  for (uint32_t l = 0; l < task_config_.layers; ++l) {
    size_t mismatches = 0;
    for (size_t i = 0; i < fp32.grads[l].size(); ++i) {
      mismatches += bf16.grads16[l][i] != kernels::RoundToBf16(fp32.grads[l][i]);
    }
    EXPECT_EQ(mismatches, 0u) << "layer " << l;
  }
}

TEST_P(GpuMlpTest, RejectsCallsOutOfOrder) {
  const uint64_t numel = MlpLayerNumel(task_config_.dim);
  DeviceArray<uint16_t> slot(numel);
  DeviceArray<float> grad(numel);
  ASSERT_NE(slot.get(), nullptr);
  ASSERT_NE(grad.get(), nullptr);
  ASSERT_CUDA_OK(cudaMemset(slot.get(), 0, numel * sizeof(uint16_t)));

  EXPECT_EQ(GpuShardPass::Create(task_, 0, stream_).status().code(),
            absl::StatusCode::kInvalidArgument);
  absl::StatusOr<GpuShardPass> pass = GpuShardPass::Create(task_, 4, stream_);
  ASSERT_TRUE(pass.ok()) << pass.status();
  EXPECT_EQ(pass->Forward(0, slot.get()).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(pass->Reset(kStep, 0, 5).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(pass->Reset(kStep, 4, 3).code(), absl::StatusCode::kInvalidArgument);
  ASSERT_OK(pass->Reset(kStep, 0, 4));
  EXPECT_EQ(pass->samples(), 4u);
  EXPECT_EQ(pass->Forward(1, slot.get()).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(pass->Forward(0, nullptr).code(), absl::StatusCode::kInvalidArgument);
  ASSERT_OK(pass->Forward(0, slot.get()));
  EXPECT_EQ(pass->Loss().status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(pass->Backward(0, grad.get()).code(), absl::StatusCode::kFailedPrecondition);
  for (uint32_t l = 1; l < task_config_.layers; ++l) ASSERT_OK(pass->Forward(l, slot.get()));
  EXPECT_EQ(pass->Forward(task_config_.layers, slot.get()).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(pass->Backward(0, grad.get()).code(), absl::StatusCode::kFailedPrecondition);
  for (uint32_t l = task_config_.layers; l-- > 0;) ASSERT_OK(pass->Backward(l, grad.get()));
  EXPECT_EQ(pass->Backward(0, grad.get()).code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_CUDA_OK(cudaStreamSynchronize(stream_));
}

INSTANTIATE_TEST_SUITE_P(Dims, GpuMlpTest, ::testing::Values(64u, 256u),
                         [](const ::testing::TestParamInfo<uint32_t>& info) {
                           return "D" + std::to_string(info.param);
                         });

}  // namespace
}  // namespace slidedp::examples
