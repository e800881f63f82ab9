#include "examples/native_trainer/mlp_task.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "kernels/cpu/bf16.h"
#include "model/manifest.h"

namespace slidedp::examples {
namespace v1 = slidedp::v1;
namespace {

void Check(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "ShardPass: %s\n", what);
    std::abort();
  }
}

uint64_t SplitMix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

// A dot product with eight partial sums combined in a fixed tree: a fixed order of operations
// (so the same bits everywhere) that the compiler can still keep in vector registers.
float Dot(const float* a, const float* b, uint32_t n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  uint32_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (uint32_t k = 0; k < 8; ++k) acc[k] += a[i + k] * b[i + k];
  }
  for (uint32_t k = 0; i < n; ++i, ++k) acc[k] += a[i] * b[i];
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

// out[o] = act(b[o] + W[o, :] . in) for a [D, D] weight followed by a [D] bias.
void DenseForward(const float* params, const float* in, uint32_t dim, bool tanh_act, float* out) {
  const float* bias = params + uint64_t{dim} * dim;
  for (uint32_t o = 0; o < dim; ++o) {
    const float z = Dot(params + uint64_t{o} * dim, in, dim) + bias[o];
    out[o] = tanh_act ? std::tanh(z) : z;
  }
}

}  // namespace

absl::Status ValidateMlpConfig(const MlpConfig& c, uint32_t world_size) {
  if (c.layers < 1 || c.layers > 4096) {
    return absl::InvalidArgumentError(absl::StrCat("layers: expected 1..4096, got ", c.layers));
  }
  if (c.dim < 1 || c.dim > 4096) {
    return absl::InvalidArgumentError(absl::StrCat("dim: expected 1..4096, got ", c.dim));
  }
  if (world_size < 1 || world_size > 64) {
    return absl::InvalidArgumentError(absl::StrCat("world_size: expected 1..64, got ", world_size));
  }
  if (c.batch < 1 || c.batch % world_size != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "batch: expected a positive multiple of world_size (", world_size, "), got ", c.batch));
  }
  return absl::OkStatus();
}

std::string MlpLayerName(uint32_t layer) { return absl::StrCat("mlp.", layer); }

v1::ModelManifest MlpManifest(const MlpConfig& c) {
  v1::ModelManifest m;
  m.set_family("mlp");
  m.set_name(absl::StrCat("native-mlp-L", c.layers, "-D", c.dim));
  for (uint32_t i = 0; i < c.layers; ++i) {
    v1::LayerSpec* layer = m.add_layers();
    layer->set_name(MlpLayerName(i));
    layer->set_kind(v1::LAYER_KIND_DECODER);
    v1::TensorSpec* w = layer->add_tensors();
    w->set_name(absl::StrCat(MlpLayerName(i), ".weight"));
    w->add_shape(c.dim);
    w->add_shape(c.dim);
    w->set_dtype(v1::DTYPE_BF16);
    v1::TensorSpec* b = layer->add_tensors();
    b->set_name(absl::StrCat(MlpLayerName(i), ".bias"));
    b->add_shape(c.dim);
    b->set_dtype(v1::DTYPE_BF16);
    b->set_no_decay(true);
  }
  return m;
}

v1::JobSpec MlpJobSpec(const MlpConfig& c, const MlpOptimizer& optimizer, uint32_t world_size,
                       uint64_t chunk_bytes) {
  v1::JobSpec spec;
  *spec.mutable_manifest() = MlpManifest(c);
  spec.set_world_size(world_size);
  spec.set_seed(c.seed);
  v1::OptimizerConfig* o = spec.mutable_optimizer();
  o->set_lr(optimizer.lr);
  o->set_beta1(0.9);
  o->set_beta2(0.999);
  o->set_eps(1e-8);
  o->set_weight_decay(optimizer.weight_decay);
  o->set_no_decay_norms_and_biases(true);
  o->set_schedule(v1::LR_SCHEDULE_CONSTANT);
  o->set_clip(v1::CLIP_POLICY_NONE);
  o->set_grad_dtype(v1::DTYPE_FP32);
  o->set_scale_by_world_size(true);
  v1::Routes* r = spec.mutable_routes();
  r->set_param_route(v1::PARAM_ROUTE_REPLICATED);
  r->set_grad_route(v1::GRAD_ROUTE_CPU_REDUCTION);
  r->set_chunk_bytes(chunk_bytes);
  return spec;
}

void MlpSampleInput(uint64_t seed, uint64_t step, uint64_t index, uint32_t dim, float* x) {
  const uint64_t key = SplitMix64(SplitMix64(SplitMix64(seed + 2) ^ step) ^ index);
  for (uint32_t j = 0; j < dim; ++j) {
    // 24 random bits: exactly representable, uniform on a grid in [-1, 1).
    const uint64_t bits = SplitMix64(key + j) >> 40;
    x[j] = static_cast<float>(bits) * 0x1.0p-23f - 1.0f;
  }
}

MlpTask::MlpTask(const MlpConfig& config) : config_(config) {
  // The teacher: weights N(0, 1/D) (unit-scale pre-activations for inputs of unit scale),
  // biases N(0, 0.1^2), from the same counter-based generator as hostd's init.
  const uint32_t d = config_.dim;
  const double w_std = 1.0 / std::sqrt(static_cast<double>(d));
  teacher_.resize(config_.layers);
  for (uint32_t l = 0; l < config_.layers; ++l) {
    std::vector<float>& p = teacher_[l];
    p.resize(MlpLayerNumel(d));
    const std::string w = absl::StrCat("teacher.", l, ".weight");
    const std::string b = absl::StrCat("teacher.", l, ".bias");
    for (uint64_t i = 0; i < uint64_t{d} * d; ++i) {
      p[i] = model::InitialValue(config_.seed + 1, w, model::InitKind::kNormal, w_std, i);
    }
    for (uint32_t i = 0; i < d; ++i) {
      p[uint64_t{d} * d + i] =
          model::InitialValue(config_.seed + 1, b, model::InitKind::kNormal, 0.1, i);
    }
  }
}

void MlpTask::Sample(uint64_t step, uint64_t index, float* x, float* y) const {
  const uint32_t d = config_.dim;
  MlpSampleInput(config_.seed, step, index, d, x);
  std::vector<float> a(x, x + d);
  std::vector<float> b(d);
  for (uint32_t l = 0; l < config_.layers; ++l) {
    DenseForward(teacher_[l].data(), a.data(), d, l + 1 < config_.layers, b.data());
    a.swap(b);
  }
  std::copy(a.begin(), a.end(), y);
}

ShardPass::ShardPass(const MlpTask& task, uint64_t step, uint64_t begin, uint64_t end)
    : task_(task),
      layers_(task.config().layers),
      dim_(task.config().dim),
      n_(end > begin ? end - begin : 0) {
  targets_.resize(n_ * dim_);
  activations_.resize(layers_ + 1);
  for (auto& a : activations_) a.resize(n_ * dim_);
  params_.resize(layers_);
  for (uint64_t s = 0; s < n_; ++s) {
    task_.Sample(step, begin + s, &activations_[0][s * dim_], &targets_[s * dim_]);
  }
}

void ShardPass::Forward(uint32_t layer, const uint16_t* params) {
  std::vector<float> widened(MlpLayerNumel(dim_));
  for (size_t i = 0; i < widened.size(); ++i) widened[i] = kernels::Bf16ToFp32(params[i]);
  ForwardFp32(layer, widened.data());
}

void ShardPass::ForwardFp32(uint32_t layer, const float* params) {
  Check(layer == forward_done_ && layer < layers_, "Forward out of order");
  params_[layer].assign(params, params + MlpLayerNumel(dim_));
  const bool tanh_act = layer + 1 < layers_;
  const std::vector<float>& in = activations_[layer];
  std::vector<float>& out = activations_[layer + 1];
  for (uint64_t s = 0; s < n_; ++s) {
    DenseForward(params_[layer].data(), &in[s * dim_], dim_, tanh_act, &out[s * dim_]);
  }
  ++forward_done_;
  if (forward_done_ == layers_) backward_next_ = layers_;
}

double ShardPass::Loss() const {
  Check(forward_done_ == layers_, "Loss before the last Forward");
  const std::vector<float>& out = activations_[layers_];
  double loss = 0;
  for (uint64_t s = 0; s < n_; ++s) {
    double sq = 0;
    for (uint32_t o = 0; o < dim_; ++o) {
      const double e = static_cast<double>(out[s * dim_ + o]) - targets_[s * dim_ + o];
      sq += e * e;
    }
    loss += 0.5 * sq;
  }
  return loss / static_cast<double>(task_.config().batch);
}

void ShardPass::Backward(uint32_t layer, float* grad) {
  Check(backward_next_ != 0 && layer + 1 == backward_next_, "Backward out of order");
  const uint32_t d = dim_;
  const uint64_t dd = uint64_t{d} * d;
  const std::vector<float>& in = activations_[layer];
  const std::vector<float>& out = activations_[layer + 1];
  // delta_ becomes dL/dz of this layer, [n, D].
  if (layer + 1 == layers_) {
    const float inv_batch = 1.0f / static_cast<float>(task_.config().batch);
    delta_.resize(n_ * d);
    for (uint64_t i = 0; i < n_ * d; ++i) delta_[i] = (out[i] - targets_[i]) * inv_batch;
  } else {
    for (uint64_t i = 0; i < n_ * d; ++i) delta_[i] *= 1.0f - out[i] * out[i];
  }
  // Sums over the shard's samples in index order.
  std::fill(grad, grad + MlpLayerNumel(d), 0.0f);
  float* gb = grad + dd;
  for (uint64_t s = 0; s < n_; ++s) {
    const float* dz = &delta_[s * d];
    const float* h = &in[s * d];
    for (uint32_t o = 0; o < d; ++o) {
      const float g = dz[o];
      float* gw = grad + uint64_t{o} * d;
      for (uint32_t i = 0; i < d; ++i) gw[i] += g * h[i];
      gb[o] += g;
    }
  }
  if (layer > 0) {
    // dL/dh_layer = W^T dz, accumulated row by row of W (contiguous).
    const float* w = params_[layer].data();
    delta_prev_.assign(n_ * d, 0.0f);
    for (uint64_t s = 0; s < n_; ++s) {
      const float* dz = &delta_[s * d];
      float* dh = &delta_prev_[s * d];
      for (uint32_t o = 0; o < d; ++o) {
        const float g = dz[o];
        const float* wo = w + uint64_t{o} * d;
        for (uint32_t i = 0; i < d; ++i) dh[i] += wo[i] * g;
      }
    }
    delta_.swap(delta_prev_);
  }
  --backward_next_;
}

}  // namespace slidedp::examples
