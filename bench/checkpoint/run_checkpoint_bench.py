#!/usr/bin/env python3
"""Checkpoint stall while training runs: step times with and without a checkpoint in flight.

Usage: run_checkpoint_bench.py --hostd PATH --slidedpctl PATH --trainer PATH
                               [--layers 8] [--dim 2048] [--batch 4] [--steps 24]
                               [--checkpoint-at 8,16] [--dir DIR] [--pool BYTES]
                               [--update-threads 0] [--out FILE]
Starts hostd (--model none, checkpoint.dir DIR) and one native_trainer rank on an MLP of
`layers` x `dim` (FP32 master + m + v: 12 B per parameter written per checkpoint); when the
trainer has finished each step listed in --checkpoint-at it asks `slidedpctl checkpoint
--no-wait` for a checkpoint, which is then written while the following steps run. A poller
records when each checkpoint is in flight; each step is classed "with" when a checkpoint was in
flight at any point of it. Prints one JSON document: per-step milliseconds, the median step
time with and without a checkpoint in flight (and their ratio), hostd's checkpoint counters
(stall seconds: updates waiting on the writer; snapshot seconds: updates copying layers into
the pool; bytes; MB/s; layers pooled / written live) and the stall per step.

On a GPU machine the same counters come from `slidedpctl stats --json` while a python_client
job runs (examples/train_hf.py): start hostd with --checkpoint.dir and run
`slidedpctl checkpoint --no-wait` during training; compare the client's step_time_s of the
steps overlapping the write with the others.
"""
import argparse
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import tempfile
import threading
import time


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hostd", required=True)
    ap.add_argument("--slidedpctl", required=True)
    ap.add_argument("--trainer", required=True)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--checkpoint-at", default="8,16")
    ap.add_argument("--dir", default="")
    ap.add_argument("--pool", default="0", help="checkpoint.snapshot_pool_bytes (0: auto)")
    ap.add_argument("--update-threads", default="0")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    at = {int(x) for x in args.checkpoint_at.split(",") if x}

    tmp = tempfile.mkdtemp(prefix="slidedp-ckbench-")
    ckdir = args.dir or os.path.join(tmp, "ckpt")
    sock = os.path.join(tmp, "hostd.sock")
    instance = f"ckb{os.getpid()}"
    hostd_cmd = [args.hostd, "--model", "none", "--world_size", "1", "--socket", sock,
                 "--instance", instance, "--mlock", "best_effort", "--log_level", "warn",
                 "--update_threads", args.update_threads, "--checkpoint.dir", ckdir,
                 "--checkpoint.keep_last", "2", "--checkpoint.on_stop", "false",
                 "--checkpoint.snapshot_pool_bytes", args.pool]
    hostd = subprocess.Popen(hostd_cmd)
    inflight = []  # (t, step in flight or 0)
    stop = threading.Event()
    try:
        while not os.path.exists(sock):
            if hostd.poll() is not None:
                raise SystemExit(f"hostd exited with {hostd.returncode}")
            time.sleep(0.05)

        def ctl(*a, check=True):
            r = subprocess.run([args.slidedpctl, "--socket", sock, *a], capture_output=True,
                               text=True, timeout=600)
            if check and r.returncode != 0:
                raise SystemExit(f"slidedpctl {a}: {r.stderr}")
            return r.stdout

        def poll():
            while not stop.is_set():
                try:
                    job = json.loads(ctl("status", "--json", check=False) or "{}").get("job") or {}
                    inflight.append((time.time(), int(job.get("checkpoint_in_flight_step", 0))))
                except (ValueError, subprocess.SubprocessError):
                    pass
                time.sleep(0.02)

        trainer_cmd = [args.trainer, "--socket", sock, "--rank", "0", "--world-size", "1",
                       "--create-job", "--steps", str(args.steps), "--layers", str(args.layers),
                       "--dim", str(args.dim), "--batch", str(args.batch),
                       "--chunk-bytes", str(1 << 20), "--timeout-ms", "600000"]
        trainer = subprocess.Popen(trainer_cmd, stdout=subprocess.PIPE, text=True, bufsize=1)
        poller = threading.Thread(target=poll)
        poller.start()
        steps = []  # (step, ms, end time)
        requested = []
        for line in trainer.stdout:
            m = re.match(r"rank 0 step +(\d+) .*step_ms +([\d.]+)", line)
            if not m:
                continue
            t, ms = int(m.group(1)), float(m.group(2))
            steps.append((t, ms, time.time()))
            if t in at:
                requested.append((t, time.time(), json.loads(ctl("checkpoint", "--no-wait",
                                                                 "--json"))))
        trainer.wait()
        # Let the last checkpoint commit before reading the counters.
        deadline = time.time() + 600
        while time.time() < deadline:
            job = json.loads(ctl("status", "--json")).get("job") or {}
            if int(job.get("checkpoint_in_flight_step", 0)) == 0:
                break
            time.sleep(0.05)
        stop.set()
        poller.join()
        stats = json.loads(ctl("stats", "--json"))
    finally:
        stop.set()
        hostd.send_signal(signal.SIGTERM)
        hostd.wait(timeout=120)
        if not args.dir:
            shutil.rmtree(tmp, ignore_errors=True)

    def in_flight(t0, t1):
        return any(s != 0 and t0 <= t <= t1 for t, s in inflight)

    rows = []
    for i, (t, ms, end) in enumerate(steps):
        rows.append({"step": t, "ms": ms, "checkpoint_in_flight": in_flight(end - ms / 1000, end)})
    with_ck = [r["ms"] for r in rows[1:] if r["checkpoint_in_flight"]]
    without = [r["ms"] for r in rows[1:] if not r["checkpoint_in_flight"]]
    params = args.layers * (args.dim * args.dim + args.dim)
    n_ck = int(stats.get("checkpoints_committed", 0))
    report = {
        "bench": "checkpoint_stall",
        "machine": {"host": platform.node(), "cpus": os.cpu_count()},
        "command": hostd_cmd, "trainer": trainer_cmd,
        "params": params, "state_bytes_per_checkpoint": 12 * params,
        "checkpoints_requested_after_steps": sorted(at),
        "steps": rows,
        "median_step_ms_without_checkpoint": statistics.median(without) if without else None,
        "median_step_ms_with_checkpoint": statistics.median(with_ck) if with_ck else None,
        "steps_with_checkpoint_in_flight": len(with_ck),
        "checkpoint_stall_seconds": float(stats.get("checkpoint_stall_seconds", 0)),
        "checkpoint_snapshot_seconds": float(stats.get("checkpoint_snapshot_seconds", 0)),
        "checkpoint_bytes_written": int(stats.get("checkpoint_bytes_written", 0)),
        "checkpoints_committed": n_ck,
        "last_checkpoint_seconds": float(stats.get("last_checkpoint_seconds", 0)),
        "last_checkpoint_mb_per_s": float(stats.get("last_checkpoint_mb_per_s", 0)),
        "layers_snapshotted": int(stats.get("checkpoint_layers_snapshotted", 0)),
        "layers_written_live": int(stats.get("checkpoint_layers_written_live", 0)),
        "layers_copied_by_writer": int(stats.get("checkpoint_layers_copied_by_writer", 0)),
        "pool_high_water_bytes": int(stats.get("checkpoint_pool_high_water_bytes", 0)),
    }
    if without and with_ck:
        report["step_time_ratio_with_vs_without"] = (statistics.median(with_ck) /
                                                     statistics.median(without))
    if without and n_ck:
        stall = report["checkpoint_stall_seconds"] + report["checkpoint_snapshot_seconds"]
        report["stall_per_checkpoint_s"] = stall / n_ck
        report["stall_per_checkpoint_vs_step"] = stall / n_ck / (statistics.median(without) / 1e3)
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
