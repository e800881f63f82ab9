#!/usr/bin/env python3
"""Loss parity on the GPU: a Qwen3-shaped model trained through hostd with slidedp against the
same model trained GPU-resident with torch.optim.AdamW (FP32 master weights, BF16 compute), same
init (one safetensors file both load) and the same data order (issue #5, acceptance 2).

Run from the repository root on the GPU machine, with a bundle built here:
  python3 bench/parity/h200_parity.py --bundle .carry/bundle --out $OUT/parity [--steps 200]
Writes OUT/parity_<model>.json (both loss curves, max/mean |dloss|, machine, commands) and
OUT/parity_<model>.png.
"""
import argparse
import json
import os
import platform
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, os.path.join(ROOT, "examples"))


def synthetic_tokens(path, vocab, seed=5, phrases=512, phrase_len=64, n=4_000_000):
    """A learnable stream: random draws of a fixed set of random phrases."""
    import numpy as np
    rng = np.random.default_rng(seed)
    table = rng.integers(0, min(vocab, 32000), size=(phrases, phrase_len), dtype=np.int64)
    picks = rng.integers(0, phrases, size=n // phrase_len)
    np.save(path, table[picks].ravel().astype(np.int32))
    return path


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bundle", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--work", default="/tmp/slidedp-parity")
    ap.add_argument("--checkpointing", default="full")
    ap.add_argument("--resident-layers", type=int, default=0,
                    help="the first N decoder layers updated on the GPU (slidedp.attach)")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    os.makedirs(a.work, exist_ok=True)
    py = sys.executable
    mdir = os.path.join(a.work, a.model)
    t0 = time.time()
    if not os.path.exists(os.path.join(mdir, "model.safetensors")):
        subprocess.run([py, os.path.join(ROOT, "examples", "train_hf.py"), "prepare", mdir,
                        "--model", a.model, "--seed", "0"], check=True)
    import train_hf
    cfg = train_hf.make_config(mdir)
    data = synthetic_tokens(os.path.join(a.work, "tokens.npy"), cfg.vocab_size)
    sock = os.path.join(a.work, "hostd.sock")
    if os.path.exists(sock):
        os.unlink(sock)
    hostd_cmd = [os.path.join(a.bundle, "bin", "hostd"), "--model", mdir, "--socket", sock,
                 "--instance", "parity", "--mlock", "best_effort", "--lr", str(a.lr)]
    hlog = open(os.path.join(a.out, "hostd.log"), "w")
    hostd = subprocess.Popen(hostd_cmd, stdout=hlog, stderr=subprocess.STDOUT)
    try:
        while not os.path.exists(sock):
            if hostd.poll() is not None:
                raise SystemExit(f"hostd exited: see {hlog.name}")
            time.sleep(0.1)
        loss_log = os.path.join(a.out, "slidedp_losses.jsonl")
        train_cmd = [py, os.path.join(ROOT, "examples", "train_hf.py"), "train", "--hostd", sock,
                     "--model", mdir, "--data", data, "--batch", str(a.batch), "--seq",
                     str(a.seq), "--steps", str(a.steps), "--device", "cuda", "--no-progress",
                     "--checkpointing", a.checkpointing, "--loss-log", loss_log,
                     "--resident-layers", str(a.resident_layers)]
        env = dict(os.environ, SLIDEDP_RANK_LIB=os.path.join(a.bundle, "lib",
                                                             "libslidedp_rank.so"))
        t1 = time.time()
        r = subprocess.run(train_cmd, env=env, capture_output=True, text=True)
        open(os.path.join(a.out, "train.log"), "w").write(r.stdout + r.stderr)
        if r.returncode != 0:
            raise SystemExit(f"slidedp training failed:\n{r.stderr[-4000:]}")
        ours = [json.loads(l) for l in open(loss_log)]
        t_ours = time.time() - t1
    finally:
        hostd.terminate()
        hostd.wait()
    import python_client_test as pct
    pct.LR = a.lr
    t2 = time.time()
    ref_losses, _ = pct.reference(mdir, a.steps, a.batch, a.seq, data, "cuda")
    t_ref = time.time() - t2
    import torch
    diffs = [abs(o["loss"] - r) for o, r in zip(ours, ref_losses)]
    res = {
        "what": "loss parity: slidedp through hostd vs GPU-resident torch AdamW (FP32 master)",
        "model": a.model,
        "batch": a.batch, "seq": a.seq, "steps": a.steps, "lr": a.lr,
        "checkpointing": a.checkpointing, "resident_layers": a.resident_layers,
        "max_abs_dloss": max(diffs), "mean_abs_dloss": sum(diffs) / len(diffs),
        "argmax_step": diffs.index(max(diffs)) + 1,
        "first_loss": [ours[0]["loss"], ref_losses[0]], "last_loss": [ours[-1]["loss"],
                                                                      ref_losses[-1]],
        "slidedp_losses": [o["loss"] for o in ours], "reference_losses": ref_losses,
        "slidedp_step_time_s_median": sorted(o["step_time_s"] for o in ours)[len(ours) // 2],
        "slidedp_seconds": round(t_ours, 1), "reference_seconds": round(t_ref, 1),
        "machine": {"host": platform.node(), "gpu": torch.cuda.get_device_name(0),
                    "torch": torch.__version__},
        "commands": {"this": " ".join(sys.argv), "hostd": " ".join(hostd_cmd),
                     "train": " ".join(train_cmd)},
        "reference": "tests/python_client_test.py reference(): FP32 master in "
                     "torch.optim.AdamW, BF16 compute on the GPU, whole batch in one process",
    }
    tag = a.model + (f"_resident{a.resident_layers}" if a.resident_layers else "")
    path = os.path.join(a.out, f"parity_{tag}.json")
    json.dump(res, open(path, "w"), indent=1)
    print(json.dumps({k: v for k, v in res.items() if not k.endswith("losses")}, indent=1))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
        steps = list(range(1, len(ours) + 1))
        ax[0].plot(steps, res["slidedp_losses"], label="slidedp (hostd AdamW)")
        ax[0].plot(steps, ref_losses, "--", label="GPU-resident torch AdamW")
        ax[0].set_ylabel("loss")
        ax[0].legend()
        ax[1].plot(steps, diffs)
        ax[1].axhline(5e-4, color="r", ls=":", label="5e-4")
        ax[1].set_ylabel("|Δ loss|")
        ax[1].set_xlabel("step")
        ax[1].legend()
        fig.suptitle(f"{a.model}, batch {a.batch}, seq {a.seq}: max |Δ| {max(diffs):.2e}")
        fig.savefig(os.path.join(a.out, f"parity_{tag}.png"), dpi=100)
    except ImportError as e:
        print(f"no plot: {e}")
    print(f"total {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
