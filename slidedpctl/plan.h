// `slidedpctl plan`: the analytical step-time model (model/step_model.h) for a model, world size,
// per-rank batch, sequence length, per-layer layout (model/layout.h) and hardware profile; no
// hostd needed. Prints C, each host/transfer resource and H, E, T, the regime, tokens/s, a peak
// GPU memory estimate, PCIe bytes per step, R_cross and the weak/strong scaling rows for
// R = 1, 2, 4, 8; with --json every figure, the inputs and the effective profile, so that
// AutoPolicy can rank layouts with its own measured rates (--profile FILE).
//
// Thread-safe: RunPlan reads files and writes only to its streams.
#pragma once

#include <cstdint>
#include <ostream>
#include <string>

#include "model/step_model.h"
#include "nlohmann/json.hpp"

namespace slidedp::ctl {

struct PlanOptions {
  std::string model;
  uint32_t gpus = 0;
  uint64_t batch = 0;
  uint64_t seq = 0;
  std::string layout;   // empty: model::DefaultLayout
  std::string profile;  // empty: the built-in H200 profile
  uint32_t window_slots = model::kDefaultWindowSlots;
  std::string grad_route = "gpu_reduction";
};

// {"model": {...}, "inputs": {...}, "profile": {...}, "compute": {...}, "host": {...},
//  "exposure": {...}, "step_s", "regime", "tokens_per_s", "memory": {...}, "pcie": {...},
//  "r_cross": {...}, "scaling": [...]}.
nlohmann::ordered_json PlanToJson(const model::StepPlan& plan);
void PrintPlan(const model::StepPlan& plan, std::ostream& out);

// Exit codes (exit_codes.h): 0, or 2 with "slidedpctl: --<flag>: ..." on `err` for a model that
// does not load, a layout that does not parse or fit the model, a profile file that is missing
// or bad.
int RunPlan(const PlanOptions& options, bool json, std::ostream& out, std::ostream& err);

}  // namespace slidedp::ctl
