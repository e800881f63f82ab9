// The C entry points of libslidedp_kernels_py.so (linked against the shared library itself, so
// this also checks that they are exported) against the C++ API.

#include "kernels/cpu/kernels_capi.h"

#include <bit>
#include <cstdint>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/adamw.h"

namespace slidedp::kernels {
namespace {

TEST(KernelsCapiTest, IsaQueries) {
  EXPECT_EQ(slidedp_best_isa(), static_cast<int>(BestIsa()));
  EXPECT_EQ(slidedp_isa_supported(0), 1);
  EXPECT_EQ(slidedp_isa_supported(1), IsaSupported(Isa::kAvx2) ? 1 : 0);
  EXPECT_EQ(slidedp_isa_supported(-1), 0);
  EXPECT_EQ(slidedp_isa_supported(4), 0);
}

TEST(KernelsCapiTest, ScalarsMatchCpp) {
  SlidedpAdamWScalars c;
  ASSERT_EQ(slidedp_make_adamw_scalars(1e-3, 0.9, 0.95, 1e-8, 0.1, 0.5, 7, &c), 0);
  const AdamWScalars s = MakeAdamWScalars(1e-3, 0.9, 0.95, 1e-8, 0.1, 0.5, 7);
  EXPECT_EQ(c.beta1, s.beta1);
  EXPECT_EQ(c.beta2, s.beta2);
  EXPECT_EQ(c.one_minus_beta1, s.one_minus_beta1);
  EXPECT_EQ(c.one_minus_beta2, s.one_minus_beta2);
  EXPECT_EQ(c.eps, s.eps);
  EXPECT_EQ(c.decay_factor, s.decay_factor);
  EXPECT_EQ(c.step_size, s.step_size);
  EXPECT_EQ(c.inv_sqrt_bias_correction2, s.inv_sqrt_bias_correction2);
  EXPECT_EQ(c.grad_scale, s.grad_scale);
  EXPECT_EQ(slidedp_make_adamw_scalars(1e-3, 0.9, 0.95, 1e-8, 0.1, 0.5, 0, &c), -1);
  EXPECT_EQ(slidedp_make_adamw_scalars(1e-3, 0.9, 0.95, 1e-8, 0.1, 0.5, 1, nullptr), -1);
}

TEST(KernelsCapiTest, StepMatchesCpp) {
  const size_t n = 1001;
  std::vector<float> grad(n), master(n), m(n), v(n);
  for (size_t i = 0; i < n; ++i) {
    grad[i] = static_cast<float>(i % 17) * 0.01f - 0.08f;
    master[i] = static_cast<float>(i % 13) * 0.1f - 0.6f;
    m[i] = 0.001f * static_cast<float>(i % 5);
    v[i] = 1e-6f * static_cast<float>(i % 7);
  }
  std::vector<float> master_c = master, m_c = m, v_c = v;
  std::vector<uint16_t> out(n), out_c(n);
  const AdamWScalars s = MakeAdamWScalars(1e-3, 0.9, 0.999, 1e-8, 0.01, 1.0, 3);
  AdamWUpdate(BestIsa(), s, grad.data(), GradType::kFp32, master.data(), m.data(), v.data(),
              out.data(), n);
  ASSERT_EQ(slidedp_adamw_step(0, 1e-3, 0.9, 0.999, 1e-8, 0.01, 1.0, 3, grad.data(), 0,
                               master_c.data(), m_c.data(), v_c.data(), out_c.data(), n),
            0);
  for (size_t i = 0; i < n; ++i) {
    ASSERT_EQ(std::bit_cast<uint32_t>(master[i]), std::bit_cast<uint32_t>(master_c[i])) << i;
    ASSERT_EQ(std::bit_cast<uint32_t>(m[i]), std::bit_cast<uint32_t>(m_c[i])) << i;
    ASSERT_EQ(std::bit_cast<uint32_t>(v[i]), std::bit_cast<uint32_t>(v_c[i])) << i;
    ASSERT_EQ(out[i], out_c[i]) << i;
  }

  SlidedpAdamWScalars c;
  ASSERT_EQ(slidedp_make_adamw_scalars(1e-3, 0.9, 0.999, 1e-8, 0.01, 1.0, 4, &c), 0);
  EXPECT_EQ(slidedp_adamw_update(1, &c, grad.data(), 0, master_c.data(), m_c.data(), v_c.data(),
                                 nullptr, n),
            0);
  EXPECT_EQ(slidedp_adamw_update(9, &c, grad.data(), 0, master_c.data(), m_c.data(), v_c.data(),
                                 nullptr, n),
            -1);
  EXPECT_EQ(slidedp_adamw_update(0, &c, grad.data(), 2, master_c.data(), m_c.data(), v_c.data(),
                                 nullptr, n),
            -1);
  EXPECT_EQ(
      slidedp_adamw_update(0, &c, nullptr, 0, master_c.data(), m_c.data(), v_c.data(), nullptr, n),
      -1);
  EXPECT_EQ(slidedp_adamw_update(0, &c, nullptr, 0, nullptr, nullptr, nullptr, nullptr, 0), 0);
}

TEST(KernelsCapiTest, StatsAndCasts) {
  const std::vector<float> g = {1.0f, -2.0f, 0.5f, 3.0f};
  double sum = 0;
  uint64_t nonfinite = 7;
  ASSERT_EQ(slidedp_grad_stats(0, g.data(), 0, g.size(), &sum, &nonfinite), 0);
  EXPECT_EQ(sum, 14.25);
  EXPECT_EQ(nonfinite, 0u);
  EXPECT_EQ(slidedp_grad_stats(0, g.data(), 0, g.size(), nullptr, &nonfinite), -1);

  std::vector<uint16_t> h(g.size());
  ASSERT_EQ(slidedp_cast_fp32_to_bf16(slidedp_best_isa(), g.data(), h.data(), g.size()), 0);
  EXPECT_EQ(h[0], 0x3F80);
  EXPECT_EQ(h[1], 0xC000);
  std::vector<float> back(g.size());
  ASSERT_EQ(slidedp_cast_bf16_to_fp32(slidedp_best_isa(), h.data(), back.data(), h.size()), 0);
  EXPECT_EQ(back, g);
  ASSERT_EQ(slidedp_grad_stats(0, h.data(), 1, h.size(), &sum, &nonfinite), 0);
  EXPECT_EQ(sum, 14.25);
}

}  // namespace
}  // namespace slidedp::kernels
