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
// grow with the model.
//
// Ownership marker. Every directory the export creates holds kExportMarkerFile, a small JSON
// document written before any other file: {"written_by": "hostd", "hostd_version", "job_id",
// "version" (the layers' committed version), "dtype", "files": [the names it writes]}. hostd
// removes or replaces only what such a marker covers: a directory is "hostd's" when it holds a
// valid marker and nothing but regular files the marker lists (an empty directory counts too).
// Anything else (another file, a sub-directory, a symlink, a directory without a marker) is never
// removed: the export is refused with FAILED_PRECONDITION naming the directory and those entries.
// Removal unlinks the listed files one by one, the marker last, then rmdir(2)s the directory:
// never recursively.
//
// Files go to "<out_dir>.tmp", each fsynced, then the directory is renamed to out_dir (when
// `overwrite` and out_dir is an earlier export of hostd, the two are swapped atomically with
// renameat2(RENAME_EXCHANGE) and the old export's files removed; if the swapped-out directory
// turned out to hold something hostd did not write, the swap is undone and the export refused)
// and the parent directory fsynced: a crash leaves either the old out_dir or the new one, plus
// possibly a "<out_dir>.tmp" with a marker, which the next export removes (only the files that
// marker lists; a "<out_dir>.tmp" holding anything else is refused, never removed).
//
// Consistency is the caller's job: the state must not change while ExportHf runs (Engine holds
// the updates, see Engine::ExportHF). Where hostd may write at all (output_roots) is the
// caller's check too (hostd/output_roots.h).
//
// Errors: INVALID_ARGUMENT for a relative out_dir, an unknown dtype or a config that does not
// describe the manifest (naming the field); ALREADY_EXISTS when out_dir is a non-empty directory
// and not `overwrite`; FAILED_PRECONDITION when out_dir is not a directory, when `overwrite` but
// out_dir holds entries hostd did not write, or when "<out_dir>.tmp" is not a directory or
// holds such entries (each message names the directory and the entries); NOT_FOUND when
// out_dir's parent does not exist; errno-based codes (PERMISSION_DENIED, RESOURCE_EXHAUSTED for
// ENOSPC, ...) naming the path for I/O failures; CANCELLED when `cancelled` returned true.
// Nothing is left under out_dir's name on failure, and nothing hostd did not write is removed.
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
// The ownership marker in every directory an export creates (see the overview).
inline constexpr std::string_view kExportMarkerFile = ".slidedp-export.json";

struct HfExportOptions {
  std::string out_dir;  // absolute
  ExportDtype dtype = ExportDtype::kBf16;
  uint64_t max_shard_bytes = kDefaultMaxShardBytes;  // 0: the default
  bool overwrite = false;   // replace out_dir when it is an earlier export of hostd
  std::string config_json;  // the job's HF config.json text (required)
  std::string job_id;       // recorded in the marker
  kernels::Isa isa = kernels::Isa::kScalar;
  std::function<bool()> cancelled;  // polled between writes; may be empty
};

struct HfExportResult {
  std::string out_dir;             // normalized
  std::vector<std::string> files;  // the model's files inside out_dir, in the order written
                                   // (the marker kExportMarkerFile, written first, lists them)
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

// Checks out_dir without writing anything: absolute, its parent an existing directory; when it
// exists, a directory that is empty, or hostd's (see the overview) and `overwrite`; and
// "<out_dir>.tmp", when it exists, an empty directory or hostd's. Returns the normalized path.
absl::StatusOr<std::string> CheckExportDestination(const std::string& out_dir, bool overwrite);

// Writes the export (see the overview). `pool` may be null (casts on the calling thread).
absl::StatusOr<HfExportResult> ExportHf(const TrainingState& state, const HfExportOptions& options,
                                        ThreadPool* pool);

}  // namespace slidedp::hostd
