#include "model/layout.h"

#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace slidedp::model {
namespace {

using ::testing::HasSubstr;

std::string Error(const std::string& text, uint32_t layers) {
  absl::StatusOr<std::vector<LayerPolicy>> r = ParseLayout(text, layers);
  EXPECT_FALSE(r.ok()) << text;
  if (r.ok()) return "";
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  return std::string(r.status().message());
}

TEST(LayoutTest, ParsesEveryKind) {
  absl::StatusOr<std::vector<LayerPolicy>> r =
      ParseLayout("1R 1RF 1RSeg-r0.5 2F-r0 1Seg 1SAC-r1 2N-r0.25", 9);
  ASSERT_TRUE(r.ok()) << r.status();
  const std::vector<LayerPolicy> want = {
      {ActivationKind::kN, 0, true},     {ActivationKind::kF, 0, true},
      {ActivationKind::kSeg, 0.5, true}, {ActivationKind::kF, 0, false},
      {ActivationKind::kF, 0, false},    {ActivationKind::kSeg, 0, false},
      {ActivationKind::kSac, 1, false},  {ActivationKind::kN, 0.25, false},
      {ActivationKind::kN, 0.25, false}};
  EXPECT_EQ(*r, want);
}

TEST(LayoutTest, FormatsAsPolicyPy) {
  // policy.py's token(): the ratio is shown when non-zero, or for a streamed non-N layer.
  absl::StatusOr<std::vector<LayerPolicy>> r =
      ParseLayout("2R 1RF\t3F 2F-r0.0 4N-r0 1SAC-r0.125\n", 13);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(FormatLayout(*r), "2R 1RF 5F-r0 4N 1SAC-r0.125");
}

TEST(LayoutTest, RoundTrip) {
  for (const std::string text : {"36F-r0", "6R 24F-r0 6N", "3R 1RF 3N 1F-r0 28SAC-r0.5",
                                 "1RSeg-r1 35Seg-r0.75", "4RN-r0.5 32N"}) {
    absl::StatusOr<std::vector<LayerPolicy>> a = ParseLayout(text, 36);
    ASSERT_TRUE(a.ok()) << text << ": " << a.status();
    const std::string canonical = FormatLayout(*a);
    absl::StatusOr<std::vector<LayerPolicy>> b = ParseLayout(canonical, 36);
    ASSERT_TRUE(b.ok()) << canonical << ": " << b.status();
    EXPECT_EQ(*a, *b) << text << " -> " << canonical;
    EXPECT_EQ(FormatLayout(*b), canonical);
  }
  EXPECT_EQ(DefaultLayout(36), "36F-r0");
  EXPECT_TRUE(ParseLayout(DefaultLayout(4), 4).ok());
}

TEST(LayoutTest, ErrorsUsePolicyPysWords) {
  EXPECT_EQ(Error("  ", 4),
            "policy: '  ', expected a layout such as '4F-r0' (groups <count><kind>[-r<ratio>], "
            "kinds R, F, Seg, SAC, N)");
  EXPECT_EQ(Error("4X", 4),
            "policy: group '4X': expected <count><kind>[-r<ratio>] with kind one of R, F, Seg, "
            "SAC, N (e.g. '24F-r0', '6N', '4R')");
  EXPECT_THAT(Error("F", 4), HasSubstr("group 'F': expected <count><kind>"));
  EXPECT_THAT(Error("F4", 4), HasSubstr("group 'F4': expected <count><kind>"));
  EXPECT_EQ(Error("4", 4), "policy: group '4': no kind; expected one of R, F, Seg, SAC, N");
  EXPECT_EQ(Error("4-r0.5", 4),
            "policy: group '4-r0.5': no kind; expected one of R, F, Seg, SAC, N");
  EXPECT_EQ(Error("0F 4F", 4), "policy: group '0F': count 0, expected >= 1");
  EXPECT_EQ(Error("4F-r1.5", 4),
            "policy: group '4F-r1.5': ratio '1.5', expected a number in [0, 1] (the fraction of "
            "saved bytes offloaded)");
  EXPECT_THAT(Error("4F-rx", 4), HasSubstr("ratio 'x', expected a number in [0, 1]"));
  EXPECT_THAT(Error("4F-r", 4), HasSubstr("ratio '', expected"));
  EXPECT_THAT(Error("4F-rnan", 4), HasSubstr("ratio 'nan', expected"));
  EXPECT_THAT(Error("4F-r-0.1", 4), HasSubstr("ratio '-0.1', expected"));
  EXPECT_EQ(Error("2F 2R", 4),
            "policy: group '2R': resident groups (R) come first, before every streamed layer");
  EXPECT_EQ(Error("2R 3F", 4), "policy: '2R 3F' lists 5 decoder layers, the model has 4");
  EXPECT_EQ(Error("3F", 4), "policy: '3F' lists 3 decoder layers, the model has 4");
  EXPECT_THAT(Error("99999999999999999999999F", 4), HasSubstr("decoder layers, the model has 4"));
  EXPECT_THAT(Error("4Fseg", 4), HasSubstr("group '4Fseg': expected"));
}

}  // namespace
}  // namespace slidedp::model
