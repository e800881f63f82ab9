// native_trainer: one rank process of the native MLP trainer (mlp_task.h) through hostd.
//
//   native_trainer --socket S --rank r --world-size R [--create-job] [model/run flags]
//
// With --create-job the process first creates hostd's job from the model (hostd started with
// --model none); CreateJob is idempotent for the same manifest, so any rank may pass it. The
// others retry attaching until the job exists (up to 30 s). Per step t: BeginStep(t); forward
// layer by layer, each layer's parameters fetched at version t-1 through the version gate;
// backward from the last layer, each layer's FP32 gradient pushed as soon as it is computed;
// WaitStep(t). Rank r trains on the samples [r*B/R, (r+1)*B/R) of the global batch B.
//
// The loop starts at the step hostd reports at attach (AttachRankResponse.next_step: 1 for a new
// job, t + 1 for a job re-adopted at step t) and ends after step --steps. With --reattach-ms N,
// a step that fails with UNAVAILABLE (hostd died or stopped), ABORTED (hostd aborted it: a rank
// died) or OUT_OF_RANGE (the step moved on while this rank attached) does not end the process: it
// drops its session, attaches again (creating the job again with --create-job; hostd re-adopts or
// recreates its state) for up to N ms, and goes on from the step hostd then reports. Each re-attach
// prints "rank r: re-attached at step t (...)".
//
// Output: one line per step (this rank's shard loss, its contribution to the global loss; the
// global samples/s; the time spent waiting on layer versions) and a summary. --stamps FILE
// writes one JSON line per parameter fetch: {"rank","step","layer","phase":"fwd","version"}.
// Exit codes: 0 done; 3 a step was aborted (a rank died, a protocol error); 4 hostd is gone or
// shutting down; 1 anything else (2 for bad flags).
#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "examples/native_trainer/mlp_flags.h"
#include "examples/native_trainer/mlp_task.h"
#include "model/manifest.h"
#include "rankclient/rank_client.h"

namespace slidedp::examples {
namespace {

namespace v1 = slidedp::v1;
using Clock = std::chrono::steady_clock;
using rankclient::RankClient;

constexpr auto kJobWait = std::chrono::seconds(30);
constexpr int kFp32 = 1;  // RankClient dtype code

struct TrainerFlags : RankFlags {
  MlpRunFlags run;
  std::string stamps;
  uint32_t reattach_ms = 0;
};

double Ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

class Trainer {
 public:
  explicit Trainer(TrainerFlags flags)
      : f_(std::move(flags)), task_(f_.run.model), timeout_(f_.timeout_ms) {}

  absl::Status Run();
  uint64_t step() const { return step_; }

 private:
  absl::Status CreateJob();
  absl::Status Attach();
  // CreateJob (with --create-job), Attach, CheckLayout.
  absl::Status Connect();
  // Connect, retried for up to --reattach-ms while hostd is away or the old session lingers.
  absl::Status Reconnect();
  absl::Status CheckLayout() const;
  absl::Status Step(uint64_t t);

  const TrainerFlags f_;
  const MlpTask task_;
  const std::chrono::milliseconds timeout_;
  std::unique_ptr<RankClient> client_;
  std::ofstream stamps_;
  uint64_t step_ = 0;
  // Per step, for the line and the summary.
  double loss_ = 0;
  double wait_ms_ = 0;
  double push_ms_ = 0;
  double end_ms_ = 0;
};

absl::Status Trainer::CreateJob() {
  const v1::JobSpec spec =
      MlpJobSpec(f_.run.model, f_.run.optimizer, f_.run.world_size, f_.chunk_bytes);
  ASSIGN_OR_RETURN(const v1::JobSpec got,
                   RankClient::CreateJobWhenReady(f_.socket, spec, timeout_, kJobWait));
  if (got.world_size() != f_.run.world_size) {
    return absl::FailedPreconditionError(
        absl::StrCat("hostd's job has world_size ", got.world_size(),
                     " but this trainer runs with --world-size ", f_.run.world_size));
  }
  std::printf("rank %u: job '%s' ready: %u layers of %u, manifest %s, chunk %llu bytes\n", f_.rank,
              got.job_id().c_str(), f_.run.model.layers, f_.run.model.dim,
              got.manifest().manifest_hash().c_str(),
              static_cast<unsigned long long>(got.routes().chunk_bytes()));
  return absl::OkStatus();
}

absl::Status Trainer::Attach() {
  RankClient::Options o;
  o.socket = f_.socket;
  o.rank = f_.rank;
  o.manifest_hash = model::ManifestHashHex(model::ManifestHash(MlpManifest(f_.run.model)));
  o.timeout_ms = f_.timeout_ms;
  ASSIGN_OR_RETURN(client_, RankClient::AttachWhenReady(o, kJobWait));
  return absl::OkStatus();
}

absl::Status Trainer::Connect() {
  if (f_.create_job) RETURN_IF_ERROR(CreateJob());
  RETURN_IF_ERROR(Attach());
  return CheckLayout();
}

absl::Status Trainer::Reconnect() {
  const auto deadline = Clock::now() + std::chrono::milliseconds(f_.reattach_ms);
  for (;;) {
    client_.reset();
    absl::Status s = Connect();
    if (s.ok()) return s;
    // Transient while hostd restarts: not listening (UNAVAILABLE), no job yet, our previous
    // session not yet seen closed (ALREADY_EXISTS), a step aborted under us.
    const bool transient = absl::IsUnavailable(s) || absl::IsAborted(s) ||
                           absl::IsAlreadyExists(s) || absl::IsDeadlineExceeded(s) ||
                           (absl::IsFailedPrecondition(s) &&
                            absl::StrContains(s.message(), "attach before the model exists"));
    if (!transient || Clock::now() >= deadline) return s;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

// The job must be the one this process computes: same world size, FP32 gradients, and every
// layer laid out as [weight D*D | bias D] (ShardPass's layout).
absl::Status Trainer::CheckLayout() const {
  const v1::Layout& layout = client_->layout();
  if (client_->world_size() != f_.run.world_size) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the job has world_size ", client_->world_size(), ", --world-size is ", f_.run.world_size));
  }
  if (layout.grad_dtype() != v1::DTYPE_FP32) {
    return absl::FailedPreconditionError(
        "the job's gradients are not FP32; create it with this trainer (--create-job)");
  }
  const uint64_t d = f_.run.model.dim;
  for (uint32_t l = 0; l < f_.run.model.layers; ++l) {
    const v1::LayerLayout& ll = layout.layers(static_cast<int>(l));
    if (ll.numel() != MlpLayerNumel(f_.run.model.dim) || ll.tensors_size() != 2 ||
        ll.tensors(0).offset_elements() != 0 || ll.tensors(0).numel() != d * d ||
        ll.tensors(1).offset_elements() != d * d || ll.tensors(1).numel() != d) {
      return absl::FailedPreconditionError(absl::StrCat("layer ", l, " ('", ll.name(),
                                                        "') is not laid out as [weight ", d * d,
                                                        " | bias ", d, "]"));
    }
  }
  return absl::OkStatus();
}

absl::Status Trainer::Step(uint64_t t) {
  const uint32_t layers = f_.run.model.layers;
  const uint64_t per_rank = f_.run.model.batch / f_.run.world_size;
  const uint64_t begin = f_.rank * per_rank;
  const uint64_t numel = MlpLayerNumel(f_.run.model.dim);
  const size_t param_bytes = numel * sizeof(uint16_t);
  std::vector<uint16_t> params(numel);
  std::vector<float> grad(numel);

  RETURN_IF_ERROR(client_->BeginStep(t, timeout_));
  ShardPass pass(task_, t, begin, begin + per_rank);
  wait_ms_ = 0;
  for (uint32_t l = 0; l < layers; ++l) {
    // The version gate, timed on its own; the fetch then finds the version there and copies.
    const auto w0 = Clock::now();
    RETURN_IF_ERROR(client_->WaitLayer(l, t - 1, timeout_));
    wait_ms_ += Ms(Clock::now() - w0);
    ASSIGN_OR_RETURN(const uint64_t version,
                     client_->FetchParams(l, t - 1, params.data(), param_bytes, timeout_));
    if (stamps_.is_open()) {
      stamps_ << "{\"rank\":" << f_.rank << ",\"step\":" << t << ",\"layer\":" << l
              << ",\"phase\":\"fwd\",\"version\":" << version << "}\n";
    }
    pass.Forward(l, params.data());
  }
  loss_ = pass.Loss();
  for (uint32_t l = layers; l-- > 0;) {
    pass.Backward(l, grad.data());
    const auto g0 = Clock::now();
    RETURN_IF_ERROR(client_->PushGrad(t, l, grad.data(), kFp32, numel * sizeof(float), timeout_));
    push_ms_ += Ms(Clock::now() - g0);
  }
  const auto e0 = Clock::now();
  RETURN_IF_ERROR(client_->WaitStep(t, timeout_));
  end_ms_ = Ms(Clock::now() - e0);
  if (stamps_.is_open()) stamps_.flush();
  return absl::OkStatus();
}

absl::Status Trainer::Run() {
  RETURN_IF_ERROR(ValidateMlpConfig(f_.run.model, f_.run.world_size));
  if (f_.rank >= f_.run.world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank: expected 0..", f_.run.world_size - 1, ", got ", f_.rank));
  }
  if (!f_.stamps.empty()) {
    stamps_.open(f_.stamps, std::ios::trunc);
    if (!stamps_) {
      return absl::InvalidArgumentError(absl::StrCat("--stamps: cannot write ", f_.stamps));
    }
  }
  RETURN_IF_ERROR(f_.reattach_ms > 0 ? Reconnect() : Connect());
  const uint64_t per_rank = f_.run.model.batch / f_.run.world_size;
  std::printf(
      "rank %u/%u: attached at step %llu; samples [%llu, %llu) of a global batch of %u, %u layers "
      "of %u\n",
      f_.rank, f_.run.world_size, static_cast<unsigned long long>(client_->next_step_at_attach()),
      static_cast<unsigned long long>(f_.rank) * per_rank,
      (static_cast<unsigned long long>(f_.rank) + 1) * per_rank, f_.run.model.batch,
      f_.run.model.layers, f_.run.model.dim);
  std::fflush(stdout);

  const auto start = Clock::now();
  double total_wait_ms = 0;
  double first_loss = 0;
  // A job resumed from a checkpoint continues at the step after it; the data of step t is the
  // same for any world size (the global batch is split by rank), so the run continues exactly.
  const uint64_t first = std::max<uint64_t>(1, client_->next_step_at_attach());
  if (first > 1) {
    std::printf("rank %u: the job continues at step %llu\n", f_.rank,
                static_cast<unsigned long long>(first));
  }
  uint64_t steps_run = 0;
  for (uint64_t t = first; t <= f_.run.steps; ++t) {
    step_ = t;
    push_ms_ = 0;
    const auto s0 = Clock::now();
    if (absl::Status s = Step(t); !s.ok()) {
      // OUT_OF_RANGE: the step moved on under this rank (it attached as hostd aborted the step
      // of a rank that had died, which consumes the step number): attach again at hostd's step.
      if (f_.reattach_ms == 0 ||
          !(absl::IsUnavailable(s) || absl::IsAborted(s) || absl::IsOutOfRange(s))) {
        return s;
      }
      std::fprintf(stderr, "rank %u: step %llu: %s; re-attaching\n", f_.rank,
                   static_cast<unsigned long long>(t), s.ToString().c_str());
      RETURN_IF_ERROR(Reconnect());
      std::printf("rank %u: re-attached at step %llu (step %llu had failed: %s)\n", f_.rank,
                  static_cast<unsigned long long>(client_->next_step_at_attach()),
                  static_cast<unsigned long long>(t), absl::StatusCodeToString(s.code()).c_str());
      std::fflush(stdout);
      t = client_->next_step_at_attach() - 1;  // the loop's ++t
      continue;
    }
    const double step_ms = Ms(Clock::now() - s0);
    total_wait_ms += wait_ms_;
    if (steps_run++ == 0) first_loss = loss_;
    std::printf(
        "rank %u step %4llu  shard_loss %.6e  step_ms %7.2f  samples/s %9.1f (global)  "
        "version_wait_ms %6.2f  push_ms %6.2f  end_wait_ms %6.2f\n",
        f_.rank, static_cast<unsigned long long>(t), loss_, step_ms,
        f_.run.model.batch / (step_ms / 1000.0), wait_ms_, push_ms_, end_ms_);
    std::fflush(stdout);
  }
  const double total_s = Ms(Clock::now() - start) / 1000.0;
  RETURN_IF_ERROR(client_->Detach());
  std::printf(
      "rank %u summary: %llu steps in %.2f s, %.1f samples/s (global), version wait %.2f ms "
      "(%.1f%%), shard_loss %.6e -> %.6e (rank's share of the global loss)\n",
      f_.rank, static_cast<unsigned long long>(steps_run), total_s,
      total_s > 0 ? steps_run * f_.run.model.batch / total_s : 0.0, total_wait_ms,
      total_s > 0 ? total_wait_ms / (10.0 * total_s) : 0.0, first_loss, loss_);
  std::fflush(stdout);
  return absl::OkStatus();
}

}  // namespace
}  // namespace slidedp::examples

int main(int argc, char** argv) {
  using slidedp::examples::TrainerFlags;
  TrainerFlags f;
  CLI::App app{"native_trainer: one rank of the native MLP trainer through hostd"};
  slidedp::examples::AddMlpRunFlags(app, &f.run);
  slidedp::examples::AddRankFlags(app, &f);
  app.add_option("--stamps", f.stamps, "Write the fetched versions as JSON lines to this file");
  app.add_option("--reattach-ms", f.reattach_ms,
                 "On UNAVAILABLE or ABORTED, attach again (hostd restarted or a rank died) for up "
                 "to this long and go on from hostd's step; 0: exit instead")
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);

  slidedp::examples::Trainer trainer(f);
  const absl::Status s = trainer.Run();
  if (!s.ok()) {
    if (absl::IsAborted(s)) {
      std::fprintf(stderr, "rank %u: step %llu ABORTED: %s\n", f.rank,
                   static_cast<unsigned long long>(trainer.step()),
                   std::string(s.message()).c_str());
    } else if (trainer.step() != 0) {
      std::fprintf(stderr, "rank %u: step %llu: %s\n", f.rank,
                   static_cast<unsigned long long>(trainer.step()), s.ToString().c_str());
    } else {
      std::fprintf(stderr, "rank %u: %s\n", f.rank, s.ToString().c_str());
    }
  }
  return slidedp::examples::RankExitCode(s);
}
