#include "model/defaults.h"

#include <cstdint>

namespace slidedp::model {

slidedp::v1::OptimizerConfig DefaultOptimizerConfig() {
  slidedp::v1::OptimizerConfig o;
  o.set_lr(1e-4);
  o.set_beta1(0.9);
  o.set_beta2(0.999);
  o.set_eps(1e-8);
  o.set_weight_decay(0.01);
  o.set_no_decay_norms_and_biases(true);
  o.set_schedule(slidedp::v1::LR_SCHEDULE_CONSTANT);
  o.set_warmup_steps(0);
  o.set_total_steps(0);
  o.set_min_lr_ratio(0);
  o.set_clip(slidedp::v1::CLIP_POLICY_NONE);
  o.set_max_grad_norm(1.0);
  o.set_grad_dtype(slidedp::v1::DTYPE_BF16);
  o.set_scale_by_world_size(true);
  return o;
}

slidedp::v1::Routes DefaultRoutes() {
  slidedp::v1::Routes r;
  r.set_param_route(slidedp::v1::PARAM_ROUTE_REPLICATED);
  r.set_grad_route(slidedp::v1::GRAD_ROUTE_AUTO);
  r.set_chunk_bytes(uint64_t{16} << 20);
  return r;
}

}  // namespace slidedp::model
