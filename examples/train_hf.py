#!/usr/bin/env python3
"""Full fine-tune of an HF causal LM (Qwen3/Qwen2/Llama shape) through hostd with slidedp.

Two modes:
  train_hf.py prepare DIR --model qwen3-tiny [--seed S]
      writes DIR/config.json and DIR/model.safetensors (random init from the seed): start hostd
      with `hostd --model DIR` so it holds exactly these weights.
  train_hf.py train --hostd SOCK --model DIR [--data FILE] [--batch B --seq S --steps N ...]
      one rank of the job (run it under torchrun for several ranks: RANK/WORLD_SIZE); the model is
      built from DIR (config; weights too unless --meta), attached to hostd, trained for N steps.

--model for prepare: a built-in shape (qwen3-tiny, qwen3-tiny-tied, qwen3-small, qwen3-0.6b, qwen3-1.7b, qwen3-4b, qwen3-8b,
qwen3-14b, llama-tiny, qwen2-tiny) or a directory / config.json of an HF model.
--data: a text file (its UTF-8 bytes are the tokens) or a token file (.bin of uint16, .npy);
default: random tokens from --data-seed. Step k (0-based) trains on the B rows of S tokens that
start at token k*B*S of the stream (labels = inputs; HF shifts them); rank r of R takes rows
r*B/R .. (r+1)*B/R - 1; with --accum A, those are cut into A micro-batches.
"""
import argparse
import json
import logging
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "python_client"))

SHAPES = {
    # name: (hidden, intermediate, layers, heads, kv heads, head_dim, vocab, tied)
    "qwen3-tiny": (64, 128, 4, 4, 2, 16, 512, False),
    "qwen3-tiny-tied": (64, 128, 4, 4, 2, 16, 512, True),
    "qwen3-small": (256, 768, 4, 4, 2, 64, 4096, False),
    "qwen3-0.6b": (1024, 3072, 28, 16, 8, 128, 151936, True),
    "qwen3-1.7b": (2048, 6144, 28, 16, 8, 128, 151936, True),
    "qwen3-4b": (2560, 9728, 36, 32, 8, 128, 151936, True),
    "qwen3-8b": (4096, 12288, 36, 32, 8, 128, 151936, False),
    "qwen3-14b": (5120, 17408, 40, 40, 8, 128, 151936, False),
    "llama-tiny": (64, 128, 4, 4, 2, 16, 512, False),
    "qwen2-tiny": (64, 128, 4, 4, 2, 16, 512, False),
}


def make_config(name, max_pos=4096):
    import transformers
    if os.path.isdir(name) or name.endswith(".json"):
        path = name if os.path.isdir(name) else os.path.dirname(name) or "."
        return transformers.AutoConfig.from_pretrained(path)
    if name not in SHAPES:
        raise SystemExit(f"--model: {name!r} is not a directory, a config.json or one of "
                         f"{', '.join(SHAPES)}")
    h, inter, layers, heads, kv, hd, vocab, tied = SHAPES[name]
    family = name.split("-")[0]
    cls = {"qwen3": transformers.Qwen3Config, "qwen2": transformers.Qwen2Config,
           "llama": transformers.LlamaConfig}[family]
    kw = dict(hidden_size=h, intermediate_size=inter, num_hidden_layers=layers,
              num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab,
              tie_word_embeddings=tied, max_position_embeddings=max_pos)
    if family != "qwen2":
        kw["head_dim"] = hd
    return cls(**kw)


def build_model(cfg, seed, dtype=None, meta=False):
    import torch
    import transformers
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    if meta:
        with torch.device("meta"):
            return transformers.AutoModelForCausalLM.from_config(cfg)
    return transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype or torch.float32)


def load_tokens(path, vocab, seed, need):
    """The token stream: `need` tokens (repeated cyclically if the file is shorter)."""
    import numpy as np
    if path is None:
        rng = np.random.default_rng(seed)
        return rng.integers(0, vocab, size=need, dtype=np.int64)
    if path.endswith(".npy"):
        toks = np.load(path).astype(np.int64).ravel()
    elif path.endswith(".bin"):
        toks = np.fromfile(path, dtype=np.uint16).astype(np.int64)
    else:
        toks = np.frombuffer(open(path, "rb").read(), dtype=np.uint8).astype(np.int64)
    if toks.size == 0:
        raise SystemExit(f"--data: {path} holds no tokens")
    if toks.max() >= vocab:
        toks = toks % vocab
    reps = -(-need // toks.size)
    return np.tile(toks, reps)[:need]


def batch_rows(tokens, step, batch, seq):
    """Rows of global step `step` (0-based): a [batch, seq] int64 array."""
    n = batch * seq
    start = (step * n) % (tokens.size - n + 1)
    return tokens[start:start + n].reshape(batch, seq)


def cmd_prepare(a):
    cfg = make_config(a.model, a.seq_max)
    if a.config_only:
        cfg.save_pretrained(a.dir)
        print(f"wrote {a.dir}/config.json: {cfg.model_type} (hostd initializes the weights)")
        return
    model = build_model(cfg, a.seed)
    os.makedirs(a.dir, exist_ok=True)
    model.save_pretrained(a.dir, safe_serialization=True)
    n = sum(p.numel() for p in model.parameters())
    print(f"wrote {a.dir}: {cfg.model_type}, {n / 1e6:.1f}M parameters, seed {a.seed}")


def cmd_train(a):
    import torch
    import slidedp
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if a.dist_backend and world > 1:
        # The job's own process group (slidedp.attach uses it for resident layers).
        torch.distributed.init_process_group(a.dist_backend)
    torch.set_num_threads(max(1, a.threads or (os.cpu_count() // world)))
    if a.batch % (world * a.accum) != 0:
        raise SystemExit(f"--batch: {a.batch} must be a multiple of WORLD_SIZE x --accum = "
                         f"{world * a.accum}")
    cfg = make_config(a.model)
    if a.meta:
        model = build_model(cfg, 0, meta=True)
    elif os.path.isdir(a.model) and any(f.endswith(".safetensors") for f in os.listdir(a.model)):
        import transformers
        model = transformers.AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    else:
        model = build_model(cfg, a.seed)
    model.config._attn_implementation = "sdpa"
    model.train()
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model, opt = slidedp.attach(model, hostd=a.hostd, device=device,
                                checkpointing=a.checkpointing, accumulation_steps=a.accum,
                                offload_ratio=a.offload_ratio,
                                offload_min_bytes=a.offload_min_bytes,
                                nondecoder=a.nondecoder, resident_layers=a.resident_layers,
                                policy=a.policy, memory_budget=a.memory_budget,
                                verify_init=not a.meta and not a.no_verify)
    dev = model.slidedp.device
    # A resumed job (hostd --resume) goes on at hostd's step, and so does the data.
    first = model.slidedp.next_step - 1
    tokens = load_tokens(a.data, cfg.vocab_size, a.data_seed,
                         (first + a.steps + 1) * a.batch * a.seq)
    per_rank = a.batch // world
    micro = per_rank // a.accum
    logf = open(a.loss_log.format(rank=rank), "w") if a.loss_log else None
    bar = None
    if rank == 0 and not a.no_progress:
        try:
            from tqdm import tqdm
            bar = tqdm(total=a.steps, desc="train", unit="step")
        except ImportError:
            pass
    t0 = time.perf_counter()
    for step in range(a.steps):
        rows = batch_rows(tokens, first + step, a.batch,
                          a.seq)[rank * per_rank:(rank + 1) * per_rank]
        losses = []
        for m in range(a.accum):
            x = torch.from_numpy(rows[m * micro:(m + 1) * micro].copy()).to(dev)
            loss = model(input_ids=x, labels=x).loss
            (loss / a.accum).backward()
            losses.append(float(loss.detach()))
        stats = opt.step()
        opt.zero_grad()
        rec = dict(stats, step=first + step + 1, hostd_step=stats["step"], rank=rank,
                   loss=sum(losses) / len(losses), end_unix=time.time())
        if logf:
            logf.write(json.dumps(rec) + "\n")
            logf.flush()
        if bar is not None:
            bar.set_postfix(loss=f"{rec['loss']:.4f}", tok_s=f"{stats['tokens_per_s']:.0f}")
            bar.update(1)
        elif rank == 0:
            print(f"step {first + step + 1}/{first + a.steps} loss {rec['loss']:.4f} "
                  f"{stats['tokens_per_s']:.0f} tok/s {stats['step_time_s']:.3f} s", flush=True)
    if bar is not None:
        bar.close()
    if a.dump_params and rank == 0:
        sd = model.slidedp.fetch_state_dict()
        torch.save(sd, a.dump_params)
    opt.close()
    if rank == 0:
        print(f"done: {a.steps} steps in {time.perf_counter() - t0:.1f} s", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="write a randomly initialized model directory")
    p.add_argument("dir")
    p.add_argument("--model", default="qwen3-tiny")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seq-max", type=int, default=4096)
    p.add_argument("--config-only", action="store_true", help="write config.json only")
    t = sub.add_parser("train", help="train one rank through hostd")
    t.add_argument("--hostd", required=True, help="hostd's socket")
    t.add_argument("--model", required=True, help="model directory (config.json [+ weights])")
    t.add_argument("--data", default=None)
    t.add_argument("--data-seed", type=int, default=1)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--batch", type=int, default=8, help="global batch (rows per step)")
    t.add_argument("--seq", type=int, default=128)
    t.add_argument("--steps", type=int, default=20,
                   help="steps to run (a job resumed by hostd goes on at its step, data too)")
    t.add_argument("--accum", type=int, default=1, help="micro-batches per step")
    t.add_argument("--policy", default="auto",
                   help="auto (AutoPolicy chooses at the first step), or a per-layer layout such "
                        "as '2R 20F-r0 6N' (slidedp.attach policy)")
    t.add_argument("--checkpointing", default="full",
                   type=lambda v: v if v in ("full", "none") else float(v),
                   help="full, none, or the fraction of decoder layers to recompute")
    t.add_argument("--offload-ratio", type=float, default=0.0,
                   help="fraction of decoder layers whose saved activations go to host memory "
                        "(slidedp.attach offload_ratio)")
    t.add_argument("--offload-min-bytes", type=int, default=65536,
                   help="saved tensors smaller than this stay on the device (offload_min_bytes)")
    t.add_argument("--memory-budget", type=float, default=None,
                   help="bytes of device memory a step's activations may use (slidedp.attach "
                        "memory_budget; policy auto chooses the layout under it)")
    t.add_argument("--device", default=None)
    t.add_argument("--dist-backend", default=None, choices=["gloo", "nccl"],
                   help="initialize a torch.distributed process group first (torchrun)")
    t.add_argument("--nondecoder", default="auto", choices=["auto", "resident", "host"],
                   help="where embeddings, final norm and lm_head are updated (slidedp.attach)")
    t.add_argument("--resident-layers", type=int, default=0,
                   help="the first N decoder layers stay and are updated on the device "
                        "(slidedp.attach resident_layers)")
    t.add_argument("--threads", type=int, default=0)
    t.add_argument("--meta", action="store_true", help="build the model on the meta device "
                   "(hostd's weights are used as they are)")
    t.add_argument("--no-verify", action="store_true")
    t.add_argument("--loss-log", default=None, help="JSON lines: loss and figures per step ({rank} is replaced by the rank)")
    t.add_argument("--dump-params", default=None, help="rank 0: torch.save of the final BF16 "
                   "parameters fetched from hostd")
    t.add_argument("--no-progress", action="store_true")
    a = ap.parse_args()
    {"prepare": cmd_prepare, "train": cmd_train}[a.cmd](a)


if __name__ == "__main__":
    main()
