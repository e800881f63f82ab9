// `slidedpctl estimate` and `slidedpctl doctor`: preflight checks that need no running hostd.
//
// estimate: from a model manifest (model::LoadModel: "tiny", a directory or a config.json) and
// the planned world size, per-rank batch and sequence length, the memory hostd and each rank
// will need, each figure compared with what this machine offers:
//   hostd shared memory  control + state (FP32 master, m, v: 12 B/param) + params (BF16: 2 B/param)
//                        + gradient rings (world size x 4 slots x chunk_bytes, hostd's defaults),
//                        laid out exactly as hostd does (page-aligned layer regions, 4 KiB headers)
//                        -> against /dev/shm free space;
//   pinned               all of hostd's shared memory (mlock=required, the default)
//                        -> against RLIMIT_MEMLOCK of this shell;
//   host memory          shared memory + hostd's two FP32 reduce buffers of the largest layer
//                        -> against MemAvailable;
//   GPUs                 world size -> against the NVIDIA GPUs visible here (unchecked without a
//                        driver);
//   GPU window           window slots x largest layer x 2 B (default slots: non-decoder layers + 6,
//                        as python_client's attach with prefetch 2);
//   activations          a rough estimate for full recompute: decoder layers x B x S x hidden x 2 B
//                        (checkpointed inputs) + B x S x vocab x 10 B (BF16 logits, FP32 upcast,
//                        grad) + B x S x (4 hidden + 3 intermediate) x 2 B x 2 (one layer's
//                        recompute);
//   per-GPU total        window + activations
//                        -> each GPU figure against --gpu-memory, else nvidia-smi's smallest GPU,
//                        else unchecked.
// doctor: host settings that matter to hostd (memlock, /dev/shm, THP, NUMA, hugepages, GPUs,
// CPUs), each with a verdict OK / WARN / FAIL and one sentence of advice.
//
// Thread-safe: pure functions of their arguments, except the probes in machine.h.
#pragma once

#include <cstdint>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "model/manifest.h"
#include "nlohmann/json.hpp"
#include "slidedpctl/machine.h"

namespace slidedp::ctl {

// Exit code of estimate when a figure does not fit, and of doctor when a check FAILs.
inline constexpr int kExitDoesNotFit = 5;

// hostd's defaults for the gradient rings (hostd/engine.cc kGradRingSlots, config chunk_bytes).
inline constexpr uint32_t kEstimateGradRingSlots = 4;
// python_client's default prefetch; default window slots = 2 * prefetch + 2, plus the
// non-decoder layers when they stream through the window too.
inline constexpr uint32_t kEstimatePrefetch = 2;
// Bytes per parameter of a layer the ranks keep on the GPU and update there (python_client's
// nondecoder="resident"): BF16 weights, FP32 master, m, v, FP32 gradient accumulator.
inline constexpr uint64_t kEstimateResidentBytesPerParam = 18;

// Where the embeddings, final norm and lm_head live. kResident: on each GPU for the whole run,
// updated there (python_client's default on CUDA); kStreamed: through the GPU window like the
// decoder layers, updated by hostd (python_client nondecoder="host", native rankclient ranks).
enum class NonDecoderPlacement { kResident, kStreamed };

struct EstimateInputs {
  uint32_t gpus = 1;          // world size, 1..64
  uint64_t batch = 1;         // sequences per rank per micro-step
  uint64_t seq = 1;           // tokens per sequence
  uint32_t window_slots = 0;  // 0: the default
  NonDecoderPlacement nondecoder = NonDecoderPlacement::kResident;
  uint64_t chunk_bytes = 16ull << 20;
  std::optional<uint64_t> gpu_memory;  // bytes per GPU; nullopt: GPU figures unchecked
  std::string gpu_memory_source;       // "--gpu-memory", "nvidia-smi" or ""
};

inline constexpr char kVerdictOk[] = "OK";
inline constexpr char kVerdictTooLarge[] = "TOO LARGE";
inline constexpr char kVerdictUnchecked[] = "UNCHECKED";
inline constexpr char kVerdictInfo[] = "-";  // a component of a checked figure

struct EstimateFigure {
  std::string key;    // JSON key, e.g. "shm_bytes"
  std::string label;  // table label
  uint64_t value = 0;
  bool is_bytes = true;           // else a count
  std::optional<uint64_t> limit;  // what it is compared with
  std::string against;            // e.g. "/dev/shm free", with the limit for humans
  std::string verdict;            // kVerdict*
  uint64_t over = 0;              // value - limit when TOO LARGE
};

struct Estimate {
  std::string model_source;
  std::string family;
  std::string name;
  uint64_t parameters = 0;
  uint32_t layers = 0;
  uint32_t decoder_layers = 0;
  uint64_t hidden = 0;
  uint64_t intermediate = 0;
  uint64_t vocab = 0;
  std::string largest_layer;
  uint64_t largest_layer_params = 0;
  std::string largest_streamed_layer;  // what one window slot holds
  uint64_t largest_streamed_layer_params = 0;
  uint64_t resident_params = 0;  // kResident: the non-decoder layers' parameters
  uint32_t window_slots = 0;
  bool window_slots_default = true;
  EstimateInputs inputs;
  std::vector<EstimateFigure> figures;
  bool fits = true;
};

// INVALID_ARGUMENT when the manifest lacks model.embed_tokens or an mlp.gate_proj.weight.
absl::StatusOr<Estimate> ComputeEstimate(const model::LoadedModel& model,
                                         const EstimateInputs& inputs, const MachineInfo& machine);

// {"model": {...}, "inputs": {...}, "machine": {...}, "figures": {key: {label, value, unit,
// limit, against, verdict, over}}, "verdict": "OK" | "TOO LARGE"}.
nlohmann::ordered_json EstimateToJson(const Estimate& e, const MachineInfo& machine);
void PrintEstimate(const Estimate& e, std::ostream& out);

inline constexpr char kDoctorOk[] = "OK";
inline constexpr char kDoctorWarn[] = "WARN";
inline constexpr char kDoctorFail[] = "FAIL";

struct DoctorCheck {
  std::string key;  // memory, memlock, dev_shm, transparent_hugepages, numa, hugepages, gpus, cpus
  std::string verdict;  // kDoctor*
  std::string value;
  std::string advice;
};

std::vector<DoctorCheck> RunDoctor(const MachineInfo& machine, bool is_root);
// {"checks": {key: {verdict, value, advice}}, "verdict": worst verdict}.
nlohmann::ordered_json DoctorToJson(const std::vector<DoctorCheck>& checks);
void PrintDoctor(const std::vector<DoctorCheck>& checks, std::ostream& out);
bool DoctorFailed(const std::vector<DoctorCheck>& checks);

}  // namespace slidedp::ctl
