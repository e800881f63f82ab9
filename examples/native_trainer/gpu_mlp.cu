#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/status_macros.h"
#include "examples/native_trainer/gpu_mlp.h"
#include "kernels/cuda/cuda_status.h"

#define RETURN_IF_CUBLAS_ERROR(expr, ...)                                           \
  do {                                                                              \
    const cublasStatus_t SLIDEDP_CUDA_CONCAT(_cublas_st_, __LINE__) = (expr);       \
    if (SLIDEDP_CUDA_CONCAT(_cublas_st_, __LINE__) != CUBLAS_STATUS_SUCCESS) {      \
      return ::slidedp::examples::gpu_mlp_internal::CublasStatus(                   \
          SLIDEDP_CUDA_CONCAT(_cublas_st_, __LINE__), ::absl::StrCat(__VA_ARGS__)); \
    }                                                                               \
  } while (0)

namespace slidedp::examples {
namespace gpu_mlp_internal {

// cuBLAS return codes as absl::Status, wrapped at the call site like CudaStatus.
absl::Status CublasStatus(cublasStatus_t s, absl::string_view what) {
  if (s == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
  const absl::StatusCode code =
      s == CUBLAS_STATUS_ALLOC_FAILED ? absl::StatusCode::kResourceExhausted
      : s == CUBLAS_STATUS_NOT_INITIALIZED || s == CUBLAS_STATUS_ARCH_MISMATCH
          ? absl::StatusCode::kFailedPrecondition
          : absl::StatusCode::kInternal;
  return absl::Status(
      code, absl::StrCat(what, ": cuBLAS error ", static_cast<int>(s), " (", cublasGetStatusName(s),
                         ": ", cublasGetStatusString(s), ")"));
}

// Move-only owners of the driver resources (destructors ignore errors: nothing to do with them).
template <typename T>
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(DeviceBuffer&& o) noexcept : p_(std::exchange(o.p_, nullptr)) {}
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    std::swap(p_, o.p_);
    return *this;
  }
  ~DeviceBuffer() {
    if (p_ != nullptr) cudaFree(p_);
  }
  absl::Status Allocate(uint64_t count, absl::string_view what) {
    void* p = nullptr;
    RETURN_IF_CUDA_ERROR(cudaMalloc(&p, std::max<uint64_t>(count, 1) * sizeof(T)), "cudaMalloc ",
                         what, " (", count * sizeof(T), " bytes)");
    p_ = static_cast<T*>(p);
    return absl::OkStatus();
  }
  T* get() const { return p_; }

 private:
  T* p_ = nullptr;
};

template <typename T>
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  PinnedBuffer(PinnedBuffer&& o) noexcept : p_(std::exchange(o.p_, nullptr)) {}
  PinnedBuffer& operator=(PinnedBuffer&& o) noexcept {
    std::swap(p_, o.p_);
    return *this;
  }
  ~PinnedBuffer() {
    if (p_ != nullptr) cudaFreeHost(p_);
  }
  absl::Status Allocate(uint64_t count, absl::string_view what) {
    void* p = nullptr;
    RETURN_IF_CUDA_ERROR(cudaMallocHost(&p, std::max<uint64_t>(count, 1) * sizeof(T)),
                         "cudaMallocHost ", what, " (", count * sizeof(T), " bytes)");
    p_ = static_cast<T*>(p);
    return absl::OkStatus();
  }
  T* get() const { return p_; }

 private:
  T* p_ = nullptr;
};

class Event {
 public:
  Event() = default;
  Event(Event&& o) noexcept : e_(std::exchange(o.e_, nullptr)) {}
  Event& operator=(Event&& o) noexcept {
    std::swap(e_, o.e_);
    return *this;
  }
  ~Event() {
    if (e_ != nullptr) cudaEventDestroy(e_);
  }
  absl::Status Create() {
    RETURN_IF_CUDA_ERROR(cudaEventCreateWithFlags(&e_, cudaEventDisableTiming), "cudaEventCreate");
    return absl::OkStatus();
  }
  cudaEvent_t get() const { return e_; }

 private:
  cudaEvent_t e_ = nullptr;
};

class CublasHandle {
 public:
  CublasHandle() = default;
  CublasHandle(CublasHandle&& o) noexcept : h_(std::exchange(o.h_, nullptr)) {}
  CublasHandle& operator=(CublasHandle&& o) noexcept {
    std::swap(h_, o.h_);
    return *this;
  }
  ~CublasHandle() {
    if (h_ != nullptr) cublasDestroy(h_);
  }
  absl::Status Create() {
    RETURN_IF_CUBLAS_ERROR(cublasCreate(&h_), "cublasCreate");
    return absl::OkStatus();
  }
  cublasHandle_t get() const { return h_; }

 private:
  cublasHandle_t h_ = nullptr;
};

constexpr int kThreads = 256;
constexpr uint64_t kMaxBlocks = 4096;  // grid-stride loops beyond this
// cuBLAS's recommended workspace for Hopper; fixed so the algorithm choice never depends on
// what else runs on the device.
constexpr size_t kCublasWorkspaceBytes = size_t{32} << 20;

unsigned Blocks(uint64_t n) {
  return static_cast<unsigned>(std::min<uint64_t>((n + kThreads - 1) / kThreads, kMaxBlocks));
}

__device__ __forceinline__ uint64_t GlobalIndex() {
  return uint64_t{blockIdx.x} * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ uint64_t GridStride() { return uint64_t{gridDim.x} * blockDim.x; }

// The exact widening (kernels::Bf16ToFp32).
__global__ void WidenBf16Kernel(const uint16_t* __restrict__ src, float* __restrict__ dst,
                                uint64_t n) {
  for (uint64_t i = GlobalIndex(); i < n; i += GridStride()) {
    dst[i] = __uint_as_float(static_cast<uint32_t>(src[i]) << 16);
  }
}

// kernels::RoundBitsToBf16: round to nearest even, NaN kept quiet with its sign and upper payload.
__global__ void NarrowBf16Kernel(const float* __restrict__ src, uint16_t* __restrict__ dst,
                                 uint64_t n) {
  for (uint64_t i = GlobalIndex(); i < n; i += GridStride()) {
    const uint32_t bits = __float_as_uint(src[i]);
    dst[i] = (bits & 0x7FFFFFFFu) > 0x7F800000u
                 ? static_cast<uint16_t>((bits >> 16) | 0x0040u)
                 : static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
  }
}

// z[s, o] = act(z[s, o] + b[o]) over [rows, dim]: the CPU's Dot(...) + bias[o], then tanh.
__global__ void BiasActKernel(float* __restrict__ z, const float* __restrict__ bias, uint64_t n,
                              uint32_t dim, bool tanh_act) {
  for (uint64_t i = GlobalIndex(); i < n; i += GridStride()) {
    const float v = __fadd_rn(z[i], bias[i % dim]);
    z[i] = tanh_act ? tanhf(v) : v;
  }
}

// The explicit _rn intrinsics keep nvcc from contracting into FMAs, so the deltas are rounded
// as the CPU's (which compiles without contraction) and differ only through their inputs.
// Last layer: delta = (out - target) * (1 / B).
__global__ void OutputDeltaKernel(const float* __restrict__ out, const float* __restrict__ target,
                                  float inv_batch, float* __restrict__ delta, uint64_t n) {
  for (uint64_t i = GlobalIndex(); i < n; i += GridStride()) {
    delta[i] = __fmul_rn(__fsub_rn(out[i], target[i]), inv_batch);
  }
}

// Hidden layer: delta (dL/dh of the layer's output) *= tanh'(z) = 1 - out^2.
__global__ void TanhDeltaKernel(const float* __restrict__ out, float* __restrict__ delta,
                                uint64_t n) {
  for (uint64_t i = GlobalIndex(); i < n; i += GridStride()) {
    delta[i] = __fmul_rn(delta[i], __fsub_rn(1.0f, __fmul_rn(out[i], out[i])));
  }
}

// gb[o] = sum over samples s in index order of delta[s, o], from 0: the CPU's order exactly.
// One thread per output; `rows` is a shard (a few dozen), so the serial loop is short.
__global__ void BiasGradKernel(const float* __restrict__ delta, uint64_t rows, uint32_t dim,
                               float* __restrict__ gb) {
  for (uint64_t o = GlobalIndex(); o < dim; o += GridStride()) {
    float acc = 0.0f;
    for (uint64_t s = 0; s < rows; ++s) acc = __fadd_rn(acc, delta[s * dim + o]);
    gb[o] = acc;
  }
}

}  // namespace gpu_mlp_internal

namespace gpu = gpu_mlp_internal;

struct GpuShardPass::Impl {
  const MlpTask* task = nullptr;
  uint32_t layers = 0;
  uint32_t dim = 0;
  uint64_t numel = 0;
  uint64_t max_samples = 0;
  cudaStream_t stream = nullptr;

  // Owners in acquisition order (teardown in reverse, after ~Impl has synchronized the stream).
  gpu::DeviceBuffer<float> params32;  // [L][numel]: each layer's widened parameters
  gpu::DeviceBuffer<float> acts;      // [L + 1][max_samples, D]: h_0 .. h_L
  gpu::DeviceBuffer<float> targets;   // [max_samples, D]
  gpu::DeviceBuffer<float> delta_a;   // dL/dz of the layer being backpropagated, and its
  gpu::DeviceBuffer<float> delta_b;   // W^T dz for the next one (swapped per layer)
  gpu::DeviceBuffer<float> grad32;    // BackwardBf16's FP32 gradient
  gpu::DeviceBuffer<char> workspace;  // cuBLAS
  gpu::PinnedBuffer<float> staging;   // [x | y], each [max_samples, D]
  gpu::PinnedBuffer<float> out_host;  // h_L for Loss
  gpu::Event uploaded;                // after the staging's H2D copies
  gpu::CublasHandle cublas;

  // Pass state.
  bool reset = false;   // a pass has been started
  bool failed = false;  // a call failed: only Reset continues
  uint64_t n = 0;
  uint32_t forward_done = 0;
  uint32_t backward_next = 0;  // next layer + 1 to backpropagate (0: none left)
  float* delta = nullptr;
  float* delta_prev = nullptr;

  bool stream_used = false;  // work has been enqueued on `stream`

  ~Impl() {
    // Kernels and copies of the last pass may still use the buffers.
    if (stream_used) cudaStreamSynchronize(stream);
  }

  float* act(uint32_t i) const { return acts.get() + uint64_t{i} * max_samples * dim; }
  float* params(uint32_t l) const { return params32.get() + uint64_t{l} * numel; }
  float* staged_x() const { return staging.get(); }
  float* staged_y() const { return staging.get() + max_samples * dim; }

  absl::Status CheckUsable(absl::string_view call) const {
    if (!reset) {
      return absl::FailedPreconditionError(absl::StrCat(call, ": no pass started (call Reset)"));
    }
    if (failed) {
      return absl::FailedPreconditionError(
          absl::StrCat(call, ": an earlier call of this pass failed (call Reset)"));
    }
    return absl::OkStatus();
  }
};

namespace {

// C (column-major m x n, ld m) = op(A) op(B) with every leading dimension D: the shapes the MLP
// needs once row-major [rows, D] buffers are read as column-major [D, rows].
absl::Status Gemm(cublasHandle_t h, cublasOperation_t op_a, cublasOperation_t op_b, uint64_t m,
                  uint64_t n, uint64_t k, const float* a, const float* b, float* c, uint32_t dim,
                  absl::string_view what, uint32_t layer) {
  const float one = 1.0f;
  const float zero = 0.0f;  // beta = 0: C is not read (poisoned outputs cannot leak in)
  RETURN_IF_CUBLAS_ERROR(cublasSgemm(h, op_a, op_b, static_cast<int>(m), static_cast<int>(n),
                                     static_cast<int>(k), &one, a, static_cast<int>(dim), b,
                                     static_cast<int>(dim), &zero, c, static_cast<int>(dim)),
                         "cublasSgemm (", what, ") of layer ", layer);
  return absl::OkStatus();
}

}  // namespace

GpuShardPass::GpuShardPass(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
GpuShardPass::GpuShardPass(GpuShardPass&&) noexcept = default;
GpuShardPass& GpuShardPass::operator=(GpuShardPass&&) noexcept = default;
GpuShardPass::~GpuShardPass() = default;

absl::StatusOr<GpuShardPass> GpuShardPass::Create(const MlpTask& task, uint64_t max_samples,
                                                  cudaStream_t stream) {
  if (max_samples == 0) {
    return absl::InvalidArgumentError("max_samples: expected >= 1, got 0");
  }
  const MlpConfig& c = task.config();
  // cuBLAS takes int dimensions; ValidateMlpConfig bounds D, this bounds the shard.
  if (max_samples > (uint64_t{1} << 30) / std::max<uint32_t>(c.dim, 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_samples: expected max_samples * dim <= 2^30, got ", max_samples));
  }
  auto impl = std::make_unique<Impl>();
  Impl& p = *impl;
  p.task = &task;
  p.layers = c.layers;
  p.dim = c.dim;
  p.numel = MlpLayerNumel(c.dim);
  p.max_samples = max_samples;
  p.stream = stream;
  const uint64_t act_count = max_samples * c.dim;
  RETURN_IF_ERROR(p.params32.Allocate(uint64_t{c.layers} * p.numel, "FP32 parameter copies"));
  RETURN_IF_ERROR(p.acts.Allocate(uint64_t{c.layers + 1} * act_count, "activations"));
  RETURN_IF_ERROR(p.targets.Allocate(act_count, "targets"));
  RETURN_IF_ERROR(p.delta_a.Allocate(act_count, "delta"));
  RETURN_IF_ERROR(p.delta_b.Allocate(act_count, "delta"));
  RETURN_IF_ERROR(p.grad32.Allocate(p.numel, "FP32 gradient"));
  RETURN_IF_ERROR(p.workspace.Allocate(gpu::kCublasWorkspaceBytes, "cuBLAS workspace"));
  RETURN_IF_ERROR(p.staging.Allocate(2 * act_count, "sample staging"));
  RETURN_IF_ERROR(p.out_host.Allocate(act_count, "output staging"));
  RETURN_IF_ERROR(p.uploaded.Create());
  RETURN_IF_ERROR(p.cublas.Create());
  const cublasHandle_t h = p.cublas.get();
  RETURN_IF_CUBLAS_ERROR(cublasSetStream(h, stream), "cublasSetStream");
  // After cublasSetStream, which resets the workspace to the library's default pool.
  RETURN_IF_CUBLAS_ERROR(cublasSetWorkspace(h, p.workspace.get(), gpu::kCublasWorkspaceBytes),
                         "cublasSetWorkspace");
  // True FP32 (CUBLAS_COMPUTE_32F_PEDANTIC): none of the TF32 tensor-core or BF16x9 emulated
  // paths a default-math handle may take, so the results stay within FP32 rounding of the CPU's.
  RETURN_IF_CUBLAS_ERROR(cublasSetMathMode(h, CUBLAS_PEDANTIC_MATH), "cublasSetMathMode");
  RETURN_IF_CUBLAS_ERROR(cublasSetPointerMode(h, CUBLAS_POINTER_MODE_HOST), "cublasSetPointerMode");
  RETURN_IF_CUBLAS_ERROR(cublasSetAtomicsMode(h, CUBLAS_ATOMICS_NOT_ALLOWED),
                         "cublasSetAtomicsMode");
  return GpuShardPass(std::move(impl));
}

absl::StatusOr<GpuShardPass> GpuShardPass::Create(const MlpTask& task, uint64_t step,
                                                  uint64_t begin, uint64_t end,
                                                  cudaStream_t stream) {
  if (end <= begin) {
    return absl::InvalidArgumentError(
        absl::StrCat("end: expected > begin (", begin, "), got ", end));
  }
  ASSIGN_OR_RETURN(GpuShardPass pass, Create(task, end - begin, stream));
  RETURN_IF_ERROR(pass.Reset(step, begin, end));
  return pass;
}

uint64_t GpuShardPass::samples() const { return impl_->n; }
uint64_t GpuShardPass::max_samples() const { return impl_->max_samples; }
cudaStream_t GpuShardPass::stream() const { return impl_->stream; }

absl::Status GpuShardPass::Reset(uint64_t step, uint64_t begin, uint64_t end) {
  Impl& p = *impl_;
  if (end < begin) {
    return absl::InvalidArgumentError(
        absl::StrCat("end: expected >= begin (", begin, "), got ", end));
  }
  if (end - begin > p.max_samples) {
    return absl::InvalidArgumentError(absl::StrCat("end - begin: expected <= max_samples (",
                                                   p.max_samples, "), got ", end - begin));
  }
  p.reset = true;
  p.failed = true;  // until the upload is enqueued
  p.n = end - begin;
  p.forward_done = 0;
  p.backward_next = 0;
  p.delta = p.delta_a.get();
  p.delta_prev = p.delta_b.get();
  // The previous pass's upload may still be reading the staging (pinned memory is read by the
  // copy engine asynchronously); its compute may go on, the new uploads queue behind it.
  if (p.stream_used) {
    RETURN_IF_CUDA_ERROR(cudaEventSynchronize(p.uploaded.get()), "waiting for the last upload");
  }
  const uint32_t d = p.dim;
  for (uint64_t s = 0; s < p.n; ++s) {
    p.task->Sample(step, begin + s, p.staged_x() + s * d, p.staged_y() + s * d);
  }
  const size_t bytes = p.n * d * sizeof(float);
  p.stream_used = true;
  RETURN_IF_CUDA_ERROR(
      cudaMemcpyAsync(p.act(0), p.staged_x(), bytes, cudaMemcpyHostToDevice, p.stream),
      "H2D of the inputs of step ", step);
  RETURN_IF_CUDA_ERROR(
      cudaMemcpyAsync(p.targets.get(), p.staged_y(), bytes, cudaMemcpyHostToDevice, p.stream),
      "H2D of the targets of step ", step);
  RETURN_IF_CUDA_ERROR(cudaEventRecord(p.uploaded.get(), p.stream), "cudaEventRecord (upload)");
  p.failed = false;
  return absl::OkStatus();
}

absl::Status GpuShardPass::Forward(uint32_t layer, const uint16_t* d_params) {
  Impl& p = *impl_;
  RETURN_IF_ERROR(p.CheckUsable("Forward"));
  if (layer != p.forward_done || layer >= p.layers) {
    return absl::FailedPreconditionError(absl::StrCat("Forward: expected layer ", p.forward_done,
                                                      " of ", p.layers, ", got ", layer));
  }
  if (d_params == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("Forward: d_params of layer ", layer, " null"));
  }
  p.failed = true;  // until every step below has been enqueued
  const uint32_t d = p.dim;
  float* w = p.params(layer);
  // First and only read of the caller's slot: from here on the pass uses its own copy.
  gpu::WidenBf16Kernel<<<gpu::Blocks(p.numel), gpu::kThreads, 0, p.stream>>>(d_params, w, p.numel);
  RETURN_IF_CUDA_ERROR(cudaGetLastError(), "widening kernel of layer ", layer);
  if (p.n > 0) {
    // Z^T [D, n] = W (row-major [D, D], i.e. column-major W^T, transposed back) . H^T [D, n].
    RETURN_IF_ERROR(Gemm(p.cublas.get(), CUBLAS_OP_T, CUBLAS_OP_N, d, p.n, d, w, p.act(layer),
                         p.act(layer + 1), d, "forward", layer));
    const uint64_t count = p.n * d;
    gpu::BiasActKernel<<<gpu::Blocks(count), gpu::kThreads, 0, p.stream>>>(
        p.act(layer + 1), w + uint64_t{d} * d, count, d, layer + 1 < p.layers);
    RETURN_IF_CUDA_ERROR(cudaGetLastError(), "bias/activation kernel of layer ", layer);
  }
  p.failed = false;
  ++p.forward_done;
  if (p.forward_done == p.layers) p.backward_next = p.layers;
  return absl::OkStatus();
}

absl::StatusOr<double> GpuShardPass::Loss() {
  Impl& p = *impl_;
  RETURN_IF_ERROR(p.CheckUsable("Loss"));
  if (p.forward_done != p.layers) {
    return absl::FailedPreconditionError(
        absl::StrCat("Loss: expected all ", p.layers, " layers forward, got ", p.forward_done));
  }
  const uint32_t d = p.dim;
  p.failed = true;
  RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(p.out_host.get(), p.act(p.layers), p.n * d * sizeof(float),
                                       cudaMemcpyDeviceToHost, p.stream),
                       "D2H of the output activations");
  RETURN_IF_CUDA_ERROR(cudaStreamSynchronize(p.stream), "synchronizing the pass's stream for Loss");
  p.failed = false;
  // ShardPass::Loss verbatim, on the same host targets.
  const float* out = p.out_host.get();
  const float* targets = p.staged_y();
  double loss = 0;
  for (uint64_t s = 0; s < p.n; ++s) {
    double sq = 0;
    for (uint32_t o = 0; o < d; ++o) {
      const double e = static_cast<double>(out[s * d + o]) - targets[s * d + o];
      sq += e * e;
    }
    loss += 0.5 * sq;
  }
  return loss / static_cast<double>(p.task->config().batch);
}

absl::Status GpuShardPass::Backward(uint32_t layer, float* d_grad) {
  return BackwardInto(layer, d_grad);
}

absl::Status GpuShardPass::BackwardBf16(uint32_t layer, uint16_t* d_grad) {
  Impl& p = *impl_;
  if (d_grad == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("Backward: d_grad of layer ", layer, " null"));
  }
  RETURN_IF_ERROR(BackwardInto(layer, p.grad32.get()));
  p.failed = true;
  gpu::NarrowBf16Kernel<<<gpu::Blocks(p.numel), gpu::kThreads, 0, p.stream>>>(p.grad32.get(),
                                                                              d_grad, p.numel);
  RETURN_IF_CUDA_ERROR(cudaGetLastError(), "BF16 rounding kernel of layer ", layer);
  p.failed = false;
  return absl::OkStatus();
}

absl::Status GpuShardPass::BackwardInto(uint32_t layer, float* d_grad) {
  Impl& p = *impl_;
  RETURN_IF_ERROR(p.CheckUsable("Backward"));
  if (p.backward_next == 0 || layer + 1 != p.backward_next) {
    return absl::FailedPreconditionError(
        p.forward_done != p.layers ? absl::StrCat("Backward: expected all ", p.layers,
                                                  " layers forward, got ", p.forward_done)
                                   : absl::StrCat("Backward: expected layer ",
                                                  int64_t{p.backward_next} - 1, ", got ", layer));
  }
  if (d_grad == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("Backward: d_grad of layer ", layer, " null"));
  }
  p.failed = true;
  const uint32_t d = p.dim;
  const uint64_t dd = uint64_t{d} * d;
  const uint64_t count = p.n * d;
  const float* in_act = p.act(layer);
  const float* out_act = p.act(layer + 1);
  if (p.n == 0) {
    RETURN_IF_CUDA_ERROR(cudaMemsetAsync(d_grad, 0, p.numel * sizeof(float), p.stream),
                         "zeroing the gradient of layer ", layer);
  } else {
    // delta becomes dL/dz of this layer, [n, D].
    if (layer + 1 == p.layers) {
      const float inv_batch = 1.0f / static_cast<float>(p.task->config().batch);
      gpu::OutputDeltaKernel<<<gpu::Blocks(count), gpu::kThreads, 0, p.stream>>>(
          out_act, p.targets.get(), inv_batch, p.delta, count);
    } else {
      gpu::TanhDeltaKernel<<<gpu::Blocks(count), gpu::kThreads, 0, p.stream>>>(out_act, p.delta,
                                                                               count);
    }
    RETURN_IF_CUDA_ERROR(cudaGetLastError(), "delta kernel of layer ", layer);
    // dW (row-major [D_out, D_in], i.e. column-major dW^T [D_in, D_out]) = H^T [D, n] . dZ [n, D].
    RETURN_IF_ERROR(Gemm(p.cublas.get(), CUBLAS_OP_N, CUBLAS_OP_T, d, d, p.n, in_act, p.delta,
                         d_grad, d, "weight gradient", layer));
    gpu::BiasGradKernel<<<gpu::Blocks(d), gpu::kThreads, 0, p.stream>>>(p.delta, p.n, d,
                                                                        d_grad + dd);
    RETURN_IF_CUDA_ERROR(cudaGetLastError(), "bias gradient kernel of layer ", layer);
    if (layer > 0) {
      // dH^T [D, n] = W^T . dZ^T: the row-major W read as column-major is already W^T.
      RETURN_IF_ERROR(Gemm(p.cublas.get(), CUBLAS_OP_N, CUBLAS_OP_N, d, p.n, d, p.params(layer),
                           p.delta, p.delta_prev, d, "input gradient", layer));
      std::swap(p.delta, p.delta_prev);
    }
  }
  p.failed = false;
  --p.backward_next;
  return absl::OkStatus();
}

}  // namespace slidedp::examples
