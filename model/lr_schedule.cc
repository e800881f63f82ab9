#include "model/lr_schedule.h"

#include <algorithm>
#include <cmath>
#include <numbers>

namespace slidedp::model {

double LearningRate(const slidedp::v1::OptimizerConfig& cfg, uint64_t step) {
  const double lr = cfg.lr();
  const uint64_t s = step == 0 ? 0 : step - 1;
  const uint64_t warmup = cfg.warmup_steps();
  if (s < warmup) return lr * static_cast<double>(s) / static_cast<double>(warmup);
  const auto kind = cfg.schedule();
  if (kind == slidedp::v1::LR_SCHEDULE_UNSPECIFIED || kind == slidedp::v1::LR_SCHEDULE_CONSTANT ||
      cfg.total_steps() == 0) {
    return lr;
  }
  const double span = static_cast<double>(std::max<uint64_t>(1, cfg.total_steps() - warmup));
  const double done = static_cast<double>(s - warmup);
  double f;
  if (kind == slidedp::v1::LR_SCHEDULE_LINEAR) {
    f = std::max(0.0, (span - done) / span);
  } else {
    const double progress = std::min(1.0, done / span);
    f = 0.5 * (1.0 + std::cos(std::numbers::pi * progress));
  }
  return lr * (cfg.min_lr_ratio() + (1.0 - cfg.min_lr_ratio()) * f);
}

}  // namespace slidedp::model
