// Plain-C entry points of the CPU kernels, exported by the shared library slidedp_kernels_py
// (libslidedp_kernels_py.so) so Python can call them through ctypes, e.g. to compare the fused
// update with torch.optim.AdamW. Semantics are those of kernels/cpu/adamw.h.
//
// ISA codes: 0 scalar, 1 avx2, 2 avx512, 3 avx512bf16 (slidedp::kernels::Isa). An ISA the CPU
// lacks is served by the best one it has (all paths give bit-identical results). Grad type codes:
// 0 float32, 1 bfloat16. Functions returning int return 0 on success and -1 on an invalid
// argument (unknown code, null pointer with n > 0, step 0); they never throw.
//
// Thread safety: every function is pure over the arrays it is given; concurrent calls on disjoint
// arrays are safe.
#ifndef SLIDEDP_KERNELS_CPU_KERNELS_CAPI_H_
#define SLIDEDP_KERNELS_CPU_KERNELS_CAPI_H_

#include <stddef.h>
#include <stdint.h>

#define SLIDEDP_KERNELS_EXPORT __attribute__((visibility("default")))

#ifdef __cplusplus
extern "C" {
#endif

// Mirrors slidedp::kernels::AdamWScalars field for field (static_assert in kernels_capi.cc).
typedef struct SlidedpAdamWScalars {
  float beta1;
  float beta2;
  float one_minus_beta1;
  float one_minus_beta2;
  float eps;
  float decay_factor;
  float step_size;
  float inv_sqrt_bias_correction2;
  float grad_scale;
} SlidedpAdamWScalars;

// Best ISA code for this CPU (SLIDEDP_ISA may lower it), and whether `isa` is supported (1/0).
SLIDEDP_KERNELS_EXPORT int slidedp_best_isa(void);
SLIDEDP_KERNELS_EXPORT int slidedp_isa_supported(int isa);

// MakeAdamWScalars; writes *out. -1 if out is null or step is 0.
SLIDEDP_KERNELS_EXPORT int slidedp_make_adamw_scalars(double lr, double beta1, double beta2,
                                                      double eps, double weight_decay,
                                                      double grad_scale, uint64_t step,
                                                      SlidedpAdamWScalars* out);

// AdamWUpdate. `param_bf16` may be null.
SLIDEDP_KERNELS_EXPORT int slidedp_adamw_update(int isa, const SlidedpAdamWScalars* s,
                                                const void* grad, int grad_type, float* master,
                                                float* m, float* v, uint16_t* param_bf16, size_t n);

// MakeAdamWScalars followed by AdamWUpdate, for callers that hold only hyperparameters.
SLIDEDP_KERNELS_EXPORT int slidedp_adamw_step(int isa, double lr, double beta1, double beta2,
                                              double eps, double weight_decay, double grad_scale,
                                              uint64_t step, const void* grad, int grad_type,
                                              float* master, float* m, float* v,
                                              uint16_t* param_bf16, size_t n);

// ComputeGradStats over one range; writes the sum of squares and the non-finite count.
SLIDEDP_KERNELS_EXPORT int slidedp_grad_stats(int isa, const void* grad, int grad_type, size_t n,
                                              double* sum_squares, uint64_t* nonfinite);

SLIDEDP_KERNELS_EXPORT int slidedp_cast_fp32_to_bf16(int isa, const float* in, uint16_t* out,
                                                     size_t n);
SLIDEDP_KERNELS_EXPORT int slidedp_cast_bf16_to_fp32(int isa, const uint16_t* in, float* out,
                                                     size_t n);

#ifdef __cplusplus
}  // extern "C"
#endif

#endif  // SLIDEDP_KERNELS_CPU_KERNELS_CAPI_H_
