#!/usr/bin/env python3
"""The clip / skip rule: python_client's resident-layer AdamW against the one C++ rule.

Usage: clip_rule_parity_test.py LIBSLIDEDP_RANK.so
hostd's update worker decides clipping and the non-finite skip with kernels::DecideClip
(kernels/cpu/grad_clip.h), exported as slidedp_clip_scale. python_client/slidedp/hf.py updates
the resident layers itself (StreamedRuntime._resident_update). This test feeds the same gradients
to that Python update (with a stand-in rank that serves the optimizer settings) and to the C
function with the norm the Python side computed, and checks both take the same decision: skip or
not, and the same scale, bit for bit once applied to the FP32 gradient. The cases cover a norm
below, at, just within the 1e-6 of, and above the threshold, Inf and NaN gradients, clip none and
max_grad_norm 0 (no clipping on either side). Exits 77 (CTest: skipped) when torch is missing.
"""
import math
import os
import sys
import types
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "python_client"))

try:
    import torch
except ImportError:  # pragma: no cover - reported as a skip by CTest
    print("torch is not installed: skipping the clip rule parity test")
    sys.exit(77)

from slidedp import _lib  # noqa: E402
from slidedp.hf import StreamedRuntime  # noqa: E402

LIB = None
SENTINEL = 7.0  # the first moment before the update: still there after a skipped update


class StandInRank:
    """What _resident_update asks of its rank: the world size and hostd's optimizer settings."""

    world_size = 1

    def __init__(self, clip, max_grad_norm):
        self.settings = {
            # beta1 = 0: the first moment after the update is the (clipped) gradient itself.
            "lr": 1e-3, "beta1": 0.0, "beta2": 0.5, "eps": 1e-8, "weight_decay": 0.0,
            "no_decay_norms_and_biases": False, "no_decay_tensors": [], "clip": clip,
            "max_grad_norm": max_grad_norm, "scale_by_world_size": False, "steps_completed": 0,
        }

    def optimizer(self, step):
        return dict(self.settings)


def python_update(grad, clip, max_grad_norm):
    """Runs hf.py's resident-layer update on one layer; returns (norm, skipped, applied grad)."""
    n = grad.numel()
    layer = types.SimpleNamespace(
        resident=True, acc=grad.clone(), params=[], master=torch.zeros(n),
        m=torch.full((n,), SENTINEL), v=torch.zeros(n), flat=torch.zeros(n, dtype=torch.bfloat16))
    rt = types.SimpleNamespace(layers={0: layer}, rank=StandInRank(clip, max_grad_norm), step=1,
                               s={}, resident_skipped=0)
    StreamedRuntime._resident_update(rt)
    norm = grad.norm().item()  # what _resident_update computed (the same torch call)
    return norm, rt.resident_skipped == 1, layer.m


def threshold(clip, max_grad_norm):
    """The threshold hostd passes to DecideClip for a layer clipped by itself (PerLayerThreshold
    in hostd/optimizer.cc): max_grad_norm under per_layer, none otherwise."""
    return max_grad_norm if clip == "per_layer" else 0.0


class ClipRuleParityTest(unittest.TestCase):
    def check(self, values, clip, max_grad_norm, expect_skip, expect_clipped):
        grad = torch.tensor(values, dtype=torch.float32)
        norm, py_skip, py_applied = python_update(grad, clip, max_grad_norm)
        c_skip, c_scale = _lib.clip_scale(norm, threshold(clip, max_grad_norm), LIB)
        what = f"grad {values}, clip {clip}, max_grad_norm {max_grad_norm}, norm {norm!r}"
        self.assertEqual(py_skip, c_skip, what)
        self.assertEqual(c_skip, expect_skip, what)
        if c_skip:
            self.assertEqual(c_scale, 1.0, what)
            self.assertTrue(torch.all(py_applied == SENTINEL), f"{what}: the update ran")
            return
        self.assertEqual(c_scale < 1.0, expect_clipped, f"{what}: scale {c_scale!r}")
        # The C scale applied the way hf.py applies a scale (in place on the FP32 gradient, only
        # when it is below 1) gives exactly the gradient the Python update used.
        expected = grad.clone()
        if c_scale < 1.0:
            expected.mul_(c_scale)
        self.assertTrue(torch.equal(py_applied, expected),
                        f"{what}: python applied {py_applied.tolist()}, C scale {c_scale!r} "
                        f"gives {expected.tolist()}")
        if expect_clipped:
            self.assertAlmostEqual(c_scale, max_grad_norm / (norm + 1e-6), delta=1e-15)

    def test_below_the_threshold_is_not_clipped(self):
        self.check([0.3, 0.4], "per_layer", 1.0, expect_skip=False, expect_clipped=False)

    def test_a_norm_equal_to_the_threshold_is_scaled_by_the_epsilon(self):
        # norm 5 exactly in FP32: scale 5 / (5 + 1e-6) < 1 on both sides.
        self.check([3.0, 4.0], "per_layer", 5.0, expect_skip=False, expect_clipped=True)

    def test_a_norm_just_below_within_the_epsilon_is_scaled(self):
        self.check([3.0, 4.0], "per_layer", 5.0 + 5e-7, expect_skip=False, expect_clipped=True)

    def test_a_norm_below_by_more_than_the_epsilon_is_not_scaled(self):
        self.check([3.0, 4.0], "per_layer", 5.0 + 2e-6, expect_skip=False, expect_clipped=False)

    def test_a_norm_slightly_above_is_clipped(self):
        self.check([3.0, 4.0], "per_layer", 5.0 - 1e-5, expect_skip=False, expect_clipped=True)

    def test_a_norm_far_above_is_clipped_to_the_threshold(self):
        self.check([300.0, -400.0, 1200.0], "per_layer", 1.0, expect_skip=False,
                   expect_clipped=True)

    def test_an_inf_gradient_skips(self):
        for clip in ("per_layer", "none"):
            self.check([1.0, math.inf], clip, 1.0, expect_skip=True, expect_clipped=False)
            self.check([-math.inf, 0.0], clip, 1.0, expect_skip=True, expect_clipped=False)

    def test_a_nan_gradient_skips(self):
        for clip in ("per_layer", "none"):
            self.check([math.nan, 2.0], clip, 1.0, expect_skip=True, expect_clipped=False)

    def test_clip_none_never_scales(self):
        self.check([300.0, 400.0], "none", 1.0, expect_skip=False, expect_clipped=False)

    def test_max_grad_norm_zero_means_no_clipping(self):
        self.check([300.0, 400.0], "per_layer", 0.0, expect_skip=False, expect_clipped=False)

    def test_the_abi_refuses_bad_arguments(self):
        with self.assertRaises(_lib.SlideDPError) as e:
            _lib.clip_scale(-1.0, 1.0, LIB)
        self.assertEqual(e.exception.code, 3)
        self.assertIn("grad_norm", e.exception.message)
        self.assertEqual(LIB.slidedp_clip_scale(1.0, 1.0, None, None), 3)
        self.assertEqual(_lib.clip_scale(-math.inf, 1.0, LIB), (True, 1.0))

    def test_dtype_names_keep_the_abi_integers(self):
        self.assertEqual(int(_lib.DType.FP32), 1)
        self.assertEqual(int(_lib.DType.BF16), 2)
        self.assertIs(_lib.DTYPE_FP32, _lib.DType.FP32)
        self.assertIs(_lib.DType(2), _lib.DType.BF16)


if __name__ == "__main__":
    LIB = _lib.load(sys.argv[1])
    unittest.main(argv=sys.argv[:1], verbosity=2)
