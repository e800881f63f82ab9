// The learning-rate schedule, shared by hostd's update worker and the rank library (ranks that
// update some layers themselves, client_updated_layers, use the same LR per step).
#pragma once

#include <cstdint>

#include "slidedp/v1/control.pb.h"

namespace slidedp::model {

// LR for the 1-based update `step`, following Hugging Face's schedulers (s = step - 1):
//   warm-up (s < warmup_steps): lr * s / warmup_steps
//   constant: lr; linear: lr * max(0, (total - s) / (total - warmup));
//   cosine: lr * 0.5 * (1 + cos(pi * (s - warmup) / (total - warmup)))
// with the decay part floored at min_lr_ratio: f' = min_lr_ratio + (1 - min_lr_ratio) * f.
double LearningRate(const slidedp::v1::OptimizerConfig& cfg, uint64_t step);

}  // namespace slidedp::model
