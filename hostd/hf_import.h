// Importing Hugging Face safetensors weights as a job's initial state.
//
// hostd's manifest uses the HF state_dict names and shapes (manifest.h), so a checkpoint tensor
// is matched to a manifest tensor by name. PlanImport checks the whole match before any shared
// memory is created: every manifest tensor must be in the checkpoint with the same shape (its
// dtype may be F32, BF16 or F16); checkpoint tensors the manifest does not use are ignored and
// listed in the plan (HF checkpoints carry e.g. rotary inv_freq buffers, and a tied model's
// checkpoint may carry lm_head.weight). ImportTensor then widens one tensor exactly into the
// FP32 master, reading straight from the file into the destination (F32) or through a bounded
// per-thread buffer (16-bit types), in parallel on the state's thread pool. An ImportPlan is the
// state's InitialWeights (state.h): TrainingState::Create, given it as Options::import, checks the
// plan against its layout, fills the master through ImportTensor, and sets m = v = 0 and the BF16
// params to the round-to-nearest-even cast of the imported master, as for a random init.
//
// Errors: INVALID_ARGUMENT naming the tensor and the checkpoint file for a missing tensor, a
// shape mismatch or a non-finite value; the reader's errors (safetensors.h) for the files.
// Thread safety: PlanImport and ResolveWeightsInit are pure; ImportTensor may run concurrently
// for different destinations when given different pools (or none).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "hostd/state.h"
#include "model/safetensors.h"
#include "slidedp/v1/control.pb.h"

namespace slidedp {
class ThreadPool;
}

namespace slidedp::hostd {

struct ImportSource {
  std::string name;  // the manifest's (and checkpoint's) tensor name
  const model::SafetensorsFile* file = nullptr;
  const model::SafetensorsTensor* tensor = nullptr;
};

struct ImportPlan final : InitialWeights {
  // InitialWeights: the plan must have been made for the state's manifest (INVALID_ARGUMENT
  // otherwise); Fill is ImportTensor of sources[layer][tensor].
  absl::Status Check(const std::vector<LayerInfo>& layers) const override;
  std::string Describe() const override;
  absl::Status Fill(uint32_t layer, uint32_t tensor, float* dst, ThreadPool* pool) const override;

  std::string checkpoint;  // SafetensorsCheckpoint::path()
  size_t num_files = 0;
  // sources[l][t]: where tensor t of manifest layer l comes from.
  std::vector<std::vector<ImportSource>> sources;
  std::vector<std::string> ignored;  // checkpoint tensors the manifest does not use, sorted
  uint64_t bytes = 0;                // bytes read from the files by the import
};

// Matches every tensor of `manifest` to `checkpoint`. The plan points into `checkpoint`, which
// must outlive it. Errors: INVALID_ARGUMENT naming the checkpoint file and the missing tensors
// (up to 8 of them and their count) or the first tensor whose shape differs (both shapes).
absl::StatusOr<ImportPlan> PlanImport(const slidedp::v1::ModelManifest& manifest,
                                      const model::SafetensorsCheckpoint& checkpoint);

// Writes source.tensor->numel FP32 values to `dst`, the exact widening of the stored values,
// split over `pool` (null: the calling thread). Errors: INVALID_ARGUMENT naming the tensor, the
// file and the first element that is not finite; DATA_LOSS or an errno code when a read fails.
absl::Status ImportTensor(const ImportSource& source, float* dst, ThreadPool* pool);

// How a job's weights are initialized: the `init` configuration key resolved for one model.
struct WeightsInit {
  enum class Kind { kRandom, kZeros, kSafetensors };
  Kind kind = Kind::kRandom;
  std::string path;  // kSafetensors: what SafetensorsCheckpoint::Open gets
};

// `init` is "auto", "random", "zeros" or a path. "auto" imports from `model_dir` when it is a
// directory holding model.safetensors or model.safetensors.index.json (the model's own
// directory; empty for built-in models, a config.json path or an RPC-created job), else random.
WeightsInit ResolveWeightsInit(std::string_view init, std::string_view model_dir);

}  // namespace slidedp::hostd
