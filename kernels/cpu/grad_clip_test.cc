#include "kernels/cpu/grad_clip.h"

#include <cmath>
#include <limits>

#include "gtest/gtest.h"

namespace slidedp::kernels {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

TEST(GradClipTest, BelowTheThresholdIsNotScaled) {
  const ClipDecision d = DecideClip(0.5, 1.0);
  EXPECT_FALSE(d.skip);
  EXPECT_EQ(d.scale, 1.0);
  EXPECT_EQ(DecideClip(0.0, 1.0).scale, 1.0);
}

TEST(GradClipTest, AtTheThresholdTheEpsilonScalesByAHair) {
  const ClipDecision d = DecideClip(1.0, 1.0);
  EXPECT_FALSE(d.skip);
  EXPECT_EQ(d.scale, 1.0 / (1.0 + kClipEpsilon));
  EXPECT_LT(d.scale, 1.0);
  // Within the epsilon below the threshold the formula still gives < 1; further below, 1.
  EXPECT_LT(DecideClip(1.0 - kClipEpsilon / 2, 1.0).scale, 1.0);
  EXPECT_EQ(DecideClip(1.0 - 2 * kClipEpsilon, 1.0).scale, 1.0);
}

TEST(GradClipTest, AboveTheThresholdScalesToIt) {
  const ClipDecision d = DecideClip(4.0, 1.0);
  EXPECT_FALSE(d.skip);
  EXPECT_DOUBLE_EQ(d.scale, 1.0 / (4.0 + kClipEpsilon));
  EXPECT_NEAR(4.0 * d.scale, 1.0, 1e-6);
  const ClipDecision slightly = DecideClip(std::nextafter(1.0, 2.0), 1.0);
  EXPECT_LT(slightly.scale, DecideClip(1.0, 1.0).scale);
}

TEST(GradClipTest, NonFiniteNormsSkipWhetherOrNotClippingIsOn) {
  for (double norm : {std::nan(""), kInf, -kInf}) {
    for (double max : {1.0, 0.0}) {
      const ClipDecision d = DecideClip(norm, max);
      EXPECT_TRUE(d.skip) << norm << " " << max;
      EXPECT_EQ(d.scale, 1.0) << norm << " " << max;
    }
  }
}

TEST(GradClipTest, ANonPositiveOrNanThresholdTurnsClippingOff) {
  for (double max : {0.0, -1.0, std::nan("")}) {
    const ClipDecision d = DecideClip(1e6, max);
    EXPECT_FALSE(d.skip) << max;
    EXPECT_EQ(d.scale, 1.0) << max;
  }
  EXPECT_EQ(DecideClip(1e6, kInf).scale, 1.0);
}

}  // namespace
}  // namespace slidedp::kernels
