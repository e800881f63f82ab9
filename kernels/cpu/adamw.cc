// Run-time ISA detection and dispatch to the per-ISA kernel tables.

#include "kernels/cpu/adamw.h"

#include <cpuid.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <string_view>

#include "kernels/cpu/adamw_internal.h"

namespace slidedp::kernels {
namespace {

struct CpuFeatures {
  bool avx2_fma = false;
  bool avx512 = false;
  bool avx512_bf16 = false;
};

uint64_t ReadXcr0() {
  uint32_t eax = 0;
  uint32_t edx = 0;
  // xgetbv without -mxsave; only called after CPUID reports OSXSAVE.
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return (static_cast<uint64_t>(edx) << 32) | eax;
}

CpuFeatures DetectCpuFeatures() {
  CpuFeatures f;
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (__get_cpuid_count(1, 0, &eax, &ebx, &ecx, &edx) == 0) return f;
  const bool osxsave = (ecx & (1u << 27)) != 0;
  const bool avx = (ecx & (1u << 28)) != 0;
  const bool fma = (ecx & (1u << 12)) != 0;
  if (!osxsave || !avx) return f;
  const uint64_t xcr0 = ReadXcr0();
  // The OS must save XMM|YMM state (bits 1, 2), and for AVX-512 also opmask|ZMM_Hi256|Hi16_ZMM
  // (bits 5, 6, 7); otherwise the instructions fault even though CPUID lists them.
  const bool os_avx = (xcr0 & 0x6) == 0x6;
  const bool os_avx512 = (xcr0 & 0xE6) == 0xE6;
  if (!os_avx) return f;

  unsigned max_leaf = __get_cpuid_max(0, nullptr);
  if (max_leaf < 7) return f;
  __cpuid_count(7, 0, eax, ebx, ecx, edx);
  const unsigned leaf7_max_subleaf = eax;
  const bool avx2 = (ebx & (1u << 5)) != 0;
  const bool avx512f = (ebx & (1u << 16)) != 0;
  const bool avx512bw = (ebx & (1u << 30)) != 0;
  const bool avx512vl = (ebx & (1u << 31)) != 0;
  bool avx512_bf16 = false;
  if (leaf7_max_subleaf >= 1) {
    __cpuid_count(7, 1, eax, ebx, ecx, edx);
    avx512_bf16 = (eax & (1u << 5)) != 0;
  }
  f.avx2_fma = avx2 && fma;
  f.avx512 = f.avx2_fma && os_avx512 && avx512f && avx512bw && avx512vl;
  f.avx512_bf16 = f.avx512 && avx512_bf16;
  return f;
}

const CpuFeatures& Features() {
  static const CpuFeatures features = DetectCpuFeatures();
  return features;
}

Isa BestSupportedIsa() {
  const CpuFeatures& f = Features();
  if (f.avx512_bf16) return Isa::kAvx512Bf16;
  if (f.avx512) return Isa::kAvx512;
  if (f.avx2_fma) return Isa::kAvx2;
  return Isa::kScalar;
}

// Every path computes bit-identical results, so an ISA the CPU lacks is served by the best one it
// has rather than faulting.
const internal::KernelTable& Table(Isa isa) {
  if (!IsaSupported(isa)) isa = BestSupportedIsa();
  switch (isa) {
    case Isa::kAvx512Bf16:
      return internal::kAvx512Bf16Kernels;
    case Isa::kAvx512:
      return internal::kAvx512Kernels;
    case Isa::kAvx2:
      return internal::kAvx2Kernels;
    case Isa::kScalar:
      break;
  }
  return internal::kScalarKernels;
}

}  // namespace

std::string_view IsaName(Isa isa) {
  switch (isa) {
    case Isa::kScalar:
      return "scalar";
    case Isa::kAvx2:
      return "avx2";
    case Isa::kAvx512:
      return "avx512";
    case Isa::kAvx512Bf16:
      return "avx512bf16";
  }
  return "unknown";
}

std::optional<Isa> ParseIsa(std::string_view name) {
  for (Isa isa : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512, Isa::kAvx512Bf16}) {
    if (name == IsaName(isa)) return isa;
  }
  return std::nullopt;
}

bool IsaSupported(Isa isa) {
  const CpuFeatures& f = Features();
  switch (isa) {
    case Isa::kScalar:
      return true;
    case Isa::kAvx2:
      return f.avx2_fma;
    case Isa::kAvx512:
      return f.avx512;
    case Isa::kAvx512Bf16:
      return f.avx512_bf16;
  }
  return false;
}

Isa BestIsa() {
  const Isa best = BestSupportedIsa();
  // An unknown SLIDEDP_ISA value is ignored: the environment may only lower the choice.
  const char* env = std::getenv("SLIDEDP_ISA");
  if (env == nullptr) return best;
  const std::optional<Isa> requested = ParseIsa(env);
  if (!requested.has_value()) return best;
  return static_cast<uint8_t>(*requested) < static_cast<uint8_t>(best) ? *requested : best;
}

AdamWScalars MakeAdamWScalars(double lr, double beta1, double beta2, double eps,
                              double weight_decay, double grad_scale, uint64_t step) {
  const double t = static_cast<double>(step);
  const double bias_correction1 = 1.0 - std::pow(beta1, t);
  const double bias_correction2 = 1.0 - std::pow(beta2, t);
  AdamWScalars s;
  s.beta1 = static_cast<float>(beta1);
  s.beta2 = static_cast<float>(beta2);
  s.one_minus_beta1 = static_cast<float>(1.0 - beta1);
  s.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  s.eps = static_cast<float>(eps);
  s.decay_factor = static_cast<float>(1.0 - lr * weight_decay);
  s.step_size = static_cast<float>(lr / bias_correction1);
  s.inv_sqrt_bias_correction2 = static_cast<float>(1.0 / std::sqrt(bias_correction2));
  s.grad_scale = static_cast<float>(grad_scale);
  return s;
}

void AdamWUpdate(Isa isa, const AdamWScalars& s, const void* grad, GradType grad_type,
                 float* master, float* m, float* v, uint16_t* param_bf16, size_t n) {
  if (n == 0) return;
  Table(isa).adamw_update(s, grad, grad_type, master, m, v, param_bf16, n);
}

GradStats ComputeGradStats(Isa isa, const void* grad, GradType grad_type, size_t n) {
  if (n == 0) return GradStats{};
  return Table(isa).grad_stats(grad, grad_type, n);
}

GradStats CombineGradStats(const GradStats& a, const GradStats& b) {
  return GradStats{a.sum_squares + b.sum_squares, a.nonfinite + b.nonfinite};
}

void CastFp32ToBf16(Isa isa, const float* in, uint16_t* out, size_t n) {
  if (n == 0) return;
  Table(isa).cast_fp32_to_bf16(in, out, n);
}

void CastBf16ToFp32(Isa isa, const uint16_t* in, float* out, size_t n) {
  if (n == 0) return;
  Table(isa).cast_bf16_to_fp32(in, out, n);
}

}  // namespace slidedp::kernels
