// The analytical step-time model of the SlideDP paper (section 3.4, "Regimes and scaling"):
//
//   T_step ~ max{C, H} + E
//
//   C  GPU compute per rank: forward + backward + replay (+ the device AdamW of resident decoder
//      layers), at an effective BF16 rate;
//   H  the bottleneck of host and transfer service: H2D (parameter delivery, activation reload),
//      D2H (gradients, activation offload), hostd's AdamW, and on the CPU-reduction route the
//      CPU's reduction of the ranks' FP32 gradients; the largest binds;
//   E  exposure at pipeline boundaries: the first layer's parameter fetch and the last layer's
//      update are not hidden, plus a launch/sync overhead per layer.
//
// Host-bound when H > C, else GPU-bound. Strong scaling C(R) ~ C(1)/R gives the crossover
// R_cross ~ C(1)/H. The inputs: a model manifest (its shapes), world size, per-rank batch,
// sequence length, a per-layer layout (model/layout.h) and a hardware profile of measured rates.
// Every time is in seconds per step, every byte count per step.
//
// Pure functions; thread-safe.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "model/layout.h"
#include "model/manifest.h"
#include "nlohmann/json.hpp"

namespace slidedp::model {

// Bytes hostd's AdamW moves per parameter: FP32 master, m, v read and written (24), the BF16
// gradient read (2), the BF16 parameter written (2), and the gradient's staging copy (2).
inline constexpr double kHostAdamBytesPerParam = 30.0;
// A resident layer on the GPU: BF16 weights, FP32 master, m, v, FP32 gradient accumulator.
inline constexpr double kResidentBytesPerParam = 18.0;
// python_client's default window: 2 x prefetch (2) + 2 slots.
inline constexpr uint32_t kDefaultWindowSlots = 6;

// Measured service rates of one machine. Every key of ProfileFromJson is a field here.
struct HardwareProfile {
  std::string name;
  double h2d_gb_per_s = 0;            // host -> GPU, shared by all ranks (GB = 1e9 B)
  double d2h_gb_per_s = 0;            // GPU -> host ring slots, shared by all ranks
  double gpu_bf16_tflops = 0;         // effective rate of the decoder's matmuls and attention
  double host_adam_gb_per_s = 0;      // hostd's AdamW, at kHostAdamBytesPerParam
  double cpu_reduce_gb_per_s = 0;     // the CPU route's reduction of FP32 gradients
  double gpu_adam_gparams_per_s = 0;  // device AdamW of resident decoder layers
  double layer_overhead_s = 0;        // launch + sync per decoder layer and step
  double sac_replay_fraction = 0;     // SAC's replay as a fraction of the layer forward
};

// One H200 SXM (PCIe Gen5), a 16-core Xeon with AVX-512 BF16: bench/results, see step_model.cc.
HardwareProfile BuiltinH200Profile();

// `base` with the keys of a JSON object overridden. `source` names the text in errors.
// INVALID_ARGUMENT "<source>: ..." for malformed JSON, a non-object, an unknown key (naming the
// known ones) or a bad value (naming the key and the expected type and range).
absl::StatusOr<HardwareProfile> ProfileFromJson(std::string_view json_text,
                                                const HardwareProfile& base,
                                                std::string_view source);
nlohmann::ordered_json ProfileToJson(const HardwareProfile& p);

// The shapes the model needs, read from a manifest.
struct ModelShape {
  std::string name;
  std::string family;
  uint64_t hidden = 0;
  uint64_t intermediate = 0;
  uint64_t q_dim = 0;   // heads x head_dim (q_proj's rows)
  uint64_t kv_dim = 0;  // kv_heads x head_dim (k_proj's rows)
  uint64_t heads = 0;   // from config.json; 0 when it does not say
  uint64_t kv_heads = 0;
  uint64_t head_dim = 0;
  uint64_t vocab = 0;
  bool tied = false;
  std::vector<uint64_t> decoder_params;  // per decoder layer, forward order
  uint64_t decoder_params_total = 0;
  uint64_t nondecoder_params = 0;  // embedding, final norm, lm_head: resident on each GPU
};

// INVALID_ARGUMENT "<source>: ..." when the manifest lacks embed_tokens, q/k_proj or gate_proj.
absl::StatusOr<ModelShape> ShapeFromModel(const LoadedModel& model);

enum class GradRoute { kGpuReduction, kCpuReduction };
std::string_view GradRouteName(GradRoute route);  // "gpu_reduction", "cpu_reduction"

struct StepInputs {
  uint32_t gpus = 1;                // R
  double batch = 1;                 // sequences per rank (fractional in strong-scaling rows)
  uint64_t seq = 1;                 // tokens per sequence
  std::vector<LayerPolicy> layout;  // one per decoder layer
  uint32_t window_slots = kDefaultWindowSlots;
  GradRoute route = GradRoute::kGpuReduction;
};

struct HostResource {
  std::string key;  // h2d, d2h, host_adam, cpu_reduce
  std::string label;
  double bytes = 0;
  double seconds = 0;
};

struct StepPrediction {
  // C
  double forward_flops = 0;  // per rank
  double backward_flops = 0;
  double replay_flops = 0;
  double attention_flops = 0;  // part of the three above: causal attention, forward x 3 + replay
  double lm_head_flops = 0;    // part of forward/backward: 6 x hidden x vocab x tokens
  double compute_flops_s = 0;  // all flops at gpu_bf16_tflops
  double resident_update_s = 0;
  double compute_s = 0;  // C
  // H
  std::vector<HostResource> host;  // h2d, d2h, host_adam[, cpu_reduce]
  double host_s = 0;               // H
  std::string binding;             // key of the largest
  // E
  double first_fetch_s = 0;
  double last_update_s = 0;
  double overhead_s = 0;
  double exposure_s = 0;  // E
  double step_s = 0;      // T
  std::string regime;     // "host-bound" | "GPU-bound"
  double tokens_per_s = 0;
  // Peak GPU memory per rank, an estimate.
  double window_bytes = 0;
  double resident_bytes = 0;    // resident decoder layers + non-decoder layers, 18 B/param
  double activation_bytes = 0;  // kept activations of every layer, after offload
  double replay_bytes = 0;      // one layer's full activations while it is replayed
  double logits_bytes = 0;      // B x S x vocab x (2 + 4 + 4)
  double peak_gpu_bytes = 0;
  double offloaded_bytes = 0;  // per rank and direction
  double h2d_bytes = 0;        // all ranks
  double d2h_bytes = 0;
  double pcie_bytes = 0;  // both directions
  uint32_t streamed_layers = 0;
  uint32_t refetched_layers = 0;  // fetched again in backward (not kept by the window)
  uint32_t replayed_layers = 0;   // F, Seg (SAC counts as a fraction)
};

struct ScalingRow {
  uint32_t gpus = 0;
  StepPrediction weak;                   // the per-rank batch of the inputs
  std::optional<StepPrediction> strong;  // the global batch of the inputs; absent below 1/rank
  double strong_batch = 0;
};

struct StepPlan {
  ModelShape shape;
  StepInputs inputs;
  HardwareProfile profile;
  StepPrediction at;                // the inputs
  double c1_s = 0;                  // C(1): the global batch on one GPU
  double h1_s = 0;                  // H at R = 1
  double r_cross = 0;               // C(1) / H(1)
  std::vector<ScalingRow> scaling;  // R = 1, 2, 4, 8
};

// INVALID_ARGUMENT naming the field: gpus 0, batch <= 0, seq 0, window_slots 0, a layout whose
// size is not the model's decoder layers, a profile rate <= 0.
absl::StatusOr<StepPrediction> PredictStep(const ModelShape& shape, const StepInputs& inputs,
                                           const HardwareProfile& profile);
absl::StatusOr<StepPlan> PlanStep(const ModelShape& shape, const StepInputs& inputs,
                                  const HardwareProfile& profile);

}  // namespace slidedp::model
