#!/usr/bin/env python3
"""The step-time model's predictions for R GPUs (issue #19 acceptance 4), written down before
machines with several GPUs are lent: `slidedpctl plan --json` on the Qwen3-4B shape at each
(batch per rank, seq) of the head-to-head, for R = 1, 2, 4, 8, with the layout given (default:
every layer F-r0) and the GPU-reduction route. Writes JSON (the command, every plan's figures)
and prints one line per plan.

usage: plan_predictions.py SLIDEDPCTL OUT.json [--layout L] [--profile FILE]
"""
import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
SHAPES = [(8, 1024), (16, 1024), (32, 1024), (1, 8192), (1, 32768)]


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ctl")
    ap.add_argument("out")
    ap.add_argument("--layout", default=None)
    ap.add_argument("--profile", default=None)
    ap.add_argument("--gpus", default="1,2,4,8")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        subprocess.run([sys.executable, os.path.join(REPO, "examples", "train_hf.py"), "prepare",
                        d, "--model", "qwen3-4b", "--config-only"], check=True,
                       capture_output=True)
        rows = []
        for g in [int(x) for x in a.gpus.split(",")]:
            for b, s in SHAPES:
                cmd = [a.ctl, "plan", "--model", os.path.join(d, "config.json"), "--gpus",
                       str(g), "--batch", str(b), "--seq", str(s), "--json"]
                if a.layout:
                    cmd += ["--layout", a.layout]
                if a.profile:
                    cmd += ["--profile", a.profile]
                j = json.loads(subprocess.run(cmd, check=True, capture_output=True,
                                              text=True).stdout)
                row = {"gpus": g, "batch_per_rank": b, "seq": s, "step_s": j["step_s"],
                       "regime": j["regime"], "tokens_per_s": j["tokens_per_s"],
                       "c_s": j["compute"]["c_s"], "e_s": j["exposure"]["e_s"],
                       "pcie_gb_per_step": j["pcie"]["gb_per_step"], "r_cross": j["r_cross"],
                       "plan": j}
                rows.append(row)
                print(f"R={g} b{b} seq{s}: step {j['step_s']:.3f} s ({j['regime']}), "
                      f"{j['tokens_per_s']:.0f} tok/s, PCIe {j['pcie']['gb_per_step']:.1f} "
                      f"GB/step")
    out = {"benchmark": "plan_predictions", "command": shlex.join([sys.executable] + sys.argv),
           "machine": {"host": platform.node(), "python": platform.python_version()},
           "model": "Qwen3-4B shape (examples/train_hf.py qwen3-4b)",
           "layout": a.layout or "every layer F-r0", "profile": a.profile or "built-in H200",
           "rows": rows}
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
