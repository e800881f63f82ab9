"""Attach a Hugging Face causal LM (Llama, Qwen2, Qwen3 families) to hostd.

    model, opt = slidedp.attach(model, hostd="unix:///run/slidedp/hostd.sock")
    for batch in data:
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        stats = opt.step()        # the step boundary; returns the step's figures
        opt.zero_grad()

What attach does to the model: every parameter hostd owns (all of them: embeddings, decoder
layers, final norm, lm_head) gives up its storage; forward pre-hooks put a layer's BF16 parameters
in place (views of a GPU window slot, or a host copy on the CPU backend) just before the layer
runs, and post-accumulate-grad hooks gather each layer's gradient into one flat buffer and push it
to hostd as soon as the layer's backward is done, while backward goes on with earlier layers.
hostd applies AdamW (FP32 master, fused BF16 cast) and publishes the next version; the next step's
forward waits for it per layer (the version gate).

Per-layer policy (the schedule of one step):
  decoder layers  fetched before their forward (with `prefetch` layers ahead) and released after
                  it, except the last `prefetch` ones, which stay for backward; fetched again for
                  backward (recompute with checkpointing="full"; for checkpointing="none" the
                  saved parameter views are replaced by tokens and fetched again when autograd
                  unpacks them); released when their gradient has been pushed.
  embeddings, final norm, lm_head
                  nondecoder="resident" (the default on CUDA): on the device for the whole run,
                  updated there at opt.step() (FP32 master and moments on the device, hostd's
                  AdamW settings and LR; hostd skips them: client_updated_layers).
                  nondecoder="host": fetched at their first use and kept in the window until
                  their gradient has been pushed (host-side update, like every layer). Their
                  update is the last of the step and the next forward starts with it, so it is
                  exposed (see README: step-boundary drain).
  activations     offload_ratio=r: a fraction r of the decoder layers (spread evenly) keep
                  their saved tensors in pinned host memory between forward and backward,
                  prefetched one layer ahead (slidedp/offload.py).

The step boundary (GPU backend): opt.step() does not wait for hostd. The plane keeps pushing the
step's gradients (the layer the next forward needs first goes first) while the next step begins;
hostd accepts the next BeginStep while it still applies the last updates, and each layer's fetch
waits for its own update (the version gate), so the next forward overlaps the AdamW tail.

This module is the entry point: attach() checks the model, resolves the rank and builds the
pieces: _runtime.StreamedRuntime (the schedule above, the hooks, the step boundary),
_backends (where parameters come from: host copies, the CPU window, the GPU plane),
_resident.ResidentLayers (the device-side update and uploads of resident layers) and
_optimizer.SlideDPOptimizer (what attach returns as the optimizer). They import torch; none
imports this module.
"""
import functools
import logging
import os
import weakref

import torch

from ._backends import _CpuBackend, _CpuWindowBackend, _GpuBackend
from ._lib import SlideDPError
from ._optimizer import SlideDPOptimizer
from ._runtime import StreamedRuntime, _Layer
from . import policy as _policy
from .offload import ActivationOffload
from .rank import RankHandle, manifest_hash, manifest_layers

__all__ = ["attach", "SlideDPOptimizer", "StreamedRuntime", "SUPPORTED_FAMILIES"]

log = logging.getLogger("slidedp")

SUPPORTED_FAMILIES = ("llama", "qwen2", "qwen3")


def _env_int(name):
    v = os.environ.get(name)
    return int(v) if v not in (None, "") else None


def _resolve_rank(rank, world_size):
    if rank is None:
        rank = _env_int("RANK")
    if world_size is None:
        world_size = _env_int("WORLD_SIZE")
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        if rank is None:
            rank = torch.distributed.get_rank()
        if world_size is None:
            world_size = torch.distributed.get_world_size()
    return rank or 0, world_size


def _find_decoder_stack(model):
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise SlideDPError(3, f"model: {type(model).__name__} has no model.layers ModuleList; "
                              f"expected an HF *ForCausalLM of the {', '.join(SUPPORTED_FAMILIES)} "
                              "families")
    return base


def _reinit_meta_buffers(model, device):
    for name, module in list(model.named_modules()):
        metas = [b for b in module.buffers(recurse=False) if b.is_meta]
        if not metas:
            continue
        if type(module).__name__.endswith("RotaryEmbedding"):
            with torch.device("cpu"):  # constructors differ across versions in a device arg
                fresh = type(module)(config=model.config).to(device)
            parent_name, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, attr, fresh)
        else:
            raise SlideDPError(3, f"model: buffer of {name} ({type(module).__name__}) is on the "
                                  "meta device and cannot be recomputed; build the model on the "
                                  "CPU or pass a model whose buffers are materialized")


def _layer_checksums(tensors):
    # float64 sum and sum of squares of the BF16-rounded values, per tensor.
    return [(float(t.detach().to(torch.bfloat16).double().sum()),
             float(t.detach().to(torch.bfloat16).double().square().sum())) for t in tensors]


def attach(model, hostd="unix:///run/slidedp/hostd.sock", *, rank=None, world_size=None,
           device=None, job_id="", checkpointing="full", offload_ratio=0.0,
           offload_min_bytes=65536, accumulation_steps=1, window_slots=None, prefetch=2,
           h2d_chunk_bytes=0, param_route="replicated", max_pending_grads=4, verify_init=True,
           time_waits=True, timeout_s=60, cpu_window=False, nondecoder="auto", resident_layers=0,
           process_group=None, memory_budget=None, policy="auto", lib=None):
    """Attaches an HF causal LM to hostd's job and returns (model, optimizer).

    hostd: its socket ("unix:///path" or a path). rank/world_size: default RANK/WORLD_SIZE
    (torchrun) or the initialized process group, else 0/hostd's. device: default cuda when CUDA
    is available, else cpu; "cuda" without an index means cuda:(LOCAL_RANK mod GPU count).
    checkpointing: "full" (recompute each decoder layer in backward), "none", or a fraction in
    [0, 1] of the decoder layers to recompute, spread evenly (the rest keep their activations).
    offload_ratio: the fraction r in [0, 1] of the decoder layers (spread evenly, like the
    checkpointing fraction: layer pos when floor((pos+1)r) > floor(pos r)) whose saved
    activations go to host memory during forward (pinned, copied on a side CUDA stream) and come
    back for backward one layer ahead; for a checkpointed layer that is its input, otherwise
    every tensor autograd saves in it except its parameters and tensors smaller than
    offload_min_bytes (default 64 KiB).
    policy: "auto" (the default): AutoPolicy chooses each decoder layer's activation kind,
    offload ratio and which layers stay resident, at the first forward, for its batch shape,
    from a profile of one layer on the device and the step-time model (slidedp/autopolicy.py,
    slidedp/_auto.py; it prints the table on rank 0); when checkpointing, offload_ratio or
    resident_layers is given, those are used instead, and on the CPU with no memory_budget
    every layer is F-r0. A layout string fixes it instead, e.g. "4R 24F-r0 4Seg-r0.5 4N"
    (groups in forward order: <count><kind>[-r<ratio>], kinds F full recompute, Seg attention
    and MLP segments, SAC selective checkpoint, N none, R resident on the device; r the
    fraction of a layer's saved bytes offloaded; slidedp/policy.py). None: the legacy
    arguments alone.
    accumulation_steps: micro-batches per optimizer step
    (gradients accumulated in FP32 on the compute device). window_slots: GPU window size in
    layers (default: enough for the schedule). prefetch: decoder layers fetched ahead.
    verify_init: on a fresh job, check that hostd's weights equal the model's (BF16-rounded)
    before training them.
    cpu_window: on the CPU, compute in BF16 through a window of slots like the GPU's (tests the
    GPU schedule without a GPU).
    nondecoder: where embeddings, final norm and lm_head are updated. "resident": they stay on the
    compute device and are updated there (FP32 master and moments on the device, AdamW with
    hostd's settings and LR schedule; with several ranks their gradients are all-reduced over
    `process_group`, default the initialized one, else one made from torchrun's environment);
    hostd does not update them (client_updated_layers); rank 0 uploads their state (master, m,
    v) to hostd when a checkpoint asks for it (a device snapshot, copied out on a background
    thread) and when it closes, so hostd's checkpoints, its final checkpoint and ExportHF after
    the close include them, and a job resumed from a checkpoint (hostd --resume) reads them back
    from hostd. fetch_state_dict() returns the device copy. "host": streamed
    and updated by hostd like the decoder layers; their update is the last of the step, and the
    next forward starts by waiting for it. "auto": "resident" on CUDA with one rank or an
    initialized process group and a fresh job, else "host". See README (step-boundary drain).
    resident_layers: how many of the first decoder layers (forward order) are kept and updated
    on the compute device like nondecoder="resident" layers (FP32 master and moments there,
    client_updated_layers, uploaded to hostd for its checkpoints), default 0. The next forward
    needs the first layers first, and their gradients are the last of backward, so their host
    update is the exposed tail of the step boundary; on the device it takes milliseconds. Each
    costs about 18 bytes per parameter of device memory (master, moments, gradient, BF16 copy).
    memory_budget: bytes of device memory a training step's activations may use (default: what
    is free on a CUDA device when the first forward of an input shape runs; none on the CPU). A
    batch whose estimated activations exceed it is refused (RESOURCE_EXHAUSTED, naming the batch
    that would fit) before the step begins (slidedp/preflight.py has the estimate).
    """
    cfg = getattr(model, "config", None)
    family = getattr(cfg, "model_type", None)
    if family not in SUPPORTED_FAMILIES:
        raise SlideDPError(3, f"model_type: {family!r} is not supported; expected one of "
                              f"{', '.join(SUPPORTED_FAMILIES)}")
    if checkpointing not in ("full", "none") and not (
            isinstance(checkpointing, (int, float)) and not isinstance(checkpointing, bool)
            and 0.0 <= checkpointing <= 1.0):
        raise SlideDPError(3, f"checkpointing: {checkpointing!r}, expected 'full', 'none' or the "
                              "fraction of decoder layers to recompute, in [0, 1]")
    if isinstance(offload_ratio, bool) or not isinstance(offload_ratio, (int, float)) or \
            not 0.0 <= offload_ratio <= 1.0:
        raise SlideDPError(3, f"offload_ratio: {offload_ratio!r}, expected a number in [0, 1] (the "
                              "fraction of decoder layers whose saved activations go to host "
                              "memory)")
    if isinstance(offload_min_bytes, bool) or not isinstance(offload_min_bytes, int) or \
            offload_min_bytes < 0:
        raise SlideDPError(3, f"offload_min_bytes: {offload_min_bytes!r}, expected an integer "
                              ">= 0 (saved tensors smaller than this stay on the device)")
    if int(accumulation_steps) < 1:
        raise SlideDPError(3, f"accumulation_steps: {accumulation_steps}, expected >= 1")
    if int(prefetch) < 0:
        raise SlideDPError(3, f"prefetch: {prefetch}, expected >= 0")
    if memory_budget is not None and (isinstance(memory_budget, bool) or
                                      not isinstance(memory_budget, (int, float)) or
                                      memory_budget <= 0):
        raise SlideDPError(3, f"memory_budget: {memory_budget!r}, expected a number of bytes > 0 "
                              "or None")
    base = _find_decoder_stack(model)
    rank, world_size = _resolve_rank(rank, world_size)
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        # torchrun: one GPU per local rank (ranks beyond the GPU count share them, as the
        # CPU-reduction route allows); otherwise the current device.
        local = _env_int("LOCAL_RANK")
        index = local % torch.cuda.device_count() if local is not None else \
            torch.cuda.current_device()
        device = torch.device("cuda", index)

    cfg_json = cfg.to_json_string()
    mhash = manifest_hash(cfg_json, lib)
    if nondecoder not in ("auto", "resident", "host"):
        raise SlideDPError(3, f"nondecoder: {nondecoder!r}, expected 'auto', 'resident' or 'host'")
    pg_ready = torch.distributed.is_available() and torch.distributed.is_initialized()
    if nondecoder == "auto":
        nondecoder = "resident" if device.type == "cuda" and (
            (world_size or 1) == 1 or pg_ready or process_group is not None) else "host"
    mlayers = manifest_layers(cfg_json, lib)
    dec_idx = [i for i, l in enumerate(mlayers) if l["kind"] == "LAYER_KIND_DECODER"]
    given = [f"{k}={v!r}" for k, v, d in (("checkpointing", checkpointing, "full"),
                                          ("offload_ratio", offload_ratio, 0.0),
                                          ("resident_layers", resident_layers, 0)) if v != d]
    auto = False
    if policy == "auto":
        # Explicit settings win; the CPU with no budget has nothing to choose (every layer F-r0,
        # the reference).
        auto = not given and (device.type == "cuda" or memory_budget is not None)
        if not given and not auto:
            log.info("policy='auto' on the CPU with no memory_budget: every layer F-r0")
        policy = None
    elif policy is not None:
        if not isinstance(policy, str):
            raise SlideDPError(3, f"policy: {policy!r}, expected 'auto', a layout string such "
                                  "as '4R 24F-r0 8N', or None")
        if given:
            raise SlideDPError(3, f"policy: {policy!r} with {', '.join(given)}: the layout says "
                                  "what each layer saves, offloads and keeps resident; pass one "
                                  "or the other")
        policies = _policy.parse_layout(policy, len(dec_idx))
        for pos, p in enumerate(policies):
            if p.kind == "Seg":
                _policy.check_segmentable(base.layers[pos], pos)
        resident_layers = sum(p.resident for p in policies)
    if isinstance(resident_layers, bool) or not isinstance(resident_layers, int) or \
            not 0 <= resident_layers <= len(dec_idx):
        raise SlideDPError(3, f"resident_layers: {resident_layers!r}, expected an integer in "
                              f"[0, {len(dec_idx)}] (how many of the model's {len(dec_idx)} "
                              "decoder layers, from the first, stay on the device)")
    resident = [i for i, l in enumerate(mlayers)
                if l["kind"] != "LAYER_KIND_DECODER"] if nondecoder == "resident" else []
    resident = sorted(resident + dec_idx[:resident_layers])
    if policy is None:
        policies = _policy.legacy_layout(checkpointing, offload_ratio, resident_layers,
                                         len(dec_idx))
    if len(resident) == len(mlayers):
        # hostd completes a step when the last of its layers is updated: it needs one.
        raise SlideDPError(3, f"resident_layers: {resident_layers} with nondecoder='resident' "
                              "leaves hostd no layer to update; expected at most "
                              f"{len(dec_idx) - 1}, or nondecoder='host'")
    def connect(client_updated):
        try:
            return RankHandle(hostd, rank, mhash, gpu=device.index if device.type == "cuda"
                              else -1, job_id=job_id, timeout_ms=int(timeout_s * 1000), lib=lib,
                              client_updated_layers=client_updated)
        except SlideDPError as e:
            if e.code == 9 and "manifest" in str(e):
                raise SlideDPError(9, f"the model does not match hostd's job: this model "
                                      f"({family}, {cfg.num_hidden_layers} layers, hidden "
                                      f"{cfg.hidden_size}, vocab {cfg.vocab_size}) has manifest "
                                      f"hash {mhash}; hostd said: {e}") from None
            raise
    rh = connect(resident)
    try:
        if world_size is not None and world_size != rh.world_size:
            raise SlideDPError(9, f"world_size: this job runs {world_size} ranks "
                                  f"(WORLD_SIZE/process group) but hostd's job expects "
                                  f"{rh.world_size}; start hostd with --world_size {world_size}")
        if resident and rh.next_step != 1 and not rh.client_layers_current():
            raise SlideDPError(9, f"resident layers {resident}: hostd's job is at step "
                                  f"{rh.next_step - 1} but its copy of the resident layers "
                                  "(nondecoder='resident', resident_layers) is older: "
                                  "the ranks that trained them held their state. Restart hostd "
                                  "from a checkpoint (--resume DIR) to go on from it")
        pg = process_group
        # policy='auto' may keep decoder layers resident: with several ranks their gradients
        # are all-reduced, so it may only where a process group is there to do it.
        if (resident or (auto and pg_ready)) and rh.world_size > 1 and pg is None:
            if not pg_ready:
                if "MASTER_ADDR" not in os.environ:
                    raise SlideDPError(3, "resident layers (nondecoder='resident', resident_layers) "
                                          "with several ranks all-reduce their gradients: "
                                          "initialize a torch.distributed process group, run "
                                          "under torchrun, or pass nondecoder='host' and "
                                          "resident_layers=0")
                torch.distributed.init_process_group(
                    "nccl" if device.type == "cuda" else "gloo", rank=rank,
                    world_size=rh.world_size)
            pg = torch.distributed.group.WORLD
        s = dict(
            resident=set(resident), process_group=pg, policies=policies,
            checkpointing=checkpointing, accumulation_steps=int(accumulation_steps),
            offload_ratio=float(offload_ratio), offload_min_bytes=offload_min_bytes,
            window_slots=window_slots, prefetch=int(prefetch), h2d_chunk_bytes=h2d_chunk_bytes,
            param_route=param_route, max_pending=int(max_pending_grads), verify=verify_init,
            time_waits=time_waits, cpu_window=bool(cpu_window), device=device,
            memory_budget=memory_budget)
        if not auto:
            return _attach(model, base, rh, device, mhash, s)
    except BaseException:
        rh.detach()
        raise
    from ._auto import PendingAttach
    pending = PendingAttach(model, base, rh, device, mhash, dict(
        s, mlayers=mlayers, dec_idx=dec_idx, nondecoder=nondecoder), connect)
    model.slidedp = pending
    opt = SlideDPOptimizer(pending)
    pending.optimizer = opt
    log.info("rank %d attached to %s with policy='auto': the layout is chosen at the first "
             "forward", rh.rank, rh.socket)
    return model, opt


def _replace_meta_params(model, placeholder):
    """Meta parameters cannot take a real tensor through .data: give their modules new
    Parameter objects (one per original, so tied weights stay tied)."""
    fresh = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None and p.is_meta:
                if id(p) not in fresh:
                    fresh[id(p)] = torch.nn.Parameter(placeholder, requires_grad=p.requires_grad)
                module._parameters[name] = fresh[id(p)]


def _attach(model, base, rh, device, mhash, s):
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters(remove_duplicate=False)}
    if any(p.is_meta for p in model.parameters()):
        _replace_meta_params(model, torch.empty(0, dtype=torch.bfloat16, device=device))
        meta = True
    else:
        meta = False
    named = dict(model.named_parameters(remove_duplicate=False))
    embed = model.get_input_embeddings()
    out_emb = model.get_output_embeddings()
    kinds = {}
    for i, m in enumerate(base.layers):
        kinds[f"model.layers.{i}"] = "decoder"
    layers, covered, modules = {}, set(), []
    for info in rh.layers:
        kind = kinds.get(info.name)
        try:
            module = model.get_submodule(info.name)
        except AttributeError:
            raise SlideDPError(9, f"hostd's layer {info.name!r} has no module in this model") from None
        if kind is None:
            kind = ("embedding" if module is embed else "lm_head" if module is out_emb
                    else "norm")
        params = []
        for ti in info.tensors:
            p = named.get(ti.name)
            if p is None:
                raise SlideDPError(9, f"hostd's tensor {ti.name!r} (layer {info.name}) is not a "
                                      "parameter of this model")
            if shapes[ti.name] != tuple(ti.shape):
                raise SlideDPError(9, f"{ti.name}: the model's shape is {shapes[ti.name]}, hostd's "
                                      f"is {ti.shape}")
            params.append((p, ti))
            covered.add(id(p))
        layers[info.index] = _Layer(info, kind, params)
        modules.append((module, [info.index]))
    # Tied output embeddings: the lm_head module uses the embedding's layer.
    if out_emb is not None and id(out_emb.weight) in covered and \
            all(m is not out_emb for m, _ in modules):
        owner = next(l.index for l in layers.values() if any(p is out_emb.weight
                                                             for p, _ in l.params))
        modules.append((out_emb, [owner]))
    uncovered = [n for n, p in named.items() if id(p) not in covered]
    if uncovered:
        raise SlideDPError(9, f"parameters hostd does not own: {uncovered[:5]}"
                              f"{'...' if len(uncovered) > 5 else ''}")
    decoders = [l.index for l in sorted(layers.values(), key=lambda l: l.index)
                if l.kind == "decoder"]

    # Resident layers start from the model's own weights in FP32 when it has them (a fresh job,
    # checked against hostd's below), else from hostd's BF16 copy.
    own_fp32 = {}
    for idx in s["resident"]:
        layers[idx].resident = True
        if not meta and rh.next_step == 1:
            # Straight to the compute device: no host copy of embeddings in FP32.
            own_fp32[idx] = torch.cat([p.detach().reshape(-1).to(device, torch.float32)
                                       for p, _ in layers[idx].params])

    # Checksums of the model's own weights, to verify hostd's on a fresh job.
    verify = s["verify"] and rh.next_step == 1 and not meta
    sums = {l.index: _layer_checksums([p for p, _ in l.params]) for l in layers.values()} \
        if verify else None

    if device.type == "cuda" or s["cpu_window"]:
        compute_dtype = torch.bfloat16
    else:
        first = next(iter(named.values()))
        compute_dtype = first.dtype if first.dtype in (torch.float32, torch.bfloat16) \
            else torch.float32
    placeholder = torch.empty(0, dtype=compute_dtype, device=device)
    for l in layers.values():
        for p, _ in l.params:
            p.data = placeholder
            p.grad = None
    _reinit_meta_buffers(model, device)
    model.to(device)
    if hasattr(model.config, "use_cache"):
        model.config.use_cache = False
    # slidedp checkpoints decoder layers itself (StreamedRuntime._wrap_decoder).
    if "is_activation_checkpointing" in dir(type(model)):  # transformers >= 5.2x
        if model.is_activation_checkpointing:
            model.activation_checkpointing_disable()
    elif getattr(model, "is_gradient_checkpointing", False):
        model.gradient_checkpointing_disable()

    nondec = sum(1 for l in layers.values() if l.kind != "decoder" and not l.resident)
    needed = nondec + 2 * s["prefetch"] + 2
    minimum = nondec + s["prefetch"] + 2
    if s["window_slots"] is not None and (device.type == "cuda" or s["cpu_window"]) and \
            int(s["window_slots"]) < minimum:
        raise SlideDPError(3, f"window_slots: {s['window_slots']}, expected >= {minimum} for this "
                              f"model with prefetch={s['prefetch']} (embeddings, final norm and "
                              f"lm_head stay in the window: {nondec} slots; the decoder layers "
                              f"need prefetch + 2; {needed} lets backward start prefetched)")
    if device.type == "cuda":
        slots = s["window_slots"] or needed
        backend = _GpuBackend(rh, device, slots, s["h2d_chunk_bytes"], s["param_route"],
                              s["max_pending"], s["time_waits"])
        slots = backend.plane.window_slots
    elif s["cpu_window"]:
        slots = s["window_slots"] or needed
        backend = _CpuWindowBackend(rh, slots, max(l.numel for l in layers.values()))
    else:
        slots = s["window_slots"] or needed
        backend = _CpuBackend(rh, compute_dtype)
    offload = None
    ratios = {pos: p.ratio for pos, p in enumerate(s["policies"]) if p.ratio > 0}
    if ratios:
        offload = ActivationOffload(device, ratios, s["offload_min_bytes"], s["time_waits"])
    settings = dict(s, window_slots=slots, slots_needed=needed, placeholder=placeholder,
                    modules=modules, offload=offload)
    rt = StreamedRuntime(model, rh, backend, layers, decoders, settings)
    rt.install()
    if sums is not None:
        _verify_init(rt, layers, sums)
    for idx in sorted(s["resident"]):
        rt.make_resident(layers[idx], own_fp32.get(idx), compute_dtype, device,
                         from_hostd=rh.next_step != 1)
    model.slidedp = rt
    # Route the model's forward through the saved-tensor hooks (window views become tokens).
    orig_forward = model.forward
    rt_ref = weakref.ref(rt)

    @functools.wraps(orig_forward)  # its signature stays inspectable (HF Trainer reads it)
    def forward(*args, **kwargs):
        # The step's begin and end around the model's forward (not module hooks: policy='auto'
        # attaches inside the first call, after the hooks of that call have been read).
        r = rt_ref()
        if r is None:
            return orig_forward(*args, **kwargs)
        r._on_model_pre(model, args, kwargs)
        with r.saved_tensor_hooks():
            out = orig_forward(*args, **kwargs)
        return r._on_model_post(model, args, kwargs, out)
    model.forward = forward
    log.info("rank %d attached to %s: %d layers (%d decoder), %.2fB parameters, %s backend, "
             "window %d slots, grad route %s, layout %s, non-decoder layers %s, "
             "resident decoder layers %d, activation offload %s",
             rh.rank, rh.socket, len(layers), len(decoders), rt.nparams / 1e9, backend.name,
             slots, rh.grad_route, _policy.format_layout(s["policies"]),
             "resident (device AdamW)" if any(layers[i].kind != "decoder" for i in s["resident"])
             else "host-updated", sum(1 for i in s["resident"] if layers[i].kind == "decoder"),
             f"decoder layers {sorted(offload.positions)}"
             if offload is not None else "off")
    return model, SlideDPOptimizer(rt)


def _verify_init(rt, layers, sums):
    """Compares hostd's version-0 parameters with the model's weights (checksums of the
    BF16-rounded values) through the host path, before any step begins."""
    for l in layers.values():
        buf = torch.empty(l.numel, dtype=torch.bfloat16)
        rt.rank.fetch_params(l.index, rt.next_step - 1, buf.data_ptr(), l.numel * 2)
        got = _layer_checksums([buf[ti.offset: ti.offset + ti.numel] for _, ti in l.params])
        for (p, ti), a, b in zip(l.params, sums[l.index], got):
            if a != b:
                raise SlideDPError(9, f"hostd's weights differ from the model's: {ti.name} has "
                                      f"sum {b!r} in hostd, {a!r} in the model. Start hostd with "
                                      "this model's weights (save_pretrained to a directory and "
                                      "`hostd --model DIR`) or pass verify_init=False to train "
                                      "hostd's weights")
