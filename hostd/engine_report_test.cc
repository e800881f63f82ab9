#include "hostd/engine_report.h"

#include <cmath>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/lr_schedule.h"

namespace slidedp::hostd {
namespace {

using ::testing::DoubleNear;
using ::testing::ElementsAre;

TEST(EngineReportTest, CreationLineShowsPhaseProgressAndElapsed) {
  slidedp::v1::JobCreation c;
  c.set_job_id("default");
  c.set_phase("importing weights");
  EXPECT_EQ(RenderCreationLine(c, 3.4), "creating job 'default': importing weights (3 s)");
  c.set_done(12);
  c.set_total(36);
  c.set_unit("layers");
  EXPECT_EQ(RenderCreationLine(c, 41.2),
            "creating job 'default': importing weights 12/36 layers (41 s)");
  c.set_phase("allocating shared memory");
  c.set_unit("bytes");
  c.set_done(uint64_t{3} << 29);  // 1.5 GiB
  c.set_total(uint64_t{6} << 30);
  EXPECT_EQ(RenderCreationLine(c, 0.4),
            "creating job 'default': allocating shared memory 1.5/6.0 GiB (0 s)");
}

TEST(EngineReportTest, StatusLineNamesTheJobOrTheCreationOrNothing) {
  StatusLineSnapshot s;
  EXPECT_EQ(RenderStatusLine(s), "serving, no job");
  s.creating.emplace();
  s.creating->set_job_id("j");
  s.creating->set_phase("recovering");
  s.creation_elapsed_s = 2;
  EXPECT_EQ(RenderStatusLine(s), "creating job 'j': recovering (2 s)");
  s.has_job = true;
  s.job_id = "default";
  s.model_name = "qwen3-4b";
  s.steps_completed = 120;
  s.step_state = shm::StepState::kRunning;
  s.ranks_attached = 1;
  s.world_size = 2;
  EXPECT_EQ(RenderStatusLine(s), "job default (qwen3-4b): 120 steps, running, 1/2 ranks attached");
  s.step_state = shm::StepState::kTorn;
  EXPECT_EQ(RenderStatusLine(s), "job default (qwen3-4b): 120 steps, torn, 1/2 ranks attached");
}

TEST(EngineReportTest, LayerBytesCountThreeFp32CopiesAndPageAlignedParams) {
  LayerSnapshot s;
  s.index = 3;
  s.name = "model.layers.2";
  s.kind = slidedp::v1::LAYER_KIND_DECODER;
  s.numel = 1000;
  s.version = 9;
  s.state_stride = 4096;
  s.param_bytes = 2000;
  s.numa_node = 1;
  s.skipped_steps = 2;
  s.last_grad_norm = 0.5;
  const slidedp::v1::LayerStatus l = RenderLayer(s);
  EXPECT_EQ(l.layer(), 3u);
  EXPECT_EQ(l.name(), "model.layers.2");
  EXPECT_EQ(l.kind(), slidedp::v1::LAYER_KIND_DECODER);
  EXPECT_EQ(l.state_bytes(), 3u * 4096);
  EXPECT_EQ(l.param_bytes(), 4096u);
  EXPECT_EQ(l.version(), 9u);
  EXPECT_EQ(l.numa_node(), 1);
  EXPECT_EQ(l.skipped_steps(), 2u);
  EXPECT_EQ(l.last_grad_norm(), 0.5);
}

TEST(EngineReportTest, JobShowsTheLearningRateOfTheNextStepAndTheCheckpointsAge) {
  JobSnapshot s;
  s.spec.set_job_id("default");
  s.spec.set_world_size(2);
  s.spec.mutable_routes()->set_chunk_bytes(1 << 20);
  s.optimizer.set_lr(1e-3);
  s.optimizer.set_warmup_steps(10);
  s.next_step = 5;
  s.steps_completed = 4;
  s.weights_source = "seed 7";
  s.client_updated_layers = {0, 6};
  const slidedp::v1::JobStatus before = RenderJob(s);
  EXPECT_EQ(before.job_id(), "default");
  EXPECT_EQ(before.world_size(), 2u);
  EXPECT_EQ(before.routes().chunk_bytes(), 1u << 20);
  EXPECT_EQ(before.step(), 4u);
  EXPECT_EQ(before.step_state(), "idle");
  EXPECT_EQ(before.current_lr(), model::LearningRate(s.optimizer, 5));
  EXPECT_LT(before.current_lr(), 1e-3);  // still warming up
  EXPECT_EQ(before.weights_source(), "seed 7");
  EXPECT_THAT(before.client_updated_layers(), ElementsAre(0, 6));
  EXPECT_EQ(before.last_checkpoint_path(), "");
  EXPECT_EQ(before.last_checkpoint_age_s(), 0);

  s.resumed_from = "/ck/step-4.default.default";
  s.last_checkpoint.path = "/ck/step-4.default.default";
  s.last_checkpoint.step = 4;
  s.last_checkpoint_unix_ms = 1'000'000;
  s.now_unix_ms = 1'002'500;
  const slidedp::v1::JobStatus after = RenderJob(s);
  EXPECT_EQ(after.resumed_from(), "/ck/step-4.default.default");
  EXPECT_EQ(after.weights_source(), "checkpoint /ck/step-4.default.default");
  EXPECT_EQ(after.last_checkpoint_step(), 4u);
  EXPECT_DOUBLE_EQ(after.last_checkpoint_age_s(), 2.5);
}

TEST(EngineReportTest, StatsDeriveRatesSpansAndTheCheckpointsAge) {
  StatsSnapshot s;
  s.total_params = 2'000'000'000;
  s.last_step_update_seconds = 0.5;  // 4 Gparam/s
  s.fp32_grads = false;
  LayerUpdateResult a;
  a.layer = 1;
  a.start_s = 10.0;
  a.end_s = 10.2;
  a.idle_before_seconds = 0.05;
  LayerUpdateResult b;
  b.layer = 0;
  b.start_s = 10.3;
  b.end_s = 10.6;
  b.idle_before_seconds = 0.1;
  s.last_step_layers = {a, b};
  s.step_seconds_bounds = {0.1, 1};
  s.step_seconds_buckets = {0, 3, 1};
  s.worker.layer_updates = 14;
  s.checkpoint.checkpoints_committed = 2;
  slidedp::v1::GetStatsResponse r = RenderStats(s);
  EXPECT_DOUBLE_EQ(r.update_gparams_per_second(), 4.0);
  EXPECT_DOUBLE_EQ(r.update_gbytes_per_second(), 4.0 * 28);
  EXPECT_THAT(r.last_step_span_seconds(), DoubleNear(0.6, 1e-9));
  EXPECT_THAT(r.last_step_idle_seconds(), DoubleNear(0.15, 1e-9));
  ASSERT_EQ(r.last_step_layers_size(), 2);
  EXPECT_EQ(r.last_step_layers(1).layer(), 0u);
  EXPECT_THAT(r.step_seconds_buckets(), ElementsAre(0, 3, 1));
  EXPECT_THAT(r.step_seconds_bounds(), ElementsAre(0.1, 1));
  EXPECT_EQ(r.layer_updates(), 14u);
  EXPECT_EQ(r.checkpoints_committed(), 2u);
  // No checkpoint yet: step 0, age -1 (even with a step in the snapshot).
  s.last_checkpoint_step = 3;
  EXPECT_EQ(RenderStats(s).checkpoint_last_step(), 0u);
  EXPECT_EQ(RenderStats(s).checkpoint_age_seconds(), -1.0);
  s.last_checkpoint_unix_ms = 5000;
  s.now_unix_ms = 6500;
  r = RenderStats(s);
  EXPECT_EQ(r.checkpoint_last_step(), 3u);
  EXPECT_DOUBLE_EQ(r.checkpoint_age_seconds(), 1.5);
  // FP32 gradients move 4 more bytes per parameter; no step measured: no rate.
  s.fp32_grads = true;
  EXPECT_DOUBLE_EQ(RenderStats(s).update_gbytes_per_second(), 4.0 * 32);
  s.last_step_update_seconds = 0;
  EXPECT_EQ(RenderStats(s).update_gparams_per_second(), 0);
}

}  // namespace
}  // namespace slidedp::hostd
