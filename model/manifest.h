// Model manifests: the ordered list of layers and tensors whose FP32 master weights and Adam
// state hostd owns.
//
// A manifest is built from a Hugging Face `config.json` (model_type llama, qwen2 or qwen3) or from
// a built-in test model ("tiny", "tiny-tied"), or it arrives over RPC in a CreateJob request and is
// checked with ValidateManifest. Tensor names and shapes match the HF transformers state_dict of
// the corresponding *ForCausalLM model (weights are [out_features, in_features]), so a checkpoint
// can be exported to and imported from HF without renaming.
//
// Layer order: "model.embed_tokens" (EMBEDDING), "model.layers.0" .. "model.layers.N-1" (DECODER),
// "model.norm" (FINAL_NORM), "lm_head" (LM_HEAD; absent when tie_word_embeddings is true).
// Within a decoder layer, tensors are in compute order: input_layernorm, q/k/v/o projections
// (each weight followed by its bias when the family has one), qwen3's q_norm/k_norm,
// post_attention_layernorm, gate/up/down projections.
//
// All functions are pure and thread-safe.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "slidedp/v1/control.pb.h"

namespace slidedp::model {

// Limits enforced by ValidateManifest (and by ManifestFromHfConfig before building layers).
inline constexpr int kMaxManifestLayers = 100000;
inline constexpr int kMaxTensorRank = 8;
// Total elements of a manifest; keeps every byte count derived from it (FP32 master + m + v,
// BF16 copies, gradients) far from uint64 overflow.
inline constexpr uint64_t kMaxManifestNumel = uint64_t{1} << 56;

struct LoadedModel {
  // Layers in order: embedding, decoder layers 0..N-1, final norm, lm_head (absent when tied).
  // manifest_hash is set (ManifestHashHex of ManifestHash).
  slidedp::v1::ModelManifest manifest;
  double initializer_range = 0.02;  // std-dev of the normal init, from config.json
  std::string config_json;          // the config text as read, kept for HF export
  std::string source;               // "builtin:tiny", "builtin:tiny-tied" or the config.json path
};

// Loads a model description. `spec` is one of:
//   "tiny"       built-in Qwen3-shaped test model: vocab 512, hidden 64, intermediate 128,
//                4 layers, 4 heads, 2 kv heads, head_dim 16, untied (about 0.2M parameters);
//   "tiny-tied"  the same with tied embeddings;
//   a directory  containing config.json;
//   a file path  to a config.json.
// Built-in names win over a directory of the same name (use "./tiny" for the directory).
// Errors: NOT_FOUND naming the path when it does not exist or cannot be read; INVALID_ARGUMENT
// for an empty spec or any problem in the config (see ManifestFromHfConfig).
absl::StatusOr<LoadedModel> LoadModel(std::string_view spec);

// Builds a manifest from the text of an HF config.json. `source` names the text in error
// messages (LoadModel passes the path read) and is stored in LoadedModel::source.
// Supported model_type: llama, qwen2, qwen3. Read fields: hidden_size, intermediate_size,
// num_hidden_layers, num_attention_heads, vocab_size (required positive integers);
// num_key_value_heads (default num_attention_heads), head_dim (default
// hidden_size / num_attention_heads), tie_word_embeddings (default false), attention_bias
// (llama, qwen3; default false), mlp_bias (llama; default false), initializer_range (default 0.02),
// _name_or_path (manifest name; default: the directory of `source`, else "model").
// An explicit JSON null counts as absent. qwen2 always has q/k/v biases and no o_proj bias.
// manifest.family is model_type. Every tensor is DTYPE_BF16; norm weights and biases are no_decay.
// Errors: INVALID_ARGUMENT "<source>: ..." naming the field and the expected value, or the
// parser's line and column for malformed JSON.
absl::StatusOr<LoadedModel> ManifestFromHfConfig(std::string_view json_text,
                                                 std::string_view source);

// Checks a manifest received from a client: at least one and at most kMaxManifestLayers layers;
// layer names non-empty and unique; kind a known non-UNSPECIFIED LayerKind; every layer has at
// least one tensor; tensor names non-empty and unique across the manifest; 1..kMaxTensorRank
// dimensions, each >= 1; dtype FP32 or BF16; total numel <= kMaxManifestNumel (no overflow).
// family, name and manifest_hash are not checked (hostd computes the hash itself).
// Errors: INVALID_ARGUMENT naming the offending layer/tensor path, e.g.
// "manifest.layers[3] ('model.layers.2').tensors[1] ('...q_proj.weight').shape[0]: ...".
absl::Status ValidateManifest(const slidedp::v1::ModelManifest& m);

// xxh64 (seed 0) over a canonical little-endian encoding of the structure only: for each layer
// in order its name and kind, for each tensor its name, shape, dtype and no_decay. family, name,
// tie_word_embeddings and manifest_hash do not contribute. Stable across processes and versions
// of this code; a change to the encoding must change its version tag.
uint64_t ManifestHash(const slidedp::v1::ModelManifest& m);

// 16 lowercase hex digits, zero-padded.
std::string ManifestHashHex(uint64_t hash);

// Element counts. Saturate at UINT64_MAX on overflow (impossible for a validated manifest).
uint64_t TensorNumel(const slidedp::v1::TensorSpec& t);
uint64_t LayerNumel(const slidedp::v1::LayerSpec& layer);
uint64_t ManifestNumel(const slidedp::v1::ModelManifest& m);

enum class InitKind { kNormal, kOnes, kZeros };

// Initial value of a tensor, by HF naming convention: norm weights (name ends with "norm.weight",
// which covers "layernorm.weight", "q_norm.weight", "model.norm.weight") are ones, biases (name
// ends with "bias") zeros, everything else normal(0, initializer_range).
InitKind TensorInitKind(const slidedp::v1::TensorSpec& t);

// The deterministic initial value of element `index` of tensor `tensor_name`: 1 for kOnes, 0 for
// kZeros, else std_dev * N(0, 1) from a counter-based generator keyed by (seed, tensor name), so
// a value depends on nothing else (not the layer order, not the thread count). hostd's init and
// reference trainers use this one function.
float InitialValue(uint64_t seed, std::string_view tensor_name, InitKind kind, double std_dev,
                   uint64_t index);

// True for the tensors that ManifestFromHfConfig marks no_decay (norm weights and biases).
bool IsNormOrBias(std::string_view tensor_name);

}  // namespace slidedp::model
