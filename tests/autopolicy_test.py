#!/usr/bin/env python3
"""slidedp.autopolicy (issue #19 item 3 and item 6 on the CPU): the HiGHS allocation equals the
exhaustive optimum over count vectors; a selection honours memory_budget (its layout's preflight
estimate fits, smaller budgets recompute more) and refuses with RESOURCE_EXHAUSTED when nothing
fits, without a hostd; the one-layer profile times every activation kind; a second selection of
the same workload is served from the cache without running slidedpctl.

usage: autopolicy_test.py SLIDEDPCTL [unittest args]. About 10 s on 2 cores.
"""
import os
import random
import sys
import tempfile
import unittest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "python_client"))
CTL = None

import torch  # noqa: E402
import transformers  # noqa: E402

from slidedp import autopolicy as ap  # noqa: E402
from slidedp import preflight  # noqa: E402
from slidedp._lib import SlideDPError  # noqa: E402
from slidedp.policy import LayerPolicy  # noqa: E402


def tiny(layers=4):
    cfg = transformers.Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=layers, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=512)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg).float()


def select(model, batch, seq, budget, **kw):
    args = dict(world_size=1, grad_route="cpu_reduction", window_slots=6,
                nondecoder_resident=False, allow_resident=False, memory_budget=budget,
                lib_path=None)
    args.update(kw)
    return ap.select(model, model.model, torch.device("cpu"), batch, seq, **args)


class Solver(unittest.TestCase):
    def test_equals_brute_force(self):
        rng = random.Random(7)
        kinds = [LayerPolicy(k, r) for k in ("F", "Seg", "SAC", "N") for r in (0.0, 1.0)]
        for case in range(40):
            layers = rng.randint(1, 6)
            cands = rng.sample(kinds, rng.randint(2, 5))
            if rng.random() < 0.5:
                cands.append(LayerPolicy("N", 0.0, True))
            costs = {}
            for p in cands:
                costs[p] = {"c": rng.uniform(0.5, 2.0), "h2d": rng.uniform(-0.5, 1.0),
                            "d2h": rng.uniform(-0.5, 1.0), "host_adam": rng.uniform(-0.3, 0.3),
                            "cpu_reduce": 0.0, "mem": rng.uniform(1, 100) * 2 ** 20}
            base = {"c": rng.uniform(0, 1), "h2d": rng.uniform(0, 4), "d2h": rng.uniform(0, 4),
                    "host_adam": rng.uniform(0, 5), "cpu_reduce": 0.0}
            budget = rng.uniform(0.2, 1.0) * layers * 100 * 2 ** 20
            max_res = rng.randint(0, layers)
            got, obj = ap.solve(layers, costs, base, budget, max_res)
            want, wobj = ap.brute_force(layers, costs, base, budget, max_res)
            with self.subTest(case=case):
                self.assertEqual(got is None, want is None, (got, want))
                if want is not None:
                    self.assertAlmostEqual(obj, wobj, places=6)
                    self.assertEqual(sum(got.values()), layers)
                    self.assertLessEqual(sum(n for p, n in got.items() if p.resident), max_res)
                    mem = sum(n * costs[p]["mem"] for p, n in got.items())
                    self.assertLessEqual(mem, budget * (1 + 1e-6))

    def test_no_offload_that_buys_nothing(self):
        # Every kind as fast: the layout keeping everything on the device without PCIe traffic.
        costs = {LayerPolicy("N", 0.0): {"c": 1.0, "h2d": 0.0, "d2h": 0.0, "host_adam": 0.0,
                                         "cpu_reduce": 0.0, "mem": 10.0},
                 LayerPolicy("N", 1.0): {"c": 1.0, "h2d": 0.1, "d2h": 0.1, "host_adam": 0.0,
                                         "cpu_reduce": 0.0, "mem": 0.0}}
        got, obj = ap.solve(4, costs, {"c": 0.0}, 100.0, 0)
        self.assertEqual(got, {LayerPolicy("N", 0.0): 4})
        got, _ = ap.solve(4, costs, {"c": 0.0}, 25.0, 0)
        self.assertEqual(got, {LayerPolicy("N", 0.0): 2, LayerPolicy("N", 1.0): 2})


class Selection(unittest.TestCase):
    def setUp(self):
        self.cache = tempfile.TemporaryDirectory()
        os.environ["XDG_CACHE_HOME"] = self.cache.name
        os.environ["SLIDEDP_CTL"] = CTL

    def tearDown(self):
        self.cache.cleanup()

    def estimate(self, model, batch, seq, sel):
        return preflight.layout_activation_bytes(model.config, batch, seq,
                                                 [(p.kind, p.ratio) for p in sel.policies])

    def test_budget_honoured(self):
        # 32K tokens a step: compute-bound in the step model (H200 profile), so keeping
        # activations pays and the budget decides how much.
        model = tiny()
        b, s = 8, 4096
        all_n = preflight.layout_activation_bytes(model.config, b, s, [("N", 0.0)] * 4)
        floor = preflight.layout_activation_bytes(model.config, b, s, [("F", 1.0)] * 4)
        kept = []
        for frac in (1.5, 0.9, 0.6, 0.3, 0.0):
            budget = int(floor + frac * (all_n - floor))
            sel = select(model, b, s, budget)
            self.assertEqual(len(sel.policies), 4)
            self.assertLessEqual(self.estimate(model, b, s, sel), budget, sel.layout)
            kept.append(sum(preflight.saved_bytes_per_token(model.config, p.kind)[0]
                            for p in sel.policies))
            text = ap.format_table(sel, b, s)
            self.assertIn(sel.layout, text)
            self.assertIn("selection", text)
        self.assertEqual(kept, sorted(kept, reverse=True), kept)  # less memory, less kept
        self.assertGreater(kept[0], kept[-1])
        roomy = select(model, b, s, int(2 * all_n))
        self.assertIn("break-even after", ap.format_table(roomy, b, s))

    def test_refused_when_nothing_fits(self):
        model = tiny()
        floor = preflight.layout_activation_bytes(model.config, 2, 64, [("F", 1.0)] * 4)
        with self.assertRaises(SlideDPError) as e:
            select(model, 2, 64, floor // 2)
        self.assertEqual(e.exception.code, 8)
        self.assertIn("no layout fits", str(e.exception))
        self.assertIn("Nothing was sent to hostd", str(e.exception))

    def test_cpu_without_budget_is_the_reference(self):
        sel = select(tiny(), 2, 64, None)
        self.assertEqual(sel.layout, "4F-r0")

    def test_cache(self):
        model = tiny()
        budget = preflight.layout_activation_bytes(model.config, 2, 64, [("SAC", 0.0)] * 4)
        first = select(model, 2, 64, budget)
        self.assertTrue(first.info["cache"].startswith("miss"), first.info["cache"])
        calls = []
        orig = ap.Planner.__call__

        def counting(self, layout):
            calls.append(layout)
            return orig(self, layout)
        ap.Planner.__call__ = counting
        try:
            second = select(model, 2, 64, budget)
            self.assertTrue(second.info["cache"].startswith("hit"), second.info["cache"])
            self.assertEqual(second.layout, first.layout)
            self.assertEqual(len(calls), 1, calls)  # only the chosen layout's summary
            select(model, 4, 64, budget * 2)  # another workload: measured again
            self.assertGreater(len(calls), 2)
        finally:
            ap.Planner.__call__ = orig
        # A cache file cut short (a full disk, a kill mid-write of an older version): measured
        # again and rewritten, not an error.
        for name in os.listdir(ap.cache_dir()):
            with open(os.path.join(ap.cache_dir(), name), "w") as f:
                f.write('{"key": "')
        third = select(model, 2, 64, budget)
        self.assertTrue(third.info["cache"].startswith("miss"), third.info["cache"])
        self.assertEqual(third.layout, first.layout)
        # A cache that cannot be written (its folder is a file): the selection still stands.
        root = os.environ["XDG_CACHE_HOME"]
        os.environ["XDG_CACHE_HOME"] = os.path.join(root, "cache-file")
        try:
            with open(os.environ["XDG_CACHE_HOME"], "w") as f:
                f.write("not a folder")
            fourth = select(model, 2, 64, budget)
            self.assertTrue(fourth.info["cache"].startswith("not written"), fourth.info["cache"])
            self.assertEqual(fourth.layout, first.layout)
        finally:
            os.environ["XDG_CACHE_HOME"] = root


class Profile(unittest.TestCase):
    def test_every_kind_timed(self):
        model = tiny(2)
        prof = ap.profile_kinds(model.model, ["F", "Seg", "SAC", "N"], 2, 32,
                                torch.device("cpu"), torch.float32, repeats=1)
        self.assertEqual(set(prof), {"F", "Seg", "SAC", "N"})
        for kind, row in prof.items():
            self.assertGreater(row["time_s"], 0.0, kind)
            self.assertGreater(row["time_s"], row["forward_s"], kind)
            self.assertIsNone(row["kept_bytes"])


if __name__ == "__main__":
    CTL = os.path.abspath(sys.argv.pop(1))
    unittest.main()
