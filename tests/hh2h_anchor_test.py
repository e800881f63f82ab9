#!/usr/bin/env python3
"""bench/hf_head_to_head/run.py's anchor system (issue #19 item 5): the anchor script's JSON lines are
parsed into a run record, fsdp2_offload / anchor step-time agreement is computed and flagged beyond
10%, and a run.py --dry-run invocation with a stand-in anchor script (no GPU: HH2H_ANCHOR_FORCE=1)
records it, prints the agreement line, and records a missing script as unavailable. The host-memory
sampler reads RSS from /proc/PID/status and PSS once after the measured steps (the child waits for
it). Takes about 40 s on 2 cores (two tiny-Qwen3 CPU runs).
"""
import glob
import json
import os
import subprocess
import sys
import tempfile
import unittest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN = os.path.join(REPO, "bench", "hf_head_to_head", "run.py")
sys.path.insert(0, os.path.dirname(RUN))
import run  # noqa: E402

FAKE = r'''
import json, os, sys
print("some log line", flush=True)
print(json.dumps({"what": "cpu_triad_GBps", "value": 12.5}))
b = int(sys.argv[2])
print(json.dumps({"what": sys.argv[1] + ("-nockpt" if os.environ.get("NO_CKPT") == "1" else ""),
                  "params_B": 4.02, "batch": b, "seq": 1024, "step_s": float(os.environ["FAKE_STEP_S"]),
                  "tokens_per_s": 1, "model_TFLOPS": 1.0, "peak_reserved_GiB": 20.1, "loss": 12.1}))
'''


def _report(folder):
    with open(glob.glob(os.path.join(folder, "*.json"))[0]) as f:
        return json.load(f)


class AnchorParsing(unittest.TestCase):
    def test_parse(self):
        text = ('noise\n{"what": "cpu_triad_GBps", "value": 80.1}\n'
                '{"what": "offload", "params_B": 4.02, "batch": 8, "seq": 1024, "step_s": 2.37, '
                '"tokens_per_s": 3463, "model_TFLOPS": 85.0, "peak_reserved_GiB": 30.2, "loss": 12.2}\n')
        r = run.parse_anchor_output(text, 8)
        self.assertEqual((r["status"], r["step_s"], r["step_s_mean"], r["seq"], r["cpu_triad_GBps"]),
                         ("ok", 2.37, 2.37, 1024, 80.1))
        self.assertIsNone(run.parse_anchor_output('{"what": "cpu_triad_GBps", "value": 1}\n', 8))
        with self.assertRaises(ValueError):
            run.parse_anchor_output(text, 16)

    def test_agreement(self):
        def runs(f_mean):
            return [{"system": "anchor", "ckpt": True, "batch": 8, "status": "ok", "step_s": 2.37},
                    {"system": "fsdp2_offload", "ckpt": True, "batch": 8, "status": "ok", "step_s": 9.0,
                     "step_s_mean": f_mean}]
        a = run.anchor_agreement(runs(2.5))
        self.assertEqual(len(a), 1)
        self.assertAlmostEqual(a[0]["ratio"], 2.5 / 2.37)
        self.assertTrue(a[0]["within_tolerance"])
        a = run.anchor_agreement(runs(4.4))[0]
        self.assertFalse(a["within_tolerance"])
        self.assertIn("FLAG", run.summary_table({"runs": [], "ratios": {"fsdp2_offload_over_anchor": [a]}}))
        a = run.anchor_agreement(runs(2.0)[:1])[0]  # no fsdp2_offload run
        self.assertIsNone(a["ratio"])
        self.assertIn("not run", a["why"])
        self.assertEqual(run.anchor_agreement(runs(2.0)[1:]), [])


class AnchorDryRun(unittest.TestCase):
    def test_dry_run(self):
        with tempfile.TemporaryDirectory() as d:
            fake = os.path.join(d, "anchor.py")
            with open(fake, "w") as f:
                f.write(FAKE)
            # A stand-in anchor step of 1000 s: the real fsdp2_offload CPU step (well under a
            # second) is outside 10% of it on any machine, so the agreement line must flag it.
            env = dict(os.environ, HH2H_ANCHOR_FORCE="1", FAKE_STEP_S="1000")
            r = subprocess.run([sys.executable, RUN, "--dry-run", "--anchor-script", fake, "--run", "anchor:on:2",
                                "--run", "fsdp2_offload:on:2", "--out", os.path.join(d, "out")],
                               capture_output=True, text=True, env=env, timeout=280)
            self.assertEqual(r.returncode, 0, r.stderr[-3000:])
            self.assertRegex(r.stderr, r"AGREEMENT fsdp2_offload / anchor step time \(ckpt b2\): [0-9.]+ .*FLAG")
            rep = _report(os.path.join(d, "out"))
            anchor, off = rep["runs"]
            self.assertEqual((anchor["status"], anchor["step_s"], anchor["seq"]),
                             ("ok", 1000.0, 1024))
            self.assertAlmostEqual(anchor["tokens_per_s"], 2 * 1024 / 1000.0)
            self.assertIsNone(anchor["host_pss_peak_GiB"])  # never walked
            self.assertEqual(off["status"], "ok", off.get("why"))
            self.assertEqual(off["settings"]["init_device"], "cpu")
            self.assertGreater(off["host_pss_measured_GiB"], 0)  # the sample after the measured steps
            self.assertGreater(off["host_rss_peak_train_GiB"], 0)
            self.assertLess(off["child_wall_s"], 120)  # it did not sit out the 30 s wait for that sample
            agr = rep["ratios"]["fsdp2_offload_over_anchor"][0]
            self.assertAlmostEqual(agr["ratio"], off["step_s_mean"] / 1000.0)
            self.assertFalse(agr["within_tolerance"])
            # a missing script: unavailable without running anything
            r = subprocess.run([sys.executable, RUN, "--dry-run", "--anchor-script", os.path.join(d, "none.py"),
                                "--run", "anchor:off:2", "--out", os.path.join(d, "out2")],
                               capture_output=True, text=True, env=env, timeout=200)
            self.assertEqual(r.returncode, 0, r.stderr[-3000:])
            rep = _report(os.path.join(d, "out2"))
            self.assertEqual(rep["runs"][0]["status"], "unavailable")
            self.assertIn("not found", rep["runs"][0]["why"])
            self.assertIn("n/a", r.stderr)


if __name__ == "__main__":
    unittest.main()
