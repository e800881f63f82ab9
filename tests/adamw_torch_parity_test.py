#!/usr/bin/env python3
"""The fused AdamW+BF16 kernel against torch.optim.AdamW, element-wise over 10 steps.

Usage: adamw_torch_parity_test.py LIBSLIDEDP_KERNELS_PY.so
Loads the kernel through ctypes (the C entry points of kernels/cpu/kernels_capi.h), runs the same
10 steps as torch.optim.AdamW (foreach and fused implementations) from the same initial values,
and compares master weights (4 ULP + 1e-6 lr per step, see master_error), moments (relative) and the BF16 cast (bit-exact against
torch's own round-to-nearest-even cast of our master). Exits 77 (CTest: skipped) when torch is
not installed.
"""
import ctypes
import sys
import unittest

try:
    import torch
except ImportError:  # pragma: no cover - reported as a skip by CTest
    print("torch is not installed: skipping the torch.optim.AdamW parity test")
    sys.exit(77)

LIB = None


class Scalars(ctypes.Structure):
    _fields_ = [(n, ctypes.c_float) for n in (
        "beta1", "beta2", "one_minus_beta1", "one_minus_beta2", "eps", "decay_factor",
        "step_size", "inv_sqrt_bias_correction2", "grad_scale")]


def ptr(t):
    return ctypes.c_void_p(t.data_ptr())


def ulp(x):
    x = x.abs()
    return torch.nextafter(x, torch.full_like(x, float("inf"))) - x


def master_error(ours, ref, lr, steps):
    """max |ours - ref| / (4 ulp(ref) + steps * 1e-6 * lr).

    The update's own rounding differs from torch's (torch uses lerp for m and divides by
    sqrt(bias correction) where the contract uses fma and multiplies by its reciprocal): each
    step may differ by a few ULP of the step (~lr), which near zero exceeds ULPs of the weight.
    """
    return float(((ours - ref).abs() / (4 * ulp(ref) + steps * 1e-6 * lr)).max())


class AdamWTorchParity(unittest.TestCase):
    def run_case(self, fused, n, weight_decay, isa):
        g = torch.Generator().manual_seed(n)
        lr, betas, eps = 1e-3, (0.9, 0.999), 1e-8
        init = torch.randn(n, generator=g) * 0.02
        grads = [torch.randn(n, generator=g).to(torch.bfloat16) for _ in range(10)]

        ref = init.clone().requires_grad_(False)
        p = torch.nn.Parameter(ref)
        opt = torch.optim.AdamW([p], lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                fused=fused, foreach=None if fused else True)

        master = init.clone()
        m = torch.zeros(n)
        v = torch.zeros(n)
        out = torch.zeros(n, dtype=torch.int16)
        for step, gb in enumerate(grads, start=1):
            p.grad = gb.float()
            opt.step()
            rc = LIB.slidedp_adamw_step(isa, ctypes.c_double(lr), ctypes.c_double(betas[0]),
                                        ctypes.c_double(betas[1]), ctypes.c_double(eps),
                                        ctypes.c_double(weight_decay), ctypes.c_double(1.0),
                                        ctypes.c_uint64(step), ptr(gb), 1, ptr(master), ptr(m),
                                        ptr(v), ptr(out), ctypes.c_size_t(n))
            self.assertEqual(rc, 0)
        st = opt.state[p]
        err = master_error(master, p.detach(), lr, len(grads))
        self.assertLessEqual(err, 1.0, f"master differs from torch beyond tolerance ({err:.3f})")
        torch.testing.assert_close(m, st["exp_avg"], rtol=1e-5, atol=1e-6)  # grads ~N(0,1)
        torch.testing.assert_close(v, st["exp_avg_sq"], rtol=1e-5, atol=1e-9)
        # Our BF16 output is exactly torch's RNE cast of our master.
        self.assertTrue(torch.equal(out, master.to(torch.bfloat16).view(torch.int16)))
        return err

    def test_against_torch(self):
        report = []
        isas = [i for i in range(4) if LIB.slidedp_isa_supported(i)]
        for fused in (False, True):
            for n in (1, 17, 1000, 65537):
                for wd in (0.0, 0.1):
                    for isa in isas:
                        report.append((fused, n, wd, isa, self.run_case(fused, n, wd, isa)))
        print("worst master error vs torch, as a fraction of the tolerance:",
              f"{max(r[-1] for r in report):.3f}", file=sys.stderr)


if __name__ == "__main__":
    LIB = ctypes.CDLL(sys.argv[1])
    LIB.slidedp_adamw_step.restype = ctypes.c_int
    LIB.slidedp_isa_supported.restype = ctypes.c_int
    unittest.main(argv=sys.argv[:1], verbosity=2)
