// Device kernels of the GPU data plane (see cuda_kernels.h for the contracts).
//
// Element-wise kernels (casts, scaling, pack/unpack conversions) are memory-bound: each thread
// moves kVec = 8 elements per iteration with 16-byte loads and stores (one uint4 of BF16, two of
// FP32), over a grid-stride loop whose grid fills the device once (SM count x resident blocks per
// SM). The first `head` (< 8) elements, taken so that both pointers are 16-byte aligned after
// them, and the last (< 8) elements are done one by one by the first threads of the same launch.
// When source and destination cannot be aligned together, a scalar grid-stride kernel is used.
//
// GradStats is deterministic by construction; see the comment above GradStatsKernel.
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_kernels.h"
#include "kernels/cuda/cuda_status.h"

namespace slidedp::kernels::cuda {
namespace {

constexpr int kDTypeFp32 = 1;  // control.proto DType
constexpr int kDTypeBf16 = 2;

constexpr int kThreads = 256;
// 8 x 256 = 2048 threads, the sm_90 maximum per SM; as a launch bound it caps registers at 32, so
// a grid of SM count x 8 blocks is resident at once and the grid-stride loop has no tail wave.
constexpr int kMinBlocksPerSm = 8;
constexpr int kVec = 8;
constexpr uintptr_t kVecAlignBytes = 16;

// ---------------------------------------------------------------------------------------------
// Element operations. RoundBitsToBf16 is kernels/cpu/bf16.h's rule, bit for bit (the CUDA
// intrinsics canonicalize NaN payloads, so the integer form is used).

__device__ __forceinline__ uint16_t RoundBitsToBf16(uint32_t bits) {
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) {
    return static_cast<uint16_t>((bits >> 16) | 0x0040u);
  }
  return static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

__device__ __forceinline__ float WidenBf16(uint16_t b) {
  return __uint_as_float(static_cast<uint32_t>(b) << 16);
}

struct Fp32ToBf16Op {
  using In = float;
  using Out = uint16_t;
  __device__ __forceinline__ Out operator()(In x) const {
    return RoundBitsToBf16(__float_as_uint(x));
  }
};

struct Bf16ToFp32Op {
  using In = uint16_t;
  using Out = float;
  __device__ __forceinline__ Out operator()(In x) const { return WidenBf16(x); }
};

struct ScaleFp32Op {
  using In = float;
  using Out = float;
  float s;
  __device__ __forceinline__ Out operator()(In x) const { return __fmul_rn(x, s); }
};

struct ScaleBf16Op {
  using In = uint16_t;
  using Out = uint16_t;
  float s;
  __device__ __forceinline__ Out operator()(In x) const {
    return RoundBitsToBf16(__float_as_uint(__fmul_rn(WidenBf16(x), s)));
  }
};

// ---------------------------------------------------------------------------------------------
// 16-byte vector access of kVec elements; `p` must be 16-byte aligned.

template <typename T>
__device__ __forceinline__ void LoadVec(const T* p, T (&v)[kVec]) {
  constexpr int kWords = kVec * sizeof(T) / sizeof(uint4);
  static_assert(kWords * sizeof(uint4) == sizeof(v));
  uint4 w[kWords];
#pragma unroll
  for (int i = 0; i < kWords; ++i) w[i] = reinterpret_cast<const uint4*>(p)[i];
  memcpy(v, w, sizeof(v));
}

template <typename T>
__device__ __forceinline__ void StoreVec(T* p, const T (&v)[kVec]) {
  constexpr int kWords = kVec * sizeof(T) / sizeof(uint4);
  static_assert(kWords * sizeof(uint4) == sizeof(v));
  uint4 w[kWords];
  memcpy(w, v, sizeof(v));
#pragma unroll
  for (int i = 0; i < kWords; ++i) reinterpret_cast<uint4*>(p)[i] = w[i];
}

__device__ __forceinline__ uint64_t GlobalThread() {
  return static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ uint64_t GridThreads() {
  return static_cast<uint64_t>(gridDim.x) * blockDim.x;
}

// out[i] = op(in[i]) for i < n, where in + head and out + head are both 16-byte aligned
// (head <= min(n, kVec - 1)). `in` may equal `out` (each element is read and written by the same
// thread), hence no __restrict__.
template <typename Op>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSm)
    MapVecKernel(const typename Op::In* in, typename Op::Out* out, uint64_t n, uint32_t head,
                 Op op) {
  using In = typename Op::In;
  using Out = typename Op::Out;
  const uint64_t tid = GlobalThread();
  const uint64_t stride = GridThreads();
  const uint64_t nvec = (n - head) / kVec;
  const In* vin = in + head;
  Out* vout = out + head;
  for (uint64_t v = tid; v < nvec; v += stride) {
    In a[kVec];
    LoadVec(vin + v * kVec, a);
    Out b[kVec];
#pragma unroll
    for (int j = 0; j < kVec; ++j) b[j] = op(a[j]);
    StoreVec(vout + v * kVec, b);
  }
  if (tid < head) out[tid] = op(in[tid]);
  const uint64_t rest = head + nvec * kVec;
  if (tid < n - rest) out[rest + tid] = op(in[rest + tid]);
}

// The fallback when `in` and `out` cannot both be 16-byte aligned: element accesses, four per
// thread in flight. Only used for distinct, non-overlapping buffers.
constexpr int kScalarUnroll = 4;

template <typename Op>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSm)
    MapScalarKernel(const typename Op::In* __restrict__ in, typename Op::Out* __restrict__ out,
                    uint64_t n, Op op) {
  using In = typename Op::In;
  const uint64_t stride = GridThreads();
  for (uint64_t base = GlobalThread(); base < n; base += kScalarUnroll * stride) {
    In a[kScalarUnroll];
#pragma unroll
    for (int j = 0; j < kScalarUnroll; ++j) {
      const uint64_t i = base + j * stride;
      if (i < n) a[j] = in[i];
    }
#pragma unroll
    for (int j = 0; j < kScalarUnroll; ++j) {
      const uint64_t i = base + j * stride;
      if (i < n) out[i] = op(a[j]);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// GradStats.
//
// Determinism: the grid is StatsBlocks(n) blocks of kStatsThreads threads, a function of n only
// (never of the stream, the occupancy or the SM count). The input is cut into chunks of 8
// elements; global thread t sums the chunks t, t + T, t + 2T, ... (T = all threads) in that
// order, each chunk's 8 squares first added in element order. Whether a chunk is read with vector
// loads (x 16-byte aligned, full chunk) or element by element (otherwise) changes nothing in
// that arithmetic, so the result does not depend on x's alignment either. A block adds its
// threads' sums in a fixed shuffle tree and block 0..G-1 partials go to scratch in FP64 (counts
// as integers). The block that increments the scratch counter last (threadfence + atomicAdd, the
// CUDA threadFenceReduction pattern) re-reads all G partials and reduces them with the same fixed
// mapping and tree, so which block happens to finish last does not matter.
//
// The counter is zeroed by a 4-byte cudaMemsetAsync queued before every launch rather than reset
// by the last block: the scratch contract allows any contents (a fresh cudaMalloc, or a launch
// aborted half-way), and the memset costs one tiny stream operation, like a second launch would.
//
// Squares are exact in FP64 (24-bit significands), so an FMA or a separate multiply and add give
// the same bits. Non-finite elements add 0 and are counted.

constexpr int kStatsThreads = 256;
constexpr uint32_t kStatsMaxBlocks = 1024;  // <= 132 SMs x 8 resident blocks on an H200
constexpr uint64_t kStatsChunk = 8;
constexpr uint64_t kStatsMinElemsPerBlock = kStatsThreads * kStatsChunk * 4;
constexpr uint64_t kStatsHeaderBytes = 16;  // the uint32 counter, padded

uint32_t StatsBlocks(uint64_t n) {
  const uint64_t blocks = (n + kStatsMinElemsPerBlock - 1) / kStatsMinElemsPerBlock;
  return blocks == 0                ? 1u
         : blocks > kStatsMaxBlocks ? kStatsMaxBlocks
                                    : static_cast<uint32_t>(blocks);
}

template <int kDType>
__device__ __forceinline__ float LoadElem(const void* x, uint64_t i) {
  if constexpr (kDType == kDTypeFp32) {
    return static_cast<const float*>(x)[i];
  } else {
    return WidenBf16(static_cast<const uint16_t*>(x)[i]);
  }
}

template <int kDType>
__device__ __forceinline__ void LoadChunk(const void* x, uint64_t chunk, uint64_t n, bool aligned,
                                          float (&v)[kStatsChunk]) {
  const uint64_t first = chunk * kStatsChunk;
  if (aligned && first + kStatsChunk <= n) {
    if constexpr (kDType == kDTypeFp32) {
      LoadVec(static_cast<const float*>(x) + first, v);
    } else {
      uint16_t b[kVec];
      LoadVec(static_cast<const uint16_t*>(x) + first, b);
#pragma unroll
      for (int j = 0; j < kVec; ++j) v[j] = WidenBf16(b[j]);
    }
  } else {
#pragma unroll
    for (int j = 0; j < static_cast<int>(kStatsChunk); ++j) {
      v[j] = first + j < n ? LoadElem<kDType>(x, first + j) : 0.0f;
    }
  }
}

// Sums (s, c) over the block in a fixed order; the result is valid in thread 0. Ends with the
// shared arrays still being read by warp 0: callers sync before calling again.
__device__ __forceinline__ void BlockReduce(double& s, unsigned long long& c) {
  __shared__ double warp_s[kStatsThreads / 32];
  __shared__ unsigned long long warp_c[kStatsThreads / 32];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    s += __shfl_down_sync(0xFFFFFFFFu, s, offset);
    c += __shfl_down_sync(0xFFFFFFFFu, c, offset);
  }
  if (lane == 0) {
    warp_s[warp] = s;
    warp_c[warp] = c;
  }
  __syncthreads();
  if (warp == 0) {
    s = lane < kStatsThreads / 32 ? warp_s[lane] : 0.0;
    c = lane < kStatsThreads / 32 ? warp_c[lane] : 0ull;
#pragma unroll
    for (int offset = kStatsThreads / 64; offset > 0; offset >>= 1) {
      s += __shfl_down_sync(0xFFFFFFFFu, s, offset);
      c += __shfl_down_sync(0xFFFFFFFFu, c, offset);
    }
  }
}

template <int kDType>
__global__ void __launch_bounds__(kStatsThreads, kMinBlocksPerSm)
    GradStatsKernel(const void* __restrict__ x, uint64_t n, bool aligned,
                    unsigned int* __restrict__ counter, double* __restrict__ part_sum,
                    unsigned long long* __restrict__ part_count, GradStatsResult* out) {
  const uint64_t chunks = (n + kStatsChunk - 1) / kStatsChunk;
  const uint64_t stride = GridThreads();
  double sum = 0.0;
  unsigned long long nonfinite = 0;
  for (uint64_t chunk = GlobalThread(); chunk < chunks; chunk += stride) {
    float v[kStatsChunk];
    LoadChunk<kDType>(x, chunk, n, aligned, v);
    double chunk_sum = 0.0;
#pragma unroll
    for (int j = 0; j < static_cast<int>(kStatsChunk); ++j) {
      const bool finite = (__float_as_uint(v[j]) & 0x7F800000u) != 0x7F800000u;
      nonfinite += finite ? 0u : 1u;
      const double d = finite ? static_cast<double>(v[j]) : 0.0;
      chunk_sum = __fma_rn(d, d, chunk_sum);
    }
    sum += chunk_sum;
  }
  BlockReduce(sum, nonfinite);

  __shared__ bool is_last;
  if (threadIdx.x == 0) {
    part_sum[blockIdx.x] = sum;
    part_count[blockIdx.x] = nonfinite;
    __threadfence();  // the partials are visible device-wide before the counter moves
    is_last = atomicAdd(counter, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (!is_last) return;

  __threadfence();  // pairs with the other blocks' fences: their partials are read below
  sum = 0.0;
  nonfinite = 0;
  for (uint32_t b = threadIdx.x; b < gridDim.x; b += kStatsThreads) {
    sum += __ldcg(part_sum + b);  // L2, never a stale L1 line
    nonfinite += __ldcg(part_count + b);
  }
  BlockReduce(sum, nonfinite);
  if (threadIdx.x == 0) {
    out->sumsq = sum;
    out->nonfinite = nonfinite;
  }
}

// ---------------------------------------------------------------------------------------------
// Host side.

int DTypeBytes(int dtype) { return dtype == kDTypeFp32 ? 4 : 2; }

absl::Status CheckDType(const char* what, const char* field, int dtype) {
  if (dtype == kDTypeFp32 || dtype == kDTypeBf16) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(what, ": ", field, " is ", dtype, "; expected 1 (FP32) or 2 (BF16)"));
}

absl::Status CheckPointer(const char* what, const char* field, const void* p, uint64_t n,
                          uint64_t elem_bytes) {
  if (n == 0) return absl::OkStatus();
  if (p == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": ", field, " is null for ", n, " elements"));
  }
  if (reinterpret_cast<uintptr_t>(p) % elem_bytes != 0) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": ", field, " (",
                                                   absl::Hex(reinterpret_cast<uintptr_t>(p)),
                                                   ") is not aligned to ", elem_bytes, " bytes"));
  }
  return absl::OkStatus();
}

absl::Status CheckNoOverlap(const char* what, const void* src, uint64_t src_bytes, const void* dst,
                            uint64_t dst_bytes) {
  const uintptr_t s = reinterpret_cast<uintptr_t>(src);
  const uintptr_t d = reinterpret_cast<uintptr_t>(dst);
  if (src_bytes == 0 || dst_bytes == 0 || s + src_bytes <= d || d + dst_bytes <= s) {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat(what, ": src [", absl::Hex(s), ", +", src_bytes,
                                                 ") and dst [", absl::Hex(d), ", +", dst_bytes,
                                                 ") overlap"));
}

// Grid size of the element-wise kernels for the current device: SM count x resident blocks per
// SM. Cached per device (both attributes are immutable); one 64-bit word so a reader never
// sees half of an entry.
constexpr int kMaxCachedDevices = 64;
std::atomic<uint64_t> g_device_blocks[kMaxCachedDevices];

absl::Status MaxResidentBlocks(uint32_t* blocks) {
  int device = 0;
  RETURN_IF_CUDA_ERROR(cudaGetDevice(&device), "cudaGetDevice");
  if (device >= 0 && device < kMaxCachedDevices) {
    const uint64_t cached = g_device_blocks[device].load(std::memory_order_relaxed);
    if (cached != 0) {
      *blocks = static_cast<uint32_t>(cached);
      return absl::OkStatus();
    }
  }
  int sm_count = 0;
  int threads_per_sm = 0;
  RETURN_IF_CUDA_ERROR(cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, device),
                       "multiprocessor count of device ", device);
  RETURN_IF_CUDA_ERROR(
      cudaDeviceGetAttribute(&threads_per_sm, cudaDevAttrMaxThreadsPerMultiProcessor, device),
      "max threads per multiprocessor of device ", device);
  int per_sm = threads_per_sm / kThreads;
  per_sm = per_sm < 1 ? 1 : per_sm > kMinBlocksPerSm ? kMinBlocksPerSm : per_sm;
  const uint64_t total = static_cast<uint64_t>(sm_count < 1 ? 1 : sm_count) * per_sm;
  if (device >= 0 && device < kMaxCachedDevices) {
    g_device_blocks[device].store(total, std::memory_order_relaxed);
  }
  *blocks = static_cast<uint32_t>(total);
  return absl::OkStatus();
}

uint32_t GridFor(uint64_t work_items, uint64_t per_block, uint32_t max_blocks) {
  const uint64_t want = (work_items + per_block - 1) / per_block;
  return want == 0 ? 1u : want < max_blocks ? static_cast<uint32_t>(want) : max_blocks;
}

template <typename... KernelArgs, typename... Args>
cudaError_t Launch(void (*kernel)(KernelArgs...), uint32_t blocks, uint32_t threads,
                   cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(blocks);
  config.blockDim = dim3(threads);
  config.dynamicSmemBytes = 0;
  config.stream = stream;
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % kVecAlignBytes == 0; }

// Whether element `i` of an array at `p` would be 16-byte aligned (without forming p + i, which
// may lie past a short array).
template <typename T>
bool Aligned16At(const T* p, int i) {
  return (reinterpret_cast<uintptr_t>(p) + static_cast<uintptr_t>(i) * sizeof(T)) %
             kVecAlignBytes ==
         0;
}

// out[i] = op(in[i]) for i < n. `in == out` is allowed (in-place scaling); otherwise the ranges
// must not overlap (checked by the callers).
template <typename Op>
absl::Status LaunchMap(const char* what, const typename Op::In* in, typename Op::Out* out,
                       uint64_t n, Op op, cudaStream_t stream) {
  if (n == 0) return absl::OkStatus();
  uint32_t max_blocks = 0;
  if (absl::Status s = MaxResidentBlocks(&max_blocks); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat(what, ": ", s.message()));
  }
  int head = -1;
  for (int h = 0; h < kVec; ++h) {
    if (Aligned16At(in, h) && Aligned16At(out, h)) {
      head = h;
      break;
    }
  }
  cudaError_t e;
  if (head >= 0) {
    const uint64_t clipped_head = static_cast<uint64_t>(head) < n ? head : n;
    const uint64_t nvec = (n - clipped_head) / kVec;
    e = Launch(MapVecKernel<Op>, GridFor(nvec, kThreads, max_blocks), kThreads, stream, in, out, n,
               static_cast<uint32_t>(clipped_head), op);
  } else {
    e = Launch(MapScalarKernel<Op>, GridFor(n, kThreads * kScalarUnroll, max_blocks), kThreads,
               stream, in, out, n, op);
  }
  return ::slidedp::cuda::CudaStatus(e, absl::StrCat(what, " launch (", n, " elements)"));
}

// dst[0, n) = src[0, n) converted; dtypes already checked.
absl::Status Convert(const char* what, const void* src, int src_dtype, void* dst, int dst_dtype,
                     uint64_t n, cudaStream_t stream) {
  if (n == 0) return absl::OkStatus();
  if (src_dtype == dst_dtype) {
    RETURN_IF_CUDA_ERROR(
        cudaMemcpyAsync(dst, src, n * DTypeBytes(src_dtype), cudaMemcpyDefault, stream), what,
        ": copy of ", n, " elements");
    return absl::OkStatus();
  }
  if (src_dtype == kDTypeFp32) {
    return LaunchMap(what, static_cast<const float*>(src), static_cast<uint16_t*>(dst), n,
                     Fp32ToBf16Op{}, stream);
  }
  return LaunchMap(what, static_cast<const uint16_t*>(src), static_cast<float*>(dst), n,
                   Bf16ToFp32Op{}, stream);
}

absl::Status CheckConvertArgs(const char* what, const void* src, int src_dtype, uint64_t n,
                              const void* dst, int dst_dtype, uint64_t dst_n) {
  if (absl::Status s = CheckDType(what, "src_dtype", src_dtype); !s.ok()) return s;
  if (absl::Status s = CheckDType(what, "dst_dtype", dst_dtype); !s.ok()) return s;
  if (absl::Status s = CheckPointer(what, "src", src, n, DTypeBytes(src_dtype)); !s.ok()) return s;
  if (absl::Status s = CheckPointer(what, "dst", dst, dst_n, DTypeBytes(dst_dtype)); !s.ok()) {
    return s;
  }
  return CheckNoOverlap(what, src, n * DTypeBytes(src_dtype), dst, dst_n * DTypeBytes(dst_dtype));
}

}  // namespace

absl::Status Bf16ToFp32(const uint16_t* src, float* dst, uint64_t n, cudaStream_t stream) {
  constexpr const char* kWhat = "Bf16ToFp32";
  if (absl::Status s = CheckConvertArgs(kWhat, src, kDTypeBf16, n, dst, kDTypeFp32, n); !s.ok()) {
    return s;
  }
  return LaunchMap(kWhat, src, dst, n, Bf16ToFp32Op{}, stream);
}

absl::Status Fp32ToBf16(const float* src, uint16_t* dst, uint64_t n, cudaStream_t stream) {
  constexpr const char* kWhat = "Fp32ToBf16";
  if (absl::Status s = CheckConvertArgs(kWhat, src, kDTypeFp32, n, dst, kDTypeBf16, n); !s.ok()) {
    return s;
  }
  return LaunchMap(kWhat, src, dst, n, Fp32ToBf16Op{}, stream);
}

absl::Status ScaleFp32(float* x, float s, uint64_t n, cudaStream_t stream) {
  if (absl::Status st = CheckPointer("ScaleFp32", "x", x, n, sizeof(float)); !st.ok()) return st;
  return LaunchMap("ScaleFp32", x, x, n, ScaleFp32Op{s}, stream);
}

absl::Status ScaleBf16(uint16_t* x, float s, uint64_t n, cudaStream_t stream) {
  if (absl::Status st = CheckPointer("ScaleBf16", "x", x, n, sizeof(uint16_t)); !st.ok()) {
    return st;
  }
  return LaunchMap("ScaleBf16", x, x, n, ScaleBf16Op{s}, stream);
}

absl::Status PackPadded(const void* src, int src_dtype, uint64_t n, void* dst, int dst_dtype,
                        uint64_t padded_n, cudaStream_t stream) {
  constexpr const char* kWhat = "PackPadded";
  if (padded_n < n) {
    return absl::InvalidArgumentError(
        absl::StrCat(kWhat, ": padded_n is ", padded_n, "; expected >= n = ", n));
  }
  if (absl::Status s = CheckConvertArgs(kWhat, src, src_dtype, n, dst, dst_dtype, padded_n);
      !s.ok()) {
    return s;
  }
  if (absl::Status s = Convert(kWhat, src, src_dtype, dst, dst_dtype, n, stream); !s.ok()) {
    return s;
  }
  if (padded_n > n) {
    // The padding is a few elements per layer (shard rounding); a memset node is cheaper than a
    // second pass of the conversion kernel over it. Zero bits are +0 in both dtypes.
    const uint64_t elem = DTypeBytes(dst_dtype);
    RETURN_IF_CUDA_ERROR(
        cudaMemsetAsync(static_cast<char*>(dst) + n * elem, 0, (padded_n - n) * elem, stream),
        kWhat, ": zeroing ", padded_n - n, " padding elements");
  }
  return absl::OkStatus();
}

absl::Status Unpack(const void* src, int src_dtype, void* dst, int dst_dtype, uint64_t n,
                    cudaStream_t stream) {
  constexpr const char* kWhat = "Unpack";
  if (absl::Status s = CheckConvertArgs(kWhat, src, src_dtype, n, dst, dst_dtype, n); !s.ok()) {
    return s;
  }
  return Convert(kWhat, src, src_dtype, dst, dst_dtype, n, stream);
}

uint64_t StatsScratchBytes(uint64_t n) {
  return kStatsHeaderBytes +
         static_cast<uint64_t>(StatsBlocks(n)) * (sizeof(double) + sizeof(unsigned long long));
}

absl::Status GradStats(const void* x, int dtype, uint64_t n, void* scratch, GradStatsResult* out,
                       cudaStream_t stream) {
  constexpr const char* kWhat = "GradStats";
  if (absl::Status s = CheckDType(kWhat, "dtype", dtype); !s.ok()) return s;
  if (absl::Status s = CheckPointer(kWhat, "x", x, n, DTypeBytes(dtype)); !s.ok()) return s;
  if (absl::Status s = CheckPointer(kWhat, "scratch", scratch, 1, kStatsHeaderBytes); !s.ok()) {
    return s;
  }
  if (absl::Status s = CheckPointer(kWhat, "out", out, 1, alignof(GradStatsResult)); !s.ok()) {
    return s;
  }
  const uint32_t blocks = StatsBlocks(n);
  auto* counter = static_cast<unsigned int*>(scratch);
  auto* part_sum = reinterpret_cast<double*>(static_cast<char*>(scratch) + kStatsHeaderBytes);
  auto* part_count = reinterpret_cast<unsigned long long*>(part_sum + blocks);
  RETURN_IF_CUDA_ERROR(cudaMemsetAsync(counter, 0, sizeof(*counter), stream), kWhat,
                       ": zeroing the scratch counter");
  const bool aligned = Aligned16(x);
  const cudaError_t e = dtype == kDTypeFp32
                            ? Launch(GradStatsKernel<kDTypeFp32>, blocks, kStatsThreads, stream, x,
                                     n, aligned, counter, part_sum, part_count, out)
                            : Launch(GradStatsKernel<kDTypeBf16>, blocks, kStatsThreads, stream, x,
                                     n, aligned, counter, part_sum, part_count, out);
  return ::slidedp::cuda::CudaStatus(e, absl::StrCat(kWhat, " launch (", n, " elements)"));
}

}  // namespace slidedp::kernels::cuda
