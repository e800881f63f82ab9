// The defaults a job gets when its spec leaves a setting out: hostd's configuration starts from
// them, and so do tools that reason about a job without a daemon (slidedpctl estimate).
#pragma once

#include "slidedp/v1/control.pb.h"

namespace slidedp::model {

// lr 1e-4, beta1 0.9, beta2 0.999, eps 1e-8, weight_decay 0.01, no_decay_norms_and_biases true,
// schedule constant, warmup 0, total_steps 0, min_lr_ratio 0, clip none, max_grad_norm 1.0,
// grad_dtype BF16, scale_by_world_size true.
slidedp::v1::OptimizerConfig DefaultOptimizerConfig();
// param_route replicated, grad_route cpu_reduction, chunk_bytes 16 MiB.
slidedp::v1::Routes DefaultRoutes();

}  // namespace slidedp::model
