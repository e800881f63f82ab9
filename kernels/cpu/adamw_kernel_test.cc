// Every SIMD path against the scalar reference, element-wise and bit for bit; the scalar reference
// against an independent double-precision emulation of the contract and against textbook AdamW;
// threaded against serial.

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "common/thread_pool.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/cpu/adamw.h"
#include "kernels/cpu/adamw_internal.h"
#include "kernels/cpu/bf16.h"

namespace slidedp::kernels {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kDenormMin = std::numeric_limits<float>::denorm_min();
constexpr float kFltMin = std::numeric_limits<float>::min();

uint32_t Bits(float x) { return std::bit_cast<uint32_t>(x); }
float FromBits(uint32_t b) { return std::bit_cast<float>(b); }

// Distance in units in the last place between two floats on the ordered line of finite values
// (+0 and -0 are 0 apart). NaN against anything is "infinitely" far unless both bit patterns are
// equal.
int64_t UlpDistance(float a, float b) {
  if (std::isnan(a) || std::isnan(b)) {
    return Bits(a) == Bits(b) ? 0 : std::numeric_limits<int64_t>::max();
  }
  const auto ordered = [](float x) {
    const uint32_t bits = Bits(x);
    const int64_t magnitude = bits & 0x7FFFFFFFu;
    return (bits & 0x80000000u) != 0 ? -magnitude : magnitude;
  };
  const int64_t d = ordered(a) - ordered(b);
  return d < 0 ? -d : d;
}

TEST(UlpDistanceTest, Basics) {
  EXPECT_EQ(UlpDistance(1.0f, 1.0f), 0);
  EXPECT_EQ(UlpDistance(1.0f, std::nextafter(1.0f, 2.0f)), 1);
  EXPECT_EQ(UlpDistance(0.0f, -0.0f), 0);
  EXPECT_EQ(UlpDistance(kDenormMin, -kDenormMin), 2);
  EXPECT_EQ(UlpDistance(std::numeric_limits<float>::max(), kInf), 1);
  EXPECT_EQ(UlpDistance(std::nanf(""), 1.0f), std::numeric_limits<int64_t>::max());
}

// Bit-identical arrays; on failure names the first mismatching element.
testing::AssertionResult SameFloats(const float* expected, const float* actual, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    const int64_t ulp = UlpDistance(expected[i], actual[i]);
    if (Bits(expected[i]) != Bits(actual[i]) || ulp != 0) {
      // AssertionResult formats each << separately, so manipulators go through a stream.
      std::ostringstream message;
      message << "element " << i << " of " << n << ": expected " << expected[i] << " (0x"
              << std::hex << Bits(expected[i]) << "), got " << actual[i] << " (0x"
              << Bits(actual[i]) << std::dec << "), " << ulp << " ulp apart";
      return testing::AssertionFailure() << message.str();
    }
  }
  return testing::AssertionSuccess();
}

testing::AssertionResult SameHalves(const uint16_t* expected, const uint16_t* actual, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    if (expected[i] != actual[i]) {
      std::ostringstream message;
      message << "element " << i << " of " << n << ": expected 0x" << std::hex << expected[i]
              << ", got 0x" << actual[i];
      return testing::AssertionFailure() << message.str();
    }
  }
  return testing::AssertionSuccess();
}

bool SameDouble(double a, double b) {
  return std::bit_cast<uint64_t>(a) == std::bit_cast<uint64_t>(b);
}

// ---------------------------------------------------------------------------------------------
// ISA selection.

TEST(IsaTest, NamesRoundTrip) {
  for (Isa isa : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512, Isa::kAvx512Bf16}) {
    ASSERT_TRUE(ParseIsa(IsaName(isa)).has_value());
    EXPECT_EQ(*ParseIsa(IsaName(isa)), isa);
  }
  EXPECT_FALSE(ParseIsa("avx1024").has_value());
  EXPECT_FALSE(ParseIsa("").has_value());
}

TEST(IsaTest, BestIsaIsSupportedAndEnvOnlyLowersIt) {
  unsetenv("SLIDEDP_ISA");
  const Isa best = BestIsa();
  EXPECT_TRUE(IsaSupported(best));
  EXPECT_TRUE(IsaSupported(Isa::kScalar));
  // Support is monotone: a higher path implies the lower ones.
  if (IsaSupported(Isa::kAvx512Bf16)) {
    EXPECT_TRUE(IsaSupported(Isa::kAvx512));
  }
  if (IsaSupported(Isa::kAvx512)) {
    EXPECT_TRUE(IsaSupported(Isa::kAvx2));
  }

  setenv("SLIDEDP_ISA", "scalar", 1);
  EXPECT_EQ(BestIsa(), Isa::kScalar);
  setenv("SLIDEDP_ISA", "avx512bf16", 1);
  EXPECT_EQ(BestIsa(), best);  // never raised past the CPU
  setenv("SLIDEDP_ISA", "bogus", 1);
  EXPECT_EQ(BestIsa(), best);
  if (IsaSupported(Isa::kAvx2)) {
    setenv("SLIDEDP_ISA", "avx2", 1);
    EXPECT_EQ(BestIsa(), Isa::kAvx2);
  }
  unsetenv("SLIDEDP_ISA");
  EXPECT_EQ(BestIsa(), best);
}

TEST(AdamWScalarsTest, ComputedInDouble) {
  const AdamWScalars s = MakeAdamWScalars(1e-3, 0.9, 0.999, 1e-8, 0.1, 0.25, 3);
  EXPECT_EQ(s.beta1, 0.9f);
  EXPECT_EQ(s.beta2, 0.999f);
  EXPECT_EQ(s.one_minus_beta1, static_cast<float>(1.0 - 0.9));
  EXPECT_EQ(s.one_minus_beta2, static_cast<float>(1.0 - 0.999));
  EXPECT_EQ(s.eps, 1e-8f);
  EXPECT_EQ(s.decay_factor, static_cast<float>(1.0 - 1e-3 * 0.1));
  EXPECT_EQ(s.step_size, static_cast<float>(1e-3 / (1.0 - 0.9 * 0.9 * 0.9)));
  EXPECT_EQ(s.inv_sqrt_bias_correction2,
            static_cast<float>(1.0 / std::sqrt(1.0 - 0.999 * 0.999 * 0.999)));
  EXPECT_EQ(s.grad_scale, 0.25f);
}

// ---------------------------------------------------------------------------------------------
// The scalar reference against an independent emulation of the contract in double.

// Float FMA from double arithmetic: a*b is exact in double; a*b + c is computed with round-to-odd
// (TwoSum gives the exact error), which makes the final rounding to float correct (53 >= 24 + 2).
float EmulatedFma(float a, float b, float c) {
  const double p = static_cast<double>(a) * static_cast<double>(b);
  const double s = p + static_cast<double>(c);
  if (!std::isfinite(s)) return static_cast<float>(s);
  const double bp = s - p;
  const double err = (p - (s - bp)) + (static_cast<double>(c) - bp);
  double odd = s;
  if (err != 0 && (std::bit_cast<uint64_t>(s) & 1) == 0) {
    odd = std::nextafter(s, err > 0 ? std::numeric_limits<double>::infinity()
                                    : -std::numeric_limits<double>::infinity());
  }
  return static_cast<float>(odd);
}

// Each step rounded to float once, as the contract specifies. float(double op double) is the
// correctly rounded float result for *, / and sqrt of floats (53 >= 2 * 24 + 2).
struct Element {
  float master, m, v;
  uint16_t out;
};
Element ContractInDouble(const AdamWScalars& s, float grad, float master, float m, float v) {
  const auto mul = [](float a, float b) {
    return static_cast<float>(static_cast<double>(a) * static_cast<double>(b));
  };
  const float g = mul(grad, s.grad_scale);
  const float p = mul(master, s.decay_factor);
  const float m_new = EmulatedFma(s.one_minus_beta1, g, mul(s.beta1, m));
  const float v_new = EmulatedFma(mul(s.one_minus_beta2, g), g, mul(s.beta2, v));
  const float root = static_cast<float>(std::sqrt(static_cast<double>(v_new)));
  const float denom = EmulatedFma(root, s.inv_sqrt_bias_correction2, s.eps);
  const float ratio = static_cast<float>(static_cast<double>(m_new) / static_cast<double>(denom));
  const float master_new = EmulatedFma(-s.step_size, ratio, p);
  // BF16 by hand: nearest of the two neighbouring BF16 values, ties to even mantissa.
  const uint32_t bits = Bits(master_new);
  uint16_t out = static_cast<uint16_t>(bits >> 16);
  const uint32_t rest = bits & 0xFFFFu;
  if (rest > 0x8000u || (rest == 0x8000u && (out & 1) != 0)) ++out;
  return Element{master_new, m_new, v_new, out};
}

TEST(AdamWScalarTest, KnownAnswerForOneElementComputedInDouble) {
  const AdamWScalars s = MakeAdamWScalars(1e-2, 0.9, 0.999, 1e-8, 0.01, 1.0, 1);
  const float grad = 0.5f;
  float master = 1.0f;
  float m = 0.0f;
  float v = 0.0f;
  uint16_t out = 0;
  AdamWUpdate(Isa::kScalar, s, &grad, GradType::kFp32, &master, &m, &v, &out, 1);

  // Step 1 of AdamW from zero moments: m = 0.1 * 0.5, v = 0.001 * 0.25, and the bias-corrected
  // update is lr * sign(g) up to eps: 1 * (1 - 1e-4) - 1e-2 * 0.05/0.1 / (0.5 + 1e-8).
  const double m_exact = 0.1 * 0.5;
  const double v_exact = 0.001 * 0.25;
  const double master_exact =
      1.0 * (1.0 - 1e-2 * 0.01) -
      1e-2 / (1.0 - 0.9) * m_exact / (std::sqrt(v_exact) / std::sqrt(1.0 - 0.999) + 1e-8);
  EXPECT_NEAR(m, m_exact, 1e-8);
  EXPECT_NEAR(v, v_exact, 1e-10);
  EXPECT_NEAR(master, master_exact, 1e-7);
  EXPECT_NEAR(master, 0.9899, 1e-6);
  EXPECT_EQ(out, 0x3F7D);  // 0.98828125 and 0.9921875 are the BF16 neighbours; 0.9899 -> lower

  // And bit for bit against the emulated contract.
  const Element e = ContractInDouble(s, grad, 1.0f, 0.0f, 0.0f);
  EXPECT_EQ(Bits(master), Bits(e.master));
  EXPECT_EQ(Bits(m), Bits(e.m));
  EXPECT_EQ(Bits(v), Bits(e.v));
  EXPECT_EQ(out, e.out);
}

TEST(AdamWScalarTest, MatchesDoubleEmulationOfContract) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  std::uniform_real_distribution<float> decade(-8.0f, 2.0f);
  const size_t n = 20000;
  std::vector<float> grad(n), master(n), m(n), v(n);
  for (size_t i = 0; i < n; ++i) {
    grad[i] = unit(rng) * std::pow(10.0f, decade(rng));
    master[i] = unit(rng);
    m[i] = unit(rng) * 1e-2f;
    v[i] = std::fabs(unit(rng)) * 1e-4f;
  }
  for (uint64_t step = 1; step <= 3; ++step) {
    const AdamWScalars s = MakeAdamWScalars(1e-3, 0.9, 0.999, 1e-8, 0.01, 0.5, step);
    std::vector<Element> expected(n);
    for (size_t i = 0; i < n; ++i)
      expected[i] = ContractInDouble(s, grad[i], master[i], m[i], v[i]);
    std::vector<uint16_t> out(n);
    AdamWUpdate(Isa::kScalar, s, grad.data(), GradType::kFp32, master.data(), m.data(), v.data(),
                out.data(), n);
    for (size_t i = 0; i < n; ++i) {
      ASSERT_EQ(Bits(master[i]), Bits(expected[i].master)) << "step " << step << " element " << i;
      ASSERT_EQ(Bits(m[i]), Bits(expected[i].m)) << "step " << step << " element " << i;
      ASSERT_EQ(Bits(v[i]), Bits(expected[i].v)) << "step " << step << " element " << i;
      ASSERT_EQ(out[i], expected[i].out) << "step " << step << " element " << i;
    }
  }
}

// The contract (FP32 with its rounding steps) against textbook decoupled-weight-decay AdamW in
// double, as torch.optim.AdamW writes it, over 10 steps.
TEST(AdamWScalarTest, ContractWithinOneMillionthOfDoubleAdamWOverTenSteps) {
  const double lr = 1e-3, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, wd = 0.01, grad_scale = 0.5;
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  const size_t n = 4096;
  std::vector<float> master(n), m(n, 0.0f), v(n, 0.0f);
  std::vector<double> master_d(n), m_d(n, 0.0), v_d(n, 0.0);
  for (size_t i = 0; i < n; ++i) {
    // Away from zero so that a relative bound on the parameters is meaningful.
    master[i] = (0.5f + std::fabs(unit(rng))) * (unit(rng) < 0 ? -1.0f : 1.0f);
    master_d[i] = master[i];
  }
  std::vector<float> grad(n);
  for (uint64_t step = 1; step <= 10; ++step) {
    for (size_t i = 0; i < n; ++i) grad[i] = unit(rng);
    const AdamWScalars s = MakeAdamWScalars(lr, beta1, beta2, eps, wd, grad_scale, step);
    AdamWUpdate(Isa::kScalar, s, grad.data(), GradType::kFp32, master.data(), m.data(), v.data(),
                nullptr, n);
    const double bc1 = 1.0 - std::pow(beta1, static_cast<double>(step));
    const double bc2 = 1.0 - std::pow(beta2, static_cast<double>(step));
    for (size_t i = 0; i < n; ++i) {
      const double g = static_cast<double>(grad[i]) * grad_scale;
      master_d[i] *= 1.0 - lr * wd;
      m_d[i] = beta1 * m_d[i] + (1.0 - beta1) * g;
      v_d[i] = beta2 * v_d[i] + (1.0 - beta2) * g * g;
      const double denom = std::sqrt(v_d[i]) / std::sqrt(bc2) + eps;
      master_d[i] -= lr / bc1 * m_d[i] / denom;
    }
    for (size_t i = 0; i < n; ++i) {
      ASSERT_LE(std::fabs(master[i] - master_d[i]), 1e-6 * std::fabs(master_d[i]))
          << "step " << step << " element " << i;
      ASSERT_LE(std::fabs(v[i] - v_d[i]), 1e-6 * v_d[i]) << "step " << step << " element " << i;
      // m can cancel to near zero; bound it by the size of the gradients that built it.
      ASSERT_LE(std::fabs(m[i] - m_d[i]), 1e-6 * grad_scale) << "step " << step << " element " << i;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// SIMD paths against the scalar reference.

class IsaPathTest : public testing::TestWithParam<Isa> {
 protected:
  void SetUp() override {
    if (!IsaSupported(GetParam())) {
      GTEST_SKIP() << "ISA " << IsaName(GetParam()) << " is not supported on this CPU";
    }
  }
};

std::string IsaParamName(const testing::TestParamInfo<Isa>& info) {
  return std::string(IsaName(info.param));
}

// Arrays of one problem at chosen element offsets from a 64-byte aligned base, with a guard
// region after each array that must stay untouched.
constexpr size_t kGuard = 40;
constexpr uint16_t kPoison16 = 0xDEAD;
constexpr uint32_t kPoison32 = 0x7FBADBAD;  // a NaN pattern no kernel produces

template <typename T>
class Buffer {
 public:
  Buffer(size_t n, size_t offset, T poison) : n_(n), offset_(offset) {
    const size_t bytes = ((n + offset + kGuard) * sizeof(T) + 63) / 64 * 64;
    storage_ = static_cast<T*>(std::aligned_alloc(64, bytes));
    for (size_t i = 0; i < n + offset + kGuard; ++i) storage_[i] = poison;
  }
  ~Buffer() { std::free(storage_); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  T* data() { return storage_ + offset_; }
  const T* data() const { return storage_ + offset_; }
  T& operator[](size_t i) { return data()[i]; }
  size_t size() const { return n_; }
  bool GuardsIntact(T poison) const {
    for (size_t i = 0; i < offset_; ++i) {
      if (std::memcmp(&storage_[i], &poison, sizeof(T)) != 0) return false;
    }
    for (size_t i = 0; i < kGuard; ++i) {
      if (std::memcmp(&storage_[offset_ + n_ + i], &poison, sizeof(T)) != 0) return false;
    }
    return true;
  }

 private:
  size_t n_;
  size_t offset_;
  T* storage_;
};

struct Offsets {
  size_t grad, master, m, v, out;
};

struct Problem {
  Problem(size_t n, const Offsets& o)
      : grad32(n, o.grad, FromBits(kPoison32)),
        grad16(n, o.grad, kPoison16),
        master(n, o.master, FromBits(kPoison32)),
        m(n, o.m, FromBits(kPoison32)),
        v(n, o.v, FromBits(kPoison32)),
        out(n, o.out, kPoison16) {}
  Buffer<float> grad32;
  Buffer<uint16_t> grad16;
  Buffer<float> master, m, v;
  Buffer<uint16_t> out;
};

void FillRandom(Problem& p, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  std::uniform_real_distribution<float> decade(-7.0f, 1.0f);
  for (size_t i = 0; i < p.master.size(); ++i) {
    p.grad32[i] = unit(rng) * std::pow(10.0f, decade(rng));
    p.grad16[i] = RoundToBf16(p.grad32[i]);
    p.master[i] = unit(rng) * 0.1f;
    p.m[i] = unit(rng) * 1e-3f;
    p.v[i] = std::fabs(unit(rng)) * 1e-6f;
  }
}

void CopyState(Problem& dst, Problem& src) {
  for (size_t i = 0; i < src.master.size(); ++i) {
    dst.grad32[i] = src.grad32[i];
    dst.grad16[i] = src.grad16[i];
    dst.master[i] = src.master[i];
    dst.m[i] = src.m[i];
    dst.v[i] = src.v[i];
  }
}

void RunUpdate(Isa isa, const AdamWScalars& s, GradType type, Problem& p, bool with_out) {
  const void* grad = type == GradType::kBf16 ? static_cast<const void*>(p.grad16.data())
                                             : static_cast<const void*>(p.grad32.data());
  AdamWUpdate(isa, s, grad, type, p.master.data(), p.m.data(), p.v.data(),
              with_out ? p.out.data() : nullptr, p.master.size());
}

// Runs `steps` steps on the reference and on `isa` from the same state and compares everything,
// guards included.
void ExpectPathMatchesScalar(Isa isa, size_t n, const Offsets& o, GradType type, bool with_out,
                             Problem* ref, Problem* got, int steps = 3) {
  for (int step = 1; step <= steps; ++step) {
    SCOPED_TRACE(testing::Message()
                 << "n=" << n << " grad=" << (type == GradType::kBf16 ? "bf16" : "fp32")
                 << " offsets(grad,master,m,v,out)=" << o.grad << "," << o.master << "," << o.m
                 << "," << o.v << "," << o.out << " out=" << with_out << " step=" << step);
    const AdamWScalars s = MakeAdamWScalars(1e-3, 0.9, 0.999, 1e-8, 0.01, 0.5, step);
    RunUpdate(Isa::kScalar, s, type, *ref, with_out);
    RunUpdate(isa, s, type, *got, with_out);
    ASSERT_TRUE(SameFloats(ref->master.data(), got->master.data(), n));
    ASSERT_TRUE(SameFloats(ref->m.data(), got->m.data(), n));
    ASSERT_TRUE(SameFloats(ref->v.data(), got->v.data(), n));
    ASSERT_TRUE(SameHalves(ref->out.data(), got->out.data(), n));
    ASSERT_TRUE(got->master.GuardsIntact(FromBits(kPoison32)));
    ASSERT_TRUE(got->m.GuardsIntact(FromBits(kPoison32)));
    ASSERT_TRUE(got->v.GuardsIntact(FromBits(kPoison32)));
    ASSERT_TRUE(got->out.GuardsIntact(kPoison16));
    if (!with_out) {
      for (size_t i = 0; i < n; ++i) ASSERT_EQ(got->out[i], kPoison16) << "output written";
    }
  }
}

void CheckSize(Isa isa, size_t n, const Offsets& o, uint32_t seed, int steps = 3) {
  for (GradType type : {GradType::kBf16, GradType::kFp32}) {
    for (bool with_out : {true, false}) {
      Problem ref(n, o);
      Problem got(n, o);
      FillRandom(ref, seed);
      CopyState(got, ref);
      ExpectPathMatchesScalar(isa, n, o, type, with_out, &ref, &got, steps);
      if (testing::Test::HasFatalFailure()) return;
    }
  }
}

TEST_P(IsaPathTest, AdamWMatchesScalarForSizesZeroTo300) {
  for (size_t n = 0; n <= 300; ++n) {
    CheckSize(GetParam(), n, Offsets{0, 0, 0, 0, 0}, static_cast<uint32_t>(n));
    if (HasFatalFailure()) return;
    CheckSize(GetParam(), n, Offsets{1, 3, 5, 7, 1}, static_cast<uint32_t>(n) + 1000);
    if (HasFatalFailure()) return;
  }
}

TEST_P(IsaPathTest, AdamWMatchesScalarForLargeOddSizes) {
  // Around the streaming-store threshold and well past it, so that the head peel, the streamed
  // body and every tail length run.
  const size_t threshold = internal::kStreamingStoreMinElements;
  for (size_t n : {size_t{1023}, size_t{4097}, size_t{65519}, threshold - 1, threshold,
                   threshold + 1, threshold + 31, 3 * threshold + 17}) {
    CheckSize(GetParam(), n, Offsets{0, 0, 0, 0, 0}, static_cast<uint32_t>(n), 2);
    if (HasFatalFailure()) return;
    CheckSize(GetParam(), n, Offsets{3, 1, 2, 5, 9}, static_cast<uint32_t>(n) + 1, 2);
    if (HasFatalFailure()) return;
  }
}

TEST_P(IsaPathTest, AdamWMatchesScalarForEveryOutputAlignment) {
  const size_t n = internal::kStreamingStoreMinElements + 45;
  for (size_t out_offset = 0; out_offset < 32; ++out_offset) {
    Offsets o{out_offset % 3, out_offset, out_offset % 5, out_offset % 7, out_offset};
    Problem ref(n, o);
    Problem got(n, o);
    FillRandom(ref, static_cast<uint32_t>(out_offset));
    CopyState(got, ref);
    ExpectPathMatchesScalar(GetParam(), n, o, GradType::kBf16, true, &ref, &got, 1);
    if (HasFatalFailure()) return;
  }
}

// Values that exercise the BF16 rounding and the IEEE special cases of the update. Each element
// has at most one NaN input: with NaNs of different payloads in several operands, x86 returns the
// payload of the operand in a given instruction position, which is not part of the contract.
std::vector<float> SpecialMasters() {
  std::vector<float> values = {0.0f,
                               -0.0f,
                               kDenormMin,
                               -kDenormMin,
                               kFltMin,
                               -kFltMin,
                               kFltMin / 2,
                               -kFltMin / 3,
                               FromBits(0x007FFFFF),
                               FromBits(0x807FFFFF),
                               FromBits(0x00008000),
                               FromBits(0x00018000),
                               kInf,
                               -kInf,
                               std::nanf(""),
                               -std::nanf(""),
                               FromBits(0x7F800001),
                               FromBits(0xFF812345),
                               FromBits(0x7FC0ABCD),
                               std::numeric_limits<float>::max(),
                               -std::numeric_limits<float>::max(),
                               1.0f,
                               FromBits(0x3F808000),
                               FromBits(0x3F818000),
                               FromBits(0x3F807FFF),
                               FromBits(0x3F808001)};
  return values;
}

TEST_P(IsaPathTest, AdamWSpecialValuesMatchScalar) {
  const std::vector<float> specials = SpecialMasters();
  for (size_t n : {specials.size() * 3, size_t{777}, internal::kStreamingStoreMinElements + 99}) {
    for (GradType type : {GradType::kBf16, GradType::kFp32}) {
      Problem ref(n, Offsets{0, 0, 0, 0, 0});
      Problem got(n, Offsets{0, 0, 0, 0, 0});
      FillRandom(ref, 5);
      for (size_t i = 0; i < n; ++i) {
        const float special = specials[i % specials.size()];
        switch ((i / specials.size()) % 3) {
          case 0:  // special master, zero gradient and moments: the master passes through
            ref.master[i] = special;
            ref.grad32[i] = 0.0f;
            ref.grad16[i] = 0;
            ref.m[i] = 0.0f;
            ref.v[i] = 0.0f;
            break;
          case 1:  // special master with a live update
            ref.master[i] = special;
            break;
          default:  // special gradient
            ref.grad32[i] = special;
            ref.grad16[i] = RoundToBf16(special);
            break;
        }
      }
      CopyState(got, ref);
      ExpectPathMatchesScalar(GetParam(), n, Offsets{0, 0, 0, 0, 0}, type, true, &ref, &got, 2);
      if (HasFatalFailure()) return;
    }
  }
}

// ---- Casts.

void ExpectCastMatchesScalar(Isa isa, const std::vector<float>& in) {
  std::vector<uint16_t> ref(in.size(), kPoison16);
  std::vector<uint16_t> got(in.size(), kPoison16);
  CastFp32ToBf16(Isa::kScalar, in.data(), ref.data(), in.size());
  CastFp32ToBf16(isa, in.data(), got.data(), in.size());
  ASSERT_TRUE(SameHalves(ref.data(), got.data(), in.size()));
}

TEST(CastScalarTest, RoundToBf16Rule) {
  EXPECT_EQ(RoundToBf16(1.0f), 0x3F80);
  EXPECT_EQ(RoundToBf16(FromBits(0x3F808000)), 0x3F80);  // tie, even stays
  EXPECT_EQ(RoundToBf16(FromBits(0x3F818000)), 0x3F82);  // tie, odd rounds up
  EXPECT_EQ(RoundToBf16(FromBits(0x3F808001)), 0x3F81);
  EXPECT_EQ(RoundToBf16(FromBits(0x3F807FFF)), 0x3F80);
  EXPECT_EQ(RoundToBf16(kDenormMin), 0x0000);
  EXPECT_EQ(RoundToBf16(FromBits(0x00018000)), 0x0002);  // denormal tie, odd rounds up
  EXPECT_EQ(RoundToBf16(FromBits(0x007FFFFF)), 0x0080);  // largest denormal rounds to FLT_MIN
  EXPECT_EQ(RoundToBf16(-0.0f), 0x8000);
  EXPECT_EQ(RoundToBf16(std::numeric_limits<float>::max()), 0x7F80);  // overflow to +Inf
  EXPECT_EQ(RoundToBf16(-kInf), 0xFF80);
  EXPECT_EQ(RoundToBf16(FromBits(0x7F800001)), 0x7FC0);  // signalling NaN is quieted
  EXPECT_EQ(RoundToBf16(FromBits(0xFF812345)), 0xFFC1);  // sign and upper payload kept
  EXPECT_EQ(RoundToBf16(FromBits(0x7FFFFFFF)), 0x7FFF);  // never rounds a NaN into Inf/0
  for (uint32_t b = 0; b < 0x10000; ++b) {
    const uint16_t h = static_cast<uint16_t>(b);
    const float f = Bf16ToFp32(h);
    if (!std::isnan(f)) {
      EXPECT_EQ(RoundToBf16(f), h);
    }
  }
}

TEST_P(IsaPathTest, CastFp32ToBf16MatchesScalarOnEverySpecialPattern) {
  // Every pattern with exponent 0 (zeros, denormals), 255 (Inf, NaN), 1 and 254, both signs.
  std::vector<float> in;
  in.reserve(size_t{1} << 25);
  for (uint32_t exponent : {0u, 1u, 254u, 255u}) {
    for (uint32_t sign = 0; sign < 2; ++sign) {
      in.clear();
      for (uint32_t mantissa = 0; mantissa < (1u << 23); ++mantissa) {
        in.push_back(FromBits((sign << 31) | (exponent << 23) | mantissa));
      }
      ExpectCastMatchesScalar(GetParam(), in);
      if (HasFatalFailure()) return;
    }
  }
}

TEST_P(IsaPathTest, CastFp32ToBf16MatchesScalarOnRandomPatternsAndSizes) {
  std::mt19937 rng(3);
  std::vector<float> in(size_t{1} << 22);
  for (float& x : in) x = FromBits(static_cast<uint32_t>(rng()));
  ExpectCastMatchesScalar(GetParam(), in);
  for (size_t n = 0; n <= 300; ++n) {
    std::vector<float> part(in.begin() + static_cast<std::ptrdiff_t>(n),
                            in.begin() + static_cast<std::ptrdiff_t>(2 * n));
    ExpectCastMatchesScalar(GetParam(), part);
    if (HasFatalFailure()) return;
  }
  // Unaligned input and output, tails checked against the guard.
  for (size_t offset = 1; offset < 17; ++offset) {
    Buffer<uint16_t> ref(1000 + offset, offset, kPoison16);
    Buffer<uint16_t> got(1000 + offset, offset, kPoison16);
    CastFp32ToBf16(Isa::kScalar, in.data() + offset, ref.data(), ref.size());
    CastFp32ToBf16(GetParam(), in.data() + offset, got.data(), got.size());
    ASSERT_TRUE(SameHalves(ref.data(), got.data(), ref.size()));
    ASSERT_TRUE(got.GuardsIntact(kPoison16));
  }
}

TEST_P(IsaPathTest, CastBf16ToFp32IsExactForEveryPattern) {
  std::vector<uint16_t> in(0x10000);
  for (uint32_t b = 0; b < 0x10000; ++b) in[b] = static_cast<uint16_t>(b);
  for (size_t offset : {size_t{0}, size_t{1}, size_t{5}}) {
    for (size_t n :
         {in.size() - offset, size_t{0}, size_t{1}, size_t{15}, size_t{17}, size_t{300}}) {
      Buffer<float> got(n, offset, FromBits(kPoison32));
      CastBf16ToFp32(GetParam(), in.data() + offset, got.data(), n);
      for (size_t i = 0; i < n; ++i) {
        ASSERT_EQ(Bits(got[i]), static_cast<uint32_t>(in[offset + i]) << 16) << "element " << i;
      }
      ASSERT_TRUE(got.GuardsIntact(FromBits(kPoison32)));
    }
  }
}

// ---- Gradient statistics.

// The header's definition written out plainly, independent of the kernels.
GradStats StatsByDefinition(const std::vector<float>& g, size_t begin, size_t end) {
  GradStats r;
  for (size_t block = begin; block < end; block += kStatsBlock) {
    double lanes[16] = {};
    for (size_t i = block; i < end && i < block + kStatsBlock; ++i) {
      if (!std::isfinite(g[i])) {
        ++r.nonfinite;
        continue;
      }
      lanes[(i - block) % 16] += static_cast<double>(g[i]) * static_cast<double>(g[i]);
    }
    double s8[8], s4[4], s2[2];
    for (int j = 0; j < 8; ++j) s8[j] = lanes[j] + lanes[j + 8];
    for (int j = 0; j < 4; ++j) s4[j] = s8[j] + s8[j + 4];
    for (int j = 0; j < 2; ++j) s2[j] = s4[j] + s4[j + 2];
    r.sum_squares += s2[0] + s2[1];
  }
  return r;
}

std::vector<float> StatsInput(size_t n, uint32_t seed, bool with_specials) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  std::uniform_real_distribution<float> decade(-30.0f, 30.0f);
  std::vector<float> g(n);
  for (float& x : g) x = unit(rng) * std::pow(10.0f, decade(rng));
  if (with_specials) {
    const std::vector<float> specials = SpecialMasters();
    for (size_t i = 0; i < n; i += 37) g[i] = specials[(i / 37) % specials.size()];
  }
  return g;
}

std::vector<uint16_t> ToBf16(const std::vector<float>& g) {
  std::vector<uint16_t> h(g.size());
  for (size_t i = 0; i < g.size(); ++i) h[i] = RoundToBf16(g[i]);
  return h;
}

std::vector<float> Widen(const std::vector<uint16_t>& h) {
  std::vector<float> g(h.size());
  for (size_t i = 0; i < h.size(); ++i) g[i] = Bf16ToFp32(h[i]);
  return g;
}

TEST(GradStatsScalarTest, MatchesDefinition) {
  for (size_t n : {size_t{0}, size_t{1}, size_t{15}, size_t{16}, size_t{17}, size_t{4095},
                   size_t{4096}, size_t{4097}, size_t{3 * 4096 + 17}}) {
    const std::vector<float> g = StatsInput(n, static_cast<uint32_t>(n), true);
    const GradStats want = StatsByDefinition(g, 0, n);
    const GradStats got = ComputeGradStats(Isa::kScalar, g.data(), GradType::kFp32, n);
    EXPECT_TRUE(SameDouble(got.sum_squares, want.sum_squares)) << n;
    EXPECT_EQ(got.nonfinite, want.nonfinite) << n;

    const std::vector<uint16_t> h = ToBf16(g);
    const GradStats want16 = StatsByDefinition(Widen(h), 0, n);
    const GradStats got16 = ComputeGradStats(Isa::kScalar, h.data(), GradType::kBf16, n);
    EXPECT_TRUE(SameDouble(got16.sum_squares, want16.sum_squares)) << n;
    EXPECT_EQ(got16.nonfinite, want16.nonfinite) << n;
  }
}

TEST(GradStatsScalarTest, CountsNonFiniteAndExcludesThem) {
  const std::vector<float> g = {3.0f, kInf, 4.0f, std::nanf(""), -kInf, -0.0f};
  const GradStats s = ComputeGradStats(Isa::kScalar, g.data(), GradType::kFp32, g.size());
  EXPECT_EQ(s.sum_squares, 25.0);
  EXPECT_EQ(s.nonfinite, 3u);
  const GradStats c = CombineGradStats(s, GradStats{1.5, 2});
  EXPECT_EQ(c.sum_squares, 26.5);
  EXPECT_EQ(c.nonfinite, 5u);
}

TEST_P(IsaPathTest, GradStatsMatchScalarBitForBit) {
  std::vector<size_t> sizes;
  for (size_t n = 0; n <= 300; ++n) sizes.push_back(n);
  for (size_t n : {size_t{4095}, size_t{4096}, size_t{4097}, size_t{4096 * 5 + 1},
                   size_t{4096 * 7 + 4095}, size_t{1 << 20}}) {
    sizes.push_back(n);
  }
  for (size_t n : sizes) {
    for (bool specials : {false, true}) {
      const std::vector<float> g = StatsInput(n + 3, static_cast<uint32_t>(n), specials);
      const std::vector<uint16_t> h = ToBf16(g);
      for (size_t offset : {size_t{0}, size_t{3}}) {
        const GradStats want32 =
            ComputeGradStats(Isa::kScalar, g.data() + offset, GradType::kFp32, n);
        const GradStats got32 = ComputeGradStats(GetParam(), g.data() + offset, GradType::kFp32, n);
        ASSERT_TRUE(SameDouble(got32.sum_squares, want32.sum_squares))
            << "fp32 n=" << n << " offset=" << offset << ": " << got32.sum_squares << " vs "
            << want32.sum_squares;
        ASSERT_EQ(got32.nonfinite, want32.nonfinite) << "fp32 n=" << n;
        const GradStats want16 =
            ComputeGradStats(Isa::kScalar, h.data() + offset, GradType::kBf16, n);
        const GradStats got16 = ComputeGradStats(GetParam(), h.data() + offset, GradType::kBf16, n);
        ASSERT_TRUE(SameDouble(got16.sum_squares, want16.sum_squares))
            << "bf16 n=" << n << " offset=" << offset;
        ASSERT_EQ(got16.nonfinite, want16.nonfinite) << "bf16 n=" << n;
      }
    }
  }
}

// ---- Threaded against serial.

std::unique_ptr<ThreadPool> MakePool(int threads) {
  ThreadPool::Options options;
  options.num_threads = threads;
  absl::StatusOr<std::unique_ptr<ThreadPool>> pool = ThreadPool::Create(options);
  EXPECT_TRUE(pool.ok()) << pool.status();
  return pool.ok() ? std::move(*pool) : nullptr;
}

TEST_P(IsaPathTest, ThreadedAdamWMatchesSerial) {
  const Isa isa = GetParam();
  // Large enough that each thread's range streams its output; align 1 gives ranges whose output
  // starts at arbitrary alignment.
  const size_t n = 7 * internal::kStreamingStoreMinElements + 12345;
  for (int threads : {1, 2, 3, 7}) {
    std::unique_ptr<ThreadPool> pool = MakePool(threads);
    ASSERT_NE(pool, nullptr);
    for (size_t align : {size_t{1}, size_t{16}, size_t{4096}}) {
      for (GradType type : {GradType::kBf16, GradType::kFp32}) {
        SCOPED_TRACE(testing::Message() << "threads=" << threads << " align=" << align);
        Problem serial(n, Offsets{0, 0, 0, 0, 0});
        Problem threaded(n, Offsets{0, 0, 0, 0, 0});
        FillRandom(serial, 17);
        CopyState(threaded, serial);
        for (uint64_t step = 1; step <= 2; ++step) {
          const AdamWScalars s = MakeAdamWScalars(1e-3, 0.9, 0.95, 1e-8, 0.1, 1.0, step);
          RunUpdate(Isa::kScalar, s, type, serial, true);
          const void* grad = type == GradType::kBf16
                                 ? static_cast<const void*>(threaded.grad16.data())
                                 : static_cast<const void*>(threaded.grad32.data());
          const size_t grad_bytes = GradTypeBytes(type);
          pool->ParallelFor(n, align, [&](size_t begin, size_t end, int) {
            AdamWUpdate(isa, s, static_cast<const char*>(grad) + begin * grad_bytes, type,
                        threaded.master.data() + begin, threaded.m.data() + begin,
                        threaded.v.data() + begin, threaded.out.data() + begin, end - begin);
          });
        }
        ASSERT_TRUE(SameFloats(serial.master.data(), threaded.master.data(), n));
        ASSERT_TRUE(SameFloats(serial.m.data(), threaded.m.data(), n));
        ASSERT_TRUE(SameFloats(serial.v.data(), threaded.v.data(), n));
        ASSERT_TRUE(SameHalves(serial.out.data(), threaded.out.data(), n));
      }
    }
  }
}

// Split at kStatsBlock multiples and combined in range order, the statistics are the same for
// every ISA and equal the definition applied per range; against the unsplit sum they agree to
// rounding only, since the split changes how block sums associate (see the report on adamw.h).
TEST_P(IsaPathTest, ThreadedGradStatsDeterministicAcrossIsas) {
  const size_t n = 37 * kStatsBlock + 1234;
  const std::vector<float> g = StatsInput(n, 23, true);
  const std::vector<uint16_t> h = ToBf16(g);
  for (int threads : {1, 2, 3, 7}) {
    std::unique_ptr<ThreadPool> pool = MakePool(threads);
    ASSERT_NE(pool, nullptr);
    for (GradType type : {GradType::kFp32, GradType::kBf16}) {
      const void* data = type == GradType::kFp32 ? static_cast<const void*>(g.data())
                                                 : static_cast<const void*>(h.data());
      const size_t bytes = GradTypeBytes(type);
      const auto threaded = [&](Isa isa) {
        std::vector<GradStats> partial(threads);
        pool->ParallelFor(n, kStatsBlock, [&](size_t begin, size_t end, int t) {
          partial[t] = ComputeGradStats(isa, static_cast<const char*>(data) + begin * bytes, type,
                                        end - begin);
        });
        GradStats total;
        for (const GradStats& p : partial) total = CombineGradStats(total, p);
        return total;
      };
      const GradStats want = threaded(Isa::kScalar);
      const GradStats got = threaded(GetParam());
      EXPECT_TRUE(SameDouble(got.sum_squares, want.sum_squares)) << "threads=" << threads;
      EXPECT_EQ(got.nonfinite, want.nonfinite);

      GradStats by_definition;
      const std::vector<float> widened = type == GradType::kFp32 ? g : Widen(h);
      for (int t = 0; t < threads; ++t) {
        size_t begin = 0;
        size_t end = 0;
        ThreadPool::SplitRange(n, kStatsBlock, threads, t, &begin, &end);
        by_definition = CombineGradStats(by_definition, StatsByDefinition(widened, begin, end));
      }
      EXPECT_TRUE(SameDouble(got.sum_squares, by_definition.sum_squares));
      EXPECT_EQ(got.nonfinite, by_definition.nonfinite);

      const GradStats serial = ComputeGradStats(Isa::kScalar, data, type, n);
      EXPECT_EQ(got.nonfinite, serial.nonfinite);
      EXPECT_NEAR(got.sum_squares, serial.sum_squares, 1e-12 * serial.sum_squares);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllIsas, IsaPathTest,
                         testing::Values(Isa::kAvx2, Isa::kAvx512, Isa::kAvx512Bf16), IsaParamName);

}  // namespace
}  // namespace slidedp::kernels
