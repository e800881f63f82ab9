#include "hostd/route_choice.h"

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"

namespace slidedp::hostd {
namespace {

// The config key's name of a route: GRAD_ROUTE_GPU_REDUCTION -> gpu_reduction.
std::string RouteName(slidedp::v1::GradRoute r) {
  return absl::AsciiStrToLower(absl::StripPrefix(slidedp::v1::GradRoute_Name(r), "GRAD_ROUTE_"));
}

}  // namespace

RouteChoice ChooseGradRoute(slidedp::v1::GradRoute configured, uint32_t world_size, uint32_t rank,
                            int32_t gpu, uint32_t machine_gpus) {
  RouteChoice c;
  if (configured != slidedp::v1::GRAD_ROUTE_AUTO) {
    c.route = configured == slidedp::v1::GRAD_ROUTE_UNSPECIFIED
                  ? slidedp::v1::GRAD_ROUTE_CPU_REDUCTION
                  : configured;
    c.why = "set";
    return c;
  }
  c.automatic = true;
  c.on_gpus = gpu >= 0;
  if (gpu >= 0 && world_size > 1 && world_size > machine_gpus) {
    c.route = slidedp::v1::GRAD_ROUTE_CPU_REDUCTION;
    c.why = absl::StrCat("rank ", rank, " attached first, on GPU ", gpu, ", but ", world_size,
                         " ranks share the ", machine_gpus,
                         " GPU(s) hostd sees and NCCL needs "
                         "one per rank: hostd sums the pushes");
  } else if (gpu >= 0) {
    c.route = slidedp::v1::GRAD_ROUTE_GPU_REDUCTION;
    c.why = absl::StrCat("rank ", rank, " attached first, on GPU ", gpu, ": ",
                         world_size == 1 ? "one GPU rank returns its gradient"
                                         : "the GPU ranks all-reduce, one returns the gradient",
                         ", updated chunk by chunk");
  } else {
    c.route = slidedp::v1::GRAD_ROUTE_CPU_REDUCTION;
    c.why = absl::StrCat("rank ", rank, " attached first, on the CPU: hostd sums the pushes");
  }
  return c;
}

absl::Status CheckRankDevice(const RouteChoice& chosen, uint32_t rank, int32_t gpu) {
  if (!chosen.automatic) return absl::OkStatus();
  const bool gpu_route = chosen.on_gpus;
  if (gpu_route == (gpu >= 0)) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "gpu: rank ", rank, " attaches ", gpu >= 0 ? absl::StrCat("on GPU ", gpu) : "on the CPU",
      ", but the attached ranks are on ", gpu_route ? "GPUs" : "the CPU",
      " and grad_route auto chose ", RouteName(chosen.route),
      " for them; every rank of a job "
      "uses the same kind of device (or set grad_route explicitly)"));
}

std::string DescribeRouteChoice(const RouteChoice& c) {
  if (c.route == slidedp::v1::GRAD_ROUTE_AUTO) return "auto: chosen when the first rank attaches";
  return c.automatic ? absl::StrCat("auto: ", c.why) : "set";
}

}  // namespace slidedp::hostd
