#!/usr/bin/env python3
"""Runs gpu_plane_bench against fresh hostd processes and writes one JSON report (issue #4 item 8).

    run_gpu_plane_bench.py --bin DIR --out FILE [--quick]

DIR holds hostd, slidedpctl and gpu_plane_bench (a build's folders or a bundle's bin/). Parts:
  (a) h2d             parameter delivery through the GPU window vs raw pinned cudaMemcpyAsync,
                      H2D chunks of 4, 16, 64 and 256 MiB (8 layers of 256 MiB);
  (b) d2h_adam        an 800M-parameter layer: PushGrad -> new version published, hostd with
                      --update_granularity layer (whole layer: D2H, then AdamW) and chunk
                      (AdamW of chunk k while chunk k+1 is copied); speed-up = layer / chunk;
  (c) h2d_under_load  delivery alone vs while a 200M-parameter layer goes D2H + AdamW;
  (d) pipeline        36 layers of the Qwen3-4B decoder shape, synthetic compute per layer
                      (backward 2x forward); exposed host time per step vs compute.
Every figure, the machine and the commands go into the report. Python standard library only.
"""
import argparse
import datetime
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time

# Qwen3-4B: hidden 2560, intermediate 9728, 32 query heads and 8 KV heads of 128, 36 layers.
H, I, QH, KVH, HD, NL = 2560, 9728, 32, 8, 128, 36
QWEN3_4B_LAYER = (H * QH * HD + 2 * H * KVH * HD + QH * HD * H  # q, k, v, o
                  + 2 * HD                                      # q_norm, k_norm
                  + 3 * H * I                                   # gate, up, down
                  + 2 * H)                                      # input / post-attention norms


def sh(cmd):
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return ""


def machine():
    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem = ""
    try:
        with open("/proc/meminfo") as f:
            mem = f.readline().split(":", 1)[1].strip()
    except OSError:
        pass
    return {"hostname": platform.node(), "cpu": cpu, "cores": os.cpu_count(), "mem_total": mem,
            "gpu": sh(["nvidia-smi", "--query-gpu=name,memory.total,driver_version,pcie.link.gen.max",
                       "--format=csv,noheader"]),
            "kernel": platform.release()}


class Hostd:
    def __init__(self, bindir, tmp, tag, extra):
        self.instance = f"gpb{os.getpid()}{tag}"
        self.socket = os.path.join(tmp, f"{self.instance}.sock")
        self.log_path = os.path.join(tmp, f"{self.instance}.log")
        self.bindir = bindir
        self.cmd = [os.path.join(bindir, "hostd"), "--model", "none", "--world_size", "1",
                    "--socket", self.socket, "--instance", self.instance, "--mlock", "best_effort",
                    "--heartbeat_deadline_ms", "60000", *extra]
        self.log = open(self.log_path, "w+")
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 60
        while not os.path.exists(self.socket):
            if self.proc.poll() is not None or time.time() > deadline:
                self.log.seek(0)
                raise RuntimeError(f"hostd did not start: {self.log.read()}")
            time.sleep(0.05)

    def stats(self):
        out = sh([os.path.join(self.bindir, "slidedpctl"), "--socket", self.socket, "stats",
                  "--json"])
        try:
            return json.loads(out)
        except ValueError:
            return {"raw": out}

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.seek(0)
        return self.log.read()[-3000:]


def run_part(bindir, tmp, tag, hostd_extra, bench_args):
    h = Hostd(bindir, tmp, tag, hostd_extra)
    cmd = [os.path.join(bindir, "gpu_plane_bench"), "--socket", h.socket, *bench_args]
    t0 = time.time()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    sys.stderr.write(r.stderr)
    stats = h.stats()
    log = h.stop()
    part = {"hostd_command": h.cmd, "bench_command": cmd, "wall_s": time.time() - t0,
            "hostd_stats": stats, "rc": r.returncode}
    if r.returncode != 0:
        part["error"] = r.stderr[-3000:]
        part["hostd_log_tail"] = log
        return part
    # Log lines (spdlog) may precede the report: it starts at the first line that is "{".
    lines = r.stdout.splitlines()
    start = next((i for i, l in enumerate(lines) if l.strip() == "{"), None)
    try:
        part["result"] = json.loads("\n".join(lines[start:])) if start is not None else None
    except ValueError as e:
        part["error"] = f"unparsable report ({e}): {r.stdout[-2000:]}"
    return part


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bin", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--parts", default="a,b,c,d")
    ap.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    q = args.quick
    report = {"bench": "gpu_plane", "date": datetime.datetime.now(datetime.timezone.utc)
              .isoformat(timespec="seconds"), "command": " ".join(sys.argv),
              "machine": machine(), "parts": {}}
    tmp = tempfile.mkdtemp(prefix="slidedp-gpb-")
    if "a" in parts:
        report["parts"]["a_h2d"] = run_part(args.bin, tmp, "a", [], [
            "--mode", "h2d", "--grad-route", "cpu_reduction", "--layers", "8", "--layer-params", str((8 if q else 128) << 20),
            "--reps", "2", "--h2d-chunk-mib", "4", "16", "64", "256"])
    if "b" in parts:
        n = (64 if q else 800) * 1000 * 1000
        for gran in ("layer", "chunk"):
            report["parts"][f"b_d2h_adam_{gran}"] = run_part(
                args.bin, tmp, f"b{gran}", ["--update_granularity", gran],
                ["--mode", "d2h_adam", "--layers", "1", "--layer-params", str(n),
                 "--chunk-bytes", str(64 << 20), "--steps", "5", "--grad-route", "gpu_reduction"])
        try:
            lay = report["parts"]["b_d2h_adam_layer"]["result"]["d2h_adam"]["median_ms"]
            chk = report["parts"]["b_d2h_adam_chunk"]["result"]["d2h_adam"]["median_ms"]
            report["parts"]["b_speedup_chunked_vs_whole_layer"] = lay / chk
        except (KeyError, ZeroDivisionError, TypeError):
            pass
    if "c" in parts:
        report["parts"]["c_h2d_under_load"] = run_part(args.bin, tmp, "c", [], [
            "--mode", "h2d_under_load", "--layers", "4",
            "--layer-params", str((16 if q else 200) * 1000 * 1000), "--steps", "3",
            "--chunk-bytes", str(64 << 20)])
    if "d" in parts:
        report["parts"]["d_pipeline"] = run_part(args.bin, tmp, "d", [], [
            "--mode", "pipeline", "--layers", str(4 if q else NL),
            "--layer-params", str(QWEN3_4B_LAYER // (16 if q else 1)), "--steps", "4",
            "--chunk-bytes", str(64 << 20), "--fwd-ms", *(["1", "2"] if q else
                                                          ["2", "4", "8", "12", "16"])])
        report["parts"]["d_pipeline"]["qwen3_4b_layer_params"] = QWEN3_4B_LAYER
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps({k: (v.get("rc") if isinstance(v, dict) else v)
                      for k, v in report["parts"].items()}))


if __name__ == "__main__":
    main()
