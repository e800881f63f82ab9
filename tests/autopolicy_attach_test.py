#!/usr/bin/env python3
"""policy="auto", slidedp.attach's default (issue #19 items 3 and 6), on the CPU through a real
hostd:
  - with no memory_budget the CPU trains every layer F-r0 at once (nothing to choose);
  - with a memory_budget the layout is chosen at the first forward: opt.step() before it is
    refused, the chosen layout fits the budget (preflight's estimate) and keeps more than F, and
    the losses and hostd's final parameters equal every-layer-F's bit for bit;
  - a budget nothing fits is refused (code 8) at the first forward before hostd hears of a step:
    hostd's job stays at step 0 with no step running, and the rank detaches cleanly;
  - a chosen layout with a resident decoder layer re-attaches the rank with the new set of
    layers it updates (hostd's client_updated_layers), and trains like the same layout given
    explicitly, bit for bit;
  - two torchrun ranks with a process group take rank 0's layout (resident decoder layers
    included: both re-attach) and train like that layout given explicitly;
  - a selection that fails (not a refusal) warns and trains every layer F-r0;
  - a hostd that dies before the first forward: UNAVAILABLE at that forward, no hang, detached;
  - explicit settings (checkpointing=...) win over "auto".

usage: autopolicy_attach_test.py HOSTD LIBSLIDEDP_RANK.so SLIDEDPCTL [unittest args]
About 2 min on 2 cores (4-5 min when the machine is busy).
"""
import inspect
import json
import os
import subprocess
import sys
import tempfile
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "python_client"))
sys.path.insert(0, os.path.join(ROOT, "tests"))
from harness import HostdProcess  # noqa: E402

HOSTD = LIB = CTL = None
BATCH, SEQ, STEPS = 8, 4096, 2

import torch  # noqa: E402
import transformers  # noqa: E402


def tiny_config():
    return transformers.Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=128,
                                    num_hidden_layers=4, num_attention_heads=4,
                                    num_key_value_heads=2, head_dim=16,
                                    max_position_embeddings=4096)


class AutoAttach(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="slidedp-autoattach-")
        cls.model_dir = os.path.join(cls.tmp, "model")
        torch.manual_seed(0)
        m = transformers.AutoModelForCausalLM.from_config(tiny_config()).float()
        m.save_pretrained(cls.model_dir, safe_serialization=True)
        os.environ["SLIDEDP_RANK_LIB"] = LIB
        os.environ["SLIDEDP_CTL"] = CTL
        os.environ["XDG_CACHE_HOME"] = os.path.join(cls.tmp, "cache")
        g = torch.Generator().manual_seed(1)
        cls.data = [torch.randint(0, 256, (BATCH, SEQ), generator=g) for _ in range(STEPS)]

    def setUp(self):
        self.hostds = []

    def tearDown(self):
        for h in self.hostds:
            h.finish()

    def hostd(self, tag):
        h = HostdProcess(HOSTD, "--model", self.model_dir, "--world_size", "1", "--mlock",
                         "best_effort", "--update_threads", "1", "--grad_dtype", "fp32",
                         tmp=self.tmp, tag=tag, slidedpctl=CTL, log_name=f"hostd-{tag}.log")
        self.hostds.append(h)
        return h.start()

    def model(self):
        m = transformers.AutoModelForCausalLM.from_pretrained(self.model_dir,
                                                              dtype=torch.float32)
        m.config._attn_implementation = "sdpa"
        m.train()
        return m

    def steps(self, model, opt):
        """Trains on self.data; returns (every step's loss, the last step's figures)."""
        losses, stats = [], None
        for x in self.data:
            loss = model(input_ids=x, labels=x).loss
            loss.backward()
            stats = opt.step()
            losses.append(float(loss.detach()))
        return losses, stats

    def train(self, tag, **kw):
        import slidedp
        h = self.hostd(tag)
        model, opt = slidedp.attach(self.model(), hostd=h.socket, device="cpu", **kw)
        losses, stats = self.steps(model, opt)
        layout = stats.get("policy")
        rt = model.slidedp
        final = rt.fetch_state_dict()
        opt.close()
        return losses, final, layout, rt

    def budget(self, frac):
        from slidedp import preflight
        cfg = tiny_config()
        floor = preflight.layout_activation_bytes(cfg, BATCH, SEQ, [("F", 1.0)] * 4)
        all_n = preflight.layout_activation_bytes(cfg, BATCH, SEQ, [("N", 0.0)] * 4)
        return int(floor + frac * (all_n - floor))

    def assert_same(self, a, b):
        self.assertEqual(a[0], b[0])  # every step's loss
        self.assertEqual(sorted(a[1]), sorted(b[1]))
        for n, t in a[1].items():
            self.assertTrue(torch.equal(t, b[1][n]), n)

    def test_cpu_without_budget_trains_every_layer_f(self):
        from slidedp import policy
        import slidedp
        h = self.hostd("nob")
        model, opt = slidedp.attach(self.model(), hostd=h.socket, device="cpu")
        self.assertFalse(getattr(model.slidedp, "pending", False))
        self.assertEqual(policy.format_layout(model.slidedp.s["policies"]), "4F-r0")
        opt.close()

    def test_budget_chosen_at_first_forward_bit_exact_with_f(self):
        import slidedp
        from slidedp import policy, preflight
        ref = self.train("ref", policy="4F-r0")
        budget = self.budget(0.6)
        h = self.hostd("auto")
        model, opt = slidedp.attach(self.model(), hostd=h.socket, device="cpu",
                                    memory_budget=budget)
        self.assertTrue(model.slidedp.pending)
        # The forward's signature is the model's, before and after the first call (HF Trainer
        # keeps the dataset columns it names).
        self.assertIn("input_ids", inspect.signature(model.forward).parameters)
        with self.assertRaises(slidedp.SlideDPError) as cm:
            opt.step()
        self.assertEqual(cm.exception.code, 9)
        self.assertIn("before the first forward", str(cm.exception))
        opt.zero_grad()
        losses, stats = self.steps(model, opt)
        rt = model.slidedp
        self.assertFalse(getattr(rt, "pending", False))
        self.assertIn("labels", inspect.signature(model.forward).parameters)
        chosen = rt.s["policies"]
        self.assertEqual(stats["policy"], policy.format_layout(chosen))
        self.assertNotEqual(stats["policy"], "4F-r0")  # the budget leaves room to keep more
        est = preflight.layout_activation_bytes(model.config, BATCH, SEQ,
                                                [(p.kind, p.ratio) for p in chosen])
        self.assertLessEqual(est, budget, stats["policy"])
        final = rt.fetch_state_dict()
        opt.close()
        self.assert_same((losses, final), ref)

    def test_refused_before_hostd_hears_of_a_step(self):
        import slidedp
        from slidedp import preflight
        floor = preflight.layout_activation_bytes(tiny_config(), BATCH, SEQ, [("F", 1.0)] * 4)
        h = self.hostd("refuse")
        model, opt = slidedp.attach(self.model(), hostd=h.socket, device="cpu",
                                    memory_budget=floor // 2)
        x = self.data[0]
        with self.assertRaises(slidedp.SlideDPError) as cm:
            model(input_ids=x, labels=x)
        self.assertEqual(cm.exception.code, 8, str(cm.exception))
        self.assertIn("no layout fits", str(cm.exception))
        self.assertRegex(str(cm.exception), r"batch <= [34] fits \(seq 4096\)")
        self.assertIn("Nothing was sent to hostd", str(cm.exception))
        st = h.ctl_json("status")
        self.assertEqual(int(st["job"].get("step", 0)), 0, st["job"])  # none completed
        self.assertEqual(st["job"].get("step_state"), "idle", st["job"])  # none begun
        self.assertTrue(model.slidedp.pending)  # still waiting for a batch that fits
        opt.close()
        st = h.ctl_json("status")
        self.assertEqual([r for r in st.get("ranks", []) if r.get("attached")], [], st)

    def test_resident_layer_chosen_reattaches(self):
        from slidedp import autopolicy, policy
        ref = self.train("rref", policy="1R 3F-r0", nondecoder="resident")
        orig = autopolicy.select

        def select(*a, **kw):  # the choice fixed, to exercise what attach does with it
            self.assertTrue(kw["allow_resident"])
            sel = autopolicy.Selection()
            sel.layers = 4
            sel.policies = policy.parse_layout("1R 3F-r0", 4)
            sel.info = {"why": "fixed by the test", "selection_s": 0.0}
            return sel
        autopolicy.select = select
        try:
            got = self.train("rauto", nondecoder="resident", memory_budget=self.budget(1.0))
        finally:
            autopolicy.select = orig
        self.assertEqual(got[2], "1R 3F-r0")
        rt = got[3]
        resident = sorted(i for i, l in rt.layers.items() if l.resident)
        self.assertEqual(resident, [0, 1, 5, 6])  # embedding, decoder 1, norm, lm_head
        self.assert_same(got[:2], ref[:2])

    def test_two_ranks_take_rank_zeros_layout(self):
        """torchrun, 2 CPU ranks with a gloo process group and nondecoder="resident": rank 0
        selects, both ranks take its layout (here with resident decoder layers, so both detach
        and attach again with the new client_updated_layers), and the job trains exactly like
        the same layout given explicitly."""
        import socket as socketlib
        from slidedp import preflight
        cfg = tiny_config()
        b, s = 4, 2048  # 2 rows of 2048 per rank
        floor = preflight.layout_activation_bytes(cfg, b // 2, s, [("F", 1.0)] * 4)
        all_n = preflight.layout_activation_bytes(cfg, b // 2, s, [("N", 0.0)] * 4)
        budget = int(floor + 0.6 * (all_n - floor))

        def run(tag, *extra):
            h = HostdProcess(HOSTD, "--model", self.model_dir, "--world_size", "2", "--mlock",
                             "best_effort", "--update_threads", "1", "--grad_dtype", "fp32",
                             tmp=self.tmp, tag=tag, slidedpctl=CTL, log_name=f"hostd-{tag}.log")
            self.hostds.append(h)
            h.start()
            with socketlib.socket() as so:
                so.bind(("127.0.0.1", 0))
                port = so.getsockname()[1]
            log = os.path.join(self.tmp, f"{tag}-loss{{rank}}.jsonl")
            dump = os.path.join(self.tmp, f"{tag}-params.pt")
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                   "--master-addr", "127.0.0.1", "--master-port", str(port),
                   os.path.join(ROOT, "examples", "train_hf.py"), "train", "--hostd", h.socket,
                   "--model", self.model_dir, "--batch", str(b), "--seq", str(s), "--steps", "2",
                   "--device", "cpu", "--threads", "1", "--no-progress", "--dist-backend",
                   "gloo", "--nondecoder", "resident", "--loss-log", log, "--dump-params", dump,
                   *extra]
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=400,
                               env=dict(os.environ, OMP_NUM_THREADS="1"))
            self.assertEqual(r.returncode, 0, r.stdout[-3000:] + r.stderr[-5000:])
            recs = []
            for k in range(2):
                with open(log.format(rank=k)) as f:
                    recs.append([json.loads(line) for line in f])
            return recs, torch.load(dump), r.stderr

        recs, final, err = run("two-auto", "--memory-budget", str(budget))
        self.assertIn("slidedp AutoPolicy", err)
        layouts = {rec["policy"] for rank in recs for rec in rank}
        self.assertEqual(len(layouts), 1, layouts)  # both ranks, every step
        layout = layouts.pop()
        self.assertIn("R", layout)  # resident decoder layers: the re-attach of both ranks
        ref, ref_final, _ = run("two-fixed", "--policy", layout)
        for k in range(2):
            self.assertEqual([r["loss"] for r in recs[k]], [r["loss"] for r in ref[k]])
        self.assert_same(([], final), ([], ref_final))

    def test_layout_changed_between_steps_trains_like_f(self):
        """The runtime's set_policies, what AutoPolicy's validation calls from end_step after a
        step (rt.auto.after_step): refused inside a step, taken between steps, and a layout
        changed twice trains bit for bit like every layer F (on the GPU the first version
        called it before the step was closed, and every defaults run failed)."""
        import slidedp
        from slidedp import policy
        ref = self.train("sw-ref", policy="4F-r0")
        h = self.hostd("switch")
        model, opt = slidedp.attach(self.model(), hostd=h.socket, device="cpu", policy="4F-r0")
        rt = model.slidedp
        plan = iter(["2N 2SAC-r0.5", "1Seg 1F-r1 2N-r0.5"])

        class Switch:  # what AutoValidation does after a step
            def after_step(self, stats):
                nxt = next(plan, None)
                if nxt is not None:
                    rt.set_policies(policy.parse_layout(nxt, 4))
        # Other resident layers than attached; a layout for 3 of the 4 layers.
        for bad, layers in (("1R 3F-r0", 4), ("3F-r0", 3)):
            with self.assertRaises(slidedp.SlideDPError) as cm:
                rt.set_policies(policy.parse_layout(bad, layers))
            self.assertEqual(cm.exception.code, 3, str(cm.exception))
        rt.auto = Switch()
        losses, ran = [], []
        for i, x in enumerate(self.data):
            loss = model(input_ids=x, labels=x).loss
            if i == 0:
                with self.assertRaises(slidedp.SlideDPError) as cm:  # inside the step
                    rt.set_policies(policy.parse_layout("4N", 4))
                self.assertIn("a step is running", str(cm.exception))
            loss.backward()
            ran.append(opt.step()["policy"])
            losses.append(float(loss.detach()))
        self.assertEqual(ran[:2], ["4F-r0", "2N 2SAC-r0.5"])
        final = rt.fetch_state_dict()
        opt.close()
        self.assert_same((losses, final), ref)

    def test_dead_hostd_at_the_first_forward(self):
        """hostd dies between attach and the first forward: the first forward (the selection,
        then the attach proper) fails with UNAVAILABLE naming what it did, without hanging,
        and the model is left detached (a later forward says so, close() does not hang)."""
        import time
        import slidedp
        from harness import remove_shm
        h = self.hostd("dead")
        model, opt = slidedp.attach(self.model(), hostd=h.socket, device="cpu",
                                    memory_budget=self.budget(0.6), timeout_s=10)
        self.hostds.remove(h)
        h.kill()
        self.addCleanup(remove_shm, h.instance)  # a killed hostd leaves them for re-adoption
        x = self.data[0]
        t0 = time.time()
        with self.assertRaises(slidedp.SlideDPError) as cm:
            model(input_ids=x, labels=x)
        self.assertEqual(cm.exception.code, 14, str(cm.exception))
        self.assertIn("hostd is gone", str(cm.exception))  # and what it was doing:
        self.assertIn("fetching layer", str(cm.exception))  # verifying hostd's weights
        self.assertLess(time.time() - t0, 60)
        with self.assertRaises(slidedp.SlideDPError) as cm:
            model(input_ids=x, labels=x)
        self.assertIn("detached from hostd", str(cm.exception))
        opt.close()

    def test_selection_failure_falls_back_to_every_layer_f(self):
        """A selection that fails for another reason than a batch that cannot fit (here
        slidedpctl cannot be run) warns and trains with every layer F-r0."""
        import slidedp
        h = self.hostd("fallback")
        os.environ["SLIDEDP_CTL"] = os.path.join(self.tmp, "no-such-slidedpctl")
        try:
            model, opt = slidedp.attach(self.model(), hostd=h.socket, device="cpu",
                                        memory_budget=self.budget(0.6))
            x = self.data[0]
            with self.assertLogs("slidedp", "WARNING") as logs:
                model(input_ids=x, labels=x).loss.backward()
            self.assertIn("the selection failed", "\n".join(logs.output))
            self.assertEqual(opt.step()["policy"], "4F-r0")
            opt.close()
        finally:
            os.environ["SLIDEDP_CTL"] = CTL

    def test_explicit_settings_win(self):
        import slidedp
        from slidedp import policy
        h = self.hostd("expl")
        model, opt = slidedp.attach(self.model(), hostd=h.socket, device="cpu",
                                    checkpointing="none", memory_budget=self.budget(1.0))
        self.assertFalse(getattr(model.slidedp, "pending", False))
        self.assertEqual(policy.format_layout(model.slidedp.s["policies"]), "4N")
        opt.close()
        with self.assertRaises(slidedp.SlideDPError) as cm:
            slidedp.attach(self.model(), hostd=h.socket, device="cpu", policy=4)
        self.assertIn("policy: 4", str(cm.exception))


if __name__ == "__main__":
    HOSTD, LIB, CTL = sys.argv[1:4]
    del sys.argv[1:4]
    unittest.main()
