#!/usr/bin/env python3
"""Head-to-head training throughput: SlideDP vs FSDP2 (GPU-resident), FSDP2 + CPU offload and
DeepSpeed ZeRO-Offload on a randomly initialised Qwen3-4B-shaped HF model (one GPU).

  python3 run.py [--systems fsdp2,fsdp2_offload,deepspeed,slidedp] [--batches 8,16,32,64]
                 [--seq 1024] [--warmup 3] [--steps 5] [--out DIR] [--timeout 900]
  python3 run.py --dry-run --systems fsdp2,fsdp2_offload --batches 1,2     # tiny model, CPU, gloo
  python3 run.py --merge A.json B.json --out DIR                            # combine partial runs
  python3 run.py --one SYSTEM on|off BATCH [...]                            # one run (the child)

Every (system, ckpt, batch) runs in its own child process (this script with --one) under a
timeout; the parent samples the child's process tree (RSS, PSS) and collects the child's JSON
record. After an out-of-memory run, the larger batches of that (system, ckpt) are recorded as
{"status": "oom", "skipped": true} without running. The JSON (and PNG) are rewritten after every
run, so a killed parent leaves the runs done so far. See README.md next to this file.
"""
import argparse
import datetime
import json
import re
import os
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
SYSTEMS = ["fsdp2", "fsdp2_offload", "deepspeed", "slidedp"]  # the default --systems
# + anchor: shared/tools/anchor_baselines.py offload BATCH run as is (--anchor-script), the reference the
# harness's fsdp2_offload must reproduce within ANCHOR_TOL in the same invocation
ALL_SYSTEMS = SYSTEMS + ["anchor"]
ANCHOR_TOL = 0.10
# activation-checkpointing settings run per system (True = full-layer recompute)
SETTINGS = {"fsdp2": [True, False], "fsdp2_offload": [True], "deepspeed": [True], "slidedp": [True, False],
            "anchor": [True]}
RESULT_MARK = "HH2H_RESULT "
FLOP_FORMULA = ("model_TFLOPS = tokens_per_s * (6 * nparam + 6 * L * h * seq) / 1e12, h = heads * head_dim; "
                "dense + causal attention, forward + backward, recompute not counted "
                "(as shared/tools/anchor_baselines.py); nparam counts the tied embedding once")
LR, WD, BETAS, EPS = 1e-5, 0.01, (0.9, 0.999), 1e-8
GiB = 2 ** 30


# ----------------------------------------------------------------------------------------------
# model config
# ----------------------------------------------------------------------------------------------
def model_config(dry_run):
    from transformers import Qwen3Config
    if dry_run:
        cfg = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=16, vocab_size=512, tie_word_embeddings=True,
                          max_position_embeddings=4096)
    else:  # exactly shared/tools/anchor_baselines.py
        cfg = Qwen3Config(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                          num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
                          max_position_embeddings=4096)
    cfg._attn_implementation = "sdpa"
    return cfg


def cfg_summary(cfg):
    keys = ["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", "vocab_size", "tie_word_embeddings", "max_position_embeddings"]
    d = {k: getattr(cfg, k) for k in keys}
    d["attn_implementation"] = cfg._attn_implementation
    return d


def flops_per_token(nparam, cfg, seq):
    L, h = cfg["num_hidden_layers"], cfg["num_attention_heads"] * cfg["head_dim"]
    return 6 * nparam + 6 * L * h * seq


# ----------------------------------------------------------------------------------------------
# child: one (system, ckpt, batch) run
# ----------------------------------------------------------------------------------------------
def _mark_phase(name, ack_wait_s=0.0):
    """Tell the parent's sampler the phase; with ack_wait_s, wait (at most that long) until it has taken
    the sample that phase asks for (PATH.NAME appears)."""
    path = os.environ.get("HH2H_PHASE_FILE")
    if path:
        try:
            with open(path, "w") as f:
                f.write(name)
        except OSError:
            return
        end = time.monotonic() + ack_wait_s
        while time.monotonic() < end and not os.path.exists(f"{path}.{name}"):
            time.sleep(0.02)


def _is_oom(e):
    import torch
    if isinstance(e, getattr(torch, "OutOfMemoryError", ())) or isinstance(e, MemoryError):
        return True
    s = str(e).lower()
    return "out of memory" in s or "cublas_status_alloc_failed" in s or "cuda_error_out_of_memory" in s


def _train_begins(name="train"):
    """mark_phase of the runners. "train": called when the first warmup step starts: GPU peaks are
    reported from here on (the setup peak is kept apart), host memory samples from here on count as the
    training phase. "measured": called right after the last measured step, before anything is torn down
    (hostd still up): the parent takes its PSS sample of the process tree then, and we wait for it."""
    if name == "measured":
        _mark_phase(name, ack_wait_s=30.0)
        return
    if name == "train":
        try:
            import torch
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.synchronize()
                _SETUP_PEAK["peak_gpu_reserved_setup_GiB"] = torch.cuda.max_memory_reserved() / GiB
                _SETUP_PEAK["peak_gpu_allocated_setup_GiB"] = torch.cuda.max_memory_allocated() / GiB
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
        except Exception:  # noqa: BLE001
            pass
    _mark_phase(name)


_SETUP_PEAK = {}


def _timed_loop(step, warmup, steps, sync):
    _train_begins()
    loss = None
    for _ in range(warmup):
        loss = step()
    sync()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        loss = step()
        sync()
        times.append(time.perf_counter() - t0)
    _train_begins("measured")
    return times, float(loss.detach().float().item())


def _build_hf_model(cfg, seed, ckpt, init_dev, place=None):
    """HF random init under `with torch.device(init_dev)` from `seed`, then `.to(place)` when given.
    Offload systems build on the CPU and stay there, as anchor_baselines.py does: a 16 GB fp32 model
    built on the GPU and moved over leaves other host memory (pageable copies, their NUMA placement)
    and GPU allocator state than the anchor's, and its step time did not reproduce the anchor's.
    The GPU-resident fsdp2 builds on the CPU too (then moves to the GPU) unless --init-device gpu:
    CPU and CUDA generators differ, so only one init device keeps the weights and losses identical."""
    import torch
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    with torch.device(init_dev):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    if place and place != init_dev:
        model.to(place)
    if ckpt:
        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # transformers >= 5.2x renames it
            model.gradient_checkpointing_enable()
    model.train()
    return model


def run_fsdp2(cfg, batch, seq, steps, warmup, ckpt, dev, dry_run, seed, x, offload, init_dev="cpu"):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard, MixedPrecisionPolicy, CPUOffloadPolicy
    init_dev = "cpu" if offload else init_dev
    model = _build_hf_model(cfg, seed, ckpt, init_dev, place=None if offload else dev)
    nparam = sum(p.numel() for p in model.parameters())
    mesh = init_device_mesh(dev, (1,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    kw = dict(mesh=mesh, mp_policy=mp)
    pin = not dry_run
    if offload:
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=pin)
    for layer in model.model.layers:
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, fused=True)
    xd = x.to(dev)

    def step():
        loss = model(input_ids=xd, labels=xd).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    times, loss = _timed_loop(step, warmup, steps, sync)
    settings = {"wrap": "fully_shard per decoder layer + root", "mesh": f"{dev} (1,)",
                "mp_policy": "param_dtype bf16, reduce_dtype fp32", "master_weights": "fp32",
                "optimizer": f"torch.optim.AdamW(fused=True, lr={LR}, betas={BETAS}, eps={EPS}, weight_decay={WD})",
                "offload_policy": f"CPUOffloadPolicy(pin_memory={pin})" if offload else None,
                "init_device": init_dev,
                "activation_checkpointing": "HF gradient_checkpointing_enable() (transformers default kwargs)"
                if ckpt else None}
    return {"nparam": nparam, "step_times": times, "loss": loss, "settings": settings}


def ds_config(batch, dry_run, extra):
    cfg = {
        "train_micro_batch_size_per_gpu": batch,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "zero_optimization": {
            "stage": 2,
            "offload_optimizer": {"device": "cpu", "pin_memory": not dry_run},
            "overlap_comm": True,
            "contiguous_gradients": True,
        },
        "gradient_clipping": 0.0,
        "steps_per_print": 10 ** 9,
        "wall_clock_breakdown": False,
    }

    def merge(a, b):
        for k, v in b.items():
            if isinstance(v, dict) and isinstance(a.get(k), dict):
                merge(a[k], v)
            else:
                a[k] = v
    if extra:
        merge(cfg, extra)
    return cfg


class _SkipRest(Exception):
    """An error that will repeat for every batch of this (system, ckpt): the parent records the rest
    without running them."""


def run_deepspeed(cfg, batch, seq, steps, warmup, ckpt, dev, dry_run, seed, x, extra_cfg):
    import torch
    try:
        import deepspeed
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except Exception as e:  # noqa: BLE001
        raise _Unavailable(f"import deepspeed failed: {type(e).__name__}: {e}") from e
    model = _build_hf_model(cfg, seed, ckpt, "cpu")  # offload: built on the CPU, as the anchor
    nparam = sum(p.numel() for p in model.parameters())
    try:
        opt = DeepSpeedCPUAdam(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, adamw_mode=True)
    except Exception as e:  # noqa: BLE001  (the cpu_adam JIT build: C++ compiler, ninja, CUDA headers)
        raise _SkipRest(f"DeepSpeedCPUAdam (cpu_adam op JIT build) failed: {type(e).__name__}: {e}") from e
    conf = ds_config(batch, dry_run, extra_cfg)
    engine, opt, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=conf)
    xd = x.to(engine.device)

    def step():
        loss = engine(input_ids=xd, labels=xd).loss
        engine.backward(loss)
        engine.step()
        return loss

    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    times, loss = _timed_loop(step, warmup, steps, sync)
    settings = {"deepspeed_version": deepspeed.__version__, "ds_config": conf,
                "optimizer": f"DeepSpeedCPUAdam(adamw_mode=True, lr={LR}, betas={BETAS}, eps={EPS}, weight_decay={WD})",
                "init_device": "cpu",
                "activation_checkpointing": "HF gradient_checkpointing_enable() (transformers default kwargs)"
                if ckpt else None,
                "deepspeed_path": os.path.dirname(os.path.dirname(os.path.abspath(deepspeed.__file__)))}
    return {"nparam": nparam, "step_times": times, "loss": loss, "settings": settings}


class _Unavailable(Exception):
    pass


def _parse_opt_value(v):
    try:
        return json.loads(v)
    except ValueError:
        return v


def run_slidedp_entry(cfg, batch, seq, steps, warmup, ckpt, dev, dry_run, seed, x, user_opts):
    sys.path.insert(0, HERE)
    try:
        from slidedp_runner import run_slidedp
    except Exception as e:  # noqa: BLE001
        raise _SkipRest(f"import slidedp_runner failed: {type(e).__name__}: {e}") from e
    opts = dict(device=dev, dry_run=dry_run, seed=seed, input_ids=x, lr=LR, weight_decay=WD, betas=BETAS, eps=EPS,
                mark_phase=_train_begins, pid_file=os.environ.get("HH2H_PID_FILE"), repo_root=REPO)
    opts.update(user_opts)
    try:
        out = run_slidedp(cfg, batch, seq, steps, warmup, ckpt, **opts)
    except NotImplementedError as e:
        raise _SkipRest(f"NotImplementedError: {e}") from e
    if not isinstance(out, dict):
        raise TypeError(f"run_slidedp returned {type(out).__name__}, expected dict")
    out = dict(out)
    out.setdefault("settings", {"slidedp_opts": {k: v for k, v in user_opts.items()}})
    return out


def child_main(args):
    system, ckpt, batch = args.one[0], _parse_onoff(args.one[1]), int(args.one[2])
    dry = args.dry_run
    seq = args.seq
    rec = {"system": system, "ckpt": ckpt, "batch": batch, "seq": seq, "pid": os.getpid()}
    phase = "setup"
    t_start = time.perf_counter()
    dev = "cpu"
    try:
        import torch
        import torch.distributed as dist
        torch.set_num_threads(os.cpu_count())
        rec["torch_num_threads"] = torch.get_num_threads()
        dev = "cpu" if dry else "cuda"
        if dev == "cuda":
            torch.cuda.set_device(0)
        port = os.environ.get("MASTER_PORT") or str(_free_port())
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR=os.environ.get("MASTER_ADDR", "127.0.0.1"), MASTER_PORT=port)
        if not dist.is_initialized():
            dist.init_process_group("gloo" if dry else "nccl", init_method=f"tcp://127.0.0.1:{port}",
                                    rank=0, world_size=1)
        rec["process_group"] = dist.get_backend()
        cfg = model_config(dry)
        x = torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(args.seed + 1))
        phase = "run"
        _mark_phase("init")
        fake = os.environ.get("HH2H_TEST_OOM_BATCH")  # test hook: pretend batches >= N run out of memory
        if fake and batch >= int(fake):
            raise torch.OutOfMemoryError(f"HH2H_TEST_OOM_BATCH={fake}: simulated out of memory")
        common = (cfg, batch, seq, args.steps, args.warmup, ckpt, dev, dry, args.seed, x)
        if system == "fsdp2":
            out = run_fsdp2(*common, offload=False, init_dev="cpu" if dry or args.init_device == "cpu" else "cuda")
        elif system == "fsdp2_offload":
            out = run_fsdp2(*common, offload=True)
        elif system == "deepspeed":
            out = run_deepspeed(*common, json.loads(args.ds_config_extra) if args.ds_config_extra else None)
        elif system == "slidedp":
            out = run_slidedp_entry(*common, {k: _parse_opt_value(v) for k, v in
                                              (o.split("=", 1) for o in args.slidedp_opt)})
        else:
            raise ValueError(f"unknown system {system!r}")
        _mark_phase("done")
        rec.update(out)
        times = rec.get("step_times")
        if times:
            rec["step_s"] = statistics.median(times)
            rec["step_s_mean"] = statistics.fmean(times)
            rec["step_s_min"], rec["step_s_max"] = min(times), max(times)
        rec.setdefault("status", "ok")  # a runner may report its own oom / error
        if rec["status"] == "ok" and not rec.get("step_s"):
            raise RuntimeError("runner returned neither step_times nor step_s")
    except _Unavailable as e:
        rec.update(status="unavailable", why=str(e)[:2000], skip_rest=True)
    except _SkipRest as e:
        rec.update(status="error", phase=phase, why=str(e)[:1500], traceback_tail=traceback.format_exc()[-3000:],
                   skip_rest=True)
    except BaseException as e:  # noqa: BLE001
        tb = traceback.format_exc()
        if phase == "run" and _is_oom(e):
            rec.update(status="oom", why=f"{type(e).__name__}: {str(e)[:600]}")
        else:
            rec.update(status="error", phase=phase, why=f"{type(e).__name__}: {str(e)[:1500]}",
                       traceback_tail=tb[-3000:])
    try:
        import torch
        if dev == "cuda" and torch.cuda.is_initialized():
            rec.setdefault("peak_gpu_reserved_GiB", torch.cuda.max_memory_reserved() / GiB)
            rec.setdefault("peak_gpu_allocated_GiB", torch.cuda.max_memory_allocated() / GiB)
            for k, v in _SETUP_PEAK.items():
                rec.setdefault(k, v)
    except Exception:  # noqa: BLE001
        pass
    rec["vm_hwm_GiB"] = _proc_status_kb("VmHWM") / 2 ** 20 if _proc_status_kb("VmHWM") else None
    rec["child_wall_s"] = time.perf_counter() - t_start
    line = RESULT_MARK + json.dumps(rec, default=str)
    if args.result_file:
        with open(args.result_file, "w") as f:
            f.write(line + "\n")
    sys.stdout.flush()
    print(line, flush=True)
    # no destroy_process_group, no interpreter teardown: after an OOM or a CUDA error they can hang
    # (NCCL, DeepSpeed atexit hooks), and a world-size-1 group has no peer waiting for us
    os._exit(0)


def _proc_status_kb(key):
    try:
        with open("/proc/self/status") as f:
            for ln in f:
                if ln.startswith(key + ":"):
                    return int(ln.split()[1])
    except OSError:
        pass
    return None


def _parse_onoff(s):
    s = str(s).lower()
    if s in ("on", "1", "true", "ckpt", "yes"):
        return True
    if s in ("off", "0", "false", "nockpt", "no"):
        return False
    raise ValueError(f"ckpt must be on|off, got {s!r}")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------------------------------------
# parent: process-tree memory sampler
# ----------------------------------------------------------------------------------------------
def _children_map():
    kids = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                s = f.read()
            ppid = int(s[s.rindex(")") + 2:].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        kids.setdefault(ppid, []).append(int(name))
    return kids


def _smaps_rollup(pid):
    out = {}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for ln in f:
                parts = ln.split()
                if len(parts) >= 2 and parts[0] in ("Rss:", "Pss:", "Pss_Shmem:", "Pss_Anon:", "Pss_File:"):
                    out[parts[0][:-1]] = int(parts[1])
    except (OSError, ValueError):
        return None
    return out


def _status_rss(pid):
    """VmRSS and its parts from /proc/PID/status, kB: the kernel's per-mm counters, read without walking
    the page tables (smaps_rollup walks all of them under mmap_lock: tens of ms for a process holding
    tens of GB, contending with its mmap/munmap, page faults and pinning while it trains)."""
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for ln in f:
                if ln.startswith(("VmRSS:", "RssAnon:", "RssFile:", "RssShmem:")):
                    k, v = ln.split()[:2]
                    out["Rss" if k == "VmRSS:" else k[:-1]] = int(v)
    except (OSError, ValueError):
        return None
    return out or None


class TreeSampler(threading.Thread):
    """Samples host memory of a process, its descendants and the pids listed in pid_file (plus their
    descendants): RSS (/proc/PID/status counters, cheap) every `period` s for the whole life; PSS
    (smaps_rollup, a page-table walk) only outside the training phase, every `pss_period` s (0: never),
    and once when the child marks the phase "measured" (right after its last measured step, before
    teardown; it waits for that sample). GPU memory used (device-wide) through pynvml every `gpu_period`
    s, or nvidia-smi every 5 s when pynvml is missing, when asked."""

    def __init__(self, root, pid_file, phase_file, period=0.2, gpu=False, gpu_period=1.0, pss_period=5.0):
        super().__init__(daemon=True)
        self.root, self.pid_file, self.phase_file, self.period = root, pid_file, phase_file, period
        self.pss_period = pss_period
        self.stop_evt = threading.Event()
        self.peak = {}        # key -> max over samples of the tree's sum, kB (Rss*: status; Pss*: smaps_rollup)
        self.peak_train = {}  # the same while the child's phase is "train"
        self.measured = {}    # the smaps_rollup sums taken at phase "measured"
        self.max_procs = 0
        self.samples = 0
        self.pss_samples = 0
        self.gpu = gpu
        self.gpu_period = gpu_period
        self.gpu_peak_mib = None
        self.gpu_src = None
        self._nvml = None

    def _extra_pids(self):
        if not self.pid_file:
            return []
        try:
            with open(self.pid_file) as f:
                return [int(t) for t in f.read().split() if t.strip().isdigit()]
        except OSError:
            return []

    def _phase(self):
        try:
            with open(self.phase_file) as f:
                return f.read().strip()
        except OSError:
            return ""

    def _gpu_used_mib(self):
        if self._nvml is None:
            try:
                import pynvml
                pynvml.nvmlInit()
                self._nvml = pynvml
                self.gpu_src = "pynvml"
            except Exception:  # noqa: BLE001
                self._nvml = False
                self.gpu_src = "nvidia-smi" if shutil.which("nvidia-smi") else None
        try:
            if self._nvml:
                n = self._nvml.nvmlDeviceGetCount()
                return max(self._nvml.nvmlDeviceGetMemoryInfo(self._nvml.nvmlDeviceGetHandleByIndex(i)).used
                           for i in range(n)) / 2 ** 20
            if self.gpu_src == "nvidia-smi":
                r = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                   capture_output=True, text=True, timeout=10)
                vals = [float(v) for v in r.stdout.split()]
                return max(vals) if vals else None
        except Exception:  # noqa: BLE001
            return None
        return None

    def _tree(self):
        kids = _children_map()
        todo = [self.root] + self._extra_pids()
        seen = set()
        while todo:
            p = todo.pop()
            if p in seen:
                continue
            seen.add(p)
            todo.extend(kids.get(p, []))
        return seen

    def _sum(self, pids, read):
        tot, n = {}, 0
        for p in pids:
            r = read(p)
            if r is None:
                continue
            n += 1
            for k, v in r.items():
                tot[k] = tot.get(k, 0) + v
        return tot, n

    def _add(self, tot, train):
        for k, v in tot.items():
            self.peak[k] = max(self.peak.get(k, 0), v)
            if train:
                self.peak_train[k] = max(self.peak_train.get(k, 0), v)

    def run(self):
        next_gpu = next_pss = next_tree = 0.0
        tree = set()
        while not self.stop_evt.is_set():
            t0 = time.monotonic()
            phase = self._phase()
            if t0 >= next_tree or phase == "measured":  # scanning /proc for the tree: every second is enough
                tree, next_tree = self._tree(), t0 + 1.0
            tot, n = self._sum(tree, _status_rss)
            if n:
                self.samples += 1
                self.max_procs = max(self.max_procs, n)
                self._add(tot, phase == "train")
            if phase == "measured" and not self.measured:
                self.measured, _ = self._sum(tree, _smaps_rollup)
                self.measured = self.measured or {"none": 0}
                self.pss_samples += 1
                self._add({k: v for k, v in self.measured.items() if k.startswith("Pss")}, False)
                try:
                    open(self.phase_file + ".measured", "w").close()
                except OSError:
                    pass
            elif phase not in ("train", "measured") and self.pss_period > 0 and t0 >= next_pss:
                next_pss = t0 + self.pss_period
                tot, n = self._sum(tree, _smaps_rollup)
                if n:
                    self.pss_samples += 1
                    self._add({k: v for k, v in tot.items() if k.startswith("Pss")}, False)
            if self.gpu and t0 >= next_gpu:
                u = self._gpu_used_mib()
                next_gpu = t0 + (self.gpu_period if self._nvml else max(self.gpu_period, 5.0))
                if u is not None:
                    self.gpu_peak_mib = u if self.gpu_peak_mib is None else max(self.gpu_peak_mib, u)
            self.stop_evt.wait(max(0.0, self.period - (time.monotonic() - t0)))

    def result(self):
        g = lambda d, k: round(d[k] / 2 ** 20, 3) if k in d else None  # noqa: E731  kB -> GiB
        out = {"host_rss_peak_GiB": g(self.peak, "Rss"), "host_rss_shmem_peak_GiB": g(self.peak, "RssShmem"),
               "host_rss_peak_train_GiB": g(self.peak_train, "Rss"),
               "host_pss_peak_GiB": g(self.peak, "Pss"), "host_pss_shmem_peak_GiB": g(self.peak, "Pss_Shmem"),
               "host_pss_measured_GiB": g(self.measured, "Pss"),
               "host_pss_shmem_measured_GiB": g(self.measured, "Pss_Shmem"),
               "host_rss_measured_GiB": g(self.measured, "Rss"),
               "host_mem_samples": self.samples, "host_pss_samples": self.pss_samples,
               "host_mem_max_procs": self.max_procs}
        if self.gpu:
            out["gpu_used_device_peak_GiB"] = (round(self.gpu_peak_mib / 1024, 3)
                                               if self.gpu_peak_mib is not None else None)
            out["gpu_used_device_source"] = self.gpu_src
        return out


# ----------------------------------------------------------------------------------------------
# parent: launching children
# ----------------------------------------------------------------------------------------------
def child_cmd(args, system, ckpt, batch, result_file, extra_opts=()):
    cmd = [sys.executable, os.path.abspath(__file__), "--one", system, "on" if ckpt else "off", str(batch),
           "--seq", str(args.seq), "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--seed", str(args.seed), "--result-file", result_file]
    if args.dry_run:
        cmd.append("--dry-run")
    if system == "deepspeed" and args.ds_config_extra:
        cmd += ["--ds-config-extra", args.ds_config_extra]
    if system == "slidedp":
        for o in list(args.slidedp_opt) + list(extra_opts):  # a later KEY wins
            cmd += ["--slidedp-opt", o]
    return cmd


def child_env(args, system):
    env = dict(os.environ)
    # a torchrun / elastic environment around the parent must not leak into the world-size-1 child
    for k in list(env):
        if k.startswith("TORCHELASTIC_") or k in ("GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME",
                                                  "GROUP_WORLD_SIZE", "OMP_NUM_THREADS"):
            env.pop(k)
    env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(_free_port()), PYTHONUNBUFFERED="1")
    # the interpreter's bin (a venv run without activation: ninja for torch cpp extensions lives there)
    path = [os.path.dirname(sys.executable)]
    if system == "deepspeed" and args.ds_path:
        env["PYTHONPATH"] = args.ds_path + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        path.insert(0, os.path.join(args.ds_path, "bin"))
    env["PATH"] = os.pathsep.join(path + [env.get("PATH", "")])
    # JIT-built torch extensions (DeepSpeed's cpu_adam) are kept next to this script (gitignored), so
    # they survive between runs on a machine that keeps ignored build outputs
    env.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(HERE, ".torch_extensions"))
    if system == "deepspeed":
        if args.dry_run:
            env.setdefault("DS_ACCELERATOR", "cpu")
    return env


def _tail(path, n=3000):
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - n))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


def _read_result(result_file, stdout_file):
    for path in (result_file, stdout_file):
        try:
            with open(path, errors="replace") as f:
                lines = [ln for ln in f if ln.startswith(RESULT_MARK)]
        except OSError:
            continue
        if lines:
            try:
                return json.loads(lines[-1][len(RESULT_MARK):])
            except ValueError:
                pass
    return None


def anchor_unavailable(args, machine):
    """Why the anchor cannot run here (None: it can): its script is missing, or there is no GPU (it
    needs CUDA and NCCL; HH2H_ANCHOR_FORCE=1, a test hook, runs a stand-in script anyway)."""
    if not os.path.isfile(args.anchor_script):
        return f"anchor script {args.anchor_script} not found (--anchor-script; copy shared/tools/anchor_baselines.py)"
    if not (machine or {}).get("gpu") and os.environ.get("HH2H_ANCHOR_FORCE") != "1":
        return "the anchor script needs a CUDA GPU (none here)"
    return None


def parse_anchor_output(text, batch):
    """anchor_baselines.py prints one JSON line per measurement: {"what": "cpu_triad_GBps", "value"} and
    {"what": "offload" | "offload-nockpt", "batch", "seq", "step_s" (mean of 5 steps after 3 warmup,
    one sync at the end), "tokens_per_s", "model_TFLOPS", "peak_reserved_GiB", "loss"} -> a run
    record's fields, or None without the offload line."""
    rec, found = {}, None
    for ln in text.splitlines():
        ln = ln.strip()
        if not ln.startswith("{"):
            continue
        try:
            d = json.loads(ln)
        except ValueError:
            continue
        if d.get("what") == "cpu_triad_GBps":
            rec["cpu_triad_GBps"] = d.get("value")
        elif str(d.get("what", "")).startswith("offload") and d.get("step_s"):
            found = d
    if found is None:
        return None
    if int(found.get("batch", batch)) != batch:
        raise ValueError(f"anchor measured batch {found.get('batch')}, asked for {batch}")
    rec.update(status="ok", anchor_output=found, step_s=float(found["step_s"]), step_s_mean=float(found["step_s"]),
               seq=int(found.get("seq", 1024)), loss=found.get("loss"),
               peak_gpu_reserved_GiB=found.get("peak_reserved_GiB"))
    return rec


def anchor_record(out_path, err_path, rc, system, ckpt, batch, seq):
    rec = {"system": system, "ckpt": ckpt, "batch": batch, "seq": seq}
    try:
        with open(out_path, errors="replace") as f:
            got = parse_anchor_output(f.read(), batch)
    except (OSError, ValueError) as e:
        got, rec["why"] = None, f"{type(e).__name__}: {e}"
    if got:
        rec.update(got)
        rec["settings"] = {"what": "shared/tools/anchor_baselines.py offload BATCH, run as is: FSDP2 + "
                                   "CPUOffloadPolicy(pin_memory=True), built on the CPU, fused AdamW (default "
                                   "hyperparameters but lr 1e-5), 3 warmup + 5 timed steps; step_s is their mean"}
        return rec
    err = _tail(err_path, 2000)
    oom = "out of memory" in err.lower()
    if rc == -signal.SIGKILL:
        rec.update(where="host", why="killed by SIGKILL without a result (presumably the kernel OOM killer)")
    rec.update(status="oom" if oom or rc == -signal.SIGKILL else "error", stderr_tail=err)
    rec.setdefault("why", "out of memory" if oom else f"no offload line in the anchor's output (exit {rc})")
    return rec


def launch(args, system, ckpt, batch, log_dir, timeout, extra_opts=()):
    tag = f"{system}_{'ckpt' if ckpt else 'nockpt'}_b{batch}"
    if system == "anchor":
        why = anchor_unavailable(args, getattr(args, "machine", None))
        if why:
            print(f"[hh2h] {tag}: unavailable {why}", file=sys.stderr, flush=True)
            return {"system": system, "ckpt": ckpt, "batch": batch, "seq": 1024, "status": "unavailable",
                    "why": why, "skip_rest": True, "variant": ""}
    if extra_opts:
        tag += "_" + re.sub(r"[^A-Za-z0-9.=_-]", "_", "_".join(extra_opts))
    tmp = tempfile.mkdtemp(prefix=f"hh2h-{tag}-")
    result_file = os.path.join(tmp, "result.json")
    pid_file = os.path.join(tmp, "pids")
    phase_file = os.path.join(tmp, "phase")
    open(pid_file, "w").close()
    out_path = os.path.join(log_dir, tag + ".out")
    err_path = os.path.join(log_dir, tag + ".err")
    env = child_env(args, system)
    env["HH2H_PID_FILE"] = pid_file
    env["HH2H_PHASE_FILE"] = phase_file
    if system == "anchor":  # the script itself, nothing of ours in its process (same env as our children)
        cmd = [sys.executable, os.path.abspath(args.anchor_script), "offload", str(batch)]
        env.pop("NO_CKPT", None)
        if not ckpt:
            env["NO_CKPT"] = "1"
    else:
        cmd = child_cmd(args, system, ckpt, batch, result_file, extra_opts)
    print(f"[hh2h] {tag}: start (timeout {timeout:.0f} s)", file=sys.stderr, flush=True)
    t0 = time.time()
    with open(out_path, "w") as fo, open(err_path, "w") as fe:
        proc = subprocess.Popen(cmd, stdout=fo, stderr=fe, env=env, cwd=REPO, start_new_session=True)
        # the anchor marks no phases: no PSS walk of it at all (only the cheap RSS counters)
        sampler = TreeSampler(proc.pid, pid_file, phase_file, period=args.sample_period, gpu=not args.dry_run,
                              pss_period=0 if system == "anchor" else args.pss_period)
        sampler.start()
        timed_out = False
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_tree(proc)
            rc = proc.wait()
        finally:
            sampler.stop_evt.set()
            sampler.join(timeout=10)
    wall = time.time() - t0
    rec = (anchor_record(out_path, err_path, rc, system, ckpt, batch, args.seq) if system == "anchor" and
           not timed_out else _read_result(result_file, out_path))
    if rec is None:
        rec = {"system": system, "ckpt": ckpt, "batch": batch, "seq": args.seq}
        if timed_out:
            rec.update(status="timeout", why=f"no result within {timeout:.0f} s; child killed")
        elif rc == -signal.SIGKILL:
            rec.update(status="oom", where="host",
                       why="child killed by SIGKILL without a result (presumably the kernel OOM killer)")
        else:
            rec.update(status="crash", why=f"child exited with {rc} without a result")
        rec["stderr_tail"] = _tail(err_path, 2000)
    elif timed_out:
        rec["note"] = f"child printed its result but did not exit within {timeout:.0f} s; killed"
    if timed_out or rc != 0:
        stale = _remove_stale_ext_locks(env["TORCH_EXTENSIONS_DIR"], t0)
        if stale:
            rec["removed_stale_extension_locks"] = stale
    rec["returncode"] = rc
    rec["wall_s"] = round(wall, 2)
    rec["variant"] = ",".join(extra_opts)
    rec.update(sampler.result())
    rec["log"] = {"stdout": os.path.relpath(out_path, args.out), "stderr": os.path.relpath(err_path, args.out)}
    # extra processes named by the runner might outlive the child: not ours to kill, just say so
    shutil.rmtree(tmp, ignore_errors=True)
    st = rec.get("status")
    msg = f"step {rec['step_s']:.3f} s" if st == "ok" else (rec.get("why") or "")[:200]
    print(f"[hh2h] {tag}: {st} {msg} ({wall:.1f} s)", file=sys.stderr, flush=True)
    return rec


def _remove_stale_ext_locks(ext_dir, since):
    """A torch cpp-extension build killed midway leaves DIR/<name>/lock behind and every later build
    of that extension waits on it forever: remove the locks our killed child created."""
    removed = []
    for root, _dirs, files in os.walk(ext_dir):
        if root[len(ext_dir):].count(os.sep) > 3:
            continue
        if "lock" in files:
            p = os.path.join(root, "lock")
            try:
                if os.path.getmtime(p) >= since - 1:
                    os.remove(p)
                    removed.append(p)
            except OSError:
                pass
    return removed


def _kill_tree(proc):
    for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)  # the child's own session (start_new_session=True)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


# ----------------------------------------------------------------------------------------------
# parent: derived figures, ratios, outputs
# ----------------------------------------------------------------------------------------------
def derive(rec, nparam, cfgd, seq):
    if rec.get("status") != "ok" or not rec.get("step_s"):
        return rec
    seq = rec.get("seq") or seq  # the anchor's own (1024 always)
    tok = rec["batch"] * seq
    rec["tokens_per_step"] = tok
    rec["tokens_per_s"] = tok / rec["step_s"]
    n = rec.get("nparam") or nparam
    rec["model_TFLOPS"] = tok * flops_per_token(n, cfgd, seq) / rec["step_s"] / 1e12
    return rec


def compute_ratios(runs, batches):
    ok = {}
    status = {}
    variant = {}  # the --run options of the run behind ok[key] (the best when several ran)
    for r in runs:
        key = (r["system"], bool(r["ckpt"]), int(r["batch"]))
        status[key] = r.get("status")
        if r.get("status") == "ok" and r.get("tokens_per_s") and r["tokens_per_s"] > ok.get(key, 0):
            ok[key] = r["tokens_per_s"]
            variant[key] = r.get("variant", "")

    def row(num, den, extra):
        d = dict(extra)
        a, b = ok.get(num), ok.get(den)
        d["slidedp_tokens_per_s"] = a
        d[f"{den[0]}_tokens_per_s"] = b
        if variant.get(num):
            d["slidedp_variant"] = variant[num]
        if a and b:
            d["ratio"] = a / b
        else:
            d["ratio"] = None
            d["why"] = "; ".join(f"{k[0]} {'ckpt' if k[1] else 'nockpt'} b{k[2]}: {status.get(k, 'not run')}"
                                 for k, v in ((num, a), (den, b)) if not v)
        return d

    out = {"definition": "tokens_per_s of slidedp divided by tokens_per_s of the other system; null when either "
                         "side has no ok run (why says which)"}
    out["slidedp_over_fsdp2"] = [row(("slidedp", c, b), ("fsdp2", c, b), {"ckpt": c, "batch": b})
                                 for c in (True, False) for b in batches]

    def best(system):
        cand = [(v, k) for k, v in ok.items() if k[0] == system]
        if not cand:
            return None
        v, k = max(cand)
        return {"tokens_per_s": v, "ckpt": k[1], "batch": k[2], "variant": variant.get(k, "")}
    sb, fb = best("slidedp"), best("fsdp2")
    out["slidedp_best_over_fsdp2_best"] = {
        "ratio": sb["tokens_per_s"] / fb["tokens_per_s"] if sb and fb else None,
        "slidedp_best": sb, "fsdp2_best": fb}
    out["slidedp_over_fsdp2_offload"] = [row(("slidedp", c, b), ("fsdp2_offload", True, b),
                                             {"slidedp_ckpt": c, "fsdp2_offload_ckpt": True, "batch": b})
                                         for c in (True, False) for b in batches]
    out["slidedp_over_deepspeed"] = [row(("slidedp", c, b), ("deepspeed", True, b),
                                         {"slidedp_ckpt": c, "deepspeed_ckpt": True, "batch": b})
                                     for c in (True, False) for b in batches]
    out["fsdp2_offload_over_anchor"] = anchor_agreement(runs)
    return out


def anchor_agreement(runs):
    """fsdp2_offload's step time over the anchor script's, per (ckpt, batch) where an anchor record exists;
    both are means of the measured steps (the anchor times 5 steps as one span). The harness must
    reproduce the anchor within ANCHOR_TOL in the same run, else its offload ratios are not trusted."""
    last = {}
    for r in runs:  # the last ok record of each (system, ckpt, batch), else the last one
        k = (r["system"], bool(r["ckpt"]), int(r["batch"]))
        if r.get("status") == "ok" or last.get(k, {}).get("status") != "ok":
            last[k] = r
    rows = []
    for (system, c, b), a in sorted(last.items(), key=lambda kv: (not kv[0][1], kv[0][2])):
        if system != "anchor":
            continue
        f = last.get(("fsdp2_offload", c, b), {})
        row = {"ckpt": c, "batch": b, "anchor_step_s": a.get("step_s"),
               "fsdp2_offload_step_s_mean": f.get("step_s_mean"), "fsdp2_offload_step_s": f.get("step_s"),
               "tolerance": ANCHOR_TOL}
        if a.get("status") == "ok" and f.get("status") == "ok" and a.get("step_s") and f.get("step_s_mean"):
            row["ratio"] = f["step_s_mean"] / a["step_s"]
            row["within_tolerance"] = abs(row["ratio"] - 1) <= ANCHOR_TOL
        else:
            row.update(ratio=None, within_tolerance=None,
                       why=f"anchor: {a.get('status')}, fsdp2_offload: {f.get('status', 'not run')}")
        rows.append(row)
    return rows


def write_png(report, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # noqa: BLE001
        return f"matplotlib unavailable: {e}"
    runs = report["runs"]
    series = {}
    for r in runs:
        series.setdefault((r["system"], bool(r["ckpt"])), []).append(r)
    fig, ax = plt.subplots(figsize=(9, 5.5))
    colors = {"fsdp2": "tab:blue", "fsdp2_offload": "tab:orange", "deepspeed": "tab:green", "slidedp": "tab:red",
              "anchor": "black"}
    ymax = max([r.get("tokens_per_s") or 0 for r in runs] + [1])
    batches = sorted({int(r["batch"]) for r in runs})
    notes = []
    n_oom_rows = 0
    order = lambda kv: (ALL_SYSTEMS.index(kv[0][0]) if kv[0][0] in ALL_SYSTEMS else 99, not kv[0][1])  # noqa: E731
    for (system, ckpt), rs in sorted(series.items(), key=order):
        rs = sorted(rs, key=lambda r: r["batch"])
        label = f"{system} ({'ckpt' if ckpt else 'no ckpt'})"
        style = "-" if ckpt else "--"
        c = colors.get(system)
        xs = [r["batch"] for r in rs if r.get("status") == "ok"]
        ys = [r["tokens_per_s"] for r in rs if r.get("status") == "ok"]
        line, = ax.plot(xs, ys, style, marker="o", color=c, label=label)
        oom = [r["batch"] for r in rs if r.get("status") == "oom"]
        if oom:
            y = (0.02 + 0.035 * n_oom_rows) * ymax  # a row per series: coinciding marks stay visible
            n_oom_rows += 1
            ax.plot(oom, [y] * len(oom), "x", color=line.get_color(), markersize=9, mew=2.5)
            for b in oom:
                ax.annotate("OOM", (b, y), textcoords="offset points", xytext=(5, -3), fontsize=7,
                            color=line.get_color())
        for r in rs:
            if r.get("status") not in ("ok", "oom"):
                notes.append(f"{label}: {r.get('status')}")
    ax.set_xscale("log", base=2)
    ax.set_xticks(batches)
    ax.set_xticklabels([str(b) for b in batches])
    ax.set_ylim(bottom=0)
    ax.set_xlabel("batch (sequences per step)")
    ax.set_ylabel("training tokens/s")
    m = report.get("machine", {})
    gpu = (m.get("gpu") or {}).get("name") or ("CPU dry-run" if report.get("dry_run") else "?")
    ax.set_title(f"{report.get('model_name', 'model')}, seq {report.get('seq')}, {gpu}\n"
                 f"x at bottom = out of memory", fontsize=10)
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, loc="best")
    if notes:
        fig.text(0.01, 0.005, "not plotted: " + "; ".join(sorted(set(notes)))[:300], fontsize=6, va="bottom")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return None


def write_outputs(report, json_path, png_path):
    report["ratios"] = compute_ratios(report["runs"], report["batches"])
    err = write_png(report, png_path) if png_path else "no png"
    report["png"] = os.path.basename(png_path) if err is None else None
    if err:
        report["png_error"] = err
    tmp = json_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(report, f, indent=1, default=str)
        f.write("\n")
    os.replace(tmp, json_path)


# ----------------------------------------------------------------------------------------------
# parent: machine description
# ----------------------------------------------------------------------------------------------
PROBE = r"""
import json, os, sys, ctypes
out = {}
import torch, transformers
out["torch"] = torch.__version__; out["transformers"] = transformers.__version__
out["torch_cuda"] = torch.version.cuda
sys.path.insert(0, sys.argv[1]); import run
cfg = run.model_config(sys.argv[2] == "1")
from transformers import AutoModelForCausalLM
with torch.device("meta"):
    m = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
out["nparam"] = sum(p.numel() for p in m.parameters())
out["model_class"] = type(m).__name__
try:
    out["cudnn"] = torch.backends.cudnn.version()
except Exception: pass
try:
    out["nccl"] = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None
except Exception: pass
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    out["gpu"] = {"name": p.name, "count": torch.cuda.device_count(), "total_memory_GiB": p.total_memory / 2**30,
                  "capability": f"{p.major}.{p.minor}", "multi_processor_count": p.multi_processor_count}
try:
    lib = ctypes.CDLL("libcuda.so.1"); v = ctypes.c_int()
    if lib.cuDriverGetVersion(ctypes.byref(v)) == 0:
        out["cuda_driver_api"] = f"{v.value // 1000}.{(v.value % 1000) // 10}"
except OSError: pass
print(json.dumps(out))
"""


def machine_info(dry_run):
    m = {"hostname": socket.gethostname(), "python": sys.version.split()[0], "python_executable": sys.executable}
    try:
        with open("/proc/cpuinfo") as f:
            for ln in f:
                if ln.startswith("model name"):
                    m["cpu_model"] = ln.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    m["cpu_count"] = os.cpu_count()
    try:
        m["cpu_affinity"] = len(os.sched_getaffinity(0))
    except AttributeError:
        pass
    try:
        m["numa_nodes"] = len([d for d in os.listdir("/sys/devices/system/node") if d.startswith("node")])
    except OSError:
        pass
    try:
        with open("/proc/meminfo") as f:
            for ln in f:
                if ln.startswith("MemTotal:"):
                    m["ram_GiB"] = round(int(ln.split()[1]) / 2 ** 20, 1)
    except OSError:
        pass
    try:
        with open("/proc/driver/nvidia/version") as f:
            m["nvidia_driver"] = f.readline().strip()
    except OSError:
        pass
    if shutil.which("nvidia-smi"):
        try:
            r = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,pcie.link.gen.max,"
                                "pcie.link.width.max", "--format=csv,noheader"], capture_output=True, text=True,
                               timeout=30)
            m["nvidia_smi"] = r.stdout.strip().splitlines()
        except Exception:  # noqa: BLE001
            pass
    try:
        r = subprocess.run([sys.executable, "-c", PROBE, HERE, "1" if dry_run else "0"], capture_output=True,
                           text=True, timeout=300, env={**os.environ, "CUDA_MODULE_LOADING": "LAZY"})
        if r.returncode == 0:
            m.update(json.loads(r.stdout.strip().splitlines()[-1]))
        else:
            m["probe_error"] = r.stderr[-1500:]
    except Exception as e:  # noqa: BLE001
        m["probe_error"] = str(e)
    m["uname"] = " ".join(os.uname())
    return m


def git_info():
    out = {}
    try:
        r = subprocess.run(["git", "-C", REPO, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=20)
        if r.returncode == 0:
            out["commit"] = r.stdout.strip()
            r2 = subprocess.run(["git", "-C", REPO, "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True, timeout=20)
            out["dirty"] = bool(r2.stdout.strip()) if r2.returncode == 0 else None
        else:
            out["commit"] = None
            out["why"] = r.stderr.strip()[:300]
    except Exception as e:  # noqa: BLE001
        out["commit"] = None
        out["why"] = str(e)[:300]
    return out


# ----------------------------------------------------------------------------------------------
# parent: main loop and merge
# ----------------------------------------------------------------------------------------------
def parse_run_spec(spec):
    """SYSTEM:on|off:BATCH[:KEY=VALUE,KEY=VALUE...] -> (system, ckpt, batch, [KEY=VALUE...])."""
    parts = spec.split(":", 3)
    if len(parts) < 3:
        raise SystemExit(f"--run {spec!r}: expected SYSTEM:on|off:BATCH[:KEY=VALUE,...]")
    system, ckpt, batch = parts[0], parts[1], parts[2]
    if system not in ALL_SYSTEMS:
        raise SystemExit(f"--run {spec!r}: unknown system {system!r}; choose from {','.join(ALL_SYSTEMS)}")
    if ckpt not in ("on", "off"):
        raise SystemExit(f"--run {spec!r}: checkpointing must be on or off, got {ckpt!r}")
    if not batch.isdigit() or int(batch) < 1:
        raise SystemExit(f"--run {spec!r}: batch must be a positive integer, got {batch!r}")
    extra = [o for o in parts[3].split(",") if o] if len(parts) == 4 else []
    for o in extra:
        if "=" not in o:
            raise SystemExit(f"--run {spec!r}: option {o!r} is not KEY=VALUE")
    if extra and system != "slidedp":
        raise SystemExit(f"--run {spec!r}: per-run options apply to slidedp only")
    return system, ckpt == "on", int(batch), extra


def parent_main(args):
    if os.environ.get("RANK", "0") != "0" or os.environ.get("LOCAL_RANK", "0") != "0":
        print("[hh2h] not rank 0 of a torchrun launch: nothing to do", file=sys.stderr)
        return 0
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    for s in systems:
        if s not in ALL_SYSTEMS:
            raise SystemExit(f"unknown system {s!r}; choose from {','.join(ALL_SYSTEMS)}")
    plan = [parse_run_spec(spec) for spec in args.run]  # a bad spec fails before anything is written
    batches = sorted({int(b) for b in args.batches.split(",") if b.strip()})
    ckpt_filter = {"both": (True, False), "on": (True,), "off": (False,)}[args.ckpt]
    os.makedirs(args.out, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    stem = f"hf_head_to_head_{'dryrun_' if args.dry_run else ''}{stamp}"
    json_path = os.path.join(args.out, stem + ".json")
    png_path = os.path.join(args.out, stem + ".png")
    log_dir = os.path.join(args.out, stem + "_logs")
    os.makedirs(log_dir, exist_ok=True)
    if args.ds_path is None:
        cand = os.path.join(REPO, ".carry", "ds_site")
        args.ds_path = cand if os.path.isdir(cand) else ""
    if args.ds_path:  # pynvml (nvidia-ml-py) for the GPU sampler, when only that folder has it; last on the path
        sys.path.append(args.ds_path)

    t_begin = time.time()
    print("[hh2h] probing the machine", file=sys.stderr, flush=True)
    machine = args.machine = machine_info(args.dry_run)
    cfg = model_config_dict(args.dry_run)
    nparam = machine.get("nparam")
    report = {
        "benchmark": "hf_head_to_head",
        "model_name": "tiny Qwen3 (dry-run)" if args.dry_run else "Qwen3-4B-shaped (random init)",
        "dry_run": args.dry_run,
        "start_time": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": shlex.join([sys.executable] + sys.argv),
        "cwd": os.getcwd(),
        "git": git_info(),
        "machine": machine,
        "model_config": cfg,
        "nparam": nparam,
        "seq": args.seq, "batches": batches, "warmup": args.warmup, "steps": args.steps, "seed": args.seed,
        "timeout_s": args.timeout,
        "systems": systems,
        "flops_formula": FLOP_FORMULA,
        "flops_per_token": flops_per_token(nparam, cfg, args.seq) if nparam else None,
        "figures": {
            "step_s": "median wall time of the measured steps (each ends in a device sync), after warmup",
            "tokens_per_s": "batch * seq / step_s",
            "peak_gpu_reserved_GiB / peak_gpu_allocated_GiB": "torch.cuda.max_memory_reserved/allocated of the "
                                                              "child process from the first warmup step on (stats "
                                                              "reset after model setup; *_setup_GiB: before that)",
            "gpu_used_device_peak_GiB": "device-wide used memory (pynvml or nvidia-smi, 1 s samples), all processes",
            "host_rss_peak_GiB": f"max over {args.sample_period} s samples of the sum over the child's process "
                                 "tree (plus pids a runner names) of /proc/PID/status VmRSS (kernel counters, no "
                                 "page-table walk); whole life of the child; host_rss_shmem_peak_GiB: RssShmem",
            "host_rss_peak_train_GiB": "the same, only samples from the first warmup step to the last measured one",
            "host_pss_measured_GiB": "sum over the same tree of smaps_rollup Pss, taken once right after the last "
                                     "measured step (the child waits for it; hostd still up): the training "
                                     "footprint to compare when processes share memory; *_shmem_*: Pss_Shmem; "
                                     "host_rss_measured_GiB: smaps_rollup Rss of that sample",
            "host_pss_peak_GiB": f"max over the PSS samples: every {args.pss_period} s outside the training phase "
                                 "(none during the warmup and measured steps: a walk of a process holding tens of "
                                 "GB contends with its mmap/munmap and pinning) and the one after the measured "
                                 "steps; null for the anchor (never walked)",
            "loss": "loss of the last measured step (same CPU-built init and batch for the torch systems but "
                    "--init-device gpu's fsdp2; slidedp: hostd's own init; anchor: unseeded torch default)",
            "fsdp2_offload_over_anchor": "ratios: fsdp2_offload step_s_mean / anchor step_s (both means of 5 steps "
                                         f"after 3 warmup); must be within {ANCHOR_TOL:.0%} in the same run",
        },
        "settings": {"fsdp2": "GPU-resident FSDP2 (fully_shard per layer + root), bf16 params / fp32 reduce, "
                              "fp32 master + torch fused AdamW on the GPU; ckpt on and off",
                     "fsdp2_offload": "fsdp2 + CPUOffloadPolicy(pin_memory=True): params, grads, optimizer on "
                                      "the CPU (torch fused AdamW on the CPU); ckpt on",
                     "deepspeed": "ZeRO-Offload: ZeRO stage 2, offload_optimizer cpu (pinned), DeepSpeedCPUAdam, "
                                  "bf16; ckpt on",
                     "slidedp": "bench/hf_head_to_head/slidedp_runner.py run_slidedp(); ckpt on and off",
                     "anchor": f"{args.anchor_script} offload BATCH (NO_CKPT=1 for ckpt off), run as is in the "
                               "same environment as the other children",
                     "init": "HF random init from torch.manual_seed(seed) under torch.device('cpu') for every "
                             "torch system (offload ones stay there, as the anchor builds; fsdp2 then moves to the "
                             "GPU)" if args.init_device == "cpu" else
                             "offload systems on the CPU (as the anchor), fsdp2 on the GPU: its weights and loss "
                             "differ from theirs",
                     "optimizer_hparams": {"lr": LR, "weight_decay": WD, "betas": BETAS, "eps": EPS},
                     "deepspeed_pythonpath": args.ds_path or None,
                     "torch_num_threads": "os.cpu_count() in every child (as the anchor); OMP_NUM_THREADS "
                                          "and torchrun variables removed from the children's environment",
                     "host_memory_sampling": {"rss_period_s": args.sample_period, "pss_period_s": args.pss_period},
                     "ckpt": "HF model.gradient_checkpointing_enable() with transformers' default kwargs"},
        "runs": [],
    }
    write_outputs(report, json_path, png_path)
    if args.run:
        report["plan"] = args.run
        for system, ckpt, b, extra in plan:
            remaining = args.budget_s - (time.time() - t_begin) if args.budget_s else None
            if remaining is not None and remaining < 30:
                rec = {"system": system, "ckpt": ckpt, "batch": b, "seq": args.seq, "status": "not_run",
                       "variant": ",".join(extra), "why": f"--budget-s {args.budget_s} spent"}
            else:
                timeout = args.timeout if remaining is None else min(args.timeout, remaining)
                rec = launch(args, system, ckpt, b, log_dir, timeout, extra)
            derive(rec, nparam, cfg, args.seq)
            report["runs"].append(rec)
            write_outputs(report, json_path, png_path)
    for system in ([] if args.run else systems):
        for ckpt in [c for c in SETTINGS[system] if c in ckpt_filter]:
            stop = None
            for b in batches:
                remaining = args.budget_s - (time.time() - t_begin) if args.budget_s else None
                if stop is not None:
                    rec = {"system": system, "ckpt": ckpt, "batch": b, "seq": args.seq, "skipped": True, **stop}
                elif remaining is not None and remaining < 30:
                    rec = {"system": system, "ckpt": ckpt, "batch": b, "seq": args.seq, "status": "not_run",
                           "why": f"--budget-s {args.budget_s} spent"}
                else:
                    timeout = args.timeout if remaining is None else min(args.timeout, remaining)
                    rec = launch(args, system, ckpt, b, log_dir, timeout)
                    if rec.get("status") == "oom":
                        stop = {"status": "oom", "why": f"batch {b} ran out of memory; not run"}
                    elif rec.get("skip_rest"):
                        stop = {"status": rec["status"], "why": rec.get("why")}
                derive(rec, nparam, cfg, args.seq)
                report["runs"].append(rec)
                write_outputs(report, json_path, png_path)
    report["end_time"] = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    report["total_wall_s"] = round(time.time() - t_begin, 1)
    write_outputs(report, json_path, png_path)
    print(summary_table(report), file=sys.stderr)
    print(json_path)
    return 0


def model_config_dict(dry_run):
    return cfg_summary(model_config(dry_run))


def summary_table(report):
    lines = [f"{'system':<14} {'ckpt':<5} {'batch':>5} {'status':<11} {'step_s':>8} {'tok/s':>9} {'TFLOPS':>7} "
             f"{'GPUres':>7} {'hostRSS':>8} {'hostPSS':>8} {'loss':>8}"]
    f = lambda v, fmt: (fmt % v) if isinstance(v, (int, float)) and v is not None else "-"  # noqa: E731
    for r in report["runs"]:
        lines.append(f"{r['system']:<14} {'on' if r['ckpt'] else 'off':<5} {r['batch']:>5} "
                     f"{(r.get('status') or '?') + ('*' if r.get('skipped') else ''):<11} "
                     f"{f(r.get('step_s'), '%.3f'):>8} {f(r.get('tokens_per_s'), '%.0f'):>9} "
                     f"{f(r.get('model_TFLOPS'), '%.1f'):>7} {f(r.get('peak_gpu_reserved_GiB'), '%.1f'):>7} "
                     f"{f(r.get('host_rss_peak_GiB'), '%.2f'):>8} "
                     f"{f(r.get('host_pss_measured_GiB', r.get('host_pss_peak_GiB')), '%.2f'):>8} "
                     f"{f(r.get('loss'), '%.4f'):>8} {r.get('variant') or ''}")
    ratios = report.get("ratios", {})
    rb = ratios.get("slidedp_best_over_fsdp2_best", {})
    lines.append(f"slidedp-best / fsdp2-best: {rb.get('ratio')}")
    for a in ratios.get("fsdp2_offload_over_anchor", []):
        tag = f"{'ckpt' if a['ckpt'] else 'nockpt'} b{a['batch']}"
        if a["ratio"] is None:
            lines.append(f"AGREEMENT fsdp2_offload / anchor step time ({tag}): n/a ({a.get('why')})")
        else:
            lines.append(f"AGREEMENT fsdp2_offload / anchor step time ({tag}): {a['ratio']:.3f} "
                         f"({a['fsdp2_offload_step_s_mean']:.3f} s / {a['anchor_step_s']:.3f} s) "
                         + ("within" if a["within_tolerance"] else "FLAG: off by more than")
                         + f" {a['tolerance']:.0%}")
    for key, other in (("slidedp_over_deepspeed", "deepspeed"), ("slidedp_over_fsdp2_offload", "fsdp2_offload")):
        for r in ratios.get(key, []):
            if r.get("ratio") is not None:
                lines.append(f"RATIO slidedp / {other} tokens/s ({'ckpt' if r['slidedp_ckpt'] else 'nockpt'} "
                             f"b{r['batch']}{', ' + r['slidedp_variant'] if r.get('slidedp_variant') else ''}): "
                             f"{r['ratio']:.3f}")
    return "\n".join(lines)


def merge_main(args):
    reports = []
    for p in args.merge:
        with open(p) as f:
            reports.append(json.load(f))
    base = dict(reports[0])
    runs = {}
    for rep in reports:  # a later file's record of the same (system, ckpt, batch) replaces an earlier one
        for r in rep["runs"]:
            runs[(r["system"], bool(r["ckpt"]), int(r["batch"]))] = r
    order = lambda k: (ALL_SYSTEMS.index(k[0]) if k[0] in ALL_SYSTEMS else 99, not k[1], k[2])  # noqa: E731
    base["runs"] = [runs[k] for k in sorted(runs, key=order)]
    base["batches"] = sorted({int(r["batch"]) for r in base["runs"]})
    base["systems"] = sorted({r["system"] for r in base["runs"]}, key=lambda s: ALL_SYSTEMS.index(s)
                             if s in ALL_SYSTEMS else 99)
    base["merged_from"] = [{"file": os.path.abspath(p), "command": rep.get("command"),
                            "start_time": rep.get("start_time"), "git": rep.get("git"),
                            "hostname": rep.get("machine", {}).get("hostname")}
                           for p, rep in zip(args.merge, reports)]
    base["command"] = shlex.join([sys.executable] + sys.argv)
    for k in ("seq", "dry_run", "nparam"):
        vals = {json.dumps(rep.get(k)) for rep in reports}
        if len(vals) > 1:
            base.setdefault("merge_warnings", []).append(f"inputs differ in {k}: {sorted(vals)}")
    os.makedirs(args.out, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    stem = f"hf_head_to_head_{'dryrun_' if base.get('dry_run') else ''}merged_{stamp}"
    json_path = os.path.join(args.out, stem + ".json")
    write_outputs(base, json_path, os.path.join(args.out, stem + ".png"))
    print(summary_table(base), file=sys.stderr)
    print(json_path)
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--systems", default=",".join(SYSTEMS), help="comma list of " + ",".join(SYSTEMS))
    ap.add_argument("--batches", default=None, help="comma list (default 8,16,32,64; dry-run 1,2)")
    ap.add_argument("--ckpt", choices=["both", "on", "off"], default="both",
                    help="restrict the activation-checkpointing settings run (default: each system's own)")
    ap.add_argument("--seq", type=int, default=None, help="sequence length (default 1024; dry-run 64)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.path.join(HERE, "out"), help="output directory")
    ap.add_argument("--timeout", type=float, default=None, help="seconds per run (default 900; dry-run 300)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="stop launching runs after this many seconds (the rest are recorded not_run)")
    ap.add_argument("--sample-period", type=float, default=0.2,
                    help="host RSS sampling period, s (/proc/PID/status counters)")
    ap.add_argument("--pss-period", type=float, default=5.0,
                    help="host PSS (smaps_rollup page-table walk) period outside the training phase, s; 0: only "
                         "the sample right after the measured steps")
    ap.add_argument("--init-device", choices=["cpu", "gpu"], default="cpu",
                    help="where the GPU-resident fsdp2 builds its model (offload systems always build on the CPU, "
                         "as the anchor): cpu keeps every torch system's weights identical, gpu is faster")
    ap.add_argument("--anchor-script", default=os.path.join(REPO, ".carry", "anchor_baselines.py"),
                    help="shared/tools/anchor_baselines.py, run as system anchor (default REPO/.carry/"
                         "anchor_baselines.py)")
    ap.add_argument("--dry-run", action="store_true", help="tiny Qwen3 on the CPU with gloo")
    ap.add_argument("--ds-path", default=None,
                    help="directory put on PYTHONPATH of the deepspeed children only (install_deepspeed.sh "
                         "target); default REPO/.carry/ds_site when it exists")
    ap.add_argument("--ds-config-extra", default=None, help="JSON merged into the DeepSpeed config")
    ap.add_argument("--slidedp-opt", action="append", default=[], metavar="KEY=VALUE",
                    help="passed to run_slidedp as a keyword (VALUE parsed as JSON when it parses); repeatable")
    ap.add_argument("--run", action="append", default=[], metavar="SYSTEM:on|off:BATCH[:KEY=VALUE,...]",
                    help="run exactly these, in this order, in this one invocation (instead of --systems x --ckpt x "
                         "--batches); KEY=VALUE are slidedp options for that run only, on top of --slidedp-opt")
    ap.add_argument("--merge", nargs="+", metavar="JSON", help="combine reports of earlier runs, rewrite ratios/PNG")
    ap.add_argument("--one", nargs=3, metavar=("SYSTEM", "CKPT", "BATCH"), help=argparse.SUPPRESS)
    ap.add_argument("--result-file", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.seq is None:
        args.seq = 64 if args.dry_run else 1024
    if args.batches is None:
        args.batches = "1,2" if args.dry_run else "8,16,32,64"
    if args.timeout is None:
        args.timeout = 300.0 if args.dry_run else 900.0
    args.out = os.path.abspath(args.out)
    if args.one:
        return child_main(args)
    if args.merge:
        return merge_main(args)
    return parent_main(args)


if __name__ == "__main__":
    sys.exit(main())
