#include "slidedpctl/format.h"

#include <cstdint>

#include "gtest/gtest.h"
#include "slidedp/v1/control.pb.h"

namespace slidedp::ctl {
namespace {

TEST(FormatBytesTest, BinaryUnitsWithOneDecimal) {
  EXPECT_EQ(FormatBytes(0), "0 B");
  EXPECT_EQ(FormatBytes(1023), "1023 B");
  EXPECT_EQ(FormatBytes(1024), "1.0 KiB");
  EXPECT_EQ(FormatBytes(1536), "1.5 KiB");
  EXPECT_EQ(FormatBytes(12u << 20), "12.0 MiB");
  EXPECT_EQ(FormatBytes(uint64_t{3} << 30), "3.0 GiB");
  EXPECT_EQ(FormatBytes(UINT64_MAX), "16.0 EiB");
}

TEST(FormatBytesTest, NeverPrints1024OfAUnit) {
  EXPECT_EQ(FormatBytes((1u << 20) - 1), "1.0 MiB");
  EXPECT_EQ(FormatBytes((1u << 20) - 60), "1023.9 KiB");
}

TEST(FormatDurationMsTest, PicksTheUnit) {
  EXPECT_EQ(FormatDurationMs(0), "0ms");
  EXPECT_EQ(FormatDurationMs(450), "450ms");
  EXPECT_EQ(FormatDurationMs(3200), "3.2s");
  EXPECT_EQ(FormatDurationMs(75'000), "1m15s");
  EXPECT_EQ(FormatDurationMs(3'723'000), "1h02m03s");
  EXPECT_EQ(FormatDurationMs(uint64_t{2} * 86'400'000 + 3 * 3'600'000 + 4 * 60'000), "2d03h04m");
}

TEST(FormatCountTest, DecimalSuffixes) {
  EXPECT_EQ(FormatCount(999), "999");
  EXPECT_EQ(FormatCount(1000), "1.0K");
  EXPECT_EQ(FormatCount(1'234'567), "1.2M");
  EXPECT_EQ(FormatCount(999'960), "1.0M");
  EXPECT_EQ(FormatCount(7'000'000'000), "7.0G");
}

TEST(FormatIndexOrDashTest, NegativeIsDash) {
  EXPECT_EQ(FormatIndexOrDash(-1), "-");
  EXPECT_EQ(FormatIndexOrDash(0), "0");
  EXPECT_EQ(FormatIndexOrDash(3), "3");
}

TEST(ShortEnumNameTest, StripsTheEnumsOwnPrefix) {
  EXPECT_EQ(EnumValuePrefix(v1::LayerKind_descriptor()), "LAYER_KIND_");
  EXPECT_EQ(EnumValuePrefix(v1::DType_descriptor()), "DTYPE_");
  EXPECT_EQ(EnumValuePrefix(v1::LrScheduleKind_descriptor()), "LR_SCHEDULE_");
  EXPECT_EQ(ShortEnumName(v1::LayerKind_descriptor(), v1::LAYER_KIND_LM_HEAD), "lm_head");
  EXPECT_EQ(ShortEnumName(v1::LayerKind_descriptor(), v1::LAYER_KIND_FINAL_NORM), "final_norm");
  EXPECT_EQ(ShortEnumName(v1::ClipPolicy_descriptor(), v1::CLIP_POLICY_GLOBAL), "global");
  EXPECT_EQ(ShortEnumName(v1::GradRoute_descriptor(), v1::GRAD_ROUTE_CPU_REDUCTION),
            "cpu_reduction");
  EXPECT_EQ(ShortEnumName(v1::LrScheduleKind_descriptor(), v1::LR_SCHEDULE_COSINE), "cosine");
  EXPECT_EQ(ShortEnumName(v1::DType_descriptor(), v1::DTYPE_BF16), "bf16");
  EXPECT_EQ(ShortEnumName(v1::LayerKind_descriptor(), 99), "99");
}

}  // namespace
}  // namespace slidedp::ctl
