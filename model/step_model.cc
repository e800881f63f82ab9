#include "model/step_model.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace slidedp::model {
namespace {

using Json = nlohmann::ordered_json;

// Debian's abseil has its own string_view; the API speaks std::string_view.
absl::string_view Av(std::string_view s) { return absl::string_view(s.data(), s.size()); }

// The profile's numeric keys, with their range. `zero_ok`: >= 0 instead of > 0; `at_most_one`:
// also <= 1.
struct ProfileKey {
  const char* key;
  double HardwareProfile::*field;
  bool zero_ok;
  bool at_most_one;
  const char* unit;
};

constexpr ProfileKey kProfileKeys[] = {
    {"h2d_gb_per_s", &HardwareProfile::h2d_gb_per_s, false, false, "GB/s"},
    {"d2h_gb_per_s", &HardwareProfile::d2h_gb_per_s, false, false, "GB/s"},
    {"gpu_bf16_tflops", &HardwareProfile::gpu_bf16_tflops, false, false, "TFLOP/s"},
    {"host_adam_gb_per_s", &HardwareProfile::host_adam_gb_per_s, false, false, "GB/s"},
    {"cpu_reduce_gb_per_s", &HardwareProfile::cpu_reduce_gb_per_s, false, false, "GB/s"},
    {"gpu_adam_gparams_per_s", &HardwareProfile::gpu_adam_gparams_per_s, false, false, "Gparam/s"},
    {"layer_overhead_s", &HardwareProfile::layer_overhead_s, true, false, "s"},
    {"sac_replay_fraction", &HardwareProfile::sac_replay_fraction, true, true, "fraction"},
};

std::string Expected(const ProfileKey& k) {
  if (k.at_most_one) return "a number in [0, 1]";
  return k.zero_ok ? "a number >= 0" : "a number > 0";
}

bool InRange(const ProfileKey& k, double v) {
  if (!std::isfinite(v)) return false;
  if (k.at_most_one && v > 1.0) return false;
  return k.zero_ok ? v >= 0.0 : v > 0.0;
}

absl::Status CheckProfile(const HardwareProfile& p) {
  for (const ProfileKey& k : kProfileKeys) {
    if (!InRange(k, p.*k.field)) {
      return absl::InvalidArgumentError(
          absl::StrCat("profile ", k.key, ": ", p.*k.field, ", expected ", Expected(k)));
    }
  }
  return absl::OkStatus();
}

// Saved activation bytes per token of one decoder layer, and the part of them the offload moves
// (policy.py: for F/Seg/SAC what autograd's hooks see is the (segment) input; SAC's cached
// operator outputs stay on the device). BF16 throughout.
struct Saved {
  double total = 0;
  double offloadable = 0;
};

Saved SavedPerToken(ActivationKind kind, const ModelShape& s) {
  const double h = static_cast<double>(s.hidden);
  const double q = static_cast<double>(s.q_dim);
  const double kv = static_cast<double>(s.kv_dim);
  const double f = static_cast<double>(s.intermediate);
  switch (kind) {
    case ActivationKind::kF:
      return {2 * h, 2 * h};
    case ActivationKind::kSeg:
      return {4 * h, 4 * h};
    case ActivationKind::kSac:
      return {2 * h + 2 * (2 * q + 2 * kv + 2 * h + 2 * f), 2 * h};
    case ActivationKind::kN:
      break;
  }
  const double n = 2 * (8 * h + 2 * q + 2 * kv + 3 * f);
  return {n, n};
}

// Replayed share of a layer's forward: F and Seg all of it, SAC the non-matmul ops, N none.
double ReplayShare(ActivationKind kind, const HardwareProfile& p) {
  switch (kind) {
    case ActivationKind::kF:
    case ActivationKind::kSeg:
      return 1.0;
    case ActivationKind::kSac:
      return p.sac_replay_fraction;
    case ActivationKind::kN:
      break;
  }
  return 0.0;
}

}  // namespace

// Calibration (bench/results, the lent H200 "vm": one H200 SXM, PCIe Gen5, 16-core Xeon, 128 GiB;
// step_model_test.cc checks that this profile reproduces the step times within 10%):
HardwareProfile BuiltinH200Profile() {
  HardwareProfile p;
  p.name = "builtin:h200";
  // gpu_plane_h200_2026-11-29.json part c_h2d_under_load: parameter delivery while hostd pushes
  // and updates, 36.8-40.3 GB/s (alone, part a_h2d: 53-55 GB/s). In a step delivery always runs
  // beside AdamW, so the under-load figure.
  p.h2d_gb_per_s = 40.0;
  // gpu_plane_h200_2026-11-29.json part b_d2h_adam_layer: 800M BF16 gradients (1.6 GB) pushed into
  // hostd's ring slots in median_push_ms 92.5 ms = 17.3 GB/s.
  p.d2h_gb_per_s = 17.3;
  // h200_2026-12-03_issue18/hf_head_to_head_20261203-114623.json, Qwen3-4B seq 1024: fitted to
  // slidedp "on" b16 window_slots=40,resident_layers=6 (1.358 s, GPU-bound) and "off" b16
  // checkpointing=0.25,resident_layers=4 (1.161 s): 440 TFLOP/s puts both within 3%.
  p.gpu_bf16_tflops = 440.0;
  // adam_h200_2026-11-29.json adam_bench, adamw_bf16grad at 800M params and 16 threads:
  // 4.21 Gparam/s, x 30 B/param. (The b8 head-to-head run measured 4.05 Gparam/s with 12 update
  // threads.)
  p.host_adam_gb_per_s = 4.21 * kHostAdamBytesPerParam;
  // python_client_h200_2026-11-29/h2h_slidedp_4b_cpu_route_first_try.json vs h2h_slidedp_4b.json
  // (Qwen3-4B b8, 4.02G params): the CPU route's update took 2.83 s a step, the GPU route's
  // 1.02 s; the difference, 1.81 s for 4.02G x 4 B of FP32 gradients = 8.9 GB/s.
  p.cpu_reduce_gb_per_s = 8.9;
  // The same head-to-head, b16 resident_layers=6: resident_update_s 0.132 s for 6 x 100.9M
  // params = 4.6 Gparam/s (resident_layers=4 run: 0.127 s, 3.2 Gparam/s).
  p.gpu_adam_gparams_per_s = 4.6;
  // gpu_plane_h200_2026-11-29.json part d_pipeline, fwd 16 ms/layer (compute-bound, 36 layers):
  // exposed 34.3 ms of which the boundary drain 28.2 ms; the rest over 36 layers = 0.17 ms.
  p.layer_overhead_s = 1.7e-4;
  // The default: SAC replays norms, rotary, activation function and residual adds,
  // about a tenth of the layer forward. Not measured yet.
  p.sac_replay_fraction = 0.1;
  return p;
}

absl::StatusOr<HardwareProfile> ProfileFromJson(std::string_view json_text,
                                                const HardwareProfile& base,
                                                std::string_view source) {
  Json j;
  try {
    j = Json::parse(json_text);
  } catch (const Json::parse_error& e) {
    return absl::InvalidArgumentError(absl::StrCat(Av(source), ": not JSON: ", e.what()));
  }
  if (!j.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(Av(source), ": expected a JSON object of profile keys, got ", j.type_name()));
  }
  HardwareProfile p = base;
  std::vector<std::string> known = {"name"};
  for (const ProfileKey& k : kProfileKeys) known.emplace_back(k.key);
  for (const auto& [key, value] : j.items()) {
    if (key == "name") {
      if (!value.is_string()) {
        return absl::InvalidArgumentError(
            absl::StrCat(Av(source), ": key 'name': expected a string, got ", value.type_name()));
      }
      p.name = value.get<std::string>();
      continue;
    }
    const ProfileKey* k = nullptr;
    for (const ProfileKey& c : kProfileKeys) {
      if (key == c.key) k = &c;
    }
    if (k == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          Av(source), ": unknown key '", key, "'; expected one of ", absl::StrJoin(known, ", ")));
    }
    if (!value.is_number() || !InRange(*k, value.get<double>())) {
      return absl::InvalidArgumentError(absl::StrCat(Av(source), ": key '", key, "': expected ",
                                                     Expected(*k), " (", k->unit, "), got ",
                                                     value.dump()));
    }
    p.*k->field = value.get<double>();
  }
  if (p.name == base.name && !j.contains("name")) p.name = absl::StrCat(base.name, "+", Av(source));
  return p;
}

Json ProfileToJson(const HardwareProfile& p) {
  Json j;
  j["name"] = p.name;
  for (const ProfileKey& k : kProfileKeys) j[k.key] = p.*k.field;
  return j;
}

absl::StatusOr<ModelShape> ShapeFromModel(const LoadedModel& model) {
  const v1::ModelManifest& m = model.manifest;
  ModelShape s;
  s.name = m.name();
  s.family = m.family();
  s.tied = m.tie_word_embeddings();
  for (const v1::LayerSpec& layer : m.layers()) {
    const uint64_t n = LayerNumel(layer);
    if (layer.kind() == v1::LAYER_KIND_DECODER) {
      s.decoder_params.push_back(n);
      s.decoder_params_total += n;
    } else {
      s.nondecoder_params += n;
    }
    for (const v1::TensorSpec& t : layer.tensors()) {
      if (t.shape_size() != 2) continue;
      const uint64_t rows = static_cast<uint64_t>(t.shape(0));
      if (t.name() == "model.embed_tokens.weight") {
        s.vocab = rows;
        s.hidden = static_cast<uint64_t>(t.shape(1));
      } else if (s.intermediate == 0 && absl::EndsWith(t.name(), "mlp.gate_proj.weight")) {
        s.intermediate = rows;
      } else if (s.q_dim == 0 && absl::EndsWith(t.name(), "self_attn.q_proj.weight")) {
        s.q_dim = rows;
      } else if (s.kv_dim == 0 && absl::EndsWith(t.name(), "self_attn.k_proj.weight")) {
        s.kv_dim = rows;
      }
    }
  }
  const auto missing = [&](std::string_view what) {
    return absl::InvalidArgumentError(
        absl::StrCat(model.source, ": the manifest has no ", Av(what)));
  };
  if (s.hidden == 0) return missing("model.embed_tokens.weight [vocab, hidden]");
  if (s.intermediate == 0) return missing("mlp.gate_proj.weight [intermediate, hidden]");
  if (s.q_dim == 0) return missing("self_attn.q_proj.weight [heads x head_dim, hidden]");
  if (s.kv_dim == 0) return missing("self_attn.k_proj.weight [kv_heads x head_dim, hidden]");
  if (s.decoder_params.empty()) return missing("decoder layer");
  // Head counts only label the output; the figures need q_dim and kv_dim.
  const Json config = Json::parse(model.config_json, nullptr, /*allow_exceptions=*/false);
  if (config.is_object()) {
    const auto get = [&](const char* key) -> uint64_t {
      auto it = config.find(key);
      return it != config.end() && it->is_number_unsigned() ? it->get<uint64_t>() : 0;
    };
    s.heads = get("num_attention_heads");
    s.kv_heads = get("num_key_value_heads");
    if (s.kv_heads == 0) s.kv_heads = s.heads;
    s.head_dim = get("head_dim");
    if (s.head_dim == 0 && s.heads != 0) s.head_dim = s.q_dim / s.heads;
  }
  return s;
}

std::string_view GradRouteName(GradRoute route) {
  return route == GradRoute::kGpuReduction ? "gpu_reduction" : "cpu_reduction";
}

absl::StatusOr<StepPrediction> PredictStep(const ModelShape& shape, const StepInputs& in,
                                           const HardwareProfile& prof) {
  if (in.gpus < 1) return absl::InvalidArgumentError("gpus: 0, expected >= 1");
  if (!(in.batch > 0) || !std::isfinite(in.batch)) {
    return absl::InvalidArgumentError(absl::StrCat("batch: ", in.batch, ", expected > 0"));
  }
  if (in.seq < 1) return absl::InvalidArgumentError("seq: 0, expected >= 1");
  if (in.window_slots < 1) return absl::InvalidArgumentError("window_slots: 0, expected >= 1");
  if (in.layout.size() != shape.decoder_params.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "layout: ", in.layout.size(), " layers, the model has ", shape.decoder_params.size()));
  }
  if (absl::Status st = CheckProfile(prof); !st.ok()) return st;

  const double r = in.gpus;
  const double seq = static_cast<double>(in.seq);
  const double tokens = in.batch * seq;  // per rank
  const double flops_per_s = prof.gpu_bf16_tflops * 1e12;
  const double h2d_bps = prof.h2d_gb_per_s * 1e9;
  const double d2h_bps = prof.d2h_gb_per_s * 1e9;
  const double adam_bps = prof.host_adam_gb_per_s * 1e9;
  // Causal attention forward: QK^T and AV, 2 x 2 x S^2 x q_dim per sequence, halved.
  const double attn_fwd = 2.0 * in.batch * seq * seq * static_cast<double>(shape.q_dim);

  StepPrediction o;
  double streamed_params = 0, resident_params = 0, offloaded = 0;
  double kept = 0, transient = 0;
  std::vector<double> streamed;  // forward order
  for (size_t i = 0; i < in.layout.size(); ++i) {
    const LayerPolicy& p = in.layout[i];
    const double n = static_cast<double>(shape.decoder_params[i]);
    const double fwd = 2.0 * n * tokens + attn_fwd;
    const double share = ReplayShare(p.kind, prof);
    o.forward_flops += fwd;
    o.backward_flops += 2.0 * fwd;
    o.replay_flops += share * fwd;
    o.attention_flops += (3.0 + share) * attn_fwd;
    if (share == 1.0) ++o.replayed_layers;
    const Saved saved = SavedPerToken(p.kind, shape);
    const double off = p.ratio * saved.offloadable * tokens;
    offloaded += off;
    kept += saved.total * tokens - off;
    if (p.kind != ActivationKind::kN) {
      transient = std::max(transient, SavedPerToken(ActivationKind::kN, shape).total * tokens);
    }
    if (p.resident) {
      resident_params += n;
    } else {
      streamed_params += n;
      streamed.push_back(n);
    }
  }
  const double lm = 2.0 * static_cast<double>(shape.hidden * shape.vocab) * tokens;
  o.lm_head_flops = 3.0 * lm;
  o.forward_flops += lm;
  o.backward_flops += 2.0 * lm;
  o.compute_flops_s = (o.forward_flops + o.backward_flops + o.replay_flops) / flops_per_s;
  o.resident_update_s = resident_params / (prof.gpu_adam_gparams_per_s * 1e9);
  o.compute_s = o.compute_flops_s + o.resident_update_s;

  // The window keeps the last window_slots streamed layers of forward for backward; the others
  // are fetched again (the head-to-head's h2d_bytes: 58 fetches for 32 streamed layers and 6
  // slots, 36 for 36 layers and 40 slots).
  o.streamed_layers = static_cast<uint32_t>(streamed.size());
  const size_t refetched =
      streamed.size() > in.window_slots ? streamed.size() - in.window_slots : 0;
  o.refetched_layers = static_cast<uint32_t>(refetched);
  double fetched_params = streamed_params;
  for (size_t i = 0; i < refetched; ++i) fetched_params += streamed[i];
  o.offloaded_bytes = offloaded;
  // Every rank fetches its own copy (replicated delivery) and offloads its own activations; all of
  // it crosses the host's side of PCIe, which the profile's rates describe.
  o.h2d_bytes = r * (fetched_params * 2.0 + offloaded);
  o.d2h_bytes = in.route == GradRoute::kGpuReduction
                    ? streamed_params * 2.0 + r * offloaded     // one reduced BF16 gradient a layer
                    : r * (streamed_params * 4.0 + offloaded);  // each rank's FP32 gradient
  o.pcie_bytes = o.h2d_bytes + o.d2h_bytes;
  o.host.push_back(
      {"h2d", "H2D: parameter delivery + activation reload", o.h2d_bytes, o.h2d_bytes / h2d_bps});
  o.host.push_back({"d2h",
                    in.route == GradRoute::kGpuReduction
                        ? "D2H: one reduced BF16 gradient per layer + activation offload"
                        : "D2H: every rank's FP32 gradient + activation offload",
                    o.d2h_bytes, o.d2h_bytes / d2h_bps});
  const double adam_bytes = streamed_params * kHostAdamBytesPerParam;
  o.host.push_back({"host_adam", "hostd AdamW (30 B/param)", adam_bytes, adam_bytes / adam_bps});
  if (in.route == GradRoute::kCpuReduction) {
    const double reduce_bytes = r * streamed_params * 4.0;
    o.host.push_back({"cpu_reduce", "CPU reduction of the ranks' FP32 gradients", reduce_bytes,
                      reduce_bytes / (prof.cpu_reduce_gb_per_s * 1e9)});
  }
  for (const HostResource& h : o.host) {
    if (o.binding.empty() || h.seconds > o.host_s) {
      o.host_s = h.seconds;
      o.binding = h.key;
    }
  }

  // The first streamed layer's fetch starts the step with nothing to hide it; the last update
  // (of the first layer, which backward reaches last) drains after the GPU is done.
  if (!streamed.empty()) {
    o.first_fetch_s = r * streamed.front() * 2.0 / h2d_bps;
    o.last_update_s = streamed.front() * kHostAdamBytesPerParam / adam_bps;
  }
  o.overhead_s = prof.layer_overhead_s * static_cast<double>(in.layout.size());
  o.exposure_s = o.first_fetch_s + o.last_update_s + o.overhead_s;
  o.step_s = std::max(o.compute_s, o.host_s) + o.exposure_s;
  o.regime = o.host_s > o.compute_s ? "host-bound" : "GPU-bound";
  o.tokens_per_s = r * tokens / o.step_s;

  double largest_streamed = 0;
  for (double n : streamed) largest_streamed = std::max(largest_streamed, n);
  o.window_bytes = static_cast<double>(in.window_slots) * largest_streamed * 2.0;
  o.resident_bytes =
      (resident_params + static_cast<double>(shape.nondecoder_params)) * kResidentBytesPerParam;
  o.activation_bytes = kept;
  o.replay_bytes = transient;
  o.logits_bytes = tokens * static_cast<double>(shape.vocab) * (2 + 4 + 4);
  o.peak_gpu_bytes =
      o.window_bytes + o.resident_bytes + o.activation_bytes + o.replay_bytes + o.logits_bytes;
  return o;
}

absl::StatusOr<StepPlan> PlanStep(const ModelShape& shape, const StepInputs& inputs,
                                  const HardwareProfile& profile) {
  StepPlan plan;
  plan.shape = shape;
  plan.inputs = inputs;
  plan.profile = profile;
  absl::StatusOr<StepPrediction> at = PredictStep(shape, inputs, profile);
  if (!at.ok()) return at.status();
  plan.at = *std::move(at);
  const double global_batch = inputs.batch * inputs.gpus;
  StepInputs one = inputs;
  one.gpus = 1;
  one.batch = global_batch;
  absl::StatusOr<StepPrediction> single = PredictStep(shape, one, profile);
  if (!single.ok()) return single.status();
  plan.c1_s = single->compute_s;
  plan.h1_s = single->host_s;
  plan.r_cross = plan.h1_s > 0 ? plan.c1_s / plan.h1_s : 0;
  for (uint32_t gpus : {1u, 2u, 4u, 8u}) {
    ScalingRow row;
    row.gpus = gpus;
    StepInputs weak = inputs;
    weak.gpus = gpus;
    absl::StatusOr<StepPrediction> w = PredictStep(shape, weak, profile);
    if (!w.ok()) return w.status();
    row.weak = *std::move(w);
    row.strong_batch = global_batch / gpus;
    if (row.strong_batch >= 1.0) {
      StepInputs strong = inputs;
      strong.gpus = gpus;
      strong.batch = row.strong_batch;
      absl::StatusOr<StepPrediction> s = PredictStep(shape, strong, profile);
      if (!s.ok()) return s.status();
      row.strong = *std::move(s);
    }
    plan.scaling.push_back(std::move(row));
  }
  return plan;
}

}  // namespace slidedp::model
