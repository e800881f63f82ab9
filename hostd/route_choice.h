// The gradient route hostd picks for a job whose grad_route is auto (the default), from what
// attaches: each time the first rank attaches to a job with no rank attached, its device decides
// -- a GPU rank (AttachRankRequest.gpu >= 0) gets GPU reduction (the ranks all-reduce over NCCL
// and one rank returns the aggregated gradient, which hostd applies chunk by chunk as it
// arrives); a CPU rank gets CPU reduction (every rank pushes, hostd sums). The ranks that attach
// after it join that route (one of the other kind is warned of: the request's gpu defaults to
// 0, so a client that never sets it reads as a GPU rank). An explicit grad_route (config key, flag,
// a job spec) is used as it is and only reported.
//
// Several GPU ranks get GPU reduction when the machine has a GPU for each (NCCL needs one device
// per rank); more ranks than the GPUs hostd sees (rank processes sharing a GPU, or GPUs hostd's
// topology did not find) get CPU reduction. Several GPU ranks get GPU reduction too: reduce-scatter
// returns 1/R of the gradient per rank over R PCIe links, which is faster only where the one
// pushing rank's D2H binds the step; that choice needs a measurement on a machine with several GPUs
// (issue #22) and is not made here.
//
// Pure functions: no locks, no I/O.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "proto/slidedp/v1/control.pb.h"

namespace slidedp::hostd {

struct RouteChoice {
  slidedp::v1::GradRoute route = slidedp::v1::GRAD_ROUTE_UNSPECIFIED;
  bool automatic = false;  // chosen by hostd (grad_route auto), not set
  bool on_gpus = false;    // automatic: the ranks it was chosen for are GPU ranks
  std::string why;         // for the log and JobStatus.grad_route_choice
};

// The route of a job whose configured route is `configured` when rank `rank` attaches first
// on `gpu` (-1: CPU) with `world_size` ranks in the job, on a machine where hostd sees
// `machine_gpus` GPUs.
RouteChoice ChooseGradRoute(slidedp::v1::GradRoute configured, uint32_t world_size, uint32_t rank,
                            int32_t gpu, uint32_t machine_gpus);

// Whether rank `rank` on `gpu` may join ranks attached under `chosen`: FAILED_PRECONDITION,
// naming the field, when an automatic choice for GPU ranks meets a CPU rank or the reverse.
// Explicit routes are not checked here (the rank library refuses what it cannot do).
absl::Status CheckRankDevice(const RouteChoice& chosen, uint32_t rank, int32_t gpu);

// The text of JobStatus.grad_route_choice.
std::string DescribeRouteChoice(const RouteChoice& c);

}  // namespace slidedp::hostd
