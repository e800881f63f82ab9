#include "hostd/optimizer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <numbers>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/thread_pool.h"
#include "kernels/cpu/grad_clip.h"
#include "spdlog/spdlog.h"

namespace slidedp::hostd {
namespace {

using Clock = std::chrono::steady_clock;

double MonotonicSeconds(Clock::time_point t) {
  return std::chrono::duration<double>(t.time_since_epoch()).count();
}

// The threshold a layer is clipped to by itself: max_grad_norm under per-layer clipping, none (0)
// otherwise (global clipping computes one scale for the step's layers and passes it in).
double PerLayerThreshold(const slidedp::v1::OptimizerConfig& cfg) {
  return cfg.clip() == slidedp::v1::CLIP_POLICY_PER_LAYER ? cfg.max_grad_norm() : 0.0;
}

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

}  // namespace

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

absl::Status UpdateWorker::CheckSubmitLocked(uint32_t layer, uint64_t step) {
  if (stopping_) return absl::UnavailableError("update worker is stopping");
  if (step <= aborted_through_) {
    return absl::AbortedError(absl::StrCat("step ", step, " was aborted"));
  }
  const uint64_t version = state_->committed_version(layer);
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
  return absl::OkStatus();
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
  absl::MutexLock lock(&mu_);
  if (absl::Status s = CheckSubmitLocked(layer, step); !s.ok()) return s;
  submitted_[step][layer] = true;
  StepClipLocked(step);
  queue_.push_back(Item{.kind = ItemKind::kLayer,
                        .layer = layer,
                        .step = step,
                        .grad = grad,
                        .done = std::move(done)});
  return absl::OkStatus();
}

absl::StatusOr<bool> UpdateWorker::BeginStreamedLayer(uint32_t layer, uint64_t step,
                                                      double sum_squares, bool nonfinite,
                                                      DoneFn done) {
  if (layer >= state_->num_layers()) {
    return absl::NotFoundError(absl::StrCat("layer: ", layer, " does not exist; the model has ",
                                            state_->num_layers(), " layers (0..",
                                            state_->num_layers() - 1, ")"));
  }
  if (!nonfinite && !(sum_squares >= 0 && std::isfinite(sum_squares))) {
    return absl::InvalidArgumentError(absl::StrCat("sum_squares of layer ", layer,
                                                   ": expected a finite value >= 0 for a finite "
                                                   "gradient, got ",
                                                   sum_squares));
  }
  absl::MutexLock lock(&mu_);
  if (absl::Status s = CheckSubmitLocked(layer, step); !s.ok()) return s;
  const slidedp::v1::ClipPolicy clip = StepClipLocked(step);
  if (clip == slidedp::v1::CLIP_POLICY_GLOBAL) return false;
  submitted_[step][layer] = true;
  open_streams_[layer] = OpenStream{step, 0};
  slidedp::v1::OptimizerConfig cfg = optimizer_;
  cfg.set_clip(clip);
  queue_.push_back(Item{.kind = ItemKind::kStreamBegin,
                        .layer = layer,
                        .step = step,
                        .done = std::move(done),
                        .sum_squares = sum_squares,
                        .nonfinite = nonfinite,
                        .cfg = std::move(cfg)});
  return true;
}

absl::Status UpdateWorker::SubmitRange(uint32_t layer, uint64_t step, uint64_t offset,
                                       GradientRef grad, std::function<void()> released) {
  if (grad.data == nullptr || grad.numel == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("range of layer ", layer, " at offset ", offset, ": data is null or empty"));
  }
  absl::MutexLock lock(&mu_);
  if (stopping_) return absl::UnavailableError("update worker is stopping");
  if (step <= aborted_through_) {
    return absl::AbortedError(absl::StrCat("step ", step, " was aborted"));
  }
  auto it = open_streams_.find(layer);
  if (it == open_streams_.end() || it->second.step != step) {
    return absl::FailedPreconditionError(absl::StrCat(
        "layer ", layer, ": no streamed update of step ", step, " is open (BeginStreamedLayer)"));
  }
  const uint64_t numel = state_->layers()[layer].numel;
  if (offset > numel || grad.numel > numel - offset ||
      grad.numel > numel - it->second.elements_submitted) {
    return absl::OutOfRangeError(
        absl::StrCat("range of layer ", layer, ": [", offset, ", ", offset + grad.numel,
                     ") exceeds the layer's ", numel, " elements or the ",
                     numel - it->second.elements_submitted, " not yet submitted"));
  }
  it->second.elements_submitted += grad.numel;
  if (it->second.elements_submitted == numel) open_streams_.erase(it);
  queue_.push_back(Item{.kind = ItemKind::kStreamRange,
                        .layer = layer,
                        .step = step,
                        .grad = grad,
                        .released = std::move(released),
                        .offset = offset});
  return absl::OkStatus();
}

slidedp::v1::ClipPolicy UpdateWorker::ClipOfStep(uint64_t step) {
  absl::MutexLock lock(&mu_);
  return StepClipLocked(step);
}

slidedp::v1::ClipPolicy UpdateWorker::StepClipLocked(uint64_t step) {
  // The policy in effect when a step's first gradient arrives is the step's: a change while the
  // step runs (UpdateHyperParams) takes effect with the next one. Switched to global halfway,
  // the step would wait for gradients already applied; switched away, it would never release
  // the layers it holds.
  auto [it, inserted] = step_clip_.emplace(step, optimizer_.clip());
  if (inserted) {
    while (step_clip_.size() > 4) step_clip_.erase(step_clip_.begin());
  }
  return it->second;
}

std::vector<uint32_t> UpdateWorker::TornLayers() const {
  absl::MutexLock lock(&mu_);
  return torn_;
}

void UpdateWorker::AbortStep(uint64_t step, std::function<void()> sealed) {
  std::vector<Item> dropped;
  {
    absl::MutexLock lock(&mu_);
    aborted_through_ = std::max(aborted_through_, step);
    // An earlier abort's seal still queued stays: its callback must run (whoever aborted waits
    // for it) and before this one, so the seals run in step order.
    for (auto it = queue_.begin(); it != queue_.end();) {
      if (it->kind != ItemKind::kSeal && it->step <= aborted_through_) {
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
    for (auto it = open_streams_.begin(); it != open_streams_.end();) {
      it = it->second.step <= aborted_through_ ? open_streams_.erase(it) : std::next(it);
    }
    Item seal;
    seal.kind = ItemKind::kSeal;
    seal.step = step;
    seal.sealed = std::move(sealed);
    auto after_seals = std::find_if(queue_.begin(), queue_.end(),
                                    [](const Item& i) { return i.kind != ItemKind::kSeal; });
    queue_.insert(after_seals, std::move(seal));
  }
  for (const Item& item : dropped) {
    if (item.kind == ItemKind::kStreamRange) {
      if (item.released) item.released();
      continue;
    }
    LayerUpdateResult r;
    r.layer = item.layer;
    r.step = item.step;
    r.aborted = true;
    r.streamed = item.kind == ItemKind::kStreamBegin;
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

std::vector<kernels::AdamWScalars> UpdateWorker::LayerScalars(
    uint32_t layer, uint64_t step, double grad_scale,
    const slidedp::v1::OptimizerConfig& cfg) const {
  const LayerInfo& info = state_->layers()[layer];
  const double lr = model::LearningRate(cfg, step);
  const bool use_no_decay = cfg.no_decay_norms_and_biases();
  std::vector<kernels::AdamWScalars> scalars;
  scalars.reserve(info.tensors.size());
  for (const TensorRange& t : info.tensors) {
    const double wd = (use_no_decay && t.no_decay) ? 0.0 : cfg.weight_decay();
    scalars.push_back(
        kernels::MakeAdamWScalars(lr, cfg.beta1(), cfg.beta2(), cfg.eps(), wd, grad_scale, step));
  }
  return scalars;
}

void UpdateWorker::ApplyRange(uint32_t layer, const std::vector<kernels::AdamWScalars>& scalars,
                              const void* grad, kernels::GradType type, uint64_t begin,
                              uint64_t end) {
  const LayerInfo& info = state_->layers()[layer];
  float* master = state_->master(layer);
  float* m = state_->exp_avg(layer);
  float* v = state_->exp_avg_sq(layer);
  uint16_t* out = state_->params(layer);
  const size_t elem = kernels::GradTypeBytes(type);
  const auto* g = static_cast<const char*>(grad);
  // Thread ranges are cut at fixed element boundaries; each range is walked tensor by tensor
  // so every element gets its own tensor's weight decay. The kernel is element-wise, so where
  // the cuts fall (threads, chunks, streamed ranges) does not change a single bit.
  auto run_range = [&](size_t b, size_t e, int) {
    for (size_t ti = 0; ti < info.tensors.size(); ++ti) {
      const TensorRange& t = info.tensors[ti];
      const uint64_t lo = std::max<uint64_t>(b, t.offset);
      const uint64_t hi = std::min<uint64_t>(e, t.offset + t.numel);
      if (lo >= hi) continue;
      kernels::AdamWUpdate(options_.isa, scalars[ti], g + (lo - begin) * elem, type, master + lo,
                           m + lo, v + lo, out + lo, hi - lo);
    }
  };
  const uint64_t chunk = std::max<uint64_t>(options_.chunk_elements, kernels::kStatsBlock);
  for (uint64_t c = begin; c < end; c += chunk) {
    const uint64_t len = std::min(chunk, end - c);
    if (pool_ != nullptr) {
      pool_->ParallelFor(len, 64, [&](size_t b, size_t e, int t) { run_range(c + b, c + e, t); });
    } else {
      run_range(c, c + len, 0);
    }
  }
}

void UpdateWorker::ApplyKernel(uint32_t layer, uint64_t step, const GradientRef& grad,
                               double grad_scale, const slidedp::v1::OptimizerConfig& cfg) {
  ApplyRange(layer, LayerScalars(layer, step, grad_scale, cfg), grad.data, grad.type, 0,
             state_->layers()[layer].numel);
}

LayerUpdateResult UpdateWorker::UpdateLayerNow(uint32_t layer, uint64_t step,
                                               const GradientRef& grad, double clip_coef_override,
                                               const kernels::GradStats* precomputed,
                                               std::optional<slidedp::v1::ClipPolicy> clip) {
  const auto t0 = Clock::now();
  slidedp::v1::OptimizerConfig cfg = optimizer();
  if (clip) cfg.set_clip(*clip);
  LayerUpdateResult r;
  r.layer = layer;
  r.step = step;
  r.start_s = MonotonicSeconds(t0);
  r.idle_before_seconds = std::exchange(idle_pending_, 0.0);
  const double scale =
      cfg.scale_by_world_size() ? 1.0 / static_cast<double>(state_->world_size()) : 1.0;
  const kernels::GradStats stats = precomputed != nullptr ? *precomputed : LayerStats(grad);
  r.nonfinite = stats.nonfinite;
  if (before_write_ && stats.nonfinite == 0) before_write_(layer, step);
  state_->BeginLayerWrite(layer, step);
  // The sum of squares leaves the non-finite elements out: such a gradient's norm is NaN.
  const double norm = stats.nonfinite > 0 ? std::nan("") : std::sqrt(stats.sum_squares) * scale;
  const kernels::ClipDecision clip_rule = kernels::DecideClip(norm, PerLayerThreshold(cfg));
  r.grad_norm = norm;
  if (clip_rule.skip) {
    shm::Atomic(state_->layer_control(layer).skipped_steps).fetch_add(1);
  } else {
    const double coef = clip_coef_override >= 0 ? clip_coef_override : clip_rule.scale;
    r.clip_coef = coef;
    ApplyKernel(layer, step, grad, scale * coef, cfg);
    r.applied = true;
  }
  state_->PublishLayer(layer, step);
  const auto t1 = Clock::now();
  r.seconds = Seconds(t0, t1);
  r.end_s = MonotonicSeconds(t1);
  absl::MutexLock lock(&mu_);
  if (r.applied) {
    stats_.layer_updates++;
    stats_.params_updated += grad.numel;
  } else {
    stats_.layer_updates_skipped++;
  }
  stats_.layer_updates_buffered++;
  stats_.update_seconds_total += r.seconds;
  stats_.last_layer_seconds = r.seconds;
  return r;
}

void UpdateWorker::Seal(uint64_t step) {
  // Streamed layers of aborted steps: AbortStep dropped their queued ranges and no more are
  // accepted, so each is either untouched (sealed below like any other layer) or torn.
  std::vector<std::pair<DoneFn, LayerUpdateResult>> finished;
  std::vector<uint32_t> torn;
  for (auto it = streams_.begin(); it != streams_.end();) {
    if (it->second.step > step) {
      ++it;
      continue;
    }
    Stream& s = it->second;
    s.result.aborted = true;
    s.result.applied = false;
    if (s.ranges_applied > 0) {
      s.result.torn = true;
      torn.push_back(it->first);
    }
    finished.emplace_back(std::move(s.done), s.result);
    it = streams_.erase(it);
  }
  if (!torn.empty()) {
    absl::MutexLock lock(&mu_);
    torn_.insert(torn_.end(), torn.begin(), torn.end());
    std::sort(torn_.begin(), torn_.end());
    torn_.erase(std::unique(torn_.begin(), torn_.end()), torn_.end());
    stats_.layers_torn += torn.size();
  }
  const std::vector<uint32_t> all_torn = TornLayers();
  for (uint32_t l = 0; l < state_->num_layers(); ++l) {
    if (std::binary_search(all_torn.begin(), all_torn.end(), l)) continue;  // stays inconsistent
    if (state_->committed_version(l) < step) {
      state_->BeginLayerWrite(l, step);
      state_->PublishLayer(l, step);
    }
  }
  for (auto& [done, result] : finished) {
    if (done) done(result);
  }
}

void UpdateWorker::BeginStream(Item& item) {
  const auto t0 = Clock::now();
  Stream s;
  s.step = item.step;
  s.done = std::move(item.done);
  s.result.layer = item.layer;
  s.result.step = item.step;
  s.result.streamed = true;
  const slidedp::v1::OptimizerConfig& cfg = item.cfg;
  const double scale =
      cfg.scale_by_world_size() ? 1.0 / static_cast<double>(state_->world_size()) : 1.0;
  // The same rule as UpdateLayerNow, from the sum of squares the ranks sent.
  const double norm = item.nonfinite ? std::nan("") : std::sqrt(item.sum_squares) * scale;
  const kernels::ClipDecision clip_rule = kernels::DecideClip(norm, PerLayerThreshold(cfg));
  s.result.grad_norm = norm;
  if (clip_rule.skip) {
    s.skip = true;
    s.result.nonfinite = 1;
  } else {
    s.result.clip_coef = clip_rule.scale;
    s.scalars = LayerScalars(item.layer, item.step, scale * clip_rule.scale, cfg);
  }
  s.result.seconds = Seconds(t0, Clock::now());
  streams_[item.layer] = std::move(s);
}

void UpdateWorker::ApplyStreamRange(Item& item) {
  const auto t0 = Clock::now();
  auto it = streams_.find(item.layer);
  if (it == streams_.end() || it->second.step != item.step) {
    // SubmitRange accepts ranges only after their layer's begin item, in queue order, and an
    // abort drops both together; a range without its stream is a bug of this class.
    spdlog::critical("update worker: range of layer {} step {} has no streamed update", item.layer,
                     item.step);
    std::abort();
  }
  Stream& s = it->second;
  s.result.idle_before_seconds += std::exchange(idle_pending_, 0.0);
  if (!s.skip) {
    // pending_version marks the layer as being written from its first range on: an abort after
    // this point leaves the layer torn, which the version words must show.
    if (s.ranges_applied == 0) {
      if (before_write_) before_write_(item.layer, item.step);
      state_->BeginLayerWrite(item.layer, item.step);
      s.result.start_s = MonotonicSeconds(t0);
    }
    ApplyRange(item.layer, s.scalars, item.grad.data, item.grad.type, item.offset,
               item.offset + item.grad.numel);
    s.ranges_applied++;
  }
  if (item.released) item.released();
  s.elements_done += item.grad.numel;
  s.result.seconds += Seconds(t0, Clock::now());
  const uint64_t numel = state_->layers()[item.layer].numel;
  {
    absl::MutexLock lock(&mu_);
    if (!s.skip) stats_.ranges_streamed++;
  }
  if (s.elements_done < numel) return;
  const auto t1 = Clock::now();
  if (s.skip) {
    state_->BeginLayerWrite(item.layer, item.step);
    shm::Atomic(state_->layer_control(item.layer).skipped_steps).fetch_add(1);
  } else {
    s.result.applied = true;
  }
  LayerUpdateResult r = s.result;
  DoneFn done = std::move(s.done);
  streams_.erase(it);
  {
    // Counted before the version is published, so whoever waits for the version sees them.
    absl::MutexLock lock(&mu_);
    if (r.applied) {
      stats_.layer_updates++;
      stats_.params_updated += numel;
    } else {
      stats_.layer_updates_skipped++;
    }
    stats_.layer_updates_streamed++;
    stats_.update_seconds_total += r.seconds + Seconds(t1, Clock::now());
    stats_.last_layer_seconds = r.seconds;
  }
  state_->PublishLayer(item.layer, item.step);
  const auto t2 = Clock::now();
  r.seconds += Seconds(t1, t2);
  if (r.start_s == 0) r.start_s = MonotonicSeconds(t0);  // skipped: no range was applied
  r.end_s = MonotonicSeconds(t2);
  if (done) done(r);
}

void UpdateWorker::Finish(const Item& item, LayerUpdateResult result) {
  if (item.done) item.done(result);
}

void UpdateWorker::Run() {
  for (;;) {
    std::vector<Item> batch;
    bool global = false;
    slidedp::v1::ClipPolicy clip = slidedp::v1::CLIP_POLICY_NONE;
    const auto wait0 = Clock::now();
    bool waited = false;
    {
      absl::MutexLock lock(&mu_);
      waited = queue_.empty();
      mu_.Await(absl::Condition(
          +[](UpdateWorker* w)
               ABSL_EXCLUSIVE_LOCKS_REQUIRED(w->mu_) { return w->stopping_ || !w->queue_.empty(); },
          this));
      if (waited) idle_pending_ += Seconds(wait0, Clock::now());
      if (queue_.empty()) return;  // stopping and drained
      Item item = std::move(queue_.front());
      queue_.pop_front();
      if (item.kind != ItemKind::kLayer) {
        batch.push_back(std::move(item));
      } else {
        clip = StepClipLocked(item.step);
        global = clip == slidedp::v1::CLIP_POLICY_GLOBAL;
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
    switch (batch[0].kind) {
      case ItemKind::kSeal:
        Seal(batch[0].step);
        if (batch[0].sealed) batch[0].sealed();
        continue;
      case ItemKind::kStreamBegin:
        BeginStream(batch[0]);
        continue;
      case ItemKind::kStreamRange:
        ApplyStreamRange(batch[0]);
        continue;
      case ItemKind::kLayer:
        break;
    }
    if (!global) {
      LayerUpdateResult r =
          UpdateLayerNow(batch[0].layer, batch[0].step, batch[0].grad, -1, nullptr, clip);
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
    // Finite: the non-finite layers are left out of the total (they skip their own update).
    const double norm = std::sqrt(total) * scale;
    const double coef = kernels::DecideClip(norm, cfg.max_grad_norm()).scale;
    for (size_t i = 0; i < batch.size(); ++i) {
      LayerUpdateResult r =
          UpdateLayerNow(batch[i].layer, batch[i].step, batch[i].grad, coef, &layer_stats[i]);
      Finish(batch[i], r);
    }
  }
}

}  // namespace slidedp::hostd
