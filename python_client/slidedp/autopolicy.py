"""AutoPolicy: the selection behind policy="auto" picks each decoder layer's activation policy and
which layers stay resident, from measurements at the job's real shape (the SlideDP paper, sections
3.5-3.6, Algorithm 1).

attach's default: slidedp/_auto.py calls select() at the first forward, when the batch shape is
known and hostd has heard of no step, and resolve() after attach and after the first steps. The
steps:
  1. candidates: F, Seg, SAC, N (slidedp/policy.py), each with an offload ratio r in {0, 0.5, 1};
     resident layers R (activations kept) and RF (recomputed), when the rank may change the set of
     layers it updates itself (one rank, or a process group to agree through);
  2. profile: one decoder layer, a copy of the model's own, runs forward and backward under each
     activation kind at the real (batch, seq) with the keyword arguments HF's decoder stack gives
     its layers (its own mask and rotary code): time, bytes kept for backward, transient peak.
     The bare PCIe rates are measured with pinned copies and scale the model's pipeline rates;
  3. rank: `slidedpctl plan --json` (the step-time model, T = max(C, H) + E) gives every
     candidate's host and transfer costs (H2D, D2H, hostd's AdamW, the CPU reduction) by
     difference from the all-F layout, with the measured link rates in its profile; the layer's
     compute is the measured time;
  4. allocate: the decoder layers are identical, so a layout is a vector of counts, one per
     candidate; the count vector minimizing max(C, H2D, D2H, host AdamW, CPU reduction) under the
     memory budget is a small mixed-integer program, solved exactly by HiGHS (highspy, the
     solver scipy.optimize.milp wraps; scipy itself is not in the environments torch jobs run
     in), in milliseconds; among equally fast layouts, the least PCIe traffic and then the least
     memory. A dynamic program over the identical layers was tried first and dropped: the
     maximum of five sums needs every non-dominated vector of sums per layer count, which ran
     for minutes at 36 layers and 14 candidates;
  5. validate: after attach has placed the window and the resident layers, the activation kinds
     are solved again against the memory really free (the same figure preflight checks); after
     each of the first training steps, the peak memory torch reserved is compared with the
     prediction and the kinds are solved again with the measured ratio (at most 3 re-solves).
     The layers kept resident are fixed from the first step on;
  6. cache: the profile and the plan figures are kept under $XDG_CACHE_HOME/slidedp/autopolicy
     (default ~/.cache), keyed by the hardware (GPU name, memory, capability), the workload (the
     model's config, batch, seq, ranks, route, window) and the versions (slidedp, its library,
     slidedpctl, torch, transformers): a second start measures nothing.
It prints a table on rank 0 (stderr and logger 'slidedp'): the candidates with their measured
figures and a Pareto mark, the chosen layout, predicted step time, peak memory, PCIe GB per step,
the selection's seconds and after how many steps it pays for itself against every layer F-r0.

On the CPU with no memory_budget there is nothing to bound or measure: every layer is F-r0 (the
reference layout). With a memory_budget, the CPU ranks by the model alone (no profile; no R).
"""
import copy
import glob
import hashlib
import json
import logging
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time

from ._lib import SlideDPError
from . import policy as _policy
from . import preflight
from .policy import LayerPolicy

log = logging.getLogger("slidedp")

RATIOS = (0.0, 0.5, 1.0)
RESIDENT_BYTES_PER_PARAM = 18  # BF16 weights, FP32 master, m, v, FP32 gradient (step_model.h)
CACHE_VERSION = 3
# slidedpctl plan's built-in H200 profile was calibrated in the pipeline (H2D 40 GB/s while hostd
# pushes and updates, D2H 17.3 GB/s into hostd's ring slots) on a machine whose bare pinned copies
# ran at about 54 GB/s (bench/results/gpu_plane_h200_2026-11-29.json part a_h2d). A measured bare
# rate scales those figures; it does not replace them.
CALIBRATION_BARE_GB_PER_S = 54.0
PIPELINE_H2D_GB_PER_S = 40.0
PIPELINE_D2H_GB_PER_S = 17.3


def plan_profile(links):
    """The rates to give `slidedpctl plan` for the bare rates measure_links() measured."""
    if not links:
        return {}
    return {"h2d_gb_per_s": PIPELINE_H2D_GB_PER_S * links["h2d_gb_per_s"] /
            CALIBRATION_BARE_GB_PER_S,
            "d2h_gb_per_s": PIPELINE_D2H_GB_PER_S * links["d2h_gb_per_s"] /
            CALIBRATION_BARE_GB_PER_S}
# Of the device memory free at selection, the part the layout may take: the caching allocator's
# fragmentation and what CUDA, cuBLAS and NCCL allocate later need the rest.
FREE_MARGIN = 0.92
MAX_RESOLVES = 3


def candidates(kinds, resident):
    out = [LayerPolicy(k, r) for k in kinds for r in RATIOS]
    if resident:
        out += [LayerPolicy("N", 0.0, True), LayerPolicy("F", 0.0, True)]
    return out


# ---- slidedpctl plan ----
def find_slidedpctl():
    env = os.environ.get("SLIDEDP_CTL")
    if env:
        return env
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(os.path.dirname(here))  # the source tree or the bundle
    cands = [os.path.join(root, "bin", "slidedpctl")]
    lib = os.environ.get("SLIDEDP_RANK_LIB")
    if lib:  # next to the rank library: a bundle's lib/ and bin/, a build's rankclient/
        up = os.path.dirname(os.path.dirname(os.path.abspath(lib)))
        cands += [os.path.join(up, "bin", "slidedpctl"),
                  os.path.join(up, "slidedpctl", "slidedpctl")]
    builds = [os.path.join(root, "build")] + sorted(glob.glob(os.path.join(root, "build*")))
    cands += [os.path.join(d, "slidedpctl", "slidedpctl") for d in builds]
    for c in cands:
        if os.access(c, os.X_OK):
            return c
    found = shutil.which("slidedpctl")
    if found:
        return found
    raise SlideDPError(5, "policy='auto' ranks layouts with `slidedpctl plan`, which was not "
                          "found (looked in SLIDEDP_CTL, " + ", ".join(cands[:2]) + " and PATH): "
                          "set SLIDEDP_CTL to its path or pass a layout, e.g. policy='36F-r0'")


class Planner:
    """`slidedpctl plan --json` for one workload; results by layout string."""

    def __init__(self, ctl, config_json, gpus, batch, seq, window_slots, route, profile):
        self.ctl = ctl
        self.dir = tempfile.mkdtemp(prefix="slidedp-plan-")
        self.cfg = os.path.join(self.dir, "config.json")
        with open(self.cfg, "w") as f:
            f.write(config_json)
        self.prof = None
        if profile:
            self.prof = os.path.join(self.dir, "profile.json")
            with open(self.prof, "w") as f:
                json.dump(profile, f)
        self.args = ["--gpus", str(gpus), "--batch", str(batch), "--seq", str(seq),
                     "--window-slots", str(window_slots), "--grad-route", route]
        self.calls = 0

    def __call__(self, layout):
        cmd = [self.ctl, "plan", "--model", self.cfg, "--layout", layout, "--json"] + self.args
        if self.prof:
            cmd += ["--profile", self.prof]
        self.calls += 1
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        if p.returncode != 0:
            raise SlideDPError(13, f"policy='auto': `{' '.join(cmd)}` failed ({p.returncode}): "
                                   f"{p.stderr.strip()[:600]}")
        return json.loads(p.stdout)

    def close(self):
        shutil.rmtree(self.dir, ignore_errors=True)


def _plan_summary(j):
    """What the allocation needs of a plan: C and its non-layer part, every host resource."""
    c = j["compute"]
    total = c["forward_flops"] + c["backward_flops"] + c["replay_flops"]
    head_s = c["flops_s"] * c["lm_head_flops"] / total if total else 0.0
    return {"c_s": c["c_s"], "head_s": head_s, "resident_update_s": c["resident_update_s"],
            "host": {k: v["seconds"] for k, v in j["host"]["resources"].items()},
            "e_s": j["exposure"]["e_s"], "step_s": j["step_s"], "regime": j["regime"],
            "pcie_gb": j["pcie"]["gb_per_step"], "peak_gpu_bytes": j["memory"]["peak_gpu_bytes"],
            "tflops": j["profile"]["gpu_bf16_tflops"]}


# ---- the profile of one decoder layer ----
class _Captured(Exception):
    pass


def capture_layer_inputs(base, hidden):
    """The (args, kwargs) HF's decoder stack passes its first decoder layer for hidden states
    `hidden` (its own mask and rotary code, whatever the transformers version)."""
    got = {}

    def hook(module, args, kwargs):
        got["args"], got["kwargs"] = args, kwargs
        raise _Captured()

    h = base.layers[0].register_forward_pre_hook(hook, with_kwargs=True)
    try:
        import torch
        with torch.no_grad():
            base(inputs_embeds=hidden, use_cache=False)
    except _Captured:
        pass
    finally:
        h.remove()
    if "args" not in got:
        raise SlideDPError(13, "policy='auto': the model's decoder stack never called its first "
                               "decoder layer")
    return got["args"], got["kwargs"]


def _profile_layer_copy(base, device, dtype):
    import torch
    layer = copy.deepcopy(base.layers[0])
    if any(p.is_meta for p in layer.parameters()):
        layer = layer.to_empty(device=device)
        with torch.no_grad():
            for p in layer.parameters():
                if p.dim() > 1:
                    p.normal_(0.0, 0.02)
                else:
                    p.fill_(1.0)
    layer = layer.to(device=device, dtype=dtype)
    layer.train()
    return layer


def profile_kinds(base, kinds, batch, seq, device, dtype, repeats=3):
    """{kind: {"time_s", "forward_s", "kept_bytes", "peak_bytes"}} of one decoder layer (a copy
    of base.layers[0]) at (batch, seq): forward and backward under the kind, the best of
    `repeats` after a warm-up; bytes only on CUDA (None elsewhere). kept_bytes counts the layer's
    input like preflight does (the previous layer's output, kept for this layer's backward)."""
    import torch
    cuda = device.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    h = int(base.config.hidden_size)
    gen = torch.Generator(device="cpu").manual_seed(0)
    hidden = (torch.randn(batch, seq, h, generator=gen) * 0.5).to(device=device, dtype=dtype)
    args, kwargs = capture_layer_inputs(base, hidden)
    layer = _profile_layer_copy(base, device, dtype)
    out_grad = None
    res = {}
    for kind in kinds:
        best = None
        for it in range(repeats + 1):
            layer.zero_grad(set_to_none=True)
            x = hidden.detach().clone().requires_grad_(True)
            sync()
            m0 = torch.cuda.memory_allocated(device) if cuda else 0
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
            t0 = time.perf_counter()
            out = _policy.run_layer(kind, layer, layer.forward, lambda a: None,
                                    lambda a, o, r: o, 0, (x,) + tuple(args[1:]), kwargs)
            out = out if isinstance(out, torch.Tensor) else out[0]
            sync()
            t1 = time.perf_counter()
            m1 = torch.cuda.memory_allocated(device) if cuda else 0
            if out_grad is None:
                out_grad = torch.randn(out.shape, generator=gen).to(device=device, dtype=out.dtype)
            out.backward(out_grad)
            sync()
            t2 = time.perf_counter()
            peak = torch.cuda.max_memory_allocated(device) - m0 if cuda else None
            kept = (m1 - m0 - out.numel() * out.element_size() + x.numel() * x.element_size()) \
                if cuda else None
            del out, x
            if it == 0:
                continue  # warm-up: kernels chosen, allocator primed
            row = {"time_s": t2 - t0, "forward_s": t1 - t0, "kept_bytes": kept,
                   "peak_bytes": peak}
            if best is None or row["time_s"] < best["time_s"]:
                best = row
        res[kind] = best
    del layer, hidden, out_grad
    if cuda:
        torch.cuda.empty_cache()
    return res


def measure_links(device, nbytes=256 << 20, repeats=3):
    """H2D and D2H GB/s (1e9 B) of pinned copies on `device`."""
    import torch
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    rates = {}
    for name, dst, src in (("h2d_gb_per_s", dev, host), ("d2h_gb_per_s", host, dev)):
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(repeats):
            dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize(device)
        rates[name] = nbytes * repeats / (time.perf_counter() - t0) / 1e9
    del host, dev
    return rates


# ---- the allocation ----
RESOURCES = ("c", "h2d", "d2h", "host_adam", "cpu_reduce", "mem")


def _quiet_highs(highspy):
    """highspy.Highs() without the banner the first one prints on the process's stdout."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            return highspy.Highs()
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def solve(layers, costs, base, mem_budget, max_resident):
    """The optimal count vector, a mixed-integer program solved by HiGHS (highspy). costs:
    {LayerPolicy: {resource: per-layer value}} with RESOURCES (c absolute per layer, the host
    resources as differences from F-r0, mem the layer's device bytes); base: the totals of
    everything else (the non-layer compute, every host resource of the all-F layout).

        minimize T  over integers n_p >= 0 and T
        sum_p n_p = layers;  base[r] + sum_p n_p costs[p][r] <= T  for every time resource r;
        base[mem] + sum_p n_p costs[p][mem] <= mem_budget;  sum_{p resident} n_p <= max_resident

    (T = max(C, H2D, D2H, host AdamW, CPU reduction): the step model's max{C, H}.) Returns
    (counts {policy: n}, objective recomputed from the counts) or (None, None) when nothing fits.
    Why a MILP and not a dynamic program over the identical layers: the objective is a maximum of
    five sums, so a program needs every non-dominated vector of sums per layer count, which for
    12+ candidates and 36 layers is far too many states (it ran minutes); HiGHS proves the
    optimum of this 15-variable program in milliseconds."""
    try:
        import highspy
    except ImportError as e:
        raise SlideDPError(5, "policy='auto' solves the layer allocation with HiGHS: pip install "
                              f"highspy (a dependency of slidedp), or pass a layout ({e})")
    import numpy as np
    cands = sorted(costs, key=lambda p: (p.resident, p.kind, p.ratio))
    n = len(cands)
    inf = highspy.kHighsInf
    h = _quiet_highs(highspy)
    h.setOptionValue("output_flag", False)
    h.setOptionValue("log_to_console", False)
    h.setOptionValue("mip_rel_gap", 0.0)
    h.setOptionValue("mip_abs_gap", 1e-12)
    h.setOptionValue("threads", 1)
    lp = highspy.HighsLp()
    lp.num_col_ = n + 1
    lp.col_cost_ = np.array([0.0] * n + [1.0])
    lp.col_lower_ = np.zeros(n + 1)
    lp.col_upper_ = np.array([float(layers)] * n + [inf])
    lp.integrality_ = [highspy.HighsVarType.kInteger] * n + [highspy.HighsVarType.kContinuous]
    rows = []  # (lower, upper, {col: value})
    rows.append((float(layers), float(layers), {j: 1.0 for j in range(n)}))
    times = [r for r in RESOURCES if r != "mem"]
    # Scaled to milliseconds and GiB: HiGHS's tolerances are absolute.
    for r in times:
        coef = {j: costs[p][r] * 1e3 for j, p in enumerate(cands) if costs[p][r] != 0.0}
        coef[n] = -1.0
        rows.append((-inf, -base.get(r, 0.0) * 1e3, coef))
    room = mem_budget - base.get("mem", 0.0)
    mscale = max(abs(room), max(abs(costs[p]["mem"]) for p in cands), 1.0)
    rows.append((-inf, room / mscale, {j: costs[p]["mem"] / mscale for j, p in enumerate(cands)}))
    res = {j: 1.0 for j, p in enumerate(cands) if p.resident}
    if res:
        rows.append((-inf, float(max_resident), res))
    lp.num_row_ = len(rows)
    lp.row_lower_ = np.array([r[0] for r in rows])
    lp.row_upper_ = np.array([r[1] for r in rows])
    starts, idx, vals = [], [], []
    for j in range(n + 1):  # column-wise
        starts.append(len(idx))
        for i, (_, _, coef) in enumerate(rows):
            if j in coef and coef[j] != 0.0:
                idx.append(i)
                vals.append(coef[j])
    lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    lp.a_matrix_.start_ = np.array(starts + [len(idx)], dtype=np.int32)
    lp.a_matrix_.index_ = np.array(idx, dtype=np.int32)
    lp.a_matrix_.value_ = np.array(vals)
    h.passModel(lp)
    h.run()
    if h.getModelStatus() != highspy.HighsModelStatus.kOptimal:
        return None, None
    # Among the layouts as fast as that, the one moving the fewest bytes over PCIe and then
    # keeping the least memory (no offload that buys nothing): T fixed at its optimum.
    t_opt = h.getSolution().col_value[n]
    h.changeColBounds(n, 0.0, t_opt + 1e-9 * max(1.0, abs(t_opt)))
    sec = [(costs[p]["h2d"] + costs[p]["d2h"]) * 1e3 + costs[p]["mem"] / mscale * 1e-6
           for p in cands]
    h.changeColsCost(n + 1, np.arange(n + 1, dtype=np.int32), np.array(sec + [0.0]))
    h.run()
    if h.getModelStatus() != highspy.HighsModelStatus.kOptimal:
        return None, None
    x = h.getSolution().col_value
    counts = {p: int(round(x[j])) for j, p in enumerate(cands) if round(x[j]) > 0}
    if sum(counts.values()) != layers:
        return None, None
    tot = {r: base.get(r, 0.0) + sum(k * costs[p][r] for p, k in counts.items()) for r in RESOURCES}
    if tot["mem"] - mem_budget > 1e-6 * mscale:  # HiGHS's feasibility tolerance, scaled
        return None, None
    return counts, max(tot[r] for r in times)


def brute_force(layers, costs, base, mem_budget, max_resident):
    """solve() by enumerating every count vector (tests, small cases)."""
    cands = list(costs)
    best, best_obj = None, None

    def rec(i, left, counts):
        nonlocal best, best_obj
        if i == len(cands) - 1:
            counts = counts + [left]
            if sum(n for p, n in zip(cands, counts) if p.resident) > max_resident:
                return
            tot = {r: base.get(r, 0.0) + sum(n * costs[p][r] for p, n in zip(cands, counts))
                   for r in RESOURCES}
            if tot["mem"] > mem_budget:
                return
            obj = max(v for r, v in tot.items() if r != "mem")
            if best_obj is None or obj < best_obj - 1e-12:
                best, best_obj = {p: n for p, n in zip(cands, counts) if n}, obj
            return
        for n in range(left + 1):
            rec(i + 1, left - n, counts + [n])
    rec(0, layers, [])
    return best, best_obj


def layout_from_counts(counts):
    """Resident layers first, then the streamed ones in a fixed order (recomputed kinds before
    kept ones): the first layers' backward comes last, when the most memory is held."""
    rank = {"F": 0, "Seg": 1, "SAC": 2, "N": 3}
    out = []
    for p in sorted(counts, key=lambda p: (not p.resident, rank[p.kind], -p.ratio)):
        out += [p] * counts[p]
    return out


# ---- the selection ----
def _versions(lib_path, ctl):
    import torch
    try:
        import transformers
        tv = transformers.__version__
    except ImportError:
        tv = None
    from . import __version__

    def sig(path):
        try:
            st = os.stat(path)
            return f"{st.st_size}:{int(st.st_mtime)}"
        except OSError:
            return None
    return {"slidedp": __version__, "lib": sig(lib_path) if lib_path else None, "ctl": sig(ctl),
            "torch": torch.__version__, "transformers": tv}


def _hardware(device):
    import torch
    if device.type != "cuda":
        return {"device": "cpu", "cores": os.cpu_count()}
    p = torch.cuda.get_device_properties(device)
    return {"device": p.name, "memory": int(p.total_memory), "cc": f"{p.major}.{p.minor}",
            "count": torch.cuda.device_count()}


def cache_dir():
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "slidedp", "autopolicy")


class Selection:
    """What AutoPolicy chose and why; `policies` one LayerPolicy per decoder layer."""

    def __init__(self):
        self.policies = None
        self.rows = []
        self.info = {}
        self.resolves = 0
        self.costs = None
        self.base = None
        self.max_resident = 0
        self.layers = 0
        self.mem_scale = 1.0
        self.fixed_bytes = 0.0
        self.validated = False

    @property
    def layout(self):
        return _policy.format_layout(self.policies)


def select(model, base, device, batch, seq, *, world_size, grad_route, window_slots,
           nondecoder_resident, allow_resident, memory_budget, lib_path, rank=0, out=None,
           reclaimable=0):
    """Chooses the layout for `model` at (batch, seq) per rank. Returns a Selection.
    allow_resident: whether decoder layers may stay resident (R, RF): the caller knows whether
    the rank can change the set of layers it updates. reclaimable: bytes on the device that
    attach frees before training (the model's own weights, when it was moved there)."""
    import torch
    t_start = time.perf_counter()
    cfg = model.config
    layers = int(cfg.num_hidden_layers)
    cuda = device.type == "cuda"
    sel = Selection()
    sel.layers = layers
    if not cuda and memory_budget is None:
        sel.policies = [LayerPolicy("F", 0.0)] * layers
        sel.info = {"why": "the CPU with no memory_budget: every layer F-r0 (the reference)",
                    "selection_s": time.perf_counter() - t_start}
        return sel
    kinds = ["F", "SAC", "N"]
    try:
        _policy.check_segmentable(base.layers[0], 0)
        kinds.insert(1, "Seg")
    except SlideDPError:
        pass
    allow_resident = bool(allow_resident)
    cands = candidates(kinds, allow_resident)
    ctl = find_slidedpctl()
    cfg_json = cfg.to_json_string()
    dtype = torch.bfloat16 if cuda else next(model.parameters()).dtype
    if dtype not in (torch.float32, torch.bfloat16):
        dtype = torch.float32
    key_src = {"v": CACHE_VERSION, "hw": _hardware(device), "versions": _versions(lib_path, ctl),
               "config": json.loads(cfg_json), "batch": batch, "seq": seq, "world": world_size,
               "route": grad_route, "window": window_slots, "kinds": kinds,
               "resident": allow_resident, "dtype": str(dtype)}
    key_src["config"].pop("_name_or_path", None)
    key = hashlib.sha256(json.dumps(key_src, sort_keys=True, default=str).encode()).hexdigest()
    path = os.path.join(cache_dir(), key[:32] + ".json")
    cached = None
    try:
        with open(path) as f:
            cached = json.load(f)
        if cached.get("key") != key:
            cached = None
    except (OSError, ValueError):
        cached = None

    if cached is not None:
        prof, links, plans = cached["profile"], cached["links"], cached["plans"]
        sel.info["cache"] = f"hit ({path})"
        t_profile = 0.0
    else:
        t0 = time.perf_counter()
        prof = profile_kinds(base, kinds, batch, seq, device, dtype) if cuda else {}
        links = measure_links(device) if cuda else {}
        t_profile = time.perf_counter() - t0
        planner = Planner(ctl, cfg_json, world_size, batch, seq, window_slots, grad_route,
                      plan_profile(links))
        try:
            plans = {"all-F": _plan_summary(planner(f"{layers}F-r0"))}
            for p in cands:
                if p == LayerPolicy("F", 0.0):
                    continue
                one = LayerPolicy(p.kind, p.ratio, p.resident)
                if p.resident:
                    text = f"1{one.token()} {layers - 1}F-r0"
                else:
                    half = (layers - 1) // 2
                    text = f"{half}F-r0 1{one.token()} {layers - 1 - half}F-r0"
                plans[one.token()] = _plan_summary(planner(text))
        finally:
            planner.close()
        sel.info["cache"] = f"miss (written to {path})"
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = path + f".{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                json.dump({"key": key, "key_src": key_src, "profile": prof, "links": links,
                           "plans": plans}, f, default=str)
            os.replace(tmp, path)
        except OSError as e:
            sel.info["cache"] = f"not written ({e})"

    # Per-layer costs of each candidate.
    allf = plans["all-F"]
    f_plan_c = (allf["c_s"] - allf["head_s"]) / layers
    nondec = sum(p.numel() for n, p in model.named_parameters()
                 if not n.startswith("model.layers."))
    layer_params = sum(p.numel() for p in base.layers[0].parameters())
    tokens = batch * seq
    costs = {}
    for p in cands:
        tok = p.token()
        pl = allf if p == LayerPolicy("F", 0.0) else plans[tok]
        kept, movable = preflight.saved_bytes_per_token(cfg, p.kind)
        mem = tokens * (kept - p.ratio * movable)
        if prof and prof.get(p.kind) and prof[p.kind]["kept_bytes"] is not None:
            measured = prof[p.kind]["kept_bytes"] - p.ratio * tokens * movable
            mem = max(mem, measured)
        c = prof[p.kind]["time_s"] if prof else f_plan_c + (pl["c_s"] - allf["c_s"]) \
            - pl["resident_update_s"]
        if p.resident:
            c += pl["resident_update_s"]
            mem += RESIDENT_BYTES_PER_PARAM * layer_params
        row = {"c": c, "mem": mem}
        for r in RESOURCES[1:-1]:
            row[r] = pl["host"].get(r, 0.0) - allf["host"].get(r, 0.0)
        costs[p] = row
    # The measured layer runs `calib` times as long as the model's compute says (this GPU, this
    # shape); the non-layer part of C (the lm_head) is scaled alike.
    calib = prof["F"]["time_s"] / f_plan_c if prof and prof.get("F") and f_plan_c > 0 else 1.0
    base_sums = {"c": allf["head_s"] * calib}
    for r in RESOURCES[1:-1]:
        base_sums[r] = allf["host"].get(r, 0.0)
    sel.costs, sel.base = costs, base_sums
    sel.max_resident = layers - 1 if allow_resident else 0

    # The memory the layers' activations and residents may take.
    transient = tokens * max(12 * int(cfg.vocab_size),
                             2 * preflight.layer_activation_bytes_per_token(cfg))
    if cuda:
        free, _ = torch.cuda.mem_get_info(device)
        free += max(0, torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
        free += reclaimable
        layer_bytes = 2 * layer_params
        window = window_slots * layer_bytes + max(2, 4) * 4 * layer_params  # slots + staging
        fixed = window + (RESIDENT_BYTES_PER_PARAM * nondec if nondecoder_resident else 0)
        avail = free * FREE_MARGIN - fixed
        if memory_budget is not None:
            avail = min(avail, float(memory_budget))
        sel.fixed_bytes = fixed
    else:
        avail = float(memory_budget)
    sel.info["activation_budget"] = avail
    sel.transient = transient
    counts, obj = solve(layers, costs, base_sums, avail - transient, sel.max_resident)
    if counts is None:
        smallest = [("F", 1.0)] * layers
        need = preflight.layout_activation_bytes(cfg, batch, seq, smallest)
        fits = int(max(0.0, avail) // preflight.layout_activation_bytes(cfg, 1, seq, smallest))
        source = "memory_budget" if memory_budget is not None and avail >= memory_budget else \
            "free after the GPU window and the resident layers"
        hint = f"batch <= {fits} fits" if fits >= 1 else "not even batch 1 fits"
        raise SlideDPError(8, (
            f"batch: {batch} x seq {seq}: no layout fits. policy='auto' has "
            f"{avail / preflight.GiB:.2f} GiB for activations ({source}), and even every layer "
            f"recomputed with its input offloaded (F-r1) needs about {need / preflight.GiB:.2f} "
            f"GiB; {hint} (seq {seq}). Nothing was sent to hostd."))
    sel.policies = layout_from_counts(counts)
    sel.rows = _rows(costs, counts, tokens, prof)
    sel.info.update(selection_s=time.perf_counter() - t_start, profile_s=t_profile,
                    objective_s=obj, links=links, prof=bool(prof))
    # The chosen layout and the old fixed default, through the model with its compute rate
    # calibrated to the profiled layer (what the table and each step report as predicted).
    profile = plan_profile(links)
    if calib != 1.0:
        profile["gpu_bf16_tflops"] = allf["tflops"] / calib
    sel.info["compute_calibration"] = calib
    planner = Planner(ctl, cfg_json, world_size, batch, seq, window_slots, grad_route, profile)
    try:
        sel.info["plan"] = _plan_summary(planner(sel.layout))
        sel.info["plan_fixed"] = _plan_summary(planner(f"{layers}F-r0")) if calib != 1.0 \
            else allf
    finally:
        planner.close()
    sel.info["selection_s"] = time.perf_counter() - t_start
    return sel


def resolve(sel, avail):
    """Solves again with the residents fixed, for `avail` bytes of activation memory (what is
    free now) and the memory scale measured so far. Returns the new policies, or None when the
    current ones stand."""
    resident = [p for p in sel.policies if p.resident]
    n_res = len(resident)
    costs = {p: dict(v) for p, v in sel.costs.items() if not p.resident}
    for v in costs.values():
        v["mem"] *= sel.mem_scale
    counts, _ = solve(sel.layers - n_res, costs, _base_with(sel, resident), avail -
                      sel.transient * sel.mem_scale, 0)
    if counts is None:
        return None
    new = resident + layout_from_counts(counts)
    return None if new == sel.policies else new


def _base_with(sel, resident):
    b = dict(sel.base)
    for p in resident:
        for r in RESOURCES[:-1]:
            b[r] = b.get(r, 0.0) + sel.costs[p][r]
    return b


def _rows(costs, counts, tokens, prof):
    pts = {p: (v["c"], v["mem"], v["h2d"] + v["d2h"]) for p, v in costs.items()}
    rows = []
    for p, v in costs.items():
        dominated = any(q != p and all(a <= b for a, b in zip(pts[q], pts[p])) and
                        pts[q] != pts[p] for q in costs)
        rows.append({"candidate": p.token() if not p.resident else ("R" if p.kind == "N" else
                                                                    "R" + p.kind),
                     "layer_ms": v["c"] * 1e3, "mem_mib": v["mem"] / 2 ** 20,
                     "host_ms": {r: v[r] * 1e3 for r in ("h2d", "d2h", "host_adam")},
                     "pareto": not dominated, "chosen": counts.get(p, 0),
                     "measured": bool(prof)})
    return rows


def format_table(sel, batch, seq):
    i = sel.info
    lines = [f"slidedp AutoPolicy: batch {batch} x seq {seq}, {sel.layers} decoder layers "
             f"({'profiled on the device' if i.get('prof') else 'model only'}; cache "
             f"{i.get('cache', '-')})"]
    if not sel.rows:
        lines.append(f"  layout {sel.layout}: {i.get('why', '')}")
        return "\n".join(lines)
    lines.append("  candidate   layer ms   MiB/layer   dH2D ms  dD2H ms  dAdamW ms  pareto  chosen")
    for r in sorted(sel.rows, key=lambda r: (r["layer_ms"], r["mem_mib"])):
        h = r["host_ms"]
        lines.append(f"  {r['candidate']:<10} {r['layer_ms']:9.2f} {r['mem_mib']:11.1f} "
                     f"{h['h2d']:9.2f} {h['d2h']:8.2f} {h['host_adam']:10.2f}  "
                     f"{'*' if r['pareto'] else ' ':^6}  {r['chosen'] or '':>6}")
    p, fx = i["plan"], i["plan_fixed"]
    gain = fx["step_s"] - p["step_s"]
    be = math.ceil(i["selection_s"] / gain) if gain > 1e-9 else None
    lines.append(f"  chosen: {sel.layout}")
    lines.append(f"  predicted step {p['step_s']:.3f} s ({p['regime']}; every layer F-r0: "
                 f"{fx['step_s']:.3f} s; the allocation's bound {i.get('objective_s', 0):.3f} s; "
                 f"compute x{i.get('compute_calibration', 1.0):.2f} of the model's), "
                 f"peak GPU memory {p['peak_gpu_bytes'] / 2 ** 30:.1f} GiB "
                 f"(model estimate), PCIe {p['pcie_gb']:.1f} GB/step")
    lines.append(f"  selection {i['selection_s']:.2f} s (profile {i['profile_s']:.2f} s); "
                 + (f"break-even after {be} steps" if be is not None else
                    "no gain over every layer F-r0 predicted"))
    return "\n".join(lines)
