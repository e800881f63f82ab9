#include "hostd/optimizer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <numbers>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/thread_pool.h"

namespace slidedp::hostd {
namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

}  // namespace

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

absl::StatusOr<slidedp::v1::OptimizerConfig> NormalizeOptimizerConfig(
    const slidedp::v1::OptimizerConfig& in) {
  slidedp::v1::OptimizerConfig c = in;
  if (c.beta1() == 0 && c.beta2() == 0 && c.eps() == 0) {
    // A message with no betas/eps set: the defaults of torch.optim.AdamW.
    c.set_beta1(0.9);
    c.set_beta2(0.999);
    c.set_eps(1e-8);
  }
  if (c.schedule() == slidedp::v1::LR_SCHEDULE_UNSPECIFIED) {
    c.set_schedule(slidedp::v1::LR_SCHEDULE_CONSTANT);
  }
  if (c.clip() == slidedp::v1::CLIP_POLICY_UNSPECIFIED) c.set_clip(slidedp::v1::CLIP_POLICY_NONE);
  if (c.grad_dtype() == slidedp::v1::DTYPE_UNSPECIFIED) c.set_grad_dtype(slidedp::v1::DTYPE_BF16);
  auto bad = [](absl::string_view field, double got, absl::string_view expected) {
    return absl::InvalidArgumentError(
        absl::StrCat("optimizer.", field, ": expected ", expected, ", got ", got));
  };
  if (!(c.lr() >= 0) || !std::isfinite(c.lr())) return bad("lr", c.lr(), "a finite value >= 0");
  if (!(c.beta1() >= 0 && c.beta1() < 1)) return bad("beta1", c.beta1(), "a value in [0, 1)");
  if (!(c.beta2() >= 0 && c.beta2() < 1)) return bad("beta2", c.beta2(), "a value in [0, 1)");
  if (!(c.eps() > 0) || !std::isfinite(c.eps())) return bad("eps", c.eps(), "a finite value > 0");
  if (!(c.weight_decay() >= 0) || !std::isfinite(c.weight_decay())) {
    return bad("weight_decay", c.weight_decay(), "a finite value >= 0");
  }
  if (!(c.min_lr_ratio() >= 0 && c.min_lr_ratio() <= 1)) {
    return bad("min_lr_ratio", c.min_lr_ratio(), "a value in [0, 1]");
  }
  if (c.clip() != slidedp::v1::CLIP_POLICY_NONE && !(c.max_grad_norm() > 0)) {
    return bad("max_grad_norm", c.max_grad_norm(), "a value > 0 when clipping is on");
  }
  if (c.schedule() != slidedp::v1::LR_SCHEDULE_CONSTANT && c.total_steps() > 0 &&
      c.warmup_steps() > c.total_steps()) {
    return absl::InvalidArgumentError(
        absl::StrCat("optimizer.warmup_steps: expected <= total_steps (", c.total_steps(),
                     "), got ", c.warmup_steps()));
  }
  if (c.grad_dtype() != slidedp::v1::DTYPE_BF16 && c.grad_dtype() != slidedp::v1::DTYPE_FP32) {
    return absl::InvalidArgumentError("optimizer.grad_dtype: expected DTYPE_BF16 or DTYPE_FP32");
  }
  return c;
}

UpdateWorker::UpdateWorker(TrainingState* state, ThreadPool* pool, Options options,
                           slidedp::v1::OptimizerConfig optimizer)
    : state_(state), pool_(pool), options_(options), optimizer_(std::move(optimizer)) {}

UpdateWorker::~UpdateWorker() { Stop(); }

void UpdateWorker::Start() {
  absl::MutexLock lock(&mu_);
  if (thread_.joinable()) return;
  stopping_ = false;
  thread_ = std::thread([this] { Run(); });
}

void UpdateWorker::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  if (thread_.joinable()) thread_.join();
}

void UpdateWorker::SetOptimizer(const slidedp::v1::OptimizerConfig& optimizer) {
  absl::MutexLock lock(&mu_);
  optimizer_ = optimizer;
}

slidedp::v1::OptimizerConfig UpdateWorker::optimizer() const {
  absl::MutexLock lock(&mu_);
  return optimizer_;
}

UpdateStats UpdateWorker::stats() const {
  absl::MutexLock lock(&mu_);
  return stats_;
}

absl::Status UpdateWorker::Submit(uint32_t layer, uint64_t step, GradientRef grad, DoneFn done) {
  if (layer >= state_->num_layers()) {
    return absl::NotFoundError(absl::StrCat("layer: ", layer, " does not exist; the model has ",
                                            state_->num_layers(), " layers (0..",
                                            state_->num_layers() - 1, ")"));
  }
  const uint64_t numel = state_->layers()[layer].numel;
  if (grad.data == nullptr) return absl::InvalidArgumentError("gradient data is null");
  if (grad.numel != numel) {
    return absl::InvalidArgumentError(absl::StrCat("gradient of layer ", layer, ": expected ",
                                                   numel, " elements, got ", grad.numel));
  }
  const uint64_t version = state_->committed_version(layer);
  absl::MutexLock lock(&mu_);
  if (stopping_) return absl::UnavailableError("update worker is stopping");
  if (step <= aborted_through_) {
    return absl::AbortedError(absl::StrCat("step ", step, " was aborted"));
  }
  if (version + 1 != step) {
    return absl::FailedPreconditionError(absl::StrCat("step: layer ", layer, " is at version ",
                                                      version, ", so the next update is step ",
                                                      version + 1, "; got step ", step));
  }
  auto& seen = submitted_[step];
  if (seen.empty()) seen.assign(state_->num_layers(), false);
  if (seen[layer]) {
    return absl::AlreadyExistsError(
        absl::StrCat("gradient of layer ", layer, " for step ", step, " was already submitted"));
  }
  seen[layer] = true;
  queue_.push_back(Item{layer, step, grad, std::move(done), nullptr});
  return absl::OkStatus();
}

void UpdateWorker::AbortStep(uint64_t step, std::function<void()> sealed) {
  std::vector<Item> dropped;
  {
    absl::MutexLock lock(&mu_);
    aborted_through_ = std::max(aborted_through_, step);
    for (auto it = queue_.begin(); it != queue_.end();) {
      if (it->step <= aborted_through_) {
        dropped.push_back(std::move(*it));
        it = queue_.erase(it);
      } else {
        ++it;
      }
    }
    for (auto it = pending_global_.begin(); it != pending_global_.end();) {
      if (it->first <= aborted_through_) {
        for (Item& item : it->second) dropped.push_back(std::move(item));
        it = pending_global_.erase(it);
      } else {
        ++it;
      }
    }
    queue_.push_front(Item{kSealLayer, step, {}, nullptr, std::move(sealed)});
  }
  for (const Item& item : dropped) {
    LayerUpdateResult r;
    r.layer = item.layer;
    r.step = item.step;
    r.aborted = true;
    if (item.done) item.done(r);
  }
}

kernels::GradStats UpdateWorker::LayerStats(const GradientRef& grad) {
  const uint64_t n = grad.numel;
  const uint64_t blocks = (n + kernels::kStatsBlock - 1) / kernels::kStatsBlock;
  block_sums_.assign(blocks, 0.0);
  std::vector<uint64_t> nonfinite(pool_ != nullptr ? pool_->size() : 1, 0);
  const size_t elem = kernels::GradTypeBytes(grad.type);
  auto run = [&](size_t b, size_t e, int t) {
    for (size_t blk = b; blk < e; ++blk) {
      const uint64_t begin = blk * kernels::kStatsBlock;
      const uint64_t len = std::min<uint64_t>(kernels::kStatsBlock, n - begin);
      kernels::GradStats s = kernels::ComputeGradStats(
          options_.isa, static_cast<const char*>(grad.data) + begin * elem, grad.type, len);
      block_sums_[blk] = s.sum_squares;
      nonfinite[t] += s.nonfinite;
    }
  };
  if (pool_ != nullptr) {
    pool_->ParallelFor(blocks, 1, run);
  } else {
    run(0, blocks, 0);
  }
  kernels::GradStats out;
  for (double b : block_sums_) out.sum_squares += b;  // block order: thread-count independent
  for (uint64_t c : nonfinite) out.nonfinite += c;
  return out;
}

void UpdateWorker::ApplyKernel(uint32_t layer, uint64_t step, const GradientRef& grad,
                               double grad_scale, const slidedp::v1::OptimizerConfig& cfg) {
  const LayerInfo& info = state_->layers()[layer];
  const double lr = LearningRate(cfg, step);
  const bool use_no_decay = cfg.no_decay_norms_and_biases();
  std::vector<kernels::AdamWScalars> scalars;
  scalars.reserve(info.tensors.size());
  for (const TensorRange& t : info.tensors) {
    const double wd = (use_no_decay && t.no_decay) ? 0.0 : cfg.weight_decay();
    scalars.push_back(
        kernels::MakeAdamWScalars(lr, cfg.beta1(), cfg.beta2(), cfg.eps(), wd, grad_scale, step));
  }
  float* master = state_->master(layer);
  float* m = state_->exp_avg(layer);
  float* v = state_->exp_avg_sq(layer);
  uint16_t* out = state_->params(layer);
  const size_t elem = kernels::GradTypeBytes(grad.type);
  const auto* g = static_cast<const char*>(grad.data);
  // Thread ranges are cut at fixed element boundaries; each range is walked tensor by tensor
  // so every element gets its own tensor's weight decay.
  auto run_range = [&](size_t b, size_t e, int) {
    for (size_t ti = 0; ti < info.tensors.size(); ++ti) {
      const TensorRange& t = info.tensors[ti];
      const uint64_t lo = std::max<uint64_t>(b, t.offset);
      const uint64_t hi = std::min<uint64_t>(e, t.offset + t.numel);
      if (lo >= hi) continue;
      kernels::AdamWUpdate(options_.isa, scalars[ti], g + lo * elem, grad.type, master + lo, m + lo,
                           v + lo, out + lo, hi - lo);
    }
  };
  const uint64_t chunk = std::max<uint64_t>(options_.chunk_elements, kernels::kStatsBlock);
  for (uint64_t c = 0; c < info.numel; c += chunk) {
    const uint64_t len = std::min(chunk, info.numel - c);
    if (pool_ != nullptr) {
      pool_->ParallelFor(len, 64, [&](size_t b, size_t e, int t) { run_range(c + b, c + e, t); });
    } else {
      run_range(c, c + len, 0);
    }
  }
}

LayerUpdateResult UpdateWorker::UpdateLayerNow(uint32_t layer, uint64_t step,
                                               const GradientRef& grad, double clip_coef_override,
                                               const kernels::GradStats* precomputed) {
  const auto t0 = Clock::now();
  slidedp::v1::OptimizerConfig cfg = optimizer();
  LayerUpdateResult r;
  r.layer = layer;
  r.step = step;
  const double scale =
      cfg.scale_by_world_size() ? 1.0 / static_cast<double>(state_->world_size()) : 1.0;
  const kernels::GradStats stats = precomputed != nullptr ? *precomputed : LayerStats(grad);
  r.nonfinite = stats.nonfinite;
  state_->BeginLayerWrite(layer, step);
  if (stats.nonfinite > 0) {
    r.grad_norm = std::nan("");
    shm::Atomic(state_->layer_control(layer).skipped_steps).fetch_add(1);
  } else {
    r.grad_norm = std::sqrt(stats.sum_squares) * scale;
    double coef = 1.0;
    if (clip_coef_override >= 0) {
      coef = clip_coef_override;
    } else if (cfg.clip() == slidedp::v1::CLIP_POLICY_PER_LAYER) {
      coef = std::min(1.0, cfg.max_grad_norm() / (r.grad_norm + 1e-6));
    }
    r.clip_coef = coef;
    ApplyKernel(layer, step, grad, scale * coef, cfg);
    r.applied = true;
  }
  state_->PublishLayer(layer, step);
  r.seconds = Seconds(t0, Clock::now());
  absl::MutexLock lock(&mu_);
  if (r.applied) {
    stats_.layer_updates++;
    stats_.params_updated += grad.numel;
  } else {
    stats_.layer_updates_skipped++;
  }
  stats_.update_seconds_total += r.seconds;
  stats_.last_layer_seconds = r.seconds;
  return r;
}

void UpdateWorker::Seal(uint64_t step) {
  for (uint32_t l = 0; l < state_->num_layers(); ++l) {
    if (state_->committed_version(l) < step) {
      state_->BeginLayerWrite(l, step);
      state_->PublishLayer(l, step);
    }
  }
}

void UpdateWorker::Finish(const Item& item, LayerUpdateResult result) {
  if (item.done) item.done(result);
}

void UpdateWorker::Run() {
  for (;;) {
    std::vector<Item> batch;
    bool global = false;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](UpdateWorker* w)
               ABSL_EXCLUSIVE_LOCKS_REQUIRED(w->mu_) { return w->stopping_ || !w->queue_.empty(); },
          this));
      if (queue_.empty()) return;  // stopping and drained
      Item item = std::move(queue_.front());
      queue_.pop_front();
      if (item.layer == kSealLayer) {
        batch.push_back(std::move(item));
      } else {
        global = optimizer_.clip() == slidedp::v1::CLIP_POLICY_GLOBAL;
        if (global) {
          auto& pending = pending_global_[item.step];
          pending.push_back(std::move(item));
          if (pending.size() < state_->num_layers()) continue;
          batch = std::move(pending);
          pending_global_.erase(batch.front().step);
        } else {
          batch.push_back(std::move(item));
        }
      }
      submitted_.erase(submitted_.begin(), submitted_.lower_bound(batch.front().step));
    }
    if (batch[0].layer == kSealLayer) {
      Seal(batch[0].step);
      if (batch[0].sealed) batch[0].sealed();
      continue;
    }
    if (!global) {
      LayerUpdateResult r = UpdateLayerNow(batch[0].layer, batch[0].step, batch[0].grad);
      Finish(batch[0], r);
      continue;
    }
    // Exact global norm over every finite layer of the step, then the updates in arrival order.
    const slidedp::v1::OptimizerConfig cfg = optimizer();
    const double scale =
        cfg.scale_by_world_size() ? 1.0 / static_cast<double>(state_->world_size()) : 1.0;
    std::vector<kernels::GradStats> layer_stats;
    double total = 0;
    for (const Item& item : batch) {
      layer_stats.push_back(LayerStats(item.grad));
      if (layer_stats.back().nonfinite == 0) total += layer_stats.back().sum_squares;
    }
    const double norm = std::sqrt(total) * scale;
    const double coef = std::min(1.0, cfg.max_grad_norm() / (norm + 1e-6));
    for (size_t i = 0; i < batch.size(); ++i) {
      LayerUpdateResult r =
          UpdateLayerNow(batch[i].layer, batch[i].step, batch[i].grad, coef, &layer_stats[i]);
      Finish(batch[i], r);
    }
  }
}

}  // namespace slidedp::hostd
