// native_gpu_trainer: one rank of the native MLP trainer with its layers computed on the GPU
// (GpuShardPass, cuBLAS FP32) and its data plane on the GPU (GpuDataPlane): BF16 parameters
// stream through a window of --window-slots slots, --prefetch layers ahead; FP32 gradients go
// back by the job's gradient route.
//
//   native_gpu_trainer --socket S --rank r --world-size R [--create-job] [--gpu N]
//                      [--grad-route cpu_reduction|gpu_reduction|reduce_scatter]
//                      [--param-route replicated|sharded] [model/run flags]
//
// Several ranks may share one GPU on the CPU-reduction route with replicated parameters (NCCL
// does not allow two ranks of one communicator on one device). The routes that need NCCL create
// their communicators through hostd (rank 0 publishes the unique id).
//
// Output as native_trainer (one line per step with the rank's shard loss, a summary);
// --params-out FILE writes the final BF16 parameters of every layer (raw, layers in order), as
// native_reference --params-out does. Exit codes: 0 done; 3 a step was aborted; 4 hostd gone;
// 1 anything else (2 for bad flags).
#include <cuda_runtime_api.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "examples/native_trainer/gpu_mlp.h"
#include "examples/native_trainer/mlp_flags.h"
#include "examples/native_trainer/mlp_task.h"
#include "kernels/cuda/cuda_status.h"
#include "model/manifest.h"
#include "rankclient/gpu_plane.h"
#include "rankclient/rank_client.h"

namespace slidedp::examples {
namespace {

namespace v1 = slidedp::v1;
using Clock = std::chrono::steady_clock;
using rankclient::GpuDataPlane;
using rankclient::RankClient;

constexpr auto kJobWait = std::chrono::seconds(30);
constexpr int kFp32 = 1;

struct GpuTrainerFlags : RankFlags {
  GpuTrainerFlags() {
    chunk_bytes = 1 << 20;
    timeout_ms = 120000;
  }
  MlpRunFlags run;
  int gpu = 0;
  std::string grad_route = "cpu_reduction";
  std::string param_route = "replicated";
  uint32_t window_slots = 3;
  uint32_t prefetch = 2;
  uint64_t h2d_chunk_bytes = 64ull << 20;
  std::string params_out;
};

double Ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

class GpuTrainer {
 public:
  explicit GpuTrainer(GpuTrainerFlags flags)
      : f_(std::move(flags)), task_(f_.run.model), timeout_(f_.timeout_ms) {}
  ~GpuTrainer() {
    plane_.reset();
    pass_.reset();  // synchronizes the stream, which must still exist
    for (float* g : grads_) cudaFree(g);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  absl::Status Run();
  uint64_t step() const { return step_; }

 private:
  absl::Status CreateJob();
  absl::Status Attach();
  absl::Status Step(uint64_t t);
  absl::Status WriteParams();

  const GpuTrainerFlags f_;
  const MlpTask task_;
  const std::chrono::milliseconds timeout_;
  v1::GradRoute grad_route_ = v1::GRAD_ROUTE_CPU_REDUCTION;
  v1::ParamRoute param_route_ = v1::PARAM_ROUTE_REPLICATED;
  std::unique_ptr<RankClient> client_;
  cudaStream_t stream_ = nullptr;
  std::unique_ptr<GpuDataPlane> plane_;
  std::unique_ptr<GpuShardPass> pass_;
  std::vector<float*> grads_;
  uint64_t step_ = 0;
  double loss_ = 0;
  double fetch_ms_ = 0;
};

absl::Status GpuTrainer::CreateJob() {
  v1::JobSpec spec = MlpJobSpec(f_.run.model, f_.run.optimizer, f_.run.world_size, f_.chunk_bytes);
  spec.mutable_routes()->set_grad_route(grad_route_);
  spec.mutable_routes()->set_param_route(param_route_);
  return RankClient::CreateJobWhenReady(f_.socket, spec, timeout_, kJobWait).status();
}

absl::Status GpuTrainer::Attach() {
  RankClient::Options o;
  o.socket = f_.socket;
  o.rank = f_.rank;
  o.gpu = f_.gpu;
  o.manifest_hash = model::ManifestHashHex(model::ManifestHash(MlpManifest(f_.run.model)));
  o.timeout_ms = f_.timeout_ms;
  ASSIGN_OR_RETURN(client_, RankClient::AttachWhenReady(o, kJobWait));
  if (client_->world_size() != f_.run.world_size) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the job has world_size ", client_->world_size(), ", --world-size is ", f_.run.world_size));
  }
  if (client_->layout().grad_dtype() != v1::DTYPE_FP32) {
    return absl::FailedPreconditionError("the job's gradients are not FP32");
  }
  if (client_->layout().grad_route() != grad_route_) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the job's gradient route is ", v1::GradRoute_Name(client_->layout().grad_route()),
        ", --grad-route asks for ", v1::GradRoute_Name(grad_route_)));
  }
  for (uint32_t l = 0; l < f_.run.model.layers; ++l) {
    if (client_->layer_numel(l) != MlpLayerNumel(f_.run.model.dim)) {
      return absl::FailedPreconditionError(
          absl::StrCat("layer ", l, " has ", client_->layer_numel(l), " elements, expected ",
                       MlpLayerNumel(f_.run.model.dim)));
    }
  }
  return absl::OkStatus();
}

absl::Status GpuTrainer::Step(uint64_t t) {
  const uint32_t layers = f_.run.model.layers;
  const uint64_t per_rank = f_.run.model.batch / f_.run.world_size;
  const uint64_t begin = f_.rank * per_rank;
  RETURN_IF_ERROR(plane_->BeginStep(t, timeout_));
  RETURN_IF_ERROR(pass_->Reset(t, begin, begin + per_rank));
  // Forward: the plane's schedule keeps `prefetch` layers in flight ahead of the compute.
  std::vector<uint32_t> order(layers);
  for (uint32_t l = 0; l < layers; ++l) order[l] = l;
  RETURN_IF_ERROR(plane_->BeginSchedule(order, t - 1));
  fetch_ms_ = 0;
  for (uint32_t l = 0; l < layers; ++l) {
    const auto f0 = Clock::now();
    ASSIGN_OR_RETURN(const GpuDataPlane::Slot s, plane_->Next(timeout_));
    fetch_ms_ += Ms(Clock::now() - f0);
    RETURN_IF_ERROR(plane_->WaitSlot(s, stream_));
    RETURN_IF_ERROR(pass_->Forward(l, s.data));
    RETURN_IF_ERROR(plane_->ReleaseSlot(s, stream_));
  }
  ASSIGN_OR_RETURN(loss_, pass_->Loss());
  // Backward: each layer's gradient goes back as soon as it is enqueued.
  for (uint32_t l = layers; l-- > 0;) {
    RETURN_IF_ERROR(plane_->WaitGradConsumed(l, stream_));
    RETURN_IF_ERROR(pass_->Backward(l, grads_[l]));
    RETURN_IF_ERROR(plane_->PushGrad(t, l, grads_[l], kFp32, stream_, timeout_));
  }
  RETURN_IF_ERROR(plane_->WaitPushes(timeout_));
  return client_->WaitStep(t, timeout_);
}

absl::Status GpuTrainer::WriteParams() {
  std::FILE* out = std::fopen(f_.params_out.c_str(), "wb");
  if (out == nullptr)
    return ErrnoStatus(absl::StrCat("--params-out: cannot write ", f_.params_out));
  bool ok = true;
  std::vector<uint16_t> buf;
  for (uint32_t l = 0; l < f_.run.model.layers && ok; ++l) {
    RETURN_IF_ERROR(client_->WaitLayer(l, f_.run.steps, timeout_));
    buf.resize(client_->layer_numel(l));
    std::memcpy(buf.data(), client_->LayerParams(l), buf.size() * 2);
    RETURN_IF_ERROR(client_->CheckLayerVersion(l, f_.run.steps));
    ok = std::fwrite(buf.data(), 2, buf.size(), out) == buf.size();
  }
  if (std::fclose(out) != 0 || !ok) {
    return ErrnoStatus(absl::StrCat("--params-out: writing ", f_.params_out));
  }
  return absl::OkStatus();
}

absl::Status GpuTrainer::Run() {
  RETURN_IF_ERROR(ValidateMlpConfig(f_.run.model, f_.run.world_size));
  if (f_.rank >= f_.run.world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank: expected 0..", f_.run.world_size - 1, ", got ", f_.rank));
  }
  const std::map<std::string, v1::GradRoute> grad_routes = {
      {"cpu_reduction", v1::GRAD_ROUTE_CPU_REDUCTION},
      {"gpu_reduction", v1::GRAD_ROUTE_GPU_REDUCTION},
      {"reduce_scatter", v1::GRAD_ROUTE_REDUCE_SCATTER}};
  const std::map<std::string, v1::ParamRoute> param_routes = {
      {"replicated", v1::PARAM_ROUTE_REPLICATED}, {"sharded", v1::PARAM_ROUTE_SHARDED}};
  if (!grad_routes.count(f_.grad_route)) {
    return absl::InvalidArgumentError(absl::StrCat("--grad-route: '", f_.grad_route,
                                                   "', expected cpu_reduction, gpu_reduction or "
                                                   "reduce_scatter"));
  }
  if (!param_routes.count(f_.param_route)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--param-route: '", f_.param_route, "', expected replicated or sharded"));
  }
  grad_route_ = grad_routes.at(f_.grad_route);
  param_route_ = param_routes.at(f_.param_route);
  if (f_.prefetch >= f_.window_slots) {
    return absl::InvalidArgumentError(absl::StrCat("--prefetch: ", f_.prefetch, ", expected 0..",
                                                   f_.window_slots - 1,
                                                   " (less than --window-slots)"));
  }
  if (f_.create_job) RETURN_IF_ERROR(CreateJob());
  RETURN_IF_ERROR(Attach());

  RETURN_IF_CUDA_ERROR(cudaSetDevice(f_.gpu), "cudaSetDevice(", f_.gpu, ")");
  RETURN_IF_CUDA_ERROR(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking),
                       "compute stream");
  GpuDataPlane::Options po;
  po.device = f_.gpu;
  po.window_slots = f_.window_slots;
  po.prefetch_depth = f_.prefetch;
  po.param_route = param_route_;
  po.h2d_chunk_bytes = f_.h2d_chunk_bytes;
  ASSIGN_OR_RETURN(plane_, GpuDataPlane::Create(client_.get(), po));
  const uint64_t per_rank = f_.run.model.batch / f_.run.world_size;
  ASSIGN_OR_RETURN(GpuShardPass pass, GpuShardPass::Create(task_, per_rank, stream_));
  pass_ = std::make_unique<GpuShardPass>(std::move(pass));
  const uint64_t numel = MlpLayerNumel(f_.run.model.dim);
  grads_.assign(f_.run.model.layers, nullptr);
  for (float*& g : grads_) {
    RETURN_IF_CUDA_ERROR(cudaMalloc(&g, numel * sizeof(float)), "cudaMalloc of a gradient");
  }
  std::printf("rank %u/%u: attached on GPU %d; routes %s / %s; window %u slots, prefetch %u\n",
              f_.rank, f_.run.world_size, f_.gpu, f_.param_route.c_str(), f_.grad_route.c_str(),
              f_.window_slots, f_.prefetch);
  std::fflush(stdout);

  const auto start = Clock::now();
  double first_loss = 0;
  for (uint64_t t = 1; t <= f_.run.steps; ++t) {
    step_ = t;
    const auto s0 = Clock::now();
    RETURN_IF_ERROR(Step(t));
    const double step_ms = Ms(Clock::now() - s0);
    if (t == 1) first_loss = loss_;
    std::printf("rank %u step %4llu  shard_loss %.9e  step_ms %7.2f  fetch_ms %6.2f\n", f_.rank,
                static_cast<unsigned long long>(t), loss_, step_ms, fetch_ms_);
    std::fflush(stdout);
  }
  const double total_s = Ms(Clock::now() - start) / 1000.0;
  if (!f_.params_out.empty()) RETURN_IF_ERROR(WriteParams());
  const GpuDataPlane::Stats st = plane_->stats();
  std::printf(
      "rank %u summary: %llu steps in %.2f s; H2D %.1f MiB, D2H %.1f MiB in %llu chunks; "
      "register %.3f s, nccl init %.3f s; shard_loss %.6e -> %.6e\n",
      f_.rank, static_cast<unsigned long long>(f_.run.steps), total_s, st.h2d_bytes / 1048576.0,
      st.d2h_bytes / 1048576.0, static_cast<unsigned long long>(st.chunks_pushed),
      st.register_seconds, st.nccl_init_seconds, first_loss, loss_);
  std::fflush(stdout);
  plane_.reset();
  return client_->Detach();
}

}  // namespace
}  // namespace slidedp::examples

int main(int argc, char** argv) {
  using slidedp::examples::GpuTrainerFlags;
  GpuTrainerFlags f;
  CLI::App app{"native_gpu_trainer: one rank of the native MLP trainer on a GPU through hostd"};
  slidedp::examples::AddMlpRunFlags(app, &f.run);
  slidedp::examples::AddRankFlags(app, &f);
  app.add_option("--gpu", f.gpu, "CUDA device")->capture_default_str();
  app.add_option("--grad-route", f.grad_route, "cpu_reduction, gpu_reduction or reduce_scatter")
      ->capture_default_str();
  app.add_option("--param-route", f.param_route, "replicated or sharded")->capture_default_str();
  app.add_option("--window-slots", f.window_slots, "GPU window slots")->capture_default_str();
  app.add_option("--prefetch", f.prefetch, "Layers fetched ahead of the compute")
      ->capture_default_str();
  app.add_option("--h2d-chunk-bytes", f.h2d_chunk_bytes, "Parameter copies are cut at this size")
      ->capture_default_str();
  app.add_option("--params-out", f.params_out,
                 "Write the final BF16 parameters (raw, layers in order) to this file");
  CLI11_PARSE(app, argc, argv);

  slidedp::examples::GpuTrainer trainer(f);
  const absl::Status s = trainer.Run();
  if (!s.ok()) {
    std::fprintf(stderr, "rank %u: step %llu: %s\n", f.rank,
                 static_cast<unsigned long long>(trainer.step()), s.ToString().c_str());
  }
  return slidedp::examples::RankExitCode(s);
}
