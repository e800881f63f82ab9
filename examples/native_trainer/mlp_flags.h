// Command-line flags shared by native_trainer and native_reference, so the two cannot disagree
// on a default: the model (--layers, --dim), the data (--batch, --seed), the run (--steps,
// --world-size) and the optimizer (--lr, --weight-decay).
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>

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

}  // namespace slidedp::examples
