// native_reference: the native trainer's training in one process, with no hostd: what R rank
// processes through hostd must reproduce bit for bit.
//
//   native_reference --world-size R [model/run flags] [--out FILE]
//
// Init as hostd inits a job created over RPC (InitialValue with initializer_range 0.02; m = v = 0;
// params = RoundToBf16(master)). Per step t: for r = 0..R-1 in order, shard r's gradient with
// the trainer's ShardPass, summed in FP32 in rank order (g = g_0; g += g_1; ...: hostd's
// reducer); then per tensor the scalar AdamW kernel with hostd's scalars (LearningRate(cfg, t),
// weight decay 0 for no_decay tensors, grad_scale 1/R). Every step's update is applied, the
// last one included, as hostd does.
//
// Output: the global loss per step and, per layer, LayerStateChecksum (hostd's
// `slidedpctl layers --checksums`), on stdout and with --out FILE as JSON:
//   {"layers":[{"layer":0,"checksum":"%016x"},...],"loss":[...per step...]}
// --params-out FILE writes the final BF16 parameters of every layer, layers in order, raw
// little-endian (what native_gpu_trainer --params-out writes, for a comparison with tolerance).
#include <CLI/CLI.hpp>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status_macros.h"
#include "examples/native_trainer/mlp_flags.h"
#include "examples/native_trainer/mlp_task.h"
#include "kernels/cpu/adamw.h"
#include "kernels/cpu/bf16.h"
#include "model/job_spec.h"
#include "model/layer_checksum.h"
#include "model/lr_schedule.h"
#include "model/manifest.h"

namespace slidedp::examples {
namespace {

namespace v1 = slidedp::v1;

// hostd's initializer_range for a job created over RPC (LoadedModel's default).
constexpr double kInitializerRange = 0.02;

struct LayerState {
  std::vector<float> master, m, v, grad, shard_grad;
  std::vector<uint16_t> params;
};

// `switch_step` > 0: steps after it run with `switch_world` ranks (a job checkpointed at that
// step and resumed with another world size).
absl::Status Run(const MlpRunFlags& f, const std::string& out_path, const std::string& params_out,
                 uint64_t switch_step, uint32_t switch_world) {
  RETURN_IF_ERROR(ValidateMlpConfig(f.model, f.world_size));
  if (switch_step > 0) RETURN_IF_ERROR(ValidateMlpConfig(f.model, switch_world));
  const v1::JobSpec spec = MlpJobSpec(f.model, f.optimizer, f.world_size, /*chunk_bytes=*/65536);
  ASSIGN_OR_RETURN(const v1::OptimizerConfig cfg,
                   model::NormalizeOptimizerConfig(spec.optimizer()));
  const v1::ModelManifest& manifest = spec.manifest();
  const MlpTask task(f.model);
  const uint32_t layers = f.model.layers;
  const uint64_t numel = MlpLayerNumel(f.model.dim);

  std::vector<LayerState> state(layers);
  for (uint32_t l = 0; l < layers; ++l) {
    LayerState& s = state[l];
    s.master.resize(numel);
    s.m.assign(numel, 0.0f);
    s.v.assign(numel, 0.0f);
    s.grad.resize(numel);
    s.shard_grad.resize(numel);
    s.params.resize(numel);
    uint64_t offset = 0;
    for (const v1::TensorSpec& t : manifest.layers(static_cast<int>(l)).tensors()) {
      const uint64_t n = model::TensorNumel(t);
      const model::InitKind kind = model::TensorInitKind(t);
      for (uint64_t i = 0; i < n; ++i) {
        s.master[offset + i] =
            model::InitialValue(f.model.seed, t.name(), kind, kInitializerRange, i);
      }
      offset += n;
    }
    for (uint64_t i = 0; i < numel; ++i) s.params[i] = kernels::RoundToBf16(s.master[i]);
  }

  std::vector<double> losses;
  for (uint64_t t = 1; t <= f.steps; ++t) {
    const uint32_t world = switch_step > 0 && t > switch_step ? switch_world : f.world_size;
    const uint64_t per_rank = f.model.batch / world;
    const double grad_scale = cfg.scale_by_world_size() ? 1.0 / static_cast<double>(world) : 1.0;
    double loss = 0;
    for (uint32_t r = 0; r < world; ++r) {
      ShardPass pass(task, t, r * per_rank, (r + 1) * per_rank);
      for (uint32_t l = 0; l < layers; ++l) pass.Forward(l, state[l].params.data());
      loss += pass.Loss();
      for (uint32_t l = layers; l-- > 0;) {
        LayerState& s = state[l];
        pass.Backward(l, s.shard_grad.data());
        if (r == 0) {
          s.grad = s.shard_grad;
        } else {
          for (uint64_t i = 0; i < numel; ++i) s.grad[i] += s.shard_grad[i];
        }
      }
    }
    losses.push_back(loss);
    const double lr = model::LearningRate(cfg, t);
    for (uint32_t l = 0; l < layers; ++l) {
      LayerState& s = state[l];
      uint64_t offset = 0;
      for (const v1::TensorSpec& ts : manifest.layers(static_cast<int>(l)).tensors()) {
        const uint64_t n = model::TensorNumel(ts);
        const double wd =
            cfg.no_decay_norms_and_biases() && ts.no_decay() ? 0.0 : cfg.weight_decay();
        const kernels::AdamWScalars k =
            kernels::MakeAdamWScalars(lr, cfg.beta1(), cfg.beta2(), cfg.eps(), wd, grad_scale, t);
        kernels::AdamWUpdate(kernels::Isa::kScalar, k, s.grad.data() + offset,
                             kernels::GradType::kFp32, s.master.data() + offset,
                             s.m.data() + offset, s.v.data() + offset, s.params.data() + offset, n);
        offset += n;
      }
    }
    std::printf("step %4llu  loss %.6e (global)\n", static_cast<unsigned long long>(t), loss);
  }

  std::string json = "{\"layers\":[";
  for (uint32_t l = 0; l < layers; ++l) {
    const LayerState& s = state[l];
    const uint64_t sum = model::LayerStateChecksum(l, s.master.data(), s.m.data(), s.v.data(),
                                                   s.params.data(), numel);
    std::printf("layer %u %s checksum %016llx\n", l, MlpLayerName(l).c_str(),
                static_cast<unsigned long long>(sum));
    absl::StrAppend(&json, l == 0 ? "" : ",", "{\"layer\":", l, ",\"checksum\":\"",
                    absl::StrFormat("%016x", sum), "\"}");
  }
  absl::StrAppend(&json, "],\"loss\":[");
  for (size_t i = 0; i < losses.size(); ++i) {
    absl::StrAppend(&json, i == 0 ? "" : ",", absl::StrFormat("%.17g", losses[i]));
  }
  absl::StrAppend(&json, "]}\n");
  if (!out_path.empty()) {
    std::FILE* out = std::fopen(out_path.c_str(), "w");
    if (out == nullptr) return ErrnoStatus(absl::StrCat("--out: cannot write ", out_path));
    const bool ok = std::fwrite(json.data(), 1, json.size(), out) == json.size();
    if (std::fclose(out) != 0 || !ok) return ErrnoStatus(absl::StrCat("--out: writing ", out_path));
  }
  if (!params_out.empty()) {
    std::FILE* out = std::fopen(params_out.c_str(), "wb");
    if (out == nullptr) return ErrnoStatus(absl::StrCat("--params-out: cannot write ", params_out));
    bool ok = true;
    for (const LayerState& s : state) {
      ok = ok && std::fwrite(s.params.data(), 2, numel, out) == numel;
    }
    if (std::fclose(out) != 0 || !ok) {
      return ErrnoStatus(absl::StrCat("--params-out: writing ", params_out));
    }
  }
  return absl::OkStatus();
}

}  // namespace
}  // namespace slidedp::examples

int main(int argc, char** argv) {
  slidedp::examples::MlpRunFlags f;
  std::string out;
  std::string params_out;
  CLI::App app{"native_reference: the native MLP trainer's training in one process"};
  slidedp::examples::AddMlpRunFlags(app, &f);
  app.add_option("--out", out, "Write the layer checksums and losses as JSON to this file");
  app.add_option("--params-out", params_out,
                 "Write the final BF16 parameters (raw, layers in order) to this file");
  uint64_t switch_step = 0;
  uint32_t switch_world = 1;
  app.add_option("--resume-step", switch_step,
                 "Steps after this one run with --resume-world-size ranks (0: never), as a job "
                 "checkpointed at that step and resumed with another world size");
  app.add_option("--resume-world-size", switch_world, "World size after --resume-step");
  CLI11_PARSE(app, argc, argv);
  const absl::Status s = slidedp::examples::Run(f, out, params_out, switch_step, switch_world);
  if (!s.ok()) {
    std::fprintf(stderr, "native_reference: %s\n", s.ToString().c_str());
    return 1;
  }
  return 0;
}
