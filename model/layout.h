// Per-layer activation layouts (elastic checkpointing): what each decoder layer saves for backward,
// whether it offloads a fraction of that to host memory, and whether its weights stay resident on
// the GPU. The grammar is python_client/slidedp/policy.py's, word for word in its errors, so that
// AutoPolicy (Python) and `slidedpctl plan` read the same strings.
//
// A layout lists the decoder layers in forward order as whitespace-separated groups
// `<count><kind>[-r<ratio>]`, e.g. "6R 24F-r0 6N":
//   F      full-layer recompute (saves the layer input, backward replays the whole layer);
//   Seg    two segments (attention, MLP), each replayed from its own input;
//   SAC    selective checkpointing (matmul and attention outputs cached, cheap ops replayed);
//   N      no checkpoint (everything saved, no replay);
//   R      a resident layer (weights on the GPU, updated there), activations as N;
//   R<kind> a resident layer with another activation kind ("RF", "RSeg-r0.5");
//   -r<ratio> the fraction in [0, 1] of the saved bytes offloaded to pinned host memory (default
//   0).
// Resident groups come first; the counts sum to the model's decoder layers.
//
// Pure functions; thread-safe.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace slidedp::model {

enum class ActivationKind { kF, kSeg, kSac, kN };

// "F", "Seg", "SAC", "N".
std::string_view ActivationKindName(ActivationKind kind);

struct LayerPolicy {
  ActivationKind kind = ActivationKind::kF;
  double ratio = 0.0;  // offloaded fraction of the saved bytes, in [0, 1]
  bool resident = false;

  bool operator==(const LayerPolicy&) const = default;
};

// One LayerPolicy per decoder layer, forward order. INVALID_ARGUMENT "policy: ..." naming the group
// at fault and the expected form (policy.py's messages), or the layer-count mismatch.
absl::StatusOr<std::vector<LayerPolicy>> ParseLayout(std::string_view text, uint32_t layers);

// The canonical string: consecutive equal policies as one group (policy.py's format_layout).
// ParseLayout(FormatLayout(p), p.size()) == p.
std::string FormatLayout(const std::vector<LayerPolicy>& policies);

// The layout without --layout: every layer full recompute, nothing offloaded ("<layers>F-r0").
std::string DefaultLayout(uint32_t layers);

}  // namespace slidedp::model
