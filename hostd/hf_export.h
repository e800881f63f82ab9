// Exporting a job's weights as a Hugging Face model directory (the inverse of hf_import.h).
//
// ExportHf writes, for the state's manifest (whose names and shapes are the HF state_dict's):
//   model.safetensors                  when every tensor fits one shard, else
//   model-0000k-of-0000n.safetensors   shards of at most max_shard_bytes of tensor data (a tensor
//                                      larger than that gets a shard of its own), and
//   model.safetensors.index.json       {"metadata": {"total_size"}, "weight_map"} (only with
//                                      several shards, as transformers' save_pretrained does);
//   config.json                        the job's HF config with "torch_dtype" set to the export's
//                                      dtype and "tie_word_embeddings" to the manifest's;
//   generation_config.json             when the config names bos/eos/pad token ids.
// A tied model's manifest has no lm_head, and neither has the export (transformers ties
// lm_head.weight to model.embed_tokens.weight from the config).
//
// Tensors are FP32 (the master, written straight from the state segment) or BF16 (the master
// cast with kernels::CastFp32ToBf16, round-to-nearest-even: the same bits as the params segment
// that the ranks read), streamed through one fixed buffer of kExportBufferBytes: memory does not
// grow with the model. Files go to "<out_dir>.tmp" (with a marker file while incomplete), each
// fsynced, then the directory is renamed to out_dir (an existing out_dir is swapped atomically
// with renameat2(RENAME_EXCHANGE) when `overwrite`, and the old content removed) and the parent
// directory fsynced: a crash leaves either the old out_dir or the new one, plus possibly a
// "<out_dir>.tmp" with the marker, which the next export removes.
//
// Consistency is the caller's job: the state must not change while ExportHf runs (Engine holds
// the updates, see Engine::ExportHF).
//
// Errors: INVALID_ARGUMENT for a relative out_dir, an unknown dtype or a config that does not
// describe the manifest (naming the field); ALREADY_EXISTS when out_dir is a non-empty directory
// and not `overwrite`; FAILED_PRECONDITION when out_dir is not a directory or "<out_dir>.tmp" is
// not an earlier export's; NOT_FOUND when out_dir's parent does not exist; errno-based codes
// (PERMISSION_DENIED, RESOURCE_EXHAUSTED for ENOSPC, ...) naming the path for I/O failures;
// CANCELLED when `cancelled` returned true. Nothing is left under out_dir's name on failure.
// Thread safety: ExportHf reads the state and uses `pool` for the casts; one call at a time per
// out_dir.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/cpu/adamw.h"
#include "slidedp/v1/control.pb.h"

namespace slidedp {
class ThreadPool;
}

namespace slidedp::hostd {

class TrainingState;

enum class ExportDtype { kBf16, kFp32 };

// transformers' save_pretrained default shard size ("5GB").
inline constexpr uint64_t kDefaultMaxShardBytes = uint64_t{5} << 30;
// The staging buffer of the BF16 cast and the unit of each write.
inline constexpr uint64_t kExportBufferBytes = uint64_t{16} << 20;
// Present in "<out_dir>.tmp" until the export is complete.
inline constexpr std::string_view kExportMarkerFile = ".slidedp-export-incomplete";

struct HfExportOptions {
  std::string out_dir;  // absolute
  ExportDtype dtype = ExportDtype::kBf16;
  uint64_t max_shard_bytes = kDefaultMaxShardBytes;  // 0: the default
  bool overwrite = false;
  std::string config_json;  // the job's HF config.json text (required)
  kernels::Isa isa = kernels::Isa::kScalar;
  std::function<bool()> cancelled;  // polled between writes; may be empty
};

struct HfExportResult {
  std::string out_dir;             // normalized
  std::vector<std::string> files;  // names inside out_dir, in the order written
  uint64_t tensor_bytes = 0;
  uint32_t tensors = 0;
  double seconds = 0;
};

// One file of the export and the tensors it holds, as (layer, tensor index within the layer).
struct ExportShard {
  std::string file;
  std::vector<std::pair<uint32_t, uint32_t>> tensors;
  uint64_t bytes = 0;  // tensor data
};

// Splits the manifest's tensors, in manifest order, into shards of at most `max_shard_bytes`
// (0: the default) of `dtype` data; names them as transformers does. Pure.
std::vector<ExportShard> PlanExportShards(const slidedp::v1::ModelManifest& manifest,
                                          ExportDtype dtype, uint64_t max_shard_bytes);

// The config.json written by the export: `config_json` with torch_dtype ("bfloat16"/"float32";
// also "dtype" when the config has that key) and tie_word_embeddings set. INVALID_ARGUMENT when
// it is not an HF config (ManifestFromHfConfig's errors) or describes another model than
// `manifest` (a different manifest hash).
absl::StatusOr<std::string> ExportConfigJson(std::string_view config_json,
                                             const slidedp::v1::ModelManifest& manifest,
                                             ExportDtype dtype);

// Checks out_dir without writing anything: absolute, its parent an existing directory, and, when
// it exists, a directory that is empty or `overwrite`. Returns the normalized path.
absl::StatusOr<std::string> CheckExportDestination(const std::string& out_dir, bool overwrite);

// Writes the export (see the overview). `pool` may be null (casts on the calling thread).
absl::StatusOr<HfExportResult> ExportHf(const TrainingState& state, const HfExportOptions& options,
                                        ThreadPool* pool);

}  // namespace slidedp::hostd
