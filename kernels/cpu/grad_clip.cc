#include "kernels/cpu/grad_clip.h"

#include <algorithm>
#include <cmath>

namespace slidedp::kernels {

ClipDecision DecideClip(double grad_norm, double max_grad_norm) {
  ClipDecision d;
  if (!std::isfinite(grad_norm)) {
    d.skip = true;
    return d;
  }
  // `!(max > 0)` also turns clipping off for a NaN threshold.
  if (!(max_grad_norm > 0)) return d;
  d.scale = std::min(1.0, max_grad_norm / (grad_norm + kClipEpsilon));
  return d;
}

}  // namespace slidedp::kernels
