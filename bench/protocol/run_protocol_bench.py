#!/usr/bin/env python3
"""Per-layer overhead of the data-plane protocol for R = 1..4 rank processes through one hostd.

Usage: run_protocol_bench.py --hostd PATH --bench PATH [--ranks 1,2,3,4] [--layers 64]
                             [--numel 1024] [--steps 50] [--out FILE]
Starts hostd (--model none) for each R, runs R protocol_bench processes (rank 0 creates the
job), and writes one JSON report with the machine, the command and every rank's medians.
"""
import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time


def run_world(args, world):
    tmp = tempfile.mkdtemp(prefix="slidedp-protobench-")
    sock = os.path.join(tmp, "hostd.sock")
    instance = f"pb{os.getpid()}w{world}"
    hostd = subprocess.Popen([args.hostd, "--model", "none", "--world_size", str(world),
                              "--socket", sock, "--instance", instance, "--mlock", "best_effort",
                              "--log_level", "warn"])
    try:
        while not os.path.exists(sock):
            if hostd.poll() is not None:
                raise SystemExit(f"hostd exited with {hostd.returncode}")
            time.sleep(0.05)
        ranks = [subprocess.Popen([args.bench, "--socket", sock, "--rank", str(r), "--world",
                                   str(world), "--layers", str(args.layers), "--numel",
                                   str(args.numel), "--steps", str(args.steps)] +
                                  (["--create-job"] if r == 0 else []),
                                  stdout=subprocess.PIPE, text=True) for r in range(world)]
        results = []
        for p in ranks:
            out, _ = p.communicate(timeout=600)
            if p.returncode != 0:
                raise SystemExit(f"protocol_bench exited with {p.returncode}")
            results.append(json.loads(out))
        return results
    finally:
        hostd.send_signal(signal.SIGTERM)
        hostd.wait(timeout=60)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hostd", required=True)
    ap.add_argument("--bench", required=True)
    ap.add_argument("--ranks", default="1,2,3,4")
    ap.add_argument("--layers", type=int, default=64)
    ap.add_argument("--numel", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--out")
    args = ap.parse_args()
    report = {
        "benchmark": "protocol",
        "command": " ".join([sys.executable] + sys.argv),
        "machine": {"host": platform.node(), "cpu": platform.processor() or platform.machine(),
                    "cores": os.cpu_count(), "kernel": platform.release()},
        "units": "microseconds (medians over steps and layers)",
        "worlds": [],
    }
    for world in (int(x) for x in args.ranks.split(",")):
        ranks = run_world(args, world)
        report["worlds"].append({"world": world, "ranks": ranks})
        worst = max(ranks, key=lambda r: r["step_us_per_layer"])
        print(f"R={world}: fetch {worst['fetch_us_per_layer']:.1f} us/layer, push "
              f"{worst['push_us_per_layer']:.1f} us/layer, step {worst['step_us_per_layer']:.1f} "
              f"us/layer, step-end wait {worst['step_end_wait_us']:.1f} us", file=sys.stderr)
    text = json.dumps(report, indent=2)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
