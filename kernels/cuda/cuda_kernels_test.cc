// GPU kernels of cuda_kernels.h against the CPU reference (kernels/cpu/bf16.h): bit-identical
// casts over random bit patterns and special values, every size tail and misaligned pointers;
// pack/unpack for every dtype pair with poisoned destinations; scaling; gradient statistics
// against a CPU sum, deterministic across launches, streams and alignments; one > 2^32-element
// case for 64-bit indexing when the device has the memory.
#include "kernels/cuda/cuda_kernels.h"

#include <cuda_runtime_api.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "gtest/gtest.h"
#include "kernels/cpu/bf16.h"

namespace slidedp::kernels::cuda {
namespace {

#define ASSERT_CUDA(expr)                                                              \
  do {                                                                                 \
    const cudaError_t cuda_err_ = (expr);                                              \
    ASSERT_EQ(cuda_err_, cudaSuccess) << #expr << ": " << cudaGetErrorName(cuda_err_); \
  } while (0)

#define ASSERT_OK(expr)                                    \
  do {                                                     \
    const absl::Status status_ = (expr);                   \
    ASSERT_TRUE(status_.ok()) << #expr << ": " << status_; \
  } while (0)

constexpr int kFp32 = 1;
constexpr int kBf16 = 2;
constexpr uint8_t kPoisonByte = 0xA5;
constexpr uint64_t kGuardElems = 16;  // poisoned elements after each destination

const uint64_t kSizes[] = {0, 1, 7, 8, 9, 1023, (1u << 20) + 3};

// The CPU reference; the name Bf16ToFp32 in this namespace is the GPU cast.
float WidenBf16(uint16_t b) { return ::slidedp::kernels::Bf16ToFp32(b); }

uint64_t ElemBytes(int dtype) { return dtype == kFp32 ? 4 : 2; }

uint32_t PoisonBits(int dtype) { return dtype == kFp32 ? 0xA5A5A5A5u : 0xA5A5u; }

// A device allocation freed on scope exit.
class DeviceBuffer {
 public:
  explicit DeviceBuffer(uint64_t bytes) {
    error_ = cudaMalloc(&ptr_, bytes == 0 ? 1 : bytes);
    if (error_ != cudaSuccess) ptr_ = nullptr;
  }
  ~DeviceBuffer() {
    if (ptr_ != nullptr) cudaFree(ptr_);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  cudaError_t error() const { return error_; }
  template <typename T = void>
  T* at(uint64_t byte_offset = 0) const {
    return reinterpret_cast<T*>(static_cast<char*>(ptr_) + byte_offset);
  }

 private:
  void* ptr_ = nullptr;
  cudaError_t error_ = cudaSuccess;
};

// ---------------------------------------------------------------------------------------------
// Host data: element bit patterns stored as bytes of the dtype.

const std::vector<uint32_t>& SpecialFp32() {
  static const std::vector<uint32_t> kValues = {
      0x00000000, 0x80000000,              // +-0
      0x00000001, 0x80000001, 0x007FFFFF,  // denormals
      0x807FFFFF, 0x00008000, 0x00018000,  // denormal ties: to even (down), to even (up)
      0x00017FFF, 0x00008001, 0x80018000,  // just below / above a tie
      0x00800000, 0x80800000,              // smallest normals
      0x3F808000, 0x3F818000, 0x3F80FFFF,  // ties at 1.0: down to even, up to even; above
      0xBF808000, 0xBF818000, 0x3F807FFF,  // negative ties; just below a tie
      0x7F7F8000, 0x7F7FFFFF, 0xFF7FFFFF,  // overflow to +-Inf by rounding
      0x7F7F7FFF, 0x7F7EFFFF,              // largest values that stay finite
      0x7F800000, 0xFF800000,              // +-Inf
      0x7FC00000, 0xFFC00000, 0x7F800001,  // NaNs: quiet, negative quiet, signalling
      0x7FBFFFFF, 0xFF800001, 0x7FFFFFFF,  // payloads in the high and low bits
      0xFFFFFFFF, 0x7FA00000, 0x7F808000,  //
      0x3F800000, 0xBF800000, 0x40490FDB,  // 1, -1, pi
  };
  return kValues;
}

const std::vector<uint16_t>& SpecialBf16() {
  static const std::vector<uint16_t> kValues = {
      0x0000, 0x8000, 0x0001, 0x8001, 0x007F, 0x0080, 0x7F7F, 0xFF7F, 0x7F80,
      0xFF80, 0x7F81, 0x7FC0, 0xFFC1, 0x7FFF, 0xFFFF, 0x3F80, 0xBF80, 0x4049,
  };
  return kValues;
}

// n elements: specials first and at every 61st element, random bit patterns elsewhere (which
// include NaNs, Infs and denormals at their natural frequency).
std::vector<uint8_t> RandomBits(uint64_t n, int dtype, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> out(n * ElemBytes(dtype));
  for (uint64_t i = 0; i < n; ++i) {
    uint32_t bits = rng();
    if (dtype == kFp32) {
      const auto& sp = SpecialFp32();
      if (i < sp.size()) bits = sp[i];
      if (i % 61 == 60) bits = sp[(i / 61) % sp.size()];
      std::memcpy(&out[i * 4], &bits, 4);
    } else {
      const auto& sp = SpecialBf16();
      uint16_t b = static_cast<uint16_t>(bits >> 8);
      if (i < sp.size()) b = sp[i];
      if (i % 61 == 60) b = sp[(i / 61) % sp.size()];
      std::memcpy(&out[i * 2], &b, 2);
    }
  }
  return out;
}

// n finite values over many magnitudes, in the dtype, with `nonfinite` NaN/Inf elements at
// random positions.
std::vector<uint8_t> RandomGradient(uint64_t n, int dtype, uint32_t seed, uint64_t nonfinite) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> mantissa(-1.0f, 1.0f);
  std::uniform_int_distribution<int> exponent(-40, 40);
  std::vector<float> values(n);
  for (auto& v : values) v = std::ldexp(mantissa(rng), exponent(rng));
  const uint32_t kBad[] = {0x7FC00000u, 0xFF800000u, 0x7F800000u, 0x7F800001u, 0xFFFFFFFFu};
  for (uint64_t k = 0; k < nonfinite && n > 0; ++k) {
    values[rng() % n] = std::bit_cast<float>(kBad[k % 5]);
  }
  std::vector<uint8_t> out(n * ElemBytes(dtype));
  for (uint64_t i = 0; i < n; ++i) {
    if (dtype == kFp32) {
      std::memcpy(&out[i * 4], &values[i], 4);
    } else {
      const uint16_t b = RoundToBf16(values[i]);
      std::memcpy(&out[i * 2], &b, 2);
    }
  }
  return out;
}

uint32_t BitsAt(const std::vector<uint8_t>& bytes, uint64_t i, int dtype) {
  if (dtype == kFp32) {
    uint32_t b;
    std::memcpy(&b, &bytes[i * 4], 4);
    return b;
  }
  uint16_t b;
  std::memcpy(&b, &bytes[i * 2], 2);
  return b;
}

float ValueAt(const std::vector<uint8_t>& bytes, uint64_t i, int dtype) {
  const uint32_t b = BitsAt(bytes, i, dtype);
  return dtype == kFp32 ? std::bit_cast<float>(b) : WidenBf16(static_cast<uint16_t>(b));
}

uint32_t ConvertBits(uint32_t bits, int src_dtype, int dst_dtype) {
  if (src_dtype == dst_dtype) return bits;
  if (src_dtype == kFp32) return RoundBitsToBf16(bits);
  return bits << 16;
}

bool IsNanBits(uint32_t bits, int dtype) {
  return dtype == kFp32 ? (bits & 0x7FFFFFFFu) > 0x7F800000u : (bits & 0x7FFFu) > 0x7F80u;
}

// ---------------------------------------------------------------------------------------------

class CudaKernelsTest : public testing::Test {
 protected:
  void SetUp() override { ASSERT_CUDA(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking)); }
  void TearDown() override {
    if (stream_ != nullptr) {
      EXPECT_EQ(cudaStreamDestroy(stream_), cudaSuccess);
    }
  }

  cudaStream_t stream_ = nullptr;
};

enum class ConvertOp { kCast, kPack, kUnpack };

// Uploads `src` (n elements) at element offset src_off, poisons the destination, runs the op
// into element offset dst_off and checks every destination element: converted, zero padding,
// poison untouched before and after.
void RunConvert(ConvertOp op, int src_dtype, int dst_dtype, const std::vector<uint8_t>& src,
                uint64_t n, uint64_t padded_n, uint64_t src_off, uint64_t dst_off,
                cudaStream_t stream) {
  SCOPED_TRACE(testing::Message() << "op " << static_cast<int>(op) << " dtypes " << src_dtype
                                  << "->" << dst_dtype << " n " << n << " padded_n " << padded_n
                                  << " offsets " << src_off << "," << dst_off);
  const uint64_t ss = ElemBytes(src_dtype);
  const uint64_t ds = ElemBytes(dst_dtype);
  const uint64_t dst_elems = dst_off + padded_n + kGuardElems;
  DeviceBuffer src_buf((src_off + n) * ss);
  DeviceBuffer dst_buf(dst_elems * ds);
  ASSERT_CUDA(src_buf.error());
  ASSERT_CUDA(dst_buf.error());
  ASSERT_CUDA(cudaMemsetAsync(dst_buf.at(), kPoisonByte, dst_elems * ds, stream));
  if (n > 0) {
    ASSERT_CUDA(
        cudaMemcpyAsync(src_buf.at(src_off * ss), src.data(), n * ss, cudaMemcpyDefault, stream));
  }
  const void* s = src_buf.at(src_off * ss);
  void* d = dst_buf.at(dst_off * ds);
  switch (op) {
    case ConvertOp::kCast:
      ASSERT_OK(
          src_dtype == kFp32
              ? Fp32ToBf16(static_cast<const float*>(s), static_cast<uint16_t*>(d), n, stream)
              : Bf16ToFp32(static_cast<const uint16_t*>(s), static_cast<float*>(d), n, stream));
      break;
    case ConvertOp::kPack:
      ASSERT_OK(PackPadded(s, src_dtype, n, d, dst_dtype, padded_n, stream));
      break;
    case ConvertOp::kUnpack:
      ASSERT_OK(Unpack(s, src_dtype, d, dst_dtype, n, stream));
      break;
  }
  ASSERT_CUDA(cudaStreamSynchronize(stream));
  std::vector<uint8_t> got(dst_elems * ds);
  ASSERT_CUDA(cudaMemcpy(got.data(), dst_buf.at(), got.size(), cudaMemcpyDeviceToHost));

  uint64_t mismatches = 0;
  uint64_t first = 0;
  uint32_t first_got = 0;
  uint32_t first_want = 0;
  for (uint64_t e = 0; e < dst_elems; ++e) {
    uint32_t want = PoisonBits(dst_dtype);
    if (e >= dst_off && e < dst_off + n) {
      want = ConvertBits(BitsAt(src, e - dst_off, src_dtype), src_dtype, dst_dtype);
    } else if (e >= dst_off + n && e < dst_off + padded_n) {
      want = 0;
    }
    const uint32_t g = BitsAt(got, e, dst_dtype);
    if (g != want) {
      if (mismatches++ == 0) {
        first = e;
        first_got = g;
        first_want = want;
      }
    }
  }
  EXPECT_EQ(mismatches, 0u) << "first at destination element " << first << " (offset " << dst_off
                            << "): got 0x" << std::hex << first_got << ", want 0x" << first_want;
}

// (src, dst) element offsets: equal ones keep both pointers co-aligned (vector path after a
// head of up to 7 elements); unequal ones hit the scalar fallback or a different head.
const std::pair<uint64_t, uint64_t> kOffsets[] = {
    {0, 0}, {1, 1}, {2, 2}, {3, 3}, {4, 4}, {5, 5}, {6, 6}, {7, 7},
    {0, 1}, {1, 0}, {0, 4}, {4, 0}, {3, 7}, {2, 6}, {5, 1}, {7, 2},
};

TEST_F(CudaKernelsTest, Fp32ToBf16BitIdenticalForEverySizeAndOffset) {
  for (uint64_t n : kSizes) {
    const auto src = RandomBits(n, kFp32, static_cast<uint32_t>(n) + 1);
    for (const auto& [so, dof] : kOffsets) {
      ASSERT_NO_FATAL_FAILURE(
          RunConvert(ConvertOp::kCast, kFp32, kBf16, src, n, n, so, dof, stream_));
    }
  }
}

TEST_F(CudaKernelsTest, Bf16ToFp32BitIdenticalForEverySizeAndOffset) {
  for (uint64_t n : kSizes) {
    const auto src = RandomBits(n, kBf16, static_cast<uint32_t>(n) + 2);
    for (const auto& [so, dof] : kOffsets) {
      ASSERT_NO_FATAL_FAILURE(
          RunConvert(ConvertOp::kCast, kBf16, kFp32, src, n, n, so, dof, stream_));
    }
  }
}

// Every sign/exponent/upper-mantissa pattern with the low halves that decide the rounding:
// exact, just above, just below, at and above the tie, all ones, and a random one.
TEST_F(CudaKernelsTest, Fp32ToBf16EveryHighHalfWithRoundingLowHalves) {
  const uint32_t kLows[] = {0x0000, 0x0001, 0x7FFF, 0x8000, 0x8001, 0xFFFF, 0x1234};
  std::vector<uint8_t> src;
  for (uint32_t hi = 0; hi < 0x10000; ++hi) {
    for (uint32_t lo : kLows) {
      const uint32_t bits = hi << 16 | lo;
      const auto* p = reinterpret_cast<const uint8_t*>(&bits);
      src.insert(src.end(), p, p + 4);
    }
  }
  const uint64_t n = src.size() / 4;
  ASSERT_NO_FATAL_FAILURE(RunConvert(ConvertOp::kCast, kFp32, kBf16, src, n, n, 0, 0, stream_));
  ASSERT_NO_FATAL_FAILURE(RunConvert(ConvertOp::kCast, kFp32, kBf16, src, n, n, 3, 1, stream_));
}

TEST_F(CudaKernelsTest, Bf16ToFp32EveryPattern) {
  std::vector<uint8_t> src(2 * 0x10000);
  for (uint32_t b = 0; b < 0x10000; ++b) {
    const uint16_t v = static_cast<uint16_t>(b);
    std::memcpy(&src[2 * b], &v, 2);
  }
  ASSERT_NO_FATAL_FAILURE(
      RunConvert(ConvertOp::kCast, kBf16, kFp32, src, 0x10000, 0x10000, 0, 0, stream_));
  ASSERT_NO_FATAL_FAILURE(
      RunConvert(ConvertOp::kCast, kBf16, kFp32, src, 0x10000, 0x10000, 5, 2, stream_));
}

TEST_F(CudaKernelsTest, PackPaddedEveryDtypePairZeroesPaddingOnly) {
  const std::pair<uint64_t, uint64_t> kPackOffsets[] = {{0, 0}, {1, 1}, {3, 0}, {0, 5}};
  const uint64_t kPads[] = {0, 1, 7, 64};
  for (int sd : {kFp32, kBf16}) {
    for (int dd : {kFp32, kBf16}) {
      for (uint64_t n : kSizes) {
        const auto src = RandomBits(n, sd, static_cast<uint32_t>(n * 4 + sd * 2 + dd));
        for (uint64_t pad : kPads) {
          for (const auto& [so, dof] : kPackOffsets) {
            ASSERT_NO_FATAL_FAILURE(
                RunConvert(ConvertOp::kPack, sd, dd, src, n, n + pad, so, dof, stream_));
          }
        }
      }
    }
  }
}

TEST_F(CudaKernelsTest, UnpackEveryDtypePairWritesOnlyN) {
  const std::pair<uint64_t, uint64_t> kUnpackOffsets[] = {{0, 0}, {2, 2}, {1, 0}, {0, 7}};
  for (int sd : {kFp32, kBf16}) {
    for (int dd : {kFp32, kBf16}) {
      for (uint64_t n : kSizes) {
        const auto src = RandomBits(n, sd, static_cast<uint32_t>(n * 8 + sd * 2 + dd));
        for (const auto& [so, dof] : kUnpackOffsets) {
          ASSERT_NO_FATAL_FAILURE(
              RunConvert(ConvertOp::kUnpack, sd, dd, src, n, n, so, dof, stream_));
        }
      }
    }
  }
}

// In place; the guard elements around x stay untouched.
void RunScale(int dtype, const std::vector<uint8_t>& x, uint64_t n, uint64_t off, float s,
              cudaStream_t stream) {
  SCOPED_TRACE(testing::Message() << "dtype " << dtype << " n " << n << " offset " << off << " s "
                                  << s);
  const uint64_t es = ElemBytes(dtype);
  const uint64_t elems = off + n + kGuardElems;
  DeviceBuffer buf(elems * es);
  ASSERT_CUDA(buf.error());
  ASSERT_CUDA(cudaMemsetAsync(buf.at(), kPoisonByte, elems * es, stream));
  if (n > 0) {
    ASSERT_CUDA(cudaMemcpyAsync(buf.at(off * es), x.data(), n * es, cudaMemcpyDefault, stream));
  }
  ASSERT_OK(dtype == kFp32 ? ScaleFp32(buf.at<float>(off * es), s, n, stream)
                           : ScaleBf16(buf.at<uint16_t>(off * es), s, n, stream));
  ASSERT_CUDA(cudaStreamSynchronize(stream));
  std::vector<uint8_t> got(elems * es);
  ASSERT_CUDA(cudaMemcpy(got.data(), buf.at(), got.size(), cudaMemcpyDeviceToHost));
  uint64_t mismatches = 0;
  uint64_t first = 0;
  for (uint64_t e = 0; e < elems; ++e) {
    const uint32_t g = BitsAt(got, e, dtype);
    bool ok;
    if (e < off || e >= off + n) {
      ok = g == PoisonBits(dtype);
    } else {
      const float v = ValueAt(x, e - off, dtype) * s;
      const uint32_t want = dtype == kFp32 ? std::bit_cast<uint32_t>(v) : RoundToBf16(v);
      // The GPU returns its canonical NaN for any NaN product; only NaN-ness is compared.
      ok = IsNanBits(want, dtype) ? IsNanBits(g, dtype) : g == want;
    }
    if (!ok && mismatches++ == 0) first = e;
  }
  EXPECT_EQ(mismatches, 0u) << "first at element " << first << " (offset " << off << ")";
}

TEST_F(CudaKernelsTest, ScaleMatchesCpuInPlace) {
  const float kScales[] = {0.5f, -3.0f, 1e-30f, 0.0f, 1.0f};
  for (int dtype : {kFp32, kBf16}) {
    for (uint64_t n : kSizes) {
      const auto x = RandomBits(n, dtype, static_cast<uint32_t>(n * 3 + dtype));
      for (uint64_t off = 0; off < 8; ++off) {
        for (float s : kScales) {
          ASSERT_NO_FATAL_FAILURE(RunScale(dtype, x, n, off, s, stream_));
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// GradStats.

struct CpuStats {
  long double sumsq = 0;
  uint64_t nonfinite = 0;
};

CpuStats StatsOnCpu(const std::vector<uint8_t>& x, uint64_t n, int dtype) {
  CpuStats r;
  for (uint64_t i = 0; i < n; ++i) {
    const float v = ValueAt(x, i, dtype);
    if (!std::isfinite(v)) {
      ++r.nonfinite;
      continue;
    }
    const long double d = v;
    r.sumsq += d * d;
  }
  return r;
}

// Uploads x at element offset `off` and runs GradStats on `stream` with a scratch buffer that
// starts as 0xFF bytes (it need not be zeroed) and is followed by a guard that must stay intact.
void RunStats(int dtype, const std::vector<uint8_t>& x, uint64_t n, uint64_t off,
              cudaStream_t stream, GradStatsResult* result) {
  const uint64_t es = ElemBytes(dtype);
  DeviceBuffer xbuf((off + n) * es);
  const uint64_t scratch_bytes = StatsScratchBytes(n);
  constexpr uint64_t kScratchGuard = 256;
  DeviceBuffer scratch(scratch_bytes + kScratchGuard);
  DeviceBuffer out(sizeof(GradStatsResult));
  ASSERT_CUDA(xbuf.error());
  ASSERT_CUDA(scratch.error());
  ASSERT_CUDA(out.error());
  if (n > 0) {
    ASSERT_CUDA(cudaMemcpyAsync(xbuf.at(off * es), x.data(), n * es, cudaMemcpyDefault, stream));
  }
  ASSERT_CUDA(cudaMemsetAsync(scratch.at(), 0xFF, scratch_bytes, stream));
  ASSERT_CUDA(cudaMemsetAsync(scratch.at(scratch_bytes), kPoisonByte, kScratchGuard, stream));
  ASSERT_CUDA(cudaMemsetAsync(out.at(), 0xFF, sizeof(GradStatsResult), stream));
  ASSERT_OK(GradStats(n > 0 ? xbuf.at(off * es) : nullptr, dtype, n, scratch.at(),
                      out.at<GradStatsResult>(), stream));
  ASSERT_CUDA(cudaStreamSynchronize(stream));
  ASSERT_CUDA(cudaMemcpy(result, out.at(), sizeof(*result), cudaMemcpyDeviceToHost));
  std::vector<uint8_t> guard(kScratchGuard);
  ASSERT_CUDA(
      cudaMemcpy(guard.data(), scratch.at(scratch_bytes), kScratchGuard, cudaMemcpyDeviceToHost));
  for (uint8_t b : guard) ASSERT_EQ(b, kPoisonByte) << "GradStats wrote past StatsScratchBytes";
}

TEST_F(CudaKernelsTest, GradStatsMatchesCpuSum) {
  std::vector<uint64_t> sizes(std::begin(kSizes), std::end(kSizes));
  sizes.push_back((1u << 24) + 11);  // a full grid of 1024 blocks
  for (int dtype : {kFp32, kBf16}) {
    for (uint64_t n : sizes) {
      for (uint64_t nonfinite : {0, 3}) {
        const auto x = RandomGradient(n, dtype, static_cast<uint32_t>(n + dtype), nonfinite);
        const CpuStats want = StatsOnCpu(x, n, dtype);
        for (uint64_t off : {0, 3}) {
          SCOPED_TRACE(testing::Message() << "dtype " << dtype << " n " << n << " offset " << off);
          GradStatsResult got{};
          ASSERT_NO_FATAL_FAILURE(RunStats(dtype, x, n, off, stream_, &got));
          EXPECT_EQ(got.nonfinite, want.nonfinite);
          if (want.sumsq == 0) {
            EXPECT_EQ(got.sumsq, 0.0);
          } else {
            const double rel = static_cast<double>(
                std::fabs((static_cast<long double>(got.sumsq) - want.sumsq) / want.sumsq));
            EXPECT_LT(rel, 1e-12) << "got " << got.sumsq << " want "
                                  << static_cast<double>(want.sumsq);
          }
        }
      }
    }
  }
}

TEST_F(CudaKernelsTest, GradStatsOfNothingWritesZeros) {
  GradStatsResult got{};
  ASSERT_NO_FATAL_FAILURE(RunStats(kFp32, {}, 0, 0, stream_, &got));
  EXPECT_EQ(got.sumsq, 0.0);
  EXPECT_EQ(got.nonfinite, 0u);
}

// The same bits for repeated launches, other streams (blocking, legacy default, per-thread
// default), other scratch buffers and any alignment of x.
TEST_F(CudaKernelsTest, GradStatsIsDeterministic) {
  cudaStream_t other = nullptr;
  ASSERT_CUDA(cudaStreamCreate(&other));
  struct StreamGuard {
    cudaStream_t s;
    ~StreamGuard() { cudaStreamDestroy(s); }
  } guard{other};
  const cudaStream_t kStreams[] = {other, cudaStreamLegacy, cudaStreamPerThread};
  for (int dtype : {kFp32, kBf16}) {
    for (uint64_t n : {uint64_t{(1u << 20) + 3}, uint64_t{(1u << 24) + 11}}) {
      SCOPED_TRACE(testing::Message() << "dtype " << dtype << " n " << n);
      const auto x = RandomGradient(n, dtype, 77, 2);
      GradStatsResult first{};
      ASSERT_NO_FATAL_FAILURE(RunStats(dtype, x, n, 0, stream_, &first));
      EXPECT_EQ(first.nonfinite, 2u);
      auto expect_same = [&](const GradStatsResult& r, const char* what) {
        EXPECT_EQ(std::bit_cast<uint64_t>(r.sumsq), std::bit_cast<uint64_t>(first.sumsq))
            << what << ": " << r.sumsq << " vs " << first.sumsq;
        EXPECT_EQ(r.nonfinite, first.nonfinite) << what;
      };

      // Five launches back to back on one stream, over one input and one scratch buffer.
      const uint64_t es = ElemBytes(dtype);
      DeviceBuffer xbuf(n * es);
      DeviceBuffer scratch(StatsScratchBytes(n));
      DeviceBuffer outs(5 * sizeof(GradStatsResult));
      ASSERT_CUDA(xbuf.error());
      ASSERT_CUDA(scratch.error());
      ASSERT_CUDA(outs.error());
      ASSERT_CUDA(cudaMemcpy(xbuf.at(), x.data(), n * es, cudaMemcpyHostToDevice));
      // From pageable memory cudaMemcpy may return before the DMA has landed, and stream_ is
      // non-blocking: without this the first launch can read a partly copied input.
      ASSERT_CUDA(cudaDeviceSynchronize());
      for (int r = 0; r < 5; ++r) {
        ASSERT_OK(
            GradStats(xbuf.at(), dtype, n, scratch.at(), outs.at<GradStatsResult>() + r, stream_));
      }
      ASSERT_CUDA(cudaStreamSynchronize(stream_));
      GradStatsResult repeated[5];
      ASSERT_CUDA(cudaMemcpy(repeated, outs.at(), sizeof(repeated), cudaMemcpyDeviceToHost));
      for (const auto& r : repeated) expect_same(r, "repeated launch");

      for (cudaStream_t s : kStreams) {
        GradStatsResult r{};
        ASSERT_NO_FATAL_FAILURE(RunStats(dtype, x, n, 0, s, &r));
        expect_same(r, "other stream");
      }
      for (uint64_t off = 1; off < 8; ++off) {
        GradStatsResult r{};
        ASSERT_NO_FATAL_FAILURE(RunStats(dtype, x, n, off, stream_, &r));
        expect_same(r, "misaligned x");
      }
    }
  }
}

TEST_F(CudaKernelsTest, GradStatsWritesHostMappedResult) {
  const uint64_t n = (1u << 20) + 3;
  const auto x = RandomGradient(n, kFp32, 5, 1);
  GradStatsResult want{};
  ASSERT_NO_FATAL_FAILURE(RunStats(kFp32, x, n, 0, stream_, &want));

  void* host = nullptr;
  ASSERT_CUDA(cudaHostAlloc(&host, sizeof(GradStatsResult), cudaHostAllocMapped));
  struct HostGuard {
    void* p;
    ~HostGuard() { cudaFreeHost(p); }
  } guard{host};
  void* mapped = nullptr;
  ASSERT_CUDA(cudaHostGetDevicePointer(&mapped, host, 0));
  std::memset(host, 0xFF, sizeof(GradStatsResult));
  DeviceBuffer xbuf(n * 4);
  DeviceBuffer scratch(StatsScratchBytes(n));
  ASSERT_CUDA(xbuf.error());
  ASSERT_CUDA(scratch.error());
  ASSERT_CUDA(cudaMemcpy(xbuf.at(), x.data(), n * 4, cudaMemcpyHostToDevice));
  ASSERT_CUDA(cudaDeviceSynchronize());  // see GradStatsIsDeterministic
  ASSERT_OK(
      GradStats(xbuf.at(), kFp32, n, scratch.at(), static_cast<GradStatsResult*>(mapped), stream_));
  ASSERT_CUDA(cudaStreamSynchronize(stream_));
  const auto* got = static_cast<const GradStatsResult*>(host);
  EXPECT_EQ(std::bit_cast<uint64_t>(got->sumsq), std::bit_cast<uint64_t>(want.sumsq));
  EXPECT_EQ(got->nonfinite, 1u);
}

TEST(CudaKernelsScratchTest, StatsScratchBytesIsBoundedAndNonDecreasing) {
  uint64_t prev = 0;
  for (uint64_t n : {uint64_t{0}, uint64_t{1}, uint64_t{8192}, uint64_t{8193}, uint64_t{1} << 20,
                     uint64_t{1} << 23, uint64_t{1} << 24, uint64_t{1} << 40}) {
    const uint64_t b = StatsScratchBytes(n);
    EXPECT_GE(b, prev) << n;
    EXPECT_LE(b, 16u + 16u * 1024u) << n;
    prev = b;
  }
}

TEST_F(CudaKernelsTest, RejectsBadArguments) {
  DeviceBuffer buf(4096);
  ASSERT_CUDA(buf.error());
  char* base = buf.at<char>();
  const auto invalid = [](const absl::Status& s) {
    return s.code() == absl::StatusCode::kInvalidArgument;
  };
  EXPECT_TRUE(invalid(PackPadded(base, 3, 4, base + 1024, kFp32, 4, stream_)));
  EXPECT_TRUE(invalid(PackPadded(base, kFp32, 4, base + 1024, 0, 4, stream_)));
  EXPECT_TRUE(invalid(PackPadded(base, kFp32, 8, base + 1024, kFp32, 7, stream_)));
  EXPECT_TRUE(invalid(Unpack(base, kFp32, base + 8, kBf16, 16, stream_)));  // overlap
  EXPECT_TRUE(invalid(Unpack(nullptr, kFp32, base, kBf16, 16, stream_)));
  EXPECT_TRUE(invalid(Fp32ToBf16(reinterpret_cast<const float*>(base + 2),
                                 reinterpret_cast<uint16_t*>(base + 1024), 4, stream_)));
  EXPECT_TRUE(invalid(ScaleBf16(reinterpret_cast<uint16_t*>(base + 1), 2.0f, 4, stream_)));
  EXPECT_TRUE(invalid(GradStats(base, 7, 4, base + 1024,
                                reinterpret_cast<GradStatsResult*>(base + 2048), stream_)));
  EXPECT_TRUE(invalid(GradStats(base, kFp32, 4, base + 1032,
                                reinterpret_cast<GradStatsResult*>(base + 2048), stream_)));
  EXPECT_TRUE(invalid(GradStats(base, kFp32, 4, base + 1024, nullptr, stream_)));
  // n == 0 needs no pointers.
  EXPECT_TRUE(Fp32ToBf16(nullptr, nullptr, 0, stream_).ok());
  EXPECT_TRUE(PackPadded(nullptr, kFp32, 0, nullptr, kBf16, 0, stream_).ok());
  ASSERT_CUDA(cudaStreamSynchronize(stream_));
}

// > 2^32 elements: every index and byte offset past 2^31 and 2^32 (element and byte) must be
// computed in 64 bits. The input is a constant with marked elements at those boundaries; the
// windows around them are checked exactly and the whole output through GradStats: the poison
// is NaN, so a single element left unwritten changes the non-finite count, and every partial
// sum of these squares is exact in FP64, so the sum is compared exactly.
TEST_F(CudaKernelsTest, MoreThan2To32ElementsCastAndStats) {
  const uint64_t n = (uint64_t{1} << 32) + 5;
  const uint64_t need = n * (2 + 4 + 2) + (uint64_t{2} << 30);
  size_t free_bytes = 0;
  size_t total_bytes = 0;
  ASSERT_CUDA(cudaMemGetInfo(&free_bytes, &total_bytes));
  if (free_bytes < need) {
    GTEST_SKIP() << "needs " << (need >> 30) << " GiB of device memory, " << (free_bytes >> 30)
                 << " GiB free";
  }
  DeviceBuffer src(n * 2);
  DeviceBuffer wide(n * 4);
  DeviceBuffer narrow(n * 2);
  DeviceBuffer scratch(StatsScratchBytes(n));
  DeviceBuffer out(sizeof(GradStatsResult));
  for (const DeviceBuffer* b : {&src, &wide, &narrow, &scratch, &out}) ASSERT_CUDA(b->error());

  constexpr uint16_t kFill = 0x3F3F;  // 0.74609375: its square has 16 significant bits
  const uint64_t kMarks[] = {0,
                             1,
                             (uint64_t{1} << 30) - 1,
                             uint64_t{1} << 30,  // FP32 byte offset 2^32
                             (uint64_t{1} << 31) - 1,
                             uint64_t{1} << 31,  // BF16 byte offset 2^32; int32 overflow
                             (uint64_t{1} << 31) + 1,
                             (uint64_t{1} << 32) - 1,
                             uint64_t{1} << 32,  // uint32 overflow
                             n - 2,
                             n - 1};
  std::vector<uint16_t> mark_bits;
  for (size_t k = 0; k < std::size(kMarks); ++k) {
    mark_bits.push_back(RoundToBf16(1.0f + static_cast<float>(k) / 8.0f));
  }
  mark_bits[5] = 0x7FC1;  // NaN with a payload
  mark_bits[8] = 0xFF80;  // -Inf
  ASSERT_CUDA(cudaMemsetAsync(src.at(), 0x3F, n * 2, stream_));
  for (size_t k = 0; k < std::size(kMarks); ++k) {
    ASSERT_CUDA(
        cudaMemcpyAsync(src.at(kMarks[k] * 2), &mark_bits[k], 2, cudaMemcpyHostToDevice, stream_));
  }
  ASSERT_CUDA(cudaStreamSynchronize(stream_));

  double want_sum = static_cast<double>(n - std::size(kMarks)) *
                    (static_cast<double>(WidenBf16(kFill)) * WidenBf16(kFill));
  for (uint16_t b : mark_bits) {
    const double v = WidenBf16(b);
    if (std::isfinite(v)) want_sum += v * v;
  }
  auto expected_bf16 = [&](uint64_t i) {
    for (size_t k = 0; k < std::size(kMarks); ++k) {
      if (kMarks[k] == i) return mark_bits[k];
    }
    return kFill;
  };
  auto check_windows = [&](const DeviceBuffer& buf, int dtype) {
    for (uint64_t m : kMarks) {
      const uint64_t lo = m < 2 ? 0 : m - 2;
      const uint64_t hi = m + 3 > n ? n : m + 3;
      std::vector<uint8_t> got((hi - lo) * ElemBytes(dtype));
      ASSERT_CUDA(cudaMemcpy(got.data(), buf.at(lo * ElemBytes(dtype)), got.size(),
                             cudaMemcpyDeviceToHost));
      for (uint64_t i = lo; i < hi; ++i) {
        const uint32_t want = dtype == kFp32 ? uint32_t{expected_bf16(i)} << 16 : expected_bf16(i);
        EXPECT_EQ(BitsAt(got, i - lo, dtype), want) << "dtype " << dtype << " element " << i;
      }
    }
  };
  auto check_stats = [&](const DeviceBuffer& buf, int dtype) {
    ASSERT_OK(GradStats(buf.at(), dtype, n, scratch.at(), out.at<GradStatsResult>(), stream_));
    ASSERT_CUDA(cudaStreamSynchronize(stream_));
    GradStatsResult got{};
    ASSERT_CUDA(cudaMemcpy(&got, out.at(), sizeof(got), cudaMemcpyDeviceToHost));
    EXPECT_EQ(got.nonfinite, 2u) << "dtype " << dtype;
    EXPECT_EQ(got.sumsq, want_sum) << "dtype " << dtype;
  };

  ASSERT_CUDA(cudaMemsetAsync(wide.at(), 0xFF, n * 4, stream_));
  ASSERT_OK(Bf16ToFp32(src.at<uint16_t>(), wide.at<float>(), n, stream_));
  ASSERT_CUDA(cudaStreamSynchronize(stream_));
  ASSERT_NO_FATAL_FAILURE(check_windows(wide, kFp32));
  ASSERT_NO_FATAL_FAILURE(check_stats(wide, kFp32));

  ASSERT_CUDA(cudaMemsetAsync(narrow.at(), 0xFF, n * 2, stream_));
  ASSERT_OK(Fp32ToBf16(wide.at<float>(), narrow.at<uint16_t>(), n, stream_));
  ASSERT_CUDA(cudaStreamSynchronize(stream_));
  ASSERT_NO_FATAL_FAILURE(check_windows(narrow, kBf16));
  ASSERT_NO_FATAL_FAILURE(check_stats(narrow, kBf16));
}

}  // namespace
}  // namespace slidedp::kernels::cuda
