// cuda_kernels_bench: throughput of the kernels of kernels/cuda/cuda_kernels.h, as JSON on
// stdout. Each kernel runs --warmup times, then --reps times between two CUDA events on one
// stream; GB/s counts the bytes the kernel must read and write (1 GB = 1e9 bytes). A device-to-
// device cudaMemcpyAsync of the FP32 array is the reference ("vs_memcpy" = kernel GB/s over
// memcpy GB/s). Exits 77 when no CUDA device is usable (CTest's skip code).
//
//   cuda_kernels_bench [--elements 256M] [--reps 20] [--warmup 3]
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "bench/adam/json_writer.h"
#include "kernels/cuda/cuda_kernels.h"

namespace {

namespace k = slidedp::kernels::cuda;

constexpr int kFp32 = 1;
constexpr int kBf16 = 2;

[[noreturn]] void Die(std::string_view what) {
  std::fprintf(stderr, "cuda_kernels_bench: %.*s\n", static_cast<int>(what.size()), what.data());
  std::exit(1);
}

void Check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    Die(std::string(what) + ": " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")");
  }
}

void Check(const absl::Status& s) {
  if (!s.ok()) Die(s.ToString());
}

// "256M", "1G", "70001": K/M/G are powers of 2^10.
uint64_t ParseCount(const char* text) {
  char* end = nullptr;
  const unsigned long long v = std::strtoull(text, &end, 10);
  if (end == text) Die(std::string("not a count: ") + text);
  uint64_t mult = 1;
  if (*end == 'K' || *end == 'k') mult = uint64_t{1} << 10;
  if (*end == 'M' || *end == 'm') mult = uint64_t{1} << 20;
  if (*end == 'G' || *end == 'g') mult = uint64_t{1} << 30;
  if (mult != 1) ++end;
  if (*end != '\0') Die(std::string("not a count: ") + text);
  return v * mult;
}

struct Options {
  uint64_t elements = uint64_t{256} << 20;
  int reps = 20;
  int warmup = 3;
};

Options ParseArgs(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string_view arg = argv[i];
    auto value = [&]() -> const char* {
      if (i + 1 >= argc) Die(std::string("missing value for ") + argv[i]);
      return argv[++i];
    };
    if (arg == "--elements") {
      o.elements = ParseCount(value());
    } else if (arg == "--reps") {
      o.reps = static_cast<int>(ParseCount(value()));
    } else if (arg == "--warmup") {
      o.warmup = static_cast<int>(ParseCount(value()));
    } else if (arg == "--help" || arg == "-h") {
      std::printf("usage: cuda_kernels_bench [--elements 256M] [--reps 20] [--warmup 3]\n");
      std::exit(0);
    } else {
      Die(std::string("unknown argument ") + argv[i]);
    }
  }
  if (o.elements == 0 || o.reps < 1 || o.warmup < 0) Die("need --elements > 0 and --reps > 0");
  return o;
}

struct Case {
  std::string name;
  uint64_t bytes;  // read + written per call
  std::function<void()> run;
};

}  // namespace

int main(int argc, char** argv) {
  const Options opt = ParseArgs(argc, argv);
  int device_count = 0;
  const cudaError_t e = cudaGetDeviceCount(&device_count);
  if (e != cudaSuccess || device_count == 0) {
    std::fprintf(stderr, "SKIP: no usable CUDA device (%s)\n",
                 e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
    return 77;
  }
  int device = 0;
  Check(cudaGetDevice(&device), "cudaGetDevice");
  cudaDeviceProp prop{};
  Check(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties");

  const uint64_t n = opt.elements;
  constexpr uint64_t kPad = 64;  // PackPadded's padding, as one shard rounding
  void* f32_a = nullptr;
  void* f32_b = nullptr;
  void* bf16_a = nullptr;
  void* bf16_b = nullptr;
  void* scratch = nullptr;
  void* out = nullptr;
  Check(cudaMalloc(&f32_a, (n + kPad) * 4), "cudaMalloc");
  Check(cudaMalloc(&f32_b, (n + kPad) * 4), "cudaMalloc");
  Check(cudaMalloc(&bf16_a, (n + kPad) * 2), "cudaMalloc");
  Check(cudaMalloc(&bf16_b, (n + kPad) * 2), "cudaMalloc");
  Check(cudaMalloc(&scratch, k::StatsScratchBytes(n)), "cudaMalloc");
  Check(cudaMalloc(&out, sizeof(k::GradStatsResult)), "cudaMalloc");
  // 0x3F bytes: finite values in both dtypes (0.747...), so scaling by 1 keeps them as they are.
  Check(cudaMemset(f32_a, 0x3F, (n + kPad) * 4), "cudaMemset");
  Check(cudaMemset(bf16_a, 0x3F, (n + kPad) * 2), "cudaMemset");
  cudaStream_t stream = nullptr;
  Check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");

  auto* fa = static_cast<float*>(f32_a);
  auto* fb = static_cast<float*>(f32_b);
  auto* ha = static_cast<uint16_t*>(bf16_a);
  auto* hb = static_cast<uint16_t*>(bf16_b);
  auto* res = static_cast<k::GradStatsResult*>(out);
  const std::vector<Case> cases = {
      {"memcpy_d2d_fp32", 8 * n,
       [&] { Check(cudaMemcpyAsync(fb, fa, n * 4, cudaMemcpyDeviceToDevice, stream), "memcpy"); }},
      {"fp32_to_bf16", 6 * n, [&] { Check(k::Fp32ToBf16(fa, hb, n, stream)); }},
      {"bf16_to_fp32", 6 * n, [&] { Check(k::Bf16ToFp32(ha, fb, n, stream)); }},
      // src one element in: the pointers cannot be co-aligned, so this is the scalar fallback.
      {"fp32_to_bf16_misaligned", 6 * (n - 1),
       [&] { Check(k::Fp32ToBf16(fa + 1, hb, n - 1, stream)); }},
      {"scale_fp32", 8 * n, [&] { Check(k::ScaleFp32(fb, 1.0f, n, stream)); }},
      {"scale_bf16", 4 * n, [&] { Check(k::ScaleBf16(hb, 1.0f, n, stream)); }},
      {"pack_padded_fp32_to_bf16", 4 * n + 2 * (n + kPad),
       [&] { Check(k::PackPadded(fa, kFp32, n, hb, kBf16, n + kPad, stream)); }},
      {"pack_padded_bf16_to_fp32", 2 * n + 4 * (n + kPad),
       [&] { Check(k::PackPadded(ha, kBf16, n, fb, kFp32, n + kPad, stream)); }},
      {"pack_padded_fp32_to_fp32", 4 * n + 4 * (n + kPad),
       [&] { Check(k::PackPadded(fa, kFp32, n, fb, kFp32, n + kPad, stream)); }},
      {"unpack_bf16_to_fp32", 6 * n, [&] { Check(k::Unpack(ha, kBf16, fb, kFp32, n, stream)); }},
      {"grad_stats_fp32", 4 * n, [&] { Check(k::GradStats(fa, kFp32, n, scratch, res, stream)); }},
      {"grad_stats_bf16", 2 * n, [&] { Check(k::GradStats(ha, kBf16, n, scratch, res, stream)); }},
  };

  cudaEvent_t start = nullptr;
  cudaEvent_t stop = nullptr;
  Check(cudaEventCreate(&start), "cudaEventCreate");
  Check(cudaEventCreate(&stop), "cudaEventCreate");
  struct Result {
    const Case* c;
    double ms;
    double gbps;
  };
  std::vector<Result> results;
  for (const Case& c : cases) {
    for (int i = 0; i < opt.warmup; ++i) c.run();
    Check(cudaEventRecord(start, stream), "cudaEventRecord");
    for (int i = 0; i < opt.reps; ++i) c.run();
    Check(cudaEventRecord(stop, stream), "cudaEventRecord");
    Check(cudaEventSynchronize(stop), "cudaEventSynchronize");
    float total_ms = 0;
    Check(cudaEventElapsedTime(&total_ms, start, stop), "cudaEventElapsedTime");
    const double ms = static_cast<double>(total_ms) / opt.reps;
    results.push_back({&c, ms, static_cast<double>(c.bytes) / (ms * 1e-3) / 1e9});
  }
  k::GradStatsResult stats{};
  Check(cudaMemcpy(&stats, out, sizeof(stats), cudaMemcpyDeviceToHost), "cudaMemcpy");

  const double memcpy_gbps = results.front().gbps;
  slidedp::bench::JsonWriter w;
  w.BeginObject();
  w.Field("bench", "cuda_kernels");
  w.Field("device", prop.name);
  w.Field("sm_count", prop.multiProcessorCount);
  w.Field("elements", n);
  w.Field("reps", opt.reps);
  w.Field("warmup", opt.warmup);
  w.Field("last_grad_stats_nonfinite", static_cast<uint64_t>(stats.nonfinite));
  w.Key("kernels").BeginArray();
  for (const Result& r : results) {
    w.BeginObject();
    w.Field("name", r.c->name);
    w.Field("bytes_per_call", r.c->bytes);
    w.Field("ms", r.ms);
    w.Field("gb_per_s", r.gbps);
    w.Field("vs_memcpy", r.gbps / memcpy_gbps);
    w.EndObject();
  }
  w.EndArray();
  w.EndObject();
  std::printf("%s\n", w.str().c_str());

  Check(cudaEventDestroy(start), "cudaEventDestroy");
  Check(cudaEventDestroy(stop), "cudaEventDestroy");
  Check(cudaStreamDestroy(stream), "cudaStreamDestroy");
  for (void* p : {f32_a, f32_b, bf16_a, bf16_b, scratch, out}) Check(cudaFree(p), "cudaFree");
  return 0;
}
