// The clip / skip rule of one update, in one place: hostd's update worker (per-layer and global
// clipping, buffered and streamed layers) and the layers a rank updates itself (python_client's
// resident layers, through slidedp_clip_scale of the rank C ABI) decide with this function. It
// lives in kernels/ and not in hostd/ because the rank library links it too.
//
// The rule: a gradient whose norm is not finite (an element is NaN or Inf) skips the update and
// leaves the layer as it was; otherwise, with clipping on, the gradient is multiplied by
//   scale = min(1, max_grad_norm / (grad_norm + kClipEpsilon)),
// so a norm at or just below the threshold is already scaled by a hair (max / (max + 1e-6)), as
// in PyTorch's clip_grad_norm_.
//
// Thread safety: pure.
#pragma once

namespace slidedp::kernels {

// Added to the norm before dividing (torch.nn.utils.clip_grad_norm_'s 1e-6).
inline constexpr double kClipEpsilon = 1e-6;

struct ClipDecision {
  bool skip = false;   // the gradient is not finite: no update at all
  double scale = 1.0;  // what the gradient is multiplied by (1: not clipped, and when skipped)
};

// grad_norm: the L2 norm of the gradient as the update applies it (after any scaling by the
// world size); NaN or +-Inf when the gradient holds a non-finite element. Precondition:
// grad_norm >= 0 or not finite. max_grad_norm: the threshold; <= 0 or NaN means clipping is off
// (scale 1). The callers pass the threshold only when their clip policy clips.
ClipDecision DecideClip(double grad_norm, double max_grad_norm);

}  // namespace slidedp::kernels
