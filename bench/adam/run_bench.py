#!/usr/bin/env python3
"""One run of the host-Adam comparison: adam_bench (our fused AdamW + BF16 cast, and STREAM triad)
followed, in the same process tree and on the same sizes and thread counts, by
torch.optim.AdamW(fused=True) on CPU, alone and followed by the BF16 cast it needs.

Writes one combined JSON report (--out, and stdout); progress and a table go to stderr.

Bytes counted per parameter (what each variant must move at the least):
  ours, BF16 grad:   28  (grad 2, master/m/v read + write 24, BF16 params out 2)
  torch step:        28  (FP32 grad 4, param/exp_avg/exp_avg_sq read + write 24)
  torch step + cast: 34  (the step, then read FP32 param 4 and write BF16 param 2)
The headline ratios, per (size, threads), on medians:
  ours_bf16grad / torch_step_plus_cast  in parameters per second (target >= 1.2)
  ours_bf16grad / triad                 in GB/s at 28 B/param vs STREAM's 24 B/elem (target >= 0.9)
  ours_bf16grad / rmw                   in GB/s vs an in-place a = s*a stream at 8 B/elem, the
                                        ceiling of any in-place update on the machine

Usage: run_bench.py [--bench PATH] [--sizes 100M,200M,400M,800M] [--threads 1,2,4,8,16]
                    [--reps 5] [--max-seconds 3] [--isa NAME] [--quick] [--out FILE]

--max-seconds caps each figure (ours and torch alike, warm-up included) at that many seconds once
3 repetitions are timed, so the default run stays within about 4 minutes on a 16-core machine;
single-thread figures of the large sizes get 3 repetitions, the rest 5.
"""

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

BYTES_OURS_BF16 = 28
BYTES_TORCH_STEP = 28
BYTES_TORCH_CAST = 6
MIN_REPS_UNDER_CAP = 3


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def parse_count(text):
    scale = {"k": 1e3, "m": 1e6, "g": 1e9}
    text = text.strip()
    if text and text[-1].lower() in scale:
        return int(float(text[:-1]) * scale[text[-1].lower()])
    return int(text)


def find_bench(explicit):
    if explicit:
        return explicit
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(os.path.dirname(here))
    candidates = [os.environ.get("ADAM_BENCH", "")]
    for name in sorted(os.listdir(root)):
        if name.startswith("build"):
            candidates.append(os.path.join(root, name, "bench", "adam", "adam_bench"))
    candidates.append(shutil.which("adam_bench") or "")
    for c in candidates:
        if c and os.access(c, os.X_OK):
            return c
    sys.exit("run_bench.py: adam_bench not found; build it (cmake --build BUILD --target "
             "adam_bench) and pass --bench PATH or set ADAM_BENCH")


def summarize(seconds, params, bytes_per_param):
    med = statistics.median(seconds)
    best = min(seconds)
    return {
        "reps": len(seconds),
        "elements": params,
        "bytes_per_param": bytes_per_param,
        "median_s": med,
        "best_s": best,
        "median_gparam_per_s": params / med * 1e-9,
        "best_gparam_per_s": params / best * 1e-9,
        "median_gb_per_s": params * bytes_per_param / med * 1e-9,
        "best_gb_per_s": params * bytes_per_param / best * 1e-9,
        "all_s": seconds,
    }


def run_torch(torch, sizes, threads, reps, warmup, max_seconds):
    """torch.optim.AdamW(fused=True) over one FP32 parameter of each size with an FP32 grad."""
    results = {}
    for n in sizes:
        torch.set_num_threads(max(threads))
        gen = torch.Generator().manual_seed(0)
        param = torch.nn.Parameter(torch.empty(n, dtype=torch.float32).uniform_(-0.05, 0.05,
                                                                                 generator=gen))
        param.grad = torch.empty(n, dtype=torch.float32).uniform_(-1e-3, 1e-3, generator=gen)
        out = torch.empty(n, dtype=torch.bfloat16)
        opt = torch.optim.AdamW([param], lr=1e-4, betas=(0.9, 0.999), eps=1e-8,
                                weight_decay=0.01, fused=True)
        opt.step()  # allocates and first-touches exp_avg / exp_avg_sq
        out.copy_(param.detach())
        for t in threads:
            torch.set_num_threads(t)

            def step():
                opt.step()

            def step_cast():
                opt.step()
                out.copy_(param.detach())

            figures = {}
            for name, fn, bpp in (("step", step, BYTES_TORCH_STEP),
                                  ("step_plus_cast", step_cast,
                                   BYTES_TORCH_STEP + BYTES_TORCH_CAST)):
                first = time.perf_counter()
                for _ in range(warmup):
                    fn()
                seconds = []
                for i in range(reps):
                    start = time.perf_counter()
                    if max_seconds > 0 and i >= MIN_REPS_UNDER_CAP and start - first >= max_seconds:
                        break
                    fn()
                    seconds.append(time.perf_counter() - start)
                figures[name] = summarize(seconds, n, bpp)
            results[(n, t)] = figures
            log(f"  torch size {n} threads {t}: step "
                f"{figures['step']['median_gparam_per_s']:.2f} Gparam/s, step+cast "
                f"{figures['step_plus_cast']['median_gparam_per_s']:.2f} Gparam/s")
        del opt, param, out
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bench", help="path of the adam_bench executable")
    parser.add_argument("--sizes", default="100M,200M,400M,800M")
    parser.add_argument("--threads", default="", help="default: 1,2,4,... up to all cores")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--max-seconds", type=float, default=3.0,
                        help="cap per figure once 3 repetitions are timed (0: no cap)")
    parser.add_argument("--isa", default="")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, finishes in seconds")
    parser.add_argument("--no-torch", action="store_true", help="only adam_bench")
    parser.add_argument("--out", default="adam_bench_report.json")
    args = parser.parse_args()

    if args.quick:
        if args.sizes == parser.get_default("sizes"):
            args.sizes = "1M,3000017"
        args.reps = min(args.reps, 3)
    sizes = [parse_count(s) for s in args.sizes.split(",") if s]

    bench = find_bench(args.bench)
    with tempfile.TemporaryDirectory() as tmp:
        bench_json = os.path.join(tmp, "adam_bench.json")
        cmd = [bench, "--sizes", ",".join(str(s) for s in sizes), "--reps", str(args.reps),
               "--warmup", str(args.warmup), "--max-seconds", str(args.max_seconds),
               "--out", bench_json]
        if args.threads:
            cmd += ["--threads", args.threads]
        if args.isa:
            cmd += ["--isa", args.isa]
        if args.quick:
            cmd.append("--quick")
        log("run_bench: " + " ".join(cmd))
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        with open(bench_json) as f:
            ours = json.load(f)

    threads = sorted({r["threads"] for r in ours["results"]})
    report = {
        "benchmark": "run_bench",
        "command": " ".join([sys.executable] + sys.argv),
        "machine": dict(ours["machine"], python=platform.python_version()),
        "adam_bench": ours,
        "torch": None,
        "comparison": [],
    }

    torch = None
    if not args.no_torch:
        try:
            import torch  # noqa: PLC0415 (optional dependency)
        except ImportError as e:
            report["torch_missing"] = f"torch is not importable: {e}"
            log("run_bench: torch is not importable; reporting adam_bench figures only")

    torch_results = {}
    if torch is not None:
        report["torch"] = {
            "version": torch.__version__,
            "optimizer": "torch.optim.AdamW(fused=True), CPU, one FP32 parameter, FP32 grad",
            "cast": "out.copy_(param) into a preallocated bfloat16 tensor",
            "default_num_threads": torch.get_num_threads(),
            "bytes_per_param": {"step": BYTES_TORCH_STEP,
                                "step_plus_cast": BYTES_TORCH_STEP + BYTES_TORCH_CAST},
        }
        torch_results = run_torch(torch, sizes, threads, args.reps, args.warmup, args.max_seconds)
        report["torch"]["results"] = [
            dict(size=n, threads=t, **figs) for (n, t), figs in sorted(torch_results.items())]

    rows = []
    for r in ours["results"]:
        n, t = r["size"], r["threads"]
        ours_gps = r["adamw_bf16grad"]["median_gparam_per_s"]
        row = {
            "size": n,
            "threads": t,
            "ours_bf16grad_gparam_per_s": ours_gps,
            "ours_bf16grad_gb_per_s": r["adamw_bf16grad"]["median_gb_per_s"],
            "triad_gb_per_s": r["triad"]["median_gb_per_s"],
            "triad_nt_gb_per_s": r["triad_nt"]["median_gb_per_s"],
            "ratio_ours_to_triad": r["ratio_adamw_bf16grad_to_triad"],
            "ratio_ours_to_triad_nt": r["ratio_adamw_bf16grad_to_triad_nt"],
            "rmw_gb_per_s": r["rmw"]["median_gb_per_s"],
            "ratio_ours_to_rmw": r["ratio_adamw_bf16grad_to_rmw"],
        }
        if (n, t) in torch_results:
            tr = torch_results[(n, t)]
            row["torch_step_gparam_per_s"] = tr["step"]["median_gparam_per_s"]
            row["torch_step_plus_cast_gparam_per_s"] = tr["step_plus_cast"]["median_gparam_per_s"]
            row["ratio_ours_to_torch_step_plus_cast"] = (
                ours_gps / tr["step_plus_cast"]["median_gparam_per_s"])
            row["ratio_ours_to_torch_step"] = ours_gps / tr["step"]["median_gparam_per_s"]
        rows.append(row)
    report["comparison"] = rows

    log("")
    log(f"{'size':>11} {'thr':>4} {'ours Gp/s':>10} {'ours GB/s':>10} {'triad GB/s':>11} "
        f"{'vs triad':>9} {'vs rmw':>7} {'torch+cast':>11} {'vs torch+cast':>14}")
    for row in rows:
        torch_gps = row.get("torch_step_plus_cast_gparam_per_s")
        ratio = row.get("ratio_ours_to_torch_step_plus_cast")
        log(f"{row['size']:>11} {row['threads']:>4} {row['ours_bf16grad_gparam_per_s']:>10.3f} "
            f"{row['ours_bf16grad_gb_per_s']:>10.1f} {row['triad_gb_per_s']:>11.1f} "
            f"{row['ratio_ours_to_triad']:>9.3f} {row['ratio_ours_to_rmw']:>7.3f} "
            f"{(f'{torch_gps:.3f}' if torch_gps else '-'):>11} "
            f"{(f'{ratio:.3f}' if ratio else '-'):>14}")

    text = json.dumps(report, indent=2)
    with open(args.out, "w") as f:
        f.write(text + "\n")
    print(text)
    log(f"run_bench: wrote {args.out}")


if __name__ == "__main__":
    main()
