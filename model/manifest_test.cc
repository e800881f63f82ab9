#include "model/manifest.h"

#include <stdlib.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace slidedp::model {
namespace {

using ::nlohmann::json;
using ::slidedp::v1::LayerSpec;
using ::slidedp::v1::ModelManifest;
using ::slidedp::v1::TensorSpec;
using ::testing::ElementsAre;
using ::testing::ElementsAreArray;
using ::testing::HasSubstr;

// Verbatim (minus token ids) from the Hugging Face hub.
constexpr char kQwen3_0_6B[] = R"({
  "architectures": ["Qwen3ForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "bos_token_id": 151643,
  "eos_token_id": 151645,
  "head_dim": 128,
  "hidden_act": "silu",
  "hidden_size": 1024,
  "initializer_range": 0.02,
  "intermediate_size": 3072,
  "max_position_embeddings": 40960,
  "max_window_layers": 28,
  "model_type": "qwen3",
  "num_attention_heads": 16,
  "num_hidden_layers": 28,
  "num_key_value_heads": 8,
  "rms_norm_eps": 1e-06,
  "rope_scaling": null,
  "rope_theta": 1000000,
  "sliding_window": null,
  "tie_word_embeddings": true,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.51.0",
  "use_cache": true,
  "use_sliding_window": false,
  "vocab_size": 151936
})";

constexpr char kLlama3_8B[] = R"({
  "architectures": ["LlamaForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "bos_token_id": 128000,
  "eos_token_id": 128001,
  "hidden_act": "silu",
  "hidden_size": 4096,
  "initializer_range": 0.02,
  "intermediate_size": 14336,
  "max_position_embeddings": 8192,
  "model_type": "llama",
  "num_attention_heads": 32,
  "num_hidden_layers": 32,
  "num_key_value_heads": 8,
  "pretraining_tp": 1,
  "rms_norm_eps": 1e-05,
  "rope_scaling": null,
  "rope_theta": 500000.0,
  "tie_word_embeddings": false,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.40.0.dev0",
  "use_cache": true,
  "vocab_size": 128256
})";

constexpr char kQwen2_0_5B[] = R"({
  "architectures": ["Qwen2ForCausalLM"],
  "attention_dropout": 0.0,
  "bos_token_id": 151643,
  "eos_token_id": 151643,
  "hidden_act": "silu",
  "hidden_size": 896,
  "initializer_range": 0.02,
  "intermediate_size": 4864,
  "max_position_embeddings": 131072,
  "max_window_layers": 24,
  "model_type": "qwen2",
  "num_attention_heads": 14,
  "num_hidden_layers": 24,
  "num_key_value_heads": 2,
  "rms_norm_eps": 1e-06,
  "rope_theta": 1000000.0,
  "sliding_window": 131072,
  "tie_word_embeddings": true,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.40.1",
  "use_cache": true,
  "use_sliding_window": false,
  "vocab_size": 151936
})";

// A temporary directory removed with its contents at scope exit.
class TempDir {
 public:
  TempDir() {
    std::string tmpl = (std::filesystem::path(::testing::TempDir()) / "manifest_test.XXXXXX");
    char* made = mkdtemp(tmpl.data());
    EXPECT_NE(made, nullptr);
    path_ = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::filesystem::path& path() const { return path_; }

  std::filesystem::path Write(const std::string& rel, const std::string& text) const {
    const std::filesystem::path p = path_ / rel;
    std::filesystem::create_directories(p.parent_path());
    std::ofstream(p) << text;
    return p;
  }

 private:
  std::filesystem::path path_;
};

LoadedModel MustParse(const std::string& text, const std::string& source = "config.json") {
  absl::StatusOr<LoadedModel> m = ManifestFromHfConfig(text, source);
  EXPECT_TRUE(m.ok()) << m.status();
  return m.ok() ? *std::move(m) : LoadedModel{};
}

std::vector<std::string> TensorNames(const LayerSpec& layer) {
  std::vector<std::string> names;
  for (const TensorSpec& t : layer.tensors()) names.push_back(t.name());
  return names;
}

std::vector<int64_t> Shape(const TensorSpec& t) { return {t.shape().begin(), t.shape().end()}; }

const TensorSpec* FindTensor(const ModelManifest& m, const std::string& name) {
  for (const LayerSpec& l : m.layers()) {
    for (const TensorSpec& t : l.tensors()) {
      if (t.name() == name) return &t;
    }
  }
  return nullptr;
}

// ---------------------------------------------------------------------------------------------
// Parameter counts against the HF numbers.

TEST(ManifestFromHfConfigTest, Qwen3_0_6BMatchesHfParameterCount) {
  const LoadedModel m = MustParse(kQwen3_0_6B);
  // embed 151936*1024 + 28 * (2*1024 + 2*128 + 2048*1024 + 2*1024*1024 + 1024*2048 + 3*3072*1024)
  // + final norm 1024; lm_head is tied.
  EXPECT_EQ(ManifestNumel(m.manifest), 596049920u);
  EXPECT_EQ(m.manifest.layers_size(), 1 + 28 + 1);
  EXPECT_EQ(m.manifest.family(), "qwen3");
  EXPECT_TRUE(m.manifest.tie_word_embeddings());
  EXPECT_EQ(m.manifest.layers(29).name(), "model.norm");
  EXPECT_DOUBLE_EQ(m.initializer_range, 0.02);
  EXPECT_EQ(m.config_json, kQwen3_0_6B);
  EXPECT_EQ(m.manifest.manifest_hash(), ManifestHashHex(ManifestHash(m.manifest)));
  // head_dim 128 is explicit and differs from hidden / heads = 64.
  EXPECT_THAT(Shape(*FindTensor(m.manifest, "model.layers.0.self_attn.q_proj.weight")),
              ElementsAre(2048, 1024));
  EXPECT_THAT(Shape(*FindTensor(m.manifest, "model.layers.27.self_attn.o_proj.weight")),
              ElementsAre(1024, 2048));
  EXPECT_THAT(Shape(*FindTensor(m.manifest, "model.layers.3.self_attn.k_norm.weight")),
              ElementsAre(128));
}

TEST(ManifestFromHfConfigTest, Llama3_8BMatchesHfParameterCount) {
  const LoadedModel m = MustParse(kLlama3_8B);
  EXPECT_EQ(ManifestNumel(m.manifest), 8030261248u);
  EXPECT_EQ(m.manifest.layers_size(), 1 + 32 + 1 + 1);
  const LayerSpec& head = m.manifest.layers(34);
  EXPECT_EQ(head.name(), "lm_head");
  EXPECT_EQ(head.kind(), slidedp::v1::LAYER_KIND_LM_HEAD);
  EXPECT_THAT(TensorNames(head), ElementsAre("lm_head.weight"));
  EXPECT_THAT(Shape(head.tensors(0)), ElementsAre(128256, 4096));
  EXPECT_EQ(LayerNumel(m.manifest.layers(1)), 218112000u);
}

TEST(ManifestFromHfConfigTest, Qwen2_0_5BMatchesHfParameterCount) {
  const LoadedModel m = MustParse(kQwen2_0_5B);
  EXPECT_EQ(ManifestNumel(m.manifest), 494032768u);
  EXPECT_EQ(m.manifest.layers_size(), 1 + 24 + 1);
  EXPECT_THAT(Shape(*FindTensor(m.manifest, "model.layers.5.self_attn.k_proj.bias")),
              ElementsAre(128));
  EXPECT_EQ(FindTensor(m.manifest, "model.layers.5.self_attn.o_proj.bias"), nullptr);
}

// ---------------------------------------------------------------------------------------------
// Names, order, kinds, dtypes, no_decay.

TEST(ManifestFromHfConfigTest, Qwen3LayerTensorsInOrder) {
  const LoadedModel m = MustParse(kQwen3_0_6B);
  const LayerSpec& embed = m.manifest.layers(0);
  EXPECT_EQ(embed.name(), "model.embed_tokens");
  EXPECT_EQ(embed.kind(), slidedp::v1::LAYER_KIND_EMBEDDING);
  EXPECT_THAT(TensorNames(embed), ElementsAre("model.embed_tokens.weight"));
  EXPECT_THAT(Shape(embed.tensors(0)), ElementsAre(151936, 1024));

  const LayerSpec& layer = m.manifest.layers(8);
  EXPECT_EQ(layer.name(), "model.layers.7");
  EXPECT_EQ(layer.kind(), slidedp::v1::LAYER_KIND_DECODER);
  EXPECT_THAT(
      TensorNames(layer),
      ElementsAre(
          "model.layers.7.input_layernorm.weight", "model.layers.7.self_attn.q_proj.weight",
          "model.layers.7.self_attn.k_proj.weight", "model.layers.7.self_attn.v_proj.weight",
          "model.layers.7.self_attn.o_proj.weight", "model.layers.7.self_attn.q_norm.weight",
          "model.layers.7.self_attn.k_norm.weight",
          "model.layers.7.post_attention_layernorm.weight", "model.layers.7.mlp.gate_proj.weight",
          "model.layers.7.mlp.up_proj.weight", "model.layers.7.mlp.down_proj.weight"));
  const std::vector<std::vector<int64_t>> shapes = {
      {1024}, {2048, 1024}, {1024, 1024}, {1024, 1024}, {1024, 2048}, {128},
      {128},  {1024},       {3072, 1024}, {3072, 1024}, {1024, 3072}};
  const std::vector<bool> no_decay = {true, false, false, false, false, true,
                                      true, true,  false, false, false};
  ASSERT_EQ(layer.tensors_size(), 11);
  for (int i = 0; i < layer.tensors_size(); ++i) {
    EXPECT_EQ(Shape(layer.tensors(i)), shapes[i]) << layer.tensors(i).name();
    EXPECT_EQ(layer.tensors(i).no_decay(), no_decay[i]) << layer.tensors(i).name();
    EXPECT_EQ(layer.tensors(i).dtype(), slidedp::v1::DTYPE_BF16);
  }
  const LayerSpec& norm = m.manifest.layers(29);
  EXPECT_EQ(norm.kind(), slidedp::v1::LAYER_KIND_FINAL_NORM);
  EXPECT_THAT(TensorNames(norm), ElementsAre("model.norm.weight"));
  EXPECT_TRUE(norm.tensors(0).no_decay());
}

TEST(ManifestFromHfConfigTest, Qwen2HasQkvBiasesOnly) {
  const LoadedModel m = MustParse(kQwen2_0_5B);
  const LayerSpec& layer = m.manifest.layers(1);
  EXPECT_THAT(
      TensorNames(layer),
      ElementsAre("model.layers.0.input_layernorm.weight", "model.layers.0.self_attn.q_proj.weight",
                  "model.layers.0.self_attn.q_proj.bias", "model.layers.0.self_attn.k_proj.weight",
                  "model.layers.0.self_attn.k_proj.bias", "model.layers.0.self_attn.v_proj.weight",
                  "model.layers.0.self_attn.v_proj.bias", "model.layers.0.self_attn.o_proj.weight",
                  "model.layers.0.post_attention_layernorm.weight",
                  "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight",
                  "model.layers.0.mlp.down_proj.weight"));
  EXPECT_THAT(Shape(layer.tensors(2)), ElementsAre(896));
  EXPECT_TRUE(layer.tensors(2).no_decay());
  EXPECT_FALSE(layer.tensors(1).no_decay());
}

TEST(ManifestFromHfConfigTest, LlamaAttentionAndMlpBias) {
  json j = json::parse(kLlama3_8B);
  j["num_hidden_layers"] = 1;
  j["attention_bias"] = true;
  j["mlp_bias"] = true;
  const LoadedModel m = MustParse(j.dump());
  EXPECT_THAT(
      TensorNames(m.manifest.layers(1)),
      ElementsAre("model.layers.0.input_layernorm.weight", "model.layers.0.self_attn.q_proj.weight",
                  "model.layers.0.self_attn.q_proj.bias", "model.layers.0.self_attn.k_proj.weight",
                  "model.layers.0.self_attn.k_proj.bias", "model.layers.0.self_attn.v_proj.weight",
                  "model.layers.0.self_attn.v_proj.bias", "model.layers.0.self_attn.o_proj.weight",
                  "model.layers.0.self_attn.o_proj.bias",
                  "model.layers.0.post_attention_layernorm.weight",
                  "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.gate_proj.bias",
                  "model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.up_proj.bias",
                  "model.layers.0.mlp.down_proj.weight", "model.layers.0.mlp.down_proj.bias"));
  EXPECT_THAT(Shape(*FindTensor(m.manifest, "model.layers.0.self_attn.o_proj.bias")),
              ElementsAre(4096));
  EXPECT_THAT(Shape(*FindTensor(m.manifest, "model.layers.0.mlp.down_proj.bias")),
              ElementsAre(4096));
  EXPECT_THAT(Shape(*FindTensor(m.manifest, "model.layers.0.mlp.up_proj.bias")),
              ElementsAre(14336));
}

TEST(ManifestFromHfConfigTest, Qwen2IgnoresMlpBiasAndAttentionBias) {
  json j = json::parse(kQwen2_0_5B);
  j["mlp_bias"] = true;
  j["attention_bias"] = true;
  EXPECT_EQ(ManifestNumel(MustParse(j.dump()).manifest), 494032768u);
}

TEST(ManifestFromHfConfigTest, DefaultsForOptionalFields) {
  // Llama without num_key_value_heads, head_dim, tie_word_embeddings, initializer_range; nulls
  // count as absent.
  const LoadedModel m = MustParse(R"({"model_type": "llama", "hidden_size": 64,
      "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
      "num_key_value_heads": null, "head_dim": null, "vocab_size": 100})");
  EXPECT_EQ(m.manifest.layers_size(), 5);  // untied by default
  EXPECT_DOUBLE_EQ(m.initializer_range, 0.02);
  EXPECT_THAT(Shape(*FindTensor(m.manifest, "model.layers.1.self_attn.k_proj.weight")),
              ElementsAre(64, 64));  // kv heads = heads, head_dim = 16
  EXPECT_EQ(m.manifest.name(), "model");
}

TEST(ManifestFromHfConfigTest, NameFromNameOrPathElseDirectory) {
  json j = json::parse(kQwen2_0_5B);
  EXPECT_EQ(MustParse(j.dump(), "/models/Qwen2-0.5B/config.json").manifest.name(), "Qwen2-0.5B");
  j["_name_or_path"] = "Qwen/Qwen2-0.5B";
  j["initializer_range"] = 0.006;
  const LoadedModel m = MustParse(j.dump(), "/models/x/config.json");
  EXPECT_EQ(m.manifest.name(), "Qwen/Qwen2-0.5B");
  EXPECT_EQ(m.source, "/models/x/config.json");
  EXPECT_DOUBLE_EQ(m.initializer_range, 0.006);
}

// ---------------------------------------------------------------------------------------------
// Built-in models and LoadModel.

TEST(LoadModelTest, BuiltinTiny) {
  absl::StatusOr<LoadedModel> m = LoadModel("tiny");
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->source, "builtin:tiny");
  EXPECT_EQ(m->manifest.name(), "tiny");
  EXPECT_EQ(m->manifest.family(), "qwen3");
  EXPECT_FALSE(m->manifest.tie_word_embeddings());
  EXPECT_EQ(m->manifest.layers_size(), 1 + 4 + 1 + 1);
  EXPECT_DOUBLE_EQ(m->initializer_range, 0.02);
  // 512*64 * 2 + 4 * (2*64 + 2*16 + 64*64 + 2*32*64 + 64*64 + 3*128*64) + 64
  EXPECT_EQ(ManifestNumel(m->manifest), 65536u + 4u * (160 + 4096 + 4096 + 4096 + 24576) + 64u);
  EXPECT_THAT(Shape(*FindTensor(m->manifest, "model.layers.3.self_attn.k_proj.weight")),
              ElementsAre(32, 64));
  // config_json is a real HF config: parsing it again gives the same structure.
  ASSERT_FALSE(m->config_json.empty());
  EXPECT_EQ(json::parse(m->config_json).at("architectures")[0], "Qwen3ForCausalLM");
  EXPECT_EQ(ManifestHash(MustParse(m->config_json).manifest), ManifestHash(m->manifest));
}

TEST(LoadModelTest, BuiltinTinyTied) {
  absl::StatusOr<LoadedModel> m = LoadModel("tiny-tied");
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->source, "builtin:tiny-tied");
  EXPECT_TRUE(m->manifest.tie_word_embeddings());
  EXPECT_EQ(m->manifest.layers_size(), 1 + 4 + 1);
  EXPECT_EQ(m->manifest.layers().rbegin()->name(), "model.norm");
  EXPECT_NE(m->manifest.manifest_hash(), LoadModel("tiny")->manifest.manifest_hash());
}

TEST(LoadModelTest, DirectoryAndFilePath) {
  TempDir tmp;
  const std::filesystem::path file = tmp.Write("Qwen3-0.6B/config.json", kQwen3_0_6B);

  absl::StatusOr<LoadedModel> from_dir = LoadModel((tmp.path() / "Qwen3-0.6B").string());
  ASSERT_TRUE(from_dir.ok()) << from_dir.status();
  EXPECT_EQ(from_dir->manifest.name(), "Qwen3-0.6B");
  EXPECT_EQ(from_dir->source, file.string());
  EXPECT_EQ(from_dir->config_json, kQwen3_0_6B);
  EXPECT_EQ(ManifestNumel(from_dir->manifest), 596049920u);

  absl::StatusOr<LoadedModel> from_file = LoadModel(file.string());
  ASSERT_TRUE(from_file.ok()) << from_file.status();
  EXPECT_EQ(from_file->source, file.string());
  EXPECT_EQ(from_file->manifest.manifest_hash(), from_dir->manifest.manifest_hash());

  // A trailing slash on the directory is fine.
  absl::StatusOr<LoadedModel> slash = LoadModel((tmp.path() / "Qwen3-0.6B").string() + "/");
  ASSERT_TRUE(slash.ok()) << slash.status();
  EXPECT_EQ(slash->manifest.name(), "Qwen3-0.6B");
}

TEST(LoadModelTest, MissingPathsAreNotFound) {
  TempDir tmp;
  const std::string missing = (tmp.path() / "nope").string();
  absl::StatusOr<LoadedModel> m = LoadModel(missing);
  EXPECT_EQ(m.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(m.status().message()), HasSubstr(missing));
  EXPECT_THAT(std::string(m.status().message()), HasSubstr("tiny"));

  std::filesystem::create_directories(tmp.path() / "empty");
  m = LoadModel((tmp.path() / "empty").string());
  EXPECT_EQ(m.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(m.status().message()),
              HasSubstr((tmp.path() / "empty" / "config.json").string()));
}

TEST(LoadModelTest, EmptySpecIsInvalid) {
  EXPECT_EQ(LoadModel("").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(LoadModelTest, BadConfigInFileNamesPathAndField) {
  TempDir tmp;
  json j = json::parse(kQwen3_0_6B);
  j["hidden_size"] = -3;
  const std::filesystem::path file = tmp.Write("m/config.json", j.dump(2));
  absl::StatusOr<LoadedModel> m = LoadModel(file.string());
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(std::string(m.status().message()),
            file.string() + ": 'hidden_size' must be a positive integer, got -3");

  const std::filesystem::path bad =
      tmp.Write("b/config.json", "{\n  \"model_type\": \"qwen3\",\n}");
  m = LoadModel(bad.string());
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(m.status().message()), HasSubstr(bad.string()));
  EXPECT_THAT(std::string(m.status().message()), HasSubstr("line 3"));
}

// ---------------------------------------------------------------------------------------------
// Bad config.json inputs: each names the field and the expectation.

struct BadConfigCase {
  std::string label;
  std::function<void(json&)> mutate;
  std::vector<std::string> expect_in_message;
};

void PrintTo(const BadConfigCase& c, std::ostream* os) { *os << c.label; }

class BadConfigTest : public ::testing::TestWithParam<BadConfigCase> {};

TEST_P(BadConfigTest, RejectedWithFieldInMessage) {
  json j = json::parse(kQwen3_0_6B);
  GetParam().mutate(j);
  absl::StatusOr<LoadedModel> m = ManifestFromHfConfig(j.dump(), "config.json");
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument) << m.status();
  EXPECT_THAT(std::string(m.status().message()), HasSubstr("config.json: "));
  for (const std::string& s : GetParam().expect_in_message) {
    EXPECT_THAT(std::string(m.status().message()), HasSubstr(s));
  }
}

INSTANTIATE_TEST_SUITE_P(
    AllFields, BadConfigTest,
    ::testing::Values(
        BadConfigCase{"unsupported_model_type",
                      [](json& j) { j["model_type"] = "gpt2"; },
                      {"config.json: model_type 'gpt2' is not supported; expected one of llama, "
                       "qwen2, qwen3"}},
        BadConfigCase{"missing_model_type",
                      [](json& j) { j.erase("model_type"); },
                      {"'model_type' is missing", "llama, qwen2, qwen3"}},
        BadConfigCase{"model_type_not_string",
                      [](json& j) { j["model_type"] = 3; },
                      {"'model_type' must be a string"}},
        BadConfigCase{"negative_hidden_size",
                      [](json& j) { j["hidden_size"] = -3; },
                      {"config.json: 'hidden_size' must be a positive integer, got -3"}},
        BadConfigCase{"missing_hidden_size",
                      [](json& j) { j.erase("hidden_size"); },
                      {"'hidden_size' is missing; expected a positive integer"}},
        BadConfigCase{"string_hidden_size",
                      [](json& j) { j["hidden_size"] = "1024"; },
                      {"'hidden_size' must be a positive integer, got \"1024\""}},
        BadConfigCase{"fractional_intermediate_size",
                      [](json& j) { j["intermediate_size"] = 3072.5; },
                      {"'intermediate_size' must be a positive integer, got 3072.5"}},
        BadConfigCase{"zero_intermediate_size",
                      [](json& j) { j["intermediate_size"] = 0; },
                      {"'intermediate_size'", "got 0"}},
        BadConfigCase{"null_num_hidden_layers",
                      [](json& j) { j["num_hidden_layers"] = nullptr; },
                      {"'num_hidden_layers' is missing"}},
        BadConfigCase{"too_many_layers",
                      [](json& j) { j["num_hidden_layers"] = 200000; },
                      {"'num_hidden_layers' must be at most 99997", "200000"}},
        BadConfigCase{"huge_vocab",
                      [](json& j) { j["vocab_size"] = 1ull << 40; },
                      {"'vocab_size' must be a positive integer <= 2147483647"}},
        BadConfigCase{"bool_num_attention_heads",
                      [](json& j) { j["num_attention_heads"] = true; },
                      {"'num_attention_heads' must be a positive integer, got true"}},
        BadConfigCase{"heads_not_multiple_of_kv",
                      [](json& j) { j["num_key_value_heads"] = 6; },
                      {"'num_attention_heads' (16) must be a multiple of 'num_key_value_heads' "
                       "(6)"}},
        BadConfigCase{"zero_kv_heads",
                      [](json& j) { j["num_key_value_heads"] = 0; },
                      {"'num_key_value_heads' must be a positive integer"}},
        BadConfigCase{"hidden_not_divisible_without_head_dim",
                      [](json& j) {
                        j.erase("head_dim");
                        j["hidden_size"] = 1000;
                        j["num_attention_heads"] = 24;
                        j["num_key_value_heads"] = 8;
                      },
                      {"'hidden_size' (1000)", "'num_attention_heads' (24)", "'head_dim'"}},
        BadConfigCase{"negative_head_dim",
                      [](json& j) { j["head_dim"] = -128; },
                      {"'head_dim' must be a positive integer, got -128"}},
        BadConfigCase{"tie_word_embeddings_string",
                      [](json& j) { j["tie_word_embeddings"] = "yes"; },
                      {"'tie_word_embeddings' must be a boolean (true or false), got \"yes\""}},
        BadConfigCase{"attention_bias_int",
                      [](json& j) { j["attention_bias"] = 1; },
                      {"'attention_bias' must be a boolean"}},
        BadConfigCase{"llama_mlp_bias_string",
                      [](json& j) {
                        j["model_type"] = "llama";
                        j["mlp_bias"] = "false";
                      },
                      {"'mlp_bias' must be a boolean"}},
        BadConfigCase{"negative_initializer_range",
                      [](json& j) { j["initializer_range"] = -0.02; },
                      {"'initializer_range' must be a positive number, got -0.02"}},
        BadConfigCase{"initializer_range_string",
                      [](json& j) { j["initializer_range"] = "0.02"; },
                      {"'initializer_range' must be a positive number"}},
        BadConfigCase{"name_or_path_not_string",
                      [](json& j) { j["_name_or_path"] = 7; },
                      {"'_name_or_path' must be a string, got 7"}},
        BadConfigCase{"top_level_array",
                      [](json& j) {
                        j = json::array({1, 2});
                      },
                      {"expected a JSON object"}},
        BadConfigCase{"too_many_elements",
                      [](json& j) {
                        j["hidden_size"] = 2000000000;
                        j["vocab_size"] = 2000000000;
                        j["tie_word_embeddings"] = false;
                      },
                      {"model.embed_tokens", "element count"}}),
    [](const ::testing::TestParamInfo<BadConfigCase>& info) { return info.param.label; });

TEST(ManifestFromHfConfigTest, MalformedJsonReportsPosition) {
  absl::StatusOr<LoadedModel> m =
      ManifestFromHfConfig("{\n  \"model_type\": \"qwen3\"\n  \"hidden_size\": 1\n}", "x.json");
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(m.status().message()), HasSubstr("x.json: malformed JSON"));
  EXPECT_THAT(std::string(m.status().message()), HasSubstr("line 3, column"));

  m = ManifestFromHfConfig("", "x.json");
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(m.status().message()), HasSubstr("malformed JSON"));
}

// ---------------------------------------------------------------------------------------------
// Hash.

TEST(ManifestHashTest, StableAndHex) {
  const ModelManifest m = MustParse(kQwen2_0_5B).manifest;
  const uint64_t h = ManifestHash(m);
  EXPECT_EQ(ManifestHash(m), h);
  EXPECT_EQ(ManifestHash(MustParse(kQwen2_0_5B).manifest), h);
  EXPECT_EQ(ManifestHashHex(h).size(), 16u);
  EXPECT_EQ(ManifestHashHex(0x1), "0000000000000001");
  EXPECT_EQ(ManifestHashHex(0xABCDEF0123456789ull), "abcdef0123456789");
  EXPECT_EQ(m.manifest_hash(), ManifestHashHex(h));
}

TEST(ManifestHashTest, PinnedValueForTiny) {
  // The encoding is part of the shared-memory contract (segment headers carry the hash). If this
  // changes, bump the encoding's version tag and say so in the release notes.
  EXPECT_EQ(LoadModel("tiny")->manifest.manifest_hash(), "59187e21b76bab4b");
}

TEST(ManifestHashTest, ChangesWithStructure) {
  const ModelManifest base = MustParse(kQwen2_0_5B).manifest;
  const uint64_t h = ManifestHash(base);

  ModelManifest shape = base;
  shape.mutable_layers(3)->mutable_tensors(2)->set_shape(0, 129);
  EXPECT_NE(ManifestHash(shape), h);

  ModelManifest dtype = base;
  dtype.mutable_layers(3)->mutable_tensors(2)->set_dtype(slidedp::v1::DTYPE_FP32);
  EXPECT_NE(ManifestHash(dtype), h);

  ModelManifest decay = base;
  decay.mutable_layers(3)->mutable_tensors(2)->set_no_decay(false);
  EXPECT_NE(ManifestHash(decay), h);

  ModelManifest tname = base;
  tname.mutable_layers(3)->mutable_tensors(2)->set_name("x");
  EXPECT_NE(ManifestHash(tname), h);

  ModelManifest lname = base;
  lname.mutable_layers(3)->set_name("x");
  EXPECT_NE(ManifestHash(lname), h);

  ModelManifest kind = base;
  kind.mutable_layers(3)->set_kind(slidedp::v1::LAYER_KIND_OTHER);
  EXPECT_NE(ManifestHash(kind), h);

  ModelManifest rank = base;  // [896] vs [896, 1]: same numel, different shape
  rank.mutable_layers(3)->mutable_tensors(0)->add_shape(1);
  EXPECT_NE(ManifestHash(rank), h);

  ModelManifest order = base;
  order.mutable_layers()->SwapElements(1, 2);
  EXPECT_NE(ManifestHash(order), h);

  ModelManifest fewer = base;
  fewer.mutable_layers()->RemoveLast();
  EXPECT_NE(ManifestHash(fewer), h);
}

TEST(ManifestHashTest, IgnoresNameFamilyAndStoredHash) {
  const ModelManifest base = MustParse(kQwen2_0_5B).manifest;
  ModelManifest other = base;
  other.set_name("something else");
  other.set_family("tiny");
  other.set_manifest_hash("0123");
  other.set_tie_word_embeddings(!base.tie_word_embeddings());
  EXPECT_EQ(ManifestHash(other), ManifestHash(base));
}

// ---------------------------------------------------------------------------------------------
// ValidateManifest.

ModelManifest SmallManifest() { return MustParse(kQwen2_0_5B).manifest; }

void ExpectInvalid(const ModelManifest& m, const std::string& substr) {
  const absl::Status s = ValidateManifest(m);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr(substr));
}

TEST(ValidateManifestTest, AcceptsGeneratedManifests) {
  EXPECT_TRUE(ValidateManifest(SmallManifest()).ok());
  EXPECT_TRUE(ValidateManifest(LoadModel("tiny")->manifest).ok());
  EXPECT_TRUE(ValidateManifest(MustParse(kLlama3_8B).manifest).ok());
}

TEST(ValidateManifestTest, RejectsNoLayers) {
  ExpectInvalid(ModelManifest{}, "manifest.layers is empty");
}

TEST(ValidateManifestTest, RejectsEmptyLayerName) {
  ModelManifest m = SmallManifest();
  m.mutable_layers(2)->clear_name();
  ExpectInvalid(m, "manifest.layers[2].name is empty");
}

TEST(ValidateManifestTest, RejectsDuplicateLayerName) {
  ModelManifest m = SmallManifest();
  m.mutable_layers(2)->set_name("model.layers.0");
  ExpectInvalid(m, "manifest.layers[2] ('model.layers.0').name: duplicate layer name");
}

TEST(ValidateManifestTest, RejectsDuplicateTensorName) {
  ModelManifest m = SmallManifest();
  m.mutable_layers(2)->mutable_tensors(1)->set_name("model.embed_tokens.weight");
  ExpectInvalid(m, "tensors[1] ('model.embed_tokens.weight').name: duplicate tensor name");
}

TEST(ValidateManifestTest, RejectsEmptyTensorName) {
  ModelManifest m = SmallManifest();
  m.mutable_layers(2)->mutable_tensors(1)->clear_name();
  ExpectInvalid(m, "manifest.layers[2] ('model.layers.1').tensors[1].name is empty");
}

TEST(ValidateManifestTest, RejectsZeroAndNegativeDims) {
  ModelManifest m = SmallManifest();
  m.mutable_layers(1)->mutable_tensors(1)->set_shape(1, 0);
  ExpectInvalid(m, "tensors[1] ('model.layers.0.self_attn.q_proj.weight').shape[1] is 0");
  m.mutable_layers(1)->mutable_tensors(1)->set_shape(1, -5);
  ExpectInvalid(m, ".shape[1] is -5; every dimension must be >= 1");
}

TEST(ValidateManifestTest, RejectsEmptyAndHighRankShapes) {
  ModelManifest m = SmallManifest();
  m.mutable_layers(1)->mutable_tensors(0)->clear_shape();
  ExpectInvalid(m, ".shape has 0 dimensions");
  for (int i = 0; i < 9; ++i) m.mutable_layers(1)->mutable_tensors(0)->add_shape(1);
  ExpectInvalid(m, ".shape has 9 dimensions; expected 1 to 8");
}

TEST(ValidateManifestTest, RejectsUnspecifiedDtype) {
  ModelManifest m = SmallManifest();
  m.mutable_layers(0)->mutable_tensors(0)->set_dtype(slidedp::v1::DTYPE_UNSPECIFIED);
  ExpectInvalid(m, "('model.embed_tokens.weight').dtype is 0; expected DTYPE_BF16 or DTYPE_FP32");
  m.mutable_layers(0)->mutable_tensors(0)->set_dtype(static_cast<slidedp::v1::DType>(77));
  ExpectInvalid(m, ".dtype is 77");
}

TEST(ValidateManifestTest, RejectsUnspecifiedKind) {
  ModelManifest m = SmallManifest();
  m.mutable_layers(4)->set_kind(slidedp::v1::LAYER_KIND_UNSPECIFIED);
  ExpectInvalid(m, "manifest.layers[4] ('model.layers.3').kind is 0");
}

TEST(ValidateManifestTest, RejectsLayerWithoutTensors) {
  ModelManifest m = SmallManifest();
  m.mutable_layers(3)->clear_tensors();
  ExpectInvalid(m, "manifest.layers[3] ('model.layers.2').tensors is empty");
}

TEST(ValidateManifestTest, RejectsNumelOverflow) {
  ModelManifest m = SmallManifest();
  // 2^40 * 2^40 wraps uint64.
  TensorSpec* t = m.mutable_layers(1)->mutable_tensors(1);
  t->set_shape(0, int64_t{1} << 40);
  t->set_shape(1, int64_t{1} << 40);
  ExpectInvalid(m, "element count overflows");
  EXPECT_EQ(TensorNumel(*t), UINT64_MAX);

  // Each tensor fits, the sum over layers does not.
  ModelManifest sum = SmallManifest();
  for (int i = 1; i <= 20; ++i) {
    TensorSpec* big = sum.mutable_layers(i)->mutable_tensors(1);
    big->set_shape(0, int64_t{1} << 26);
    big->set_shape(1, int64_t{1} << 26);
  }
  ExpectInvalid(sum, "total element count exceeds");
}

TEST(ValidateManifestTest, RejectsTooManyLayers) {
  ModelManifest m;
  for (int i = 0; i < kMaxManifestLayers + 1; ++i) {
    LayerSpec* l = m.add_layers();
    // StrCat rather than "l" + std::to_string(i): GCC 12 at -O3 reports a false -Wrestrict on
    // the latter (GCC bug 105329).
    l->set_name(absl::StrCat("l", i));
    l->set_kind(slidedp::v1::LAYER_KIND_OTHER);
    TensorSpec* t = l->add_tensors();
    t->set_name(absl::StrCat("t", i));
    t->add_shape(1);
    t->set_dtype(slidedp::v1::DTYPE_FP32);
  }
  ExpectInvalid(m, "100001 layers; at most 100000");
  m.mutable_layers()->RemoveLast();
  EXPECT_TRUE(ValidateManifest(m).ok());
}

TEST(ValidateManifestTest, LongNamesComeBackBounded) {
  // The message quoted the whole name; in gRPC's trailers (8 KiB for most clients) a long one
  // reached the client as RESOURCE_EXHAUSTED "received initial metadata size exceeds limit".
  ModelManifest m = SmallManifest();
  m.mutable_layers(1)->set_name(std::string(1 << 20, 'l'));
  m.mutable_layers(1)->mutable_tensors(1)->set_name(std::string(1 << 20, 't'));
  m.mutable_layers(1)->mutable_tensors(1)->set_shape(1, 0);
  const absl::Status s = ValidateManifest(m);
  ExpectInvalid(m, ".shape[1] is 0; every dimension must be >= 1");
  ExpectInvalid(m, "... (1048576 bytes)')");
  EXPECT_LT(s.message().size(), 512u);
}

// ---------------------------------------------------------------------------------------------
// Init kinds and counts.

TEST(TensorInitKindTest, ByName) {
  auto kind = [](const std::string& name) {
    TensorSpec t;
    t.set_name(name);
    return TensorInitKind(t);
  };
  EXPECT_EQ(kind("model.layers.0.input_layernorm.weight"), InitKind::kOnes);
  EXPECT_EQ(kind("model.layers.0.post_attention_layernorm.weight"), InitKind::kOnes);
  EXPECT_EQ(kind("model.layers.0.self_attn.q_norm.weight"), InitKind::kOnes);
  EXPECT_EQ(kind("model.norm.weight"), InitKind::kOnes);
  EXPECT_EQ(kind("model.layers.0.self_attn.q_proj.bias"), InitKind::kZeros);
  EXPECT_EQ(kind("model.layers.0.mlp.down_proj.bias"), InitKind::kZeros);
  EXPECT_EQ(kind("model.layers.0.self_attn.q_proj.weight"), InitKind::kNormal);
  EXPECT_EQ(kind("model.embed_tokens.weight"), InitKind::kNormal);
  EXPECT_EQ(kind("lm_head.weight"), InitKind::kNormal);
  EXPECT_EQ(kind("model.layers.0.mlp.unbiased.weight"), InitKind::kNormal);
}

TEST(TensorInitKindTest, AgreesWithNoDecayForGeneratedManifests) {
  json j = json::parse(kLlama3_8B);
  j["num_hidden_layers"] = 2;
  j["attention_bias"] = true;
  j["mlp_bias"] = true;
  const LoadedModel m = MustParse(j.dump());
  for (const LayerSpec& l : m.manifest.layers()) {
    for (const TensorSpec& t : l.tensors()) {
      EXPECT_EQ(t.no_decay(), TensorInitKind(t) != InitKind::kNormal) << t.name();
    }
  }
}

TEST(NumelTest, Counts) {
  const ModelManifest m = MustParse(kQwen3_0_6B).manifest;
  EXPECT_EQ(LayerNumel(m.layers(0)), 151936u * 1024u);
  EXPECT_EQ(LayerNumel(m.layers(1)), 15730944u);
  uint64_t sum = 0;
  for (const LayerSpec& l : m.layers()) sum += LayerNumel(l);
  EXPECT_EQ(sum, ManifestNumel(m));
  EXPECT_EQ(TensorNumel(m.layers(1).tensors(1)), 2048u * 1024u);
}

}  // namespace
}  // namespace slidedp::model
