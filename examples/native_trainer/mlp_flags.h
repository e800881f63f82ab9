// Command-line flags shared by native_trainer and native_reference, so the two cannot disagree
// on a default: the model (--layers, --dim), the data (--batch, --seed), the run (--steps,
// --world-size) and the optimizer (--lr, --weight-decay).
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "examples/native_trainer/mlp_task.h"

namespace slidedp::examples {

struct MlpRunFlags {
  MlpConfig model;
  MlpOptimizer optimizer;
  uint32_t world_size = 1;
  uint64_t steps = 20;
};

inline void AddMlpRunFlags(CLI::App& app, MlpRunFlags* f) {
  app.add_option("--layers", f->model.layers, "Layers of the MLP stack")->capture_default_str();
  app.add_option("--dim", f->model.dim, "Width of every layer")->capture_default_str();
  app.add_option("--batch", f->model.batch, "Global batch (samples per step over all ranks)")
      ->capture_default_str();
  app.add_option("--seed", f->model.seed, "Init seed (teacher: seed + 1, data: seed + 2)")
      ->capture_default_str();
  app.add_option("--steps", f->steps, "Training steps")->capture_default_str();
  app.add_option("--world-size", f->world_size, "Number of ranks (R)")->capture_default_str();
  app.add_option("--lr", f->optimizer.lr, "AdamW learning rate")->capture_default_str();
  app.add_option("--weight-decay", f->optimizer.weight_decay, "AdamW weight decay (not biases)")
      ->capture_default_str();
}

// The flags of a rank process (native_trainer, native_gpu_trainer): hostd's socket, the rank,
// whether it creates the job, the job's gradient ring slot size and the timeout of every wait.
// Each program sets its own defaults before AddRankFlags.
struct RankFlags {
  std::string socket;
  uint32_t rank = 0;
  bool create_job = false;
  uint64_t chunk_bytes = 65536;
  uint32_t timeout_ms = 60000;
};

inline void AddRankFlags(CLI::App& app, RankFlags* f) {
  app.add_option("--socket", f->socket, "hostd's unix socket")->required();
  app.add_option("--rank", f->rank, "This process's rank, 0..R-1")->capture_default_str();
  app.add_flag("--create-job", f->create_job, "Create hostd's job from this model first");
  app.add_option("--chunk-bytes", f->chunk_bytes, "Gradient ring slot size (with --create-job)")
      ->capture_default_str();
  app.add_option("--timeout-ms", f->timeout_ms, "Timeout of every wait and RPC")
      ->capture_default_str();
}

// A rank process's exit code: 0 done; 3 a step was aborted; 4 hostd is gone; 1 anything else.
inline int RankExitCode(const absl::Status& s) {
  if (s.ok()) return 0;
  if (absl::IsAborted(s)) return 3;
  if (absl::IsUnavailable(s)) return 4;
  return 1;
}

}  // namespace slidedp::examples
