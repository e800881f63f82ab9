#include "model/step_model.h"

#include <algorithm>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/layout.h"
#include "model/manifest.h"

namespace slidedp::model {
namespace {

using ::testing::HasSubstr;

constexpr char kQwen3_4b[] = R"({"model_type": "qwen3", "hidden_size": 2560,
  "intermediate_size": 9728, "num_hidden_layers": 36, "num_attention_heads": 32,
  "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": true,
  "_name_or_path": "qwen3-4b"})";

ModelShape Qwen3_4b() {
  absl::StatusOr<LoadedModel> m = ManifestFromHfConfig(kQwen3_4b, "qwen3-4b/config.json");
  EXPECT_TRUE(m.ok()) << m.status();
  absl::StatusOr<ModelShape> s = ShapeFromModel(*m);
  EXPECT_TRUE(s.ok()) << s.status();
  return *s;
}

StepInputs Inputs(const std::string& layout, double batch, uint32_t gpus = 1, uint64_t seq = 1024,
                  uint32_t window_slots = kDefaultWindowSlots) {
  StepInputs in;
  in.gpus = gpus;
  in.batch = batch;
  in.seq = seq;
  absl::StatusOr<std::vector<LayerPolicy>> l = ParseLayout(layout, 36);
  EXPECT_TRUE(l.ok()) << l.status();
  in.layout = *l;
  in.window_slots = window_slots;
  return in;
}

StepPrediction Predict(const StepInputs& in, const HardwareProfile& p = BuiltinH200Profile()) {
  absl::StatusOr<StepPrediction> r = PredictStep(Qwen3_4b(), in, p);
  EXPECT_TRUE(r.ok()) << r.status();
  return r.ok() ? *r : StepPrediction{};
}

double Host(const StepPrediction& p, const std::string& key) {
  for (const HostResource& h : p.host) {
    if (h.key == key) return h.seconds;
  }
  ADD_FAILURE() << "no host resource " << key;
  return 0;
}

TEST(StepModelTest, ShapeOfQwen3_4b) {
  const ModelShape s = Qwen3_4b();
  EXPECT_EQ(s.hidden, 2560u);
  EXPECT_EQ(s.intermediate, 9728u);
  EXPECT_EQ(s.q_dim, 4096u);
  EXPECT_EQ(s.kv_dim, 1024u);
  EXPECT_EQ(s.heads, 32u);
  EXPECT_EQ(s.kv_heads, 8u);
  EXPECT_EQ(s.head_dim, 128u);
  EXPECT_EQ(s.vocab, 151936u);
  EXPECT_TRUE(s.tied);
  ASSERT_EQ(s.decoder_params.size(), 36u);
  EXPECT_EQ(s.decoder_params[0], 100930816u);  // gpu_plane_bench's --layer-params for this shape
  EXPECT_EQ(s.nondecoder_params, 151936u * 2560u + 2560u);
}

TEST(StepModelTest, FlopsFollowTheFormulas) {
  const StepPrediction p = Predict(Inputs("36N", 2, 1, 512));
  const double tokens = 2 * 512;
  const double dec = 36 * 100930816.0;
  const double attn = 36 * 2.0 * 2 * 512.0 * 512.0 * 4096;  // causal forward per layer
  const double lm = 2.0 * 2560 * 151936 * tokens;
  EXPECT_DOUBLE_EQ(p.forward_flops, 2 * dec * tokens + attn + lm);
  EXPECT_DOUBLE_EQ(p.backward_flops, 2 * p.forward_flops);
  EXPECT_DOUBLE_EQ(p.replay_flops, 0);
  EXPECT_DOUBLE_EQ(p.lm_head_flops, 3 * lm);
  const StepPrediction f = Predict(Inputs("36F-r0", 2, 1, 512));
  EXPECT_DOUBLE_EQ(f.replay_flops, 2 * dec * tokens + attn);
  EXPECT_EQ(f.replayed_layers, 36u);
}

TEST(StepModelTest, MoreReplayMeansMoreCompute) {
  const double n = Predict(Inputs("36N", 8)).compute_s;
  const double sac = Predict(Inputs("36SAC", 8)).compute_s;
  const double half = Predict(Inputs("18F 18N", 8)).compute_s;
  const double full = Predict(Inputs("36F", 8)).compute_s;
  const double seg = Predict(Inputs("36Seg", 8)).compute_s;
  EXPECT_LT(n, sac);
  EXPECT_LT(sac, half);
  EXPECT_LT(half, full);
  EXPECT_DOUBLE_EQ(seg, full);
}

TEST(StepModelTest, OffloadAddsTransferAndSavesMemory) {
  for (const char* kind : {"F", "Seg", "SAC", "N"}) {
    const StepPrediction kept = Predict(Inputs(std::string("36") + kind + "-r0", 8));
    const StepPrediction off = Predict(Inputs(std::string("36") + kind + "-r0.5", 8));
    EXPECT_GT(Host(off, "h2d"), Host(kept, "h2d")) << kind;
    EXPECT_GT(Host(off, "d2h"), Host(kept, "d2h")) << kind;
    EXPECT_LT(off.peak_gpu_bytes, kept.peak_gpu_bytes) << kind;
    EXPECT_GT(off.offloaded_bytes, 0) << kind;
    EXPECT_DOUBLE_EQ(off.compute_s, kept.compute_s) << kind;
  }
  // SAC offloads only its 2h input: the same bytes as F.
  EXPECT_DOUBLE_EQ(Predict(Inputs("36SAC-r1", 8)).offloaded_bytes,
                   Predict(Inputs("36F-r1", 8)).offloaded_bytes);
}

TEST(StepModelTest, MemoryPerKind) {
  const double tokens = 4 * 1024;
  const double f = Predict(Inputs("36F", 4)).activation_bytes;
  EXPECT_DOUBLE_EQ(f, 36 * 2 * 2560 * tokens);
  EXPECT_DOUBLE_EQ(Predict(Inputs("36Seg", 4)).activation_bytes, 2 * f);
  EXPECT_DOUBLE_EQ(Predict(Inputs("36N", 4)).activation_bytes,
                   36 * 2.0 * (8 * 2560 + 2 * 4096 + 2 * 1024 + 3 * 9728) * tokens);
  EXPECT_GT(Predict(Inputs("36N", 4)).peak_gpu_bytes, Predict(Inputs("36SAC", 4)).peak_gpu_bytes);
  EXPECT_GT(Predict(Inputs("36SAC", 4)).peak_gpu_bytes, Predict(Inputs("36F", 4)).peak_gpu_bytes);
  EXPECT_DOUBLE_EQ(Predict(Inputs("36F", 4)).logits_bytes, tokens * 151936 * 10);
}

TEST(StepModelTest, ResidentLayersLeaveTheHost) {
  const StepPrediction streamed = Predict(Inputs("36F", 8));
  const StepPrediction resident = Predict(Inputs("6RF 30F", 8));
  EXPECT_LT(resident.host_s, streamed.host_s);
  for (const char* key : {"h2d", "d2h", "host_adam"}) {
    EXPECT_LT(Host(resident, key), Host(streamed, key)) << key;
  }
  EXPECT_GT(resident.resident_bytes, streamed.resident_bytes);
  EXPECT_GT(resident.resident_update_s, 0);
  const StepPrediction all = Predict(Inputs("36RF", 8));
  EXPECT_DOUBLE_EQ(all.host_s, 0);
  EXPECT_DOUBLE_EQ(all.first_fetch_s, 0);
  EXPECT_EQ(all.regime, "GPU-bound");
}

TEST(StepModelTest, RoutesAndRanks) {
  StepInputs gpu = Inputs("36F", 8, 4);
  StepInputs cpu = gpu;
  cpu.route = GradRoute::kCpuReduction;
  const StepPrediction g = Predict(gpu);
  const StepPrediction c = Predict(cpu);
  EXPECT_DOUBLE_EQ(c.d2h_bytes, 4 * 2 * g.d2h_bytes);  // FP32 from every rank vs one BF16
  EXPECT_GT(Host(c, "cpu_reduce"), 0);
  EXPECT_EQ(g.host.size(), 3u);
  // Replicated delivery: H2D grows with R.
  EXPECT_DOUBLE_EQ(g.h2d_bytes, 4 * Predict(Inputs("36F", 8, 1)).h2d_bytes);
  // A window too small for the forward's layers fetches them again in backward.
  EXPECT_EQ(Predict(Inputs("36F", 8, 1, 1024, 6)).refetched_layers, 30u);
  EXPECT_EQ(Predict(Inputs("36F", 8, 1, 1024, 40)).refetched_layers, 0u);
}

TEST(StepModelTest, StepIsMaxOfCAndHPlusE) {
  const StepPrediction p = Predict(Inputs("36F", 8));
  EXPECT_DOUBLE_EQ(p.step_s, std::max(p.compute_s, p.host_s) + p.exposure_s);
  EXPECT_EQ(p.regime, p.host_s > p.compute_s ? "host-bound" : "GPU-bound");
  EXPECT_DOUBLE_EQ(p.tokens_per_s, 8 * 1024 / p.step_s);
  EXPECT_DOUBLE_EQ(p.exposure_s, p.first_fetch_s + p.last_update_s + p.overhead_s);
}

TEST(StepModelTest, CrossoverIsC1OverH) {
  absl::StatusOr<StepPlan> plan = PlanStep(Qwen3_4b(), Inputs("36F", 16, 2), BuiltinH200Profile());
  ASSERT_TRUE(plan.ok()) << plan.status();
  // C(1): the global batch (2 x 16) on one GPU.
  const StepPrediction one = Predict(Inputs("36F", 32, 1));
  EXPECT_DOUBLE_EQ(plan->c1_s, one.compute_s);
  EXPECT_DOUBLE_EQ(plan->h1_s, one.host_s);
  EXPECT_DOUBLE_EQ(plan->r_cross, one.compute_s / one.host_s);
  ASSERT_EQ(plan->scaling.size(), 4u);
  EXPECT_EQ(plan->scaling[3].gpus, 8u);
  // Strong scaling: C(R) ~ C(1) / R.
  ASSERT_TRUE(plan->scaling[3].strong.has_value());
  EXPECT_DOUBLE_EQ(plan->scaling[3].strong_batch, 4);
  EXPECT_NEAR(plan->scaling[3].strong->compute_s, plan->c1_s / 8, plan->c1_s / 8 * 1e-9);
  // Weak scaling keeps the per-rank compute.
  EXPECT_DOUBLE_EQ(plan->scaling[3].weak.compute_s, plan->at.compute_s);
  // Below one sequence per rank there is no strong-scaling row.
  absl::StatusOr<StepPlan> small = PlanStep(Qwen3_4b(), Inputs("36F", 1), BuiltinH200Profile());
  ASSERT_TRUE(small.ok());
  EXPECT_FALSE(small->scaling[1].strong.has_value());
}

// The built-in profile reproduces SlideDP's measured Qwen3-4B steps (seq 1024, one H200):
// bench/results/h200_2026-12-03_issue18/hf_head_to_head_20261203-114623.json, runs "slidedp".
TEST(StepModelTest, BuiltinProfileReproducesTheH200Measurements) {
  struct Point {
    const char* what;
    StepInputs inputs;
    double measured_s;
  };
  // checkpointing=0.25 spreads F over layers 3, 7, ..., 35; resident_layers=4 makes 0..3
  // resident.
  std::string quarter = "3R 1RF";
  for (int i = 0; i < 8; ++i) quarter += " 3N 1F";
  const Point points[] = {
      {"on b16 window_slots=40,resident_layers=6", Inputs("6RF 30F", 16, 1, 1024, 40),
       1.3581218219999869},
      {"on b8 window_slots=40", Inputs("36F", 8, 1, 1024, 40), 0.9514567539999916},
      {"off b16 checkpointing=0.25,resident_layers=4", Inputs(quarter, 16, 1, 1024, 6),
       1.1610375630000362},
  };
  for (const Point& p : points) {
    const StepPrediction pred = Predict(p.inputs);
    EXPECT_NEAR(pred.step_s / p.measured_s, 1.0, 0.10)
        << p.what << ": predicted " << pred.step_s << " s, measured " << p.measured_s << " s";
  }
  // The b8 run is host-bound (hostd's AdamW), the b16 runs GPU-bound.
  EXPECT_EQ(Predict(points[1].inputs).regime, "host-bound");
  EXPECT_EQ(Predict(points[1].inputs).binding, "host_adam");
  EXPECT_EQ(Predict(points[0].inputs).regime, "GPU-bound");
  // The h2d_bytes these runs report.
  EXPECT_DOUBLE_EQ(Predict(points[0].inputs).h2d_bytes, 6055848960.0);
  EXPECT_DOUBLE_EQ(Predict(points[2].inputs).h2d_bytes, 11707974656.0);
}

TEST(StepModelTest, InvalidInputsNameTheField) {
  const ModelShape s = Qwen3_4b();
  const HardwareProfile p = BuiltinH200Profile();
  StepInputs in = Inputs("36F", 8);
  in.gpus = 0;
  EXPECT_THAT(PredictStep(s, in, p).status().message(), HasSubstr("gpus"));
  in = Inputs("36F", 8);
  in.batch = 0;
  EXPECT_THAT(PredictStep(s, in, p).status().message(), HasSubstr("batch"));
  in = Inputs("36F", 8);
  in.seq = 0;
  EXPECT_THAT(PredictStep(s, in, p).status().message(), HasSubstr("seq"));
  in = Inputs("36F", 8);
  in.layout.pop_back();
  EXPECT_THAT(PredictStep(s, in, p).status().message(), HasSubstr("layout: 35 layers"));
  HardwareProfile bad = p;
  bad.h2d_gb_per_s = 0;
  EXPECT_THAT(PredictStep(s, Inputs("36F", 8), bad).status().message(), HasSubstr("h2d_gb_per_s"));
}

TEST(StepModelTest, ProfileJson) {
  const HardwareProfile base = BuiltinH200Profile();
  absl::StatusOr<HardwareProfile> p =
      ProfileFromJson(R"({"h2d_gb_per_s": 25, "layer_overhead_s": 0})", base, "p.json");
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->h2d_gb_per_s, 25);
  EXPECT_EQ(p->layer_overhead_s, 0);
  EXPECT_EQ(p->gpu_bf16_tflops, base.gpu_bf16_tflops);
  EXPECT_EQ(p->name, "builtin:h200+p.json");
  // Round trip through ProfileToJson.
  absl::StatusOr<HardwareProfile> back = ProfileFromJson(ProfileToJson(*p).dump(), base, "x");
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(ProfileToJson(*back), ProfileToJson(*p));

  const auto error = [&](const char* text) {
    absl::StatusOr<HardwareProfile> r = ProfileFromJson(text, base, "p.json");
    EXPECT_FALSE(r.ok()) << text;
    return r.ok() ? std::string() : std::string(r.status().message());
  };
  EXPECT_THAT(error(R"({"h2d": 1})"),
              HasSubstr("p.json: unknown key 'h2d'; expected one of name, h2d_gb_per_s"));
  EXPECT_THAT(error(R"({"h2d_gb_per_s": "fast"})"),
              HasSubstr("key 'h2d_gb_per_s': expected a number > 0 (GB/s), got \"fast\""));
  EXPECT_THAT(error(R"({"gpu_bf16_tflops": -1})"),
              HasSubstr("key 'gpu_bf16_tflops': expected a number > 0"));
  EXPECT_THAT(error(R"({"sac_replay_fraction": 2})"),
              HasSubstr("key 'sac_replay_fraction': expected a number in [0, 1]"));
  EXPECT_THAT(error(R"({"name": 3})"), HasSubstr("key 'name': expected a string"));
  EXPECT_THAT(error("[1]"), HasSubstr("expected a JSON object"));
  EXPECT_THAT(error("{"), HasSubstr("p.json: not JSON"));
}

TEST(StepModelTest, TinyModelLoads) {
  absl::StatusOr<LoadedModel> m = LoadModel("tiny");
  ASSERT_TRUE(m.ok());
  absl::StatusOr<ModelShape> s = ShapeFromModel(*m);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->decoder_params.size(), 4u);
  EXPECT_EQ(s->q_dim, 64u);
  EXPECT_EQ(s->kv_dim, 32u);
  EXPECT_FALSE(s->tied);
}

}  // namespace
}  // namespace slidedp::model
