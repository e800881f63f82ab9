#include "model/manifest.h"

#include <xxhash.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>
#include <unordered_set>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/substitute.h"
#include "common/status_macros.h"
#include "model/job_spec.h"
#include "nlohmann/json.hpp"

namespace slidedp::model {
namespace {

using ::nlohmann::json;
using ::slidedp::v1::LayerKind;
using ::slidedp::v1::LayerSpec;
using ::slidedp::v1::ModelManifest;
using ::slidedp::v1::TensorSpec;

// Largest value accepted for any integer field of config.json. Keeps every product of two fields
// (e.g. heads * head_dim * hidden) inside int64, so shapes are computed without overflow checks;
// ValidateManifest then bounds the totals.
constexpr int64_t kMaxConfigInt = std::numeric_limits<int32_t>::max();
// config.json files are a few KiB; anything this large is the wrong file.
constexpr std::uintmax_t kMaxConfigFileBytes = 16u << 20;

constexpr std::string_view kTinyConfigTemplate = R"({
  "_name_or_path": "$0",
  "architectures": ["Qwen3ForCausalLM"],
  "model_type": "qwen3",
  "vocab_size": 512,
  "hidden_size": 64,
  "intermediate_size": 128,
  "num_hidden_layers": 4,
  "num_attention_heads": 4,
  "num_key_value_heads": 2,
  "head_dim": 16,
  "hidden_act": "silu",
  "max_position_embeddings": 512,
  "rms_norm_eps": 1e-06,
  "rope_theta": 10000.0,
  "attention_bias": false,
  "attention_dropout": 0.0,
  "tie_word_embeddings": $1,
  "initializer_range": 0.02,
  "torch_dtype": "bfloat16",
  "use_cache": true
}
)";

// Debian's abseil builds absl::string_view as its own class, not an alias of std::string_view.
absl::string_view Av(std::string_view s) { return absl::string_view(s.data(), s.size()); }

// A short rendering of a JSON value for error messages.
std::string Describe(const json& v) {
  std::string s = v.dump();
  if (s.size() > 64) s = s.substr(0, 61) + "...";
  return s;
}

// Reads config.json fields with uniform, field-naming error messages.
class ConfigReader {
 public:
  ConfigReader(const json& root, std::string_view source) : root_(root), source_(source) {}

  absl::Status Error(std::string_view msg) const {
    return absl::InvalidArgumentError(absl::StrCat(Av(source_), ": ", Av(msg)));
  }

  bool Present(const char* key) const {
    auto it = root_.find(key);
    return it != root_.end() && !it->is_null();
  }

  // A required positive integer <= kMaxConfigInt.
  absl::StatusOr<int64_t> PositiveInt(const char* key) const {
    auto it = root_.find(key);
    if (it == root_.end() || it->is_null()) {
      return Error(absl::StrCat("'", key, "' is missing; expected a positive integer"));
    }
    return CheckPositiveInt(key, *it);
  }

  absl::StatusOr<int64_t> PositiveIntOr(const char* key, int64_t fallback) const {
    if (!Present(key)) return fallback;
    return CheckPositiveInt(key, root_.at(key));
  }

  absl::StatusOr<bool> BoolOr(const char* key, bool fallback) const {
    if (!Present(key)) return fallback;
    const json& v = root_.at(key);
    if (!v.is_boolean()) {
      return Error(
          absl::StrCat("'", key, "' must be a boolean (true or false), got ", Describe(v)));
    }
    return v.get<bool>();
  }

  absl::StatusOr<double> PositiveNumberOr(const char* key, double fallback) const {
    if (!Present(key)) return fallback;
    const json& v = root_.at(key);
    if (!v.is_number()) {
      return Error(absl::StrCat("'", key, "' must be a positive number, got ", Describe(v)));
    }
    const double d = v.get<double>();
    if (!std::isfinite(d) || d <= 0) {
      return Error(absl::StrCat("'", key, "' must be a positive number, got ", Describe(v)));
    }
    return d;
  }

  absl::StatusOr<std::string> StringOr(const char* key, std::string fallback) const {
    if (!Present(key)) return fallback;
    const json& v = root_.at(key);
    if (!v.is_string()) {
      return Error(absl::StrCat("'", key, "' must be a string, got ", Describe(v)));
    }
    return v.get<std::string>();
  }

 private:
  absl::StatusOr<int64_t> CheckPositiveInt(const char* key, const json& v) const {
    if (!v.is_number_integer()) {
      return Error(absl::StrCat("'", key, "' must be a positive integer, got ", Describe(v)));
    }
    if (v.is_number_unsigned()) {
      if (v.get<uint64_t>() == 0) {
        return Error(absl::StrCat("'", key, "' must be a positive integer, got 0"));
      }
      if (v.get<uint64_t>() > static_cast<uint64_t>(kMaxConfigInt)) {
        return Error(absl::StrCat("'", key, "' must be a positive integer <= ", kMaxConfigInt,
                                  ", got ", Describe(v)));
      }
      return static_cast<int64_t>(v.get<uint64_t>());
    }
    const int64_t i = v.get<int64_t>();
    if (i <= 0) {
      return Error(absl::StrCat("'", key, "' must be a positive integer, got ", Describe(v)));
    }
    if (i > kMaxConfigInt) {
      return Error(absl::StrCat("'", key, "' must be a positive integer <= ", kMaxConfigInt,
                                ", got ", Describe(v)));
    }
    return i;
  }

  const json& root_;
  std::string_view source_;
};

void AddTensor(LayerSpec* layer, const std::string& name, std::initializer_list<int64_t> shape) {
  TensorSpec* t = layer->add_tensors();
  t->set_name(name);
  for (int64_t d : shape) t->add_shape(d);
  t->set_dtype(slidedp::v1::DTYPE_BF16);
  t->set_no_decay(IsNormOrBias(name));
}

// Default manifest name: the directory holding config.json, or the last path component.
std::string DefaultModelName(std::string_view source) {
  if (source.starts_with("builtin:")) return std::string(source.substr(8));
  std::filesystem::path p(source);
  p = p.lexically_normal();
  if (!p.has_filename()) p = p.parent_path();  // trailing '/'
  if (p.extension() == ".json") p = p.parent_path();
  std::string name = p.filename().string();
  if (name.empty() || name == "." || name == "..") return "model";
  return name;
}

absl::StatusOr<std::string> ReadSmallFile(const std::filesystem::path& path) {
  std::error_code ec;
  const std::uintmax_t size = std::filesystem::file_size(path, ec);
  if (ec) {
    return absl::NotFoundError(
        absl::StrCat(path.string(), ": cannot read model config: ", ec.message()));
  }
  if (size > kMaxConfigFileBytes) {
    return absl::InvalidArgumentError(absl::StrCat(path.string(), ": ", size,
                                                   " bytes; a config.json is expected to be under ",
                                                   kMaxConfigFileBytes, " bytes"));
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::NotFoundError(
        absl::StrCat(path.string(), ": cannot open model config: ", std::strerror(errno)));
  }
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) {
    return absl::NotFoundError(absl::StrCat(path.string(), ": read failed"));
  }
  return ss.str();
}

// Appends `v` in little-endian order, independent of the host.
void PutU64(std::string& out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

void PutString(std::string& out, std::string_view s) {
  PutU64(out, s.size());
  out.append(s);
}

std::string LayerPath(int index, const LayerSpec& layer) {
  return absl::StrCat("manifest.layers[", index, "] ('", ShownText(layer.name()), "')");
}

}  // namespace

bool IsNormOrBias(std::string_view tensor_name) {
  return tensor_name.ends_with("norm.weight") || tensor_name.ends_with(".bias") ||
         tensor_name == "bias";
}

InitKind TensorInitKind(const TensorSpec& t) {
  if (absl::EndsWith(t.name(), "norm.weight")) return InitKind::kOnes;
  if (absl::EndsWith(t.name(), ".bias") || t.name() == "bias") return InitKind::kZeros;
  return InitKind::kNormal;
}

uint64_t TensorNumel(const TensorSpec& t) {
  uint64_t n = 1;
  for (int64_t d : t.shape()) {
    if (d < 0) return 0;
    if (__builtin_mul_overflow(n, static_cast<uint64_t>(d), &n)) {
      return std::numeric_limits<uint64_t>::max();
    }
  }
  return n;
}

uint64_t LayerNumel(const LayerSpec& layer) {
  uint64_t n = 0;
  for (const TensorSpec& t : layer.tensors()) {
    if (__builtin_add_overflow(n, TensorNumel(t), &n)) return std::numeric_limits<uint64_t>::max();
  }
  return n;
}

uint64_t ManifestNumel(const ModelManifest& m) {
  uint64_t n = 0;
  for (const LayerSpec& layer : m.layers()) {
    if (__builtin_add_overflow(n, LayerNumel(layer), &n)) {
      return std::numeric_limits<uint64_t>::max();
    }
  }
  return n;
}

uint64_t ManifestHash(const ModelManifest& m) {
  std::string buf;
  buf.reserve(64 + static_cast<size_t>(m.layers_size()) * 512);
  PutString(buf, "slidedp.manifest.v1");
  PutU64(buf, static_cast<uint64_t>(m.layers_size()));
  for (const LayerSpec& layer : m.layers()) {
    PutString(buf, layer.name());
    PutU64(buf, static_cast<uint64_t>(layer.kind()));
    PutU64(buf, static_cast<uint64_t>(layer.tensors_size()));
    for (const TensorSpec& t : layer.tensors()) {
      PutString(buf, t.name());
      PutU64(buf, static_cast<uint64_t>(t.shape_size()));
      for (int64_t d : t.shape()) PutU64(buf, static_cast<uint64_t>(d));
      PutU64(buf, static_cast<uint64_t>(t.dtype()));
      PutU64(buf, t.no_decay() ? 1 : 0);
    }
  }
  return XXH64(buf.data(), buf.size(), /*seed=*/0);
}

std::string ManifestHashHex(uint64_t hash) { return absl::StrFormat("%016x", hash); }

absl::Status ValidateManifest(const ModelManifest& m) {
  if (m.layers_size() == 0) {
    return absl::InvalidArgumentError("manifest.layers is empty; expected at least one layer");
  }
  if (m.layers_size() > kMaxManifestLayers) {
    return absl::InvalidArgumentError(absl::StrCat("manifest.layers has ", m.layers_size(),
                                                   " layers; at most ", kMaxManifestLayers,
                                                   " are supported"));
  }
  std::unordered_set<std::string_view> layer_names;
  std::unordered_set<std::string_view> tensor_names;
  uint64_t total = 0;
  for (int i = 0; i < m.layers_size(); ++i) {
    const LayerSpec& layer = m.layers(i);
    const std::string path = LayerPath(i, layer);
    if (layer.name().empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("manifest.layers[", i, "].name is empty; expected a unique layer name"));
    }
    if (!layer_names.insert(layer.name()).second) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ".name: duplicate layer name; layer names must be unique"));
    }
    if (!slidedp::v1::LayerKind_IsValid(layer.kind()) ||
        layer.kind() == slidedp::v1::LAYER_KIND_UNSPECIFIED) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ".kind is ", static_cast<int>(layer.kind()),
                       "; expected one of EMBEDDING, DECODER, FINAL_NORM, LM_HEAD, OTHER"));
    }
    if (layer.tensors_size() == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ".tensors is empty; expected at least one tensor"));
    }
    uint64_t layer_numel = 0;
    for (int j = 0; j < layer.tensors_size(); ++j) {
      const TensorSpec& t = layer.tensors(j);
      const std::string tpath =
          absl::StrCat(path, ".tensors[", j, "] ('", ShownText(t.name()), "')");
      if (t.name().empty()) {
        return absl::InvalidArgumentError(
            absl::StrCat(path, ".tensors[", j, "].name is empty; expected a unique tensor name"));
      }
      if (!tensor_names.insert(t.name()).second) {
        return absl::InvalidArgumentError(
            absl::StrCat(tpath, ".name: duplicate tensor name; tensor names must be unique"));
      }
      if (t.shape_size() < 1 || t.shape_size() > kMaxTensorRank) {
        return absl::InvalidArgumentError(absl::StrCat(
            tpath, ".shape has ", t.shape_size(), " dimensions; expected 1 to ", kMaxTensorRank));
      }
      uint64_t numel = 1;
      for (int k = 0; k < t.shape_size(); ++k) {
        const int64_t d = t.shape(k);
        if (d < 1) {
          return absl::InvalidArgumentError(
              absl::StrCat(tpath, ".shape[", k, "] is ", d, "; every dimension must be >= 1"));
        }
        if (__builtin_mul_overflow(numel, static_cast<uint64_t>(d), &numel) ||
            numel > kMaxManifestNumel) {
          return absl::InvalidArgumentError(absl::StrCat(
              tpath, ".shape: element count overflows; at most ", kMaxManifestNumel, " elements"));
        }
      }
      if (t.dtype() != slidedp::v1::DTYPE_BF16 && t.dtype() != slidedp::v1::DTYPE_FP32) {
        return absl::InvalidArgumentError(absl::StrCat(tpath, ".dtype is ",
                                                       static_cast<int>(t.dtype()),
                                                       "; expected DTYPE_BF16 or DTYPE_FP32"));
      }
      // Both terms are <= kMaxManifestNumel (2^56), so the sum cannot wrap.
      layer_numel += numel;
      if (layer_numel > kMaxManifestNumel) {
        return absl::InvalidArgumentError(absl::StrCat(path, ": element count overflows; at most ",
                                                       kMaxManifestNumel, " elements"));
      }
    }
    total += layer_numel;
    if (total > kMaxManifestNumel) {
      return absl::InvalidArgumentError(
          absl::StrCat("manifest: total element count exceeds ", kMaxManifestNumel, " at ", path));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<LoadedModel> ManifestFromHfConfig(std::string_view json_text,
                                                 std::string_view source) {
  json root;
  try {
    root = json::parse(json_text);
  } catch (const json::parse_error& e) {
    return absl::InvalidArgumentError(absl::StrCat(Av(source), ": malformed JSON: ", e.what()));
  }
  if (!root.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(
        Av(source), ": expected a JSON object at the top level, got ", Describe(root)));
  }
  const ConfigReader r(root, source);

  if (!r.Present("model_type")) {
    return r.Error("'model_type' is missing; expected one of llama, qwen2, qwen3");
  }
  if (!root.at("model_type").is_string()) {
    return r.Error(absl::StrCat("'model_type' must be a string, one of llama, qwen2, qwen3; got ",
                                Describe(root.at("model_type"))));
  }
  const std::string family = root.at("model_type").get<std::string>();
  const bool llama = family == "llama";
  const bool qwen2 = family == "qwen2";
  const bool qwen3 = family == "qwen3";
  if (!llama && !qwen2 && !qwen3) {
    return r.Error(absl::StrCat("model_type '", family,
                                "' is not supported; expected one of llama, qwen2, qwen3"));
  }

  ASSIGN_OR_RETURN(const int64_t hidden, r.PositiveInt("hidden_size"));
  ASSIGN_OR_RETURN(const int64_t inter, r.PositiveInt("intermediate_size"));
  ASSIGN_OR_RETURN(const int64_t num_layers, r.PositiveInt("num_hidden_layers"));
  ASSIGN_OR_RETURN(const int64_t heads, r.PositiveInt("num_attention_heads"));
  ASSIGN_OR_RETURN(const int64_t vocab, r.PositiveInt("vocab_size"));
  ASSIGN_OR_RETURN(const int64_t kv_heads, r.PositiveIntOr("num_key_value_heads", heads));
  ASSIGN_OR_RETURN(const bool tied, r.BoolOr("tie_word_embeddings", false));
  ASSIGN_OR_RETURN(const double init_range, r.PositiveNumberOr("initializer_range", 0.02));
  ASSIGN_OR_RETURN(const std::string name_or_path, r.StringOr("_name_or_path", ""));
  bool attention_bias = false;
  bool mlp_bias = false;
  if (llama || qwen3) {
    ASSIGN_OR_RETURN(attention_bias, r.BoolOr("attention_bias", false));
  }
  if (llama) {
    ASSIGN_OR_RETURN(mlp_bias, r.BoolOr("mlp_bias", false));
  }

  // Two embeddings, the final norm and at most kMaxManifestLayers in all.
  constexpr int64_t kMaxDecoderLayers = kMaxManifestLayers - 3;
  if (num_layers > kMaxDecoderLayers) {
    return r.Error(absl::StrCat("'num_hidden_layers' must be at most ", kMaxDecoderLayers,
                                " (a manifest holds at most ", kMaxManifestLayers, " layers), got ",
                                num_layers));
  }
  if (heads % kv_heads != 0) {
    return r.Error(absl::StrCat("'num_attention_heads' (", heads,
                                ") must be a multiple of 'num_key_value_heads' (", kv_heads, ")"));
  }
  int64_t head_dim = 0;
  if (r.Present("head_dim")) {
    ASSIGN_OR_RETURN(head_dim, r.PositiveInt("head_dim"));
  } else {
    if (hidden % heads != 0) {
      return r.Error(absl::StrCat("'hidden_size' (", hidden,
                                  ") is not divisible by 'num_attention_heads' (", heads,
                                  ") and 'head_dim' is absent; give head_dim explicitly"));
    }
    head_dim = hidden / heads;
  }

  LoadedModel out;
  out.initializer_range = init_range;
  out.config_json = std::string(json_text);
  out.source = std::string(source);
  ModelManifest& m = out.manifest;
  m.set_family(family);
  m.set_name(name_or_path.empty() ? DefaultModelName(source) : name_or_path);
  m.set_tie_word_embeddings(tied);

  const int64_t q_dim = heads * head_dim;
  const int64_t kv_dim = kv_heads * head_dim;
  const bool qkv_bias = qwen2 || attention_bias;
  const bool o_bias = attention_bias;  // qwen2 never has one; attention_bias is false there

  LayerSpec* embed = m.add_layers();
  embed->set_name("model.embed_tokens");
  embed->set_kind(slidedp::v1::LAYER_KIND_EMBEDDING);
  AddTensor(embed, "model.embed_tokens.weight", {vocab, hidden});

  for (int64_t i = 0; i < num_layers; ++i) {
    LayerSpec* layer = m.add_layers();
    const std::string lname = absl::StrCat("model.layers.", i);
    const std::string p = lname + ".";
    layer->set_name(lname);
    layer->set_kind(slidedp::v1::LAYER_KIND_DECODER);
    AddTensor(layer, p + "input_layernorm.weight", {hidden});
    AddTensor(layer, p + "self_attn.q_proj.weight", {q_dim, hidden});
    if (qkv_bias) AddTensor(layer, p + "self_attn.q_proj.bias", {q_dim});
    AddTensor(layer, p + "self_attn.k_proj.weight", {kv_dim, hidden});
    if (qkv_bias) AddTensor(layer, p + "self_attn.k_proj.bias", {kv_dim});
    AddTensor(layer, p + "self_attn.v_proj.weight", {kv_dim, hidden});
    if (qkv_bias) AddTensor(layer, p + "self_attn.v_proj.bias", {kv_dim});
    AddTensor(layer, p + "self_attn.o_proj.weight", {hidden, q_dim});
    if (o_bias) AddTensor(layer, p + "self_attn.o_proj.bias", {hidden});
    if (qwen3) {
      AddTensor(layer, p + "self_attn.q_norm.weight", {head_dim});
      AddTensor(layer, p + "self_attn.k_norm.weight", {head_dim});
    }
    AddTensor(layer, p + "post_attention_layernorm.weight", {hidden});
    AddTensor(layer, p + "mlp.gate_proj.weight", {inter, hidden});
    if (mlp_bias) AddTensor(layer, p + "mlp.gate_proj.bias", {inter});
    AddTensor(layer, p + "mlp.up_proj.weight", {inter, hidden});
    if (mlp_bias) AddTensor(layer, p + "mlp.up_proj.bias", {inter});
    AddTensor(layer, p + "mlp.down_proj.weight", {hidden, inter});
    if (mlp_bias) AddTensor(layer, p + "mlp.down_proj.bias", {hidden});
  }

  LayerSpec* norm = m.add_layers();
  norm->set_name("model.norm");
  norm->set_kind(slidedp::v1::LAYER_KIND_FINAL_NORM);
  AddTensor(norm, "model.norm.weight", {hidden});

  if (!tied) {
    LayerSpec* head = m.add_layers();
    head->set_name("lm_head");
    head->set_kind(slidedp::v1::LAYER_KIND_LM_HEAD);
    AddTensor(head, "lm_head.weight", {vocab, hidden});
  }

  if (absl::Status s = ValidateManifest(m); !s.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(Av(source), ": the model described is too large or malformed: ", s.message()));
  }
  m.set_manifest_hash(ManifestHashHex(ManifestHash(m)));
  return out;
}

absl::StatusOr<LoadedModel> LoadModel(std::string_view spec) {
  if (spec.empty()) {
    return absl::InvalidArgumentError(
        "model spec is empty; expected tiny, tiny-tied, a directory containing config.json, or "
        "a path to a config.json");
  }
  if (spec == "tiny" || spec == "tiny-tied") {
    const std::string text =
        absl::Substitute(Av(kTinyConfigTemplate), Av(spec), spec == "tiny-tied" ? "true" : "false");
    return ManifestFromHfConfig(text, absl::StrCat("builtin:", Av(spec)));
  }
  std::filesystem::path path{std::string(spec)};
  std::error_code ec;
  const std::filesystem::file_status st = std::filesystem::status(path, ec);
  if (ec || !std::filesystem::exists(st)) {
    return absl::NotFoundError(absl::StrCat(
        "model '", Av(spec), "': ", ec ? ec.message() : "no such file or directory",
        "; expected tiny, tiny-tied, a directory containing config.json, or a path to a "
        "config.json"));
  }
  if (std::filesystem::is_directory(st)) path /= "config.json";
  // An absolute source makes logs and the default model name (the directory) meaningful.
  path = std::filesystem::absolute(path, ec).lexically_normal();
  ASSIGN_OR_RETURN(std::string text, ReadSmallFile(path));
  return ManifestFromHfConfig(text, path.string());
}

namespace {

uint64_t InitMix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

}  // namespace

float InitialValue(uint64_t seed, std::string_view tensor_name, InitKind kind, double std_dev,
                   uint64_t index) {
  if (kind == InitKind::kOnes) return 1.0f;
  if (kind == InitKind::kZeros) return 0.0f;
  const uint64_t key = InitMix(seed ^ XXH64(tensor_name.data(), tensor_name.size(), 0));
  // Box-Muller on two 53-bit uniforms.
  const uint64_t a = InitMix(key ^ InitMix(2 * index));
  const uint64_t b = InitMix(key ^ InitMix(2 * index + 1));
  const double u1 = (static_cast<double>(a >> 11) + 1.0) * 0x1.0p-53;  // (0, 1]
  const double u2 = static_cast<double>(b >> 11) * 0x1.0p-53;          // [0, 1)
  const double n = std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * 3.14159265358979323846 * u2);
  return static_cast<float>(std_dev) * static_cast<float>(n);
}

}  // namespace slidedp::model
