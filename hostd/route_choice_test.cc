#include "hostd/route_choice.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace slidedp::hostd {
namespace {

using ::testing::HasSubstr;
namespace v1 = slidedp::v1;

TEST(RouteChoiceTest, AutoFollowsTheFirstRanksDevice) {
  for (uint32_t world : {1u, 4u}) {
    RouteChoice gpu = ChooseGradRoute(v1::GRAD_ROUTE_AUTO, world, 0, 3, 4);
    EXPECT_EQ(gpu.route, v1::GRAD_ROUTE_GPU_REDUCTION);
    EXPECT_TRUE(gpu.automatic);
    EXPECT_THAT(DescribeRouteChoice(gpu), HasSubstr("auto: rank 0 attached first, on GPU 3"));
    RouteChoice cpu = ChooseGradRoute(v1::GRAD_ROUTE_AUTO, world, 1, -1, 4);
    EXPECT_EQ(cpu.route, v1::GRAD_ROUTE_CPU_REDUCTION);
    EXPECT_THAT(DescribeRouteChoice(cpu), HasSubstr("auto: rank 1 attached first, on the CPU"));
  }
}

TEST(RouteChoiceTest, ExplicitRoutesStandWhateverAttaches) {
  for (v1::GradRoute r : {v1::GRAD_ROUTE_CPU_REDUCTION, v1::GRAD_ROUTE_GPU_REDUCTION,
                          v1::GRAD_ROUTE_REDUCE_SCATTER}) {
    for (int32_t gpu : {-1, 0}) {
      RouteChoice c = ChooseGradRoute(r, 2, 0, gpu, 1);
      EXPECT_EQ(c.route, r);
      EXPECT_FALSE(c.automatic);
      EXPECT_EQ(DescribeRouteChoice(c), "set");
      EXPECT_TRUE(CheckRankDevice(c, 1, gpu == 0 ? -1 : 0).ok());
    }
  }
  EXPECT_EQ(ChooseGradRoute(v1::GRAD_ROUTE_UNSPECIFIED, 1, 0, 0, 1).route,
            v1::GRAD_ROUTE_CPU_REDUCTION);  // what the proto says unspecified means
}

TEST(RouteChoiceTest, AutoRefusesMixedDevices) {
  RouteChoice gpu = ChooseGradRoute(v1::GRAD_ROUTE_AUTO, 2, 0, 0, 2);
  EXPECT_TRUE(CheckRankDevice(gpu, 1, 1).ok());
  absl::Status s = CheckRankDevice(gpu, 1, -1);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("gpu: rank 1 attaches on the CPU, but the attached ranks "
                                     "are on GPUs and grad_route auto chose gpu_reduction"));
  RouteChoice cpu = ChooseGradRoute(v1::GRAD_ROUTE_AUTO, 2, 0, -1, 2);
  EXPECT_TRUE(CheckRankDevice(cpu, 1, -1).ok());
  EXPECT_THAT(CheckRankDevice(cpu, 1, 2).message(),
              HasSubstr("gpu: rank 1 attaches on GPU 2, but the attached ranks are on the CPU"));
}

TEST(RouteChoiceTest, RanksSharingAGpuGetCpuReduction) {
  // NCCL needs a device per rank: two rank processes on the one GPU of the H200 machine.
  RouteChoice shared = ChooseGradRoute(v1::GRAD_ROUTE_AUTO, 2, 0, 0, 1);
  EXPECT_EQ(shared.route, v1::GRAD_ROUTE_CPU_REDUCTION);
  EXPECT_THAT(DescribeRouteChoice(shared), HasSubstr("2 ranks share the 1 GPU(s) hostd sees"));
  EXPECT_TRUE(CheckRankDevice(shared, 1, 0).ok());  // GPU ranks, CPU reduction: allowed
  EXPECT_EQ(ChooseGradRoute(v1::GRAD_ROUTE_AUTO, 1, 0, 0, 0).route,
            v1::GRAD_ROUTE_GPU_REDUCTION);  // one rank needs no NCCL peer
  EXPECT_EQ(ChooseGradRoute(v1::GRAD_ROUTE_AUTO, 8, 0, 0, 8).route, v1::GRAD_ROUTE_GPU_REDUCTION);
}

TEST(RouteChoiceTest, UnresolvedAutoSaysWhen) {
  RouteChoice c;
  c.route = v1::GRAD_ROUTE_AUTO;
  c.automatic = true;
  EXPECT_EQ(DescribeRouteChoice(c), "auto: chosen when the first rank attaches");
}

}  // namespace
}  // namespace slidedp::hostd
