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
"""
import collections
import contextlib
import logging
import math
import os
import threading
import time
import weakref

import torch
import torch.utils.checkpoint

from . import preflight
from ._lib import DTYPE_BF16, DTYPE_FP32, SlideDPError
from .offload import ActivationOffload, OffloadedTensor, spread as _spread
from .rank import GpuPlane, RankHandle, manifest_hash, manifest_layers

log = logging.getLogger("slidedp")

SUPPORTED_FAMILIES = ("llama", "qwen2", "qwen3")
_TORCH_DTYPE = {DTYPE_FP32: torch.float32, DTYPE_BF16: torch.bfloat16}


def _in_backward():
    return torch._C._current_graph_task_id() != -1


class _Layer:
    __slots__ = ("info", "index", "kind", "params", "numel", "flat", "slot", "ready", "grads_seen",
                 "nparams", "acc", "pushed", "resident", "master", "m", "v")

    def __init__(self, info, kind, params):
        self.info, self.index, self.kind = info, info.index, kind
        self.params = params  # [(Parameter, TensorInfo)], unique parameters
        self.nparams = len(params)
        self.numel = info.numel
        self.flat = None  # the layer's parameters on the compute device (flat, compute dtype)
        self.slot = None  # GPU window slot while held
        self.ready = False  # the compute stream waits for the slot's copy
        self.grads_seen = 0
        self.acc = None  # gradient buffer (FP32 accumulator when accumulating)
        self.pushed = False
        # nondecoder="resident": kept on the compute device for the whole run, updated there
        # (FP32 master and moments on the device, AdamW with hostd's settings).
        self.resident = False
        self.master = self.m = self.v = None


class _CpuBackend:
    """Host copies through slidedp_rank_fetch_params / push_grad (CPU training, tests)."""

    name = "cpu"
    windowed = False

    def __init__(self, rank, compute_dtype):
        self.rank, self.compute_dtype = rank, compute_dtype
        self.h2d_bytes = self.d2h_bytes = 0

    def begin_step(self, step):
        self.rank.begin_step(step)

    def fetch(self, layer, version):
        buf = torch.empty(layer.numel, dtype=torch.bfloat16)
        self.rank.fetch_params(layer.index, version, buf.data_ptr(), layer.numel * 2)
        self.h2d_bytes += layer.numel * 2
        layer.flat = buf if self.compute_dtype == torch.bfloat16 else buf.to(self.compute_dtype)
        layer.ready = True

    def make_ready(self, layer):
        pass

    def slot_wait_seconds(self):
        return 0.0  # host copies are synchronous: fetch_wait covers them

    def release(self, layer):
        layer.flat = None

    def push(self, step, layer, grad):
        g = grad.contiguous()
        self.rank.push_grad(step, layer.index, g.data_ptr(), self.rank.grad_dtype,
                            g.numel() * g.element_size())
        self.d2h_bytes += g.numel() * g.element_size()

    def end_step(self):
        pass

    def counters(self):
        return {"h2d_bytes": self.h2d_bytes, "d2h_bytes": self.d2h_bytes}

    def is_window_tensor(self, t):
        return False

    def close(self):
        pass


class _CpuWindowBackend(_CpuBackend):
    """The GPU backend's window discipline on the host (BF16 compute on the CPU): a fixed set of
    slots in one buffer, fetches refused when every slot is held, saved views turned into tokens.
    Lets CPU-only machines test the schedule the GPU runs (attach(..., cpu_window=True))."""

    name = "cpu-window"
    windowed = True

    def __init__(self, rank, slots, slot_elems):
        super().__init__(rank, torch.bfloat16)
        self.window_slots, self.slot_elems = slots, slot_elems
        self.window = torch.empty(slots * slot_elems, dtype=torch.bfloat16)
        self.window_ptr = self.window.untyped_storage().data_ptr()
        self.held = set()

    def fetch(self, layer, version):
        free = [i for i in range(self.window_slots) if i not in self.held]
        if not free:
            raise SlideDPError(9, f"every window slot is held ({self.window_slots} slots); "
                                  f"release one before fetching layer {layer.index}")
        slot = free[0]
        view = self.window[slot * self.slot_elems: slot * self.slot_elems + layer.numel]
        self.rank.fetch_params(layer.index, version, view.data_ptr(), layer.numel * 2)
        self.h2d_bytes += layer.numel * 2
        self.held.add(slot)
        layer.slot, layer.flat, layer.ready = slot, view, True

    def release(self, layer):
        if layer.slot is not None:
            self.held.discard(layer.slot)
        layer.slot, layer.flat, layer.ready = None, None, False

    def is_window_tensor(self, t):
        return t.device.type == "cpu" and t.untyped_storage().data_ptr() == self.window_ptr


class _CaiHolder:
    """Exposes a device pointer range to torch.as_tensor (CUDA array interface, int16 elements)."""

    def __init__(self, ptr, elems):
        self.__cuda_array_interface__ = {"shape": (elems,), "typestr": "<i2",
                                         "data": (ptr, False), "version": 2, "strides": None}


class _GpuBackend:
    """The GPU data plane: BF16 window slots filled by H2D from hostd's params mapping, gradients
    D2H'd (or reduced by NCCL) into hostd's rings, all ordered against torch's current stream."""

    name = "gpu"
    windowed = True

    def __init__(self, rank, device, window_slots, h2d_chunk_bytes, param_route, max_pending,
                 time_waits):
        self.rank, self.device = rank, device
        # A staging buffer per pending gradient (GPU-reduction route): backward may run ahead
        # of hostd by max_pending layers.
        self.plane = GpuPlane(rank, device.index or 0, window_slots=window_slots,
                              h2d_chunk_bytes=h2d_chunk_bytes, param_route=param_route,
                              staging_buffers=max(2, min(64, max_pending)),
                              reduce_in_fp32=rank.world_size > 1)
        self.window_slots, self.slot_elems = self.plane.window_slots, self.plane.slot_elems
        self.window = None  # one bf16 tensor over every slot (set at the first fetch)
        self.window_ptr = 0
        self.pending = collections.deque()  # (layer index, grad buffer) not yet consumed
        self.max_pending = max_pending
        self.time_waits = time_waits
        self.wait_events = []

    def _stream(self):
        return torch.cuda.current_stream(self.device)

    def begin_step(self, step):
        self.plane.begin_step(step)

    def fetch(self, layer, version):
        slot, ptr, numel = self.plane.fetch(layer.index, version)
        se = self.slot_elems
        if self.window is None:
            base = ptr - slot * se * 2
            holder = _CaiHolder(base, self.window_slots * se)
            self.window = torch.as_tensor(holder, device=self.device).view(torch.bfloat16)
            self.window_ptr = base
        layer.slot = slot
        layer.flat = self.window[slot * se: slot * se + numel]
        layer.ready = False

    def make_ready(self, layer):
        if layer.ready:
            return
        s = self._stream()
        if self.time_waits:
            e0 = torch.cuda.Event(enable_timing=True)
            e1 = torch.cuda.Event(enable_timing=True)
            e0.record(s)
            self.plane.wait_slot(layer.slot, s.cuda_stream)
            e1.record(s)
            self.wait_events.append((e0, e1))
        else:
            self.plane.wait_slot(layer.slot, s.cuda_stream)
        layer.ready = True

    def release(self, layer):
        if layer.slot is not None:
            self.plane.release_slot(layer.slot, self._stream().cuda_stream)
        layer.slot, layer.flat, layer.ready = None, None, False

    def push(self, step, layer, grad):
        s = self._stream()
        dtype = DTYPE_FP32 if grad.dtype == torch.float32 else DTYPE_BF16
        self.plane.push_grad(step, layer.index, grad.data_ptr(), dtype, s.cuda_stream)
        self.pending.append((layer.index, grad))
        while len(self.pending) > self.max_pending:
            idx, _ = self.pending.popleft()
            # The buffer returns to torch's allocator after this; later users of the memory on
            # this stream are ordered after the D2H.
            self.plane.wait_grad_consumed(idx, s.cuda_stream)

    def end_step(self):
        # Nothing to wait for: the plane keeps pushing this step's gradients while the next
        # step's forward runs; each layer's fetch waits for its update (the version gate), and a
        # failed push is reported by the next push or by close().
        pass

    def slot_wait_seconds(self):
        total = 0.0
        for e0, e1 in self.wait_events:
            e1.synchronize()
            total += e0.elapsed_time(e1) / 1e3
        self.wait_events.clear()
        return total

    def counters(self):
        st = self.plane.stats()
        return {"h2d_bytes": st["h2d_bytes"], "d2h_bytes": st["d2h_bytes"]}

    def is_window_tensor(self, t):
        return (self.window is not None and t.is_cuda
                and t.untyped_storage().data_ptr() == self.window_ptr)

    def close(self):
        try:
            self.plane.wait_pushes()
        finally:
            self.pending.clear()
            self.window = None
            self.plane.destroy()


class _Token:
    """A saved tensor that is a view of a window slot: re-fetched when autograd unpacks it."""
    __slots__ = ("layer", "offset", "size", "stride")

    def __init__(self, layer, offset, size, stride):
        self.layer, self.offset, self.size, self.stride = layer, offset, size, stride


def _flops_per_token(config, nparams, seq):
    layers = config.num_hidden_layers
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    h = config.num_attention_heads * head_dim
    return 6 * nparams + 6 * layers * h * seq


class SlideDPOptimizer:
    """The step boundary of an attached model. hostd runs AdamW; this object only marks steps.
    `step()` returns the step's figures (a dict; also logged on logger 'slidedp')."""

    def __init__(self, runtime):
        self._rt = runtime
        self.param_groups = [{"params": [], "lr": None}]
        self.state = {}

    def step(self, closure=None):
        """Ends the training step. Raises SlideDPError when rank 0's upload of the resident
        layers that a hostd checkpoint asked for failed (hostd's checkpoint then lacks them and
        fails): the step itself has completed, and training may go on."""
        if closure is not None:
            with torch.enable_grad():
                closure()
        return self._rt.end_step()

    def zero_grad(self, set_to_none=True):
        pass  # gradients never stay in .grad: they are pushed to hostd during backward

    def state_dict(self):
        raise SlideDPError(12, "the optimizer state lives in hostd; checkpoint it with hostd "
                               "(slidedpctl), not through the client")

    def load_state_dict(self, state):
        self.state_dict()

    def close(self):
        """Detaches from hostd. Rank 0 first uploads the resident layers' final state
        (nondecoder="resident", resident_layers) so that hostd's final checkpoint, ExportHF and
        a resume include it; when that upload (or a checkpoint's that was not raised yet) fails,
        close() raises SlideDPError after detaching: hostd's copy of those layers is older than
        the training, so its final checkpoint is not written and ExportHF refuses."""
        self._rt.close()


class StreamedRuntime:
    def __init__(self, model, rank, backend, layers, decoder_order, settings):
        self.model = model
        self.rank = rank
        self.backend = backend
        self.layers = layers  # hostd layer index -> _Layer
        self.decoders = decoder_order  # hostd layer indices of decoder layers, forward order
        self.dec_pos = {l: i for i, l in enumerate(decoder_order)}
        self.s = settings
        self.next_step = rank.next_step
        self.step = None
        self.micro = 0
        self.layers_done = 0
        self.hooks = []
        self.restore = []
        self.closed = False
        self.tokens = 0
        self.seq = 0
        self.t_step0 = None
        self.fetch_wait = 0.0
        self.fetch_waits = []
        self.begin_wait = 0.0
        self.nparams = sum(l.numel for l in layers.values())
        self.counters0 = backend.counters()
        self.resident_skipped = 0
        self.shapes_checked = set()
        self.model_config = model.config
        # offload_ratio > 0: the saved activations of these decoder layers go to host memory.
        self.offload = settings.get("offload")
        # Resident layers in hostd's checkpoints: the version their state is at, and rank 0's
        # upload (a snapshot on the device, copied out on a background thread) of the version
        # hostd asks for.
        self.resident_version = rank.next_step - 1
        self.sync_thread = None
        self.sync_started = 0  # the version of the last upload begun
        self.sync_done = 0  # the version of the last upload hostd took
        self.sync_error = None  # (version, exception) of a failed upload, until it is raised
        self.snapshot_s = 0.0  # this step's time taking a snapshot (on the training thread)

    # ---- parameters in and out of the window ----
    def _version(self):
        return self.step - 1

    def _materialize(self, layer):
        for p, ti in layer.params:
            p.data = layer.flat[ti.offset: ti.offset + ti.numel].view(ti.shape)

    def _dematerialize(self, layer):
        ph = self.s["placeholder"]
        for p, _ in layer.params:
            p.data = ph

    def _fetch(self, layer):
        t0 = time.perf_counter()
        try:
            self.backend.fetch(layer, self._version())
        except SlideDPError as e:
            if e.code == 9 and "window slot" in str(e):
                raise SlideDPError(9, f"{e.message} (window_slots={self.s['window_slots']}; the schedule "
                                      f"needs about {self.s['slots_needed']})") from None
            raise
        dt = time.perf_counter() - t0
        self.fetch_wait += dt
        if dt > 1e-3 and self.s["time_waits"]:
            # (layer, seconds, ms into the step): where the version gate held the forward.
            self.fetch_waits.append((layer.index, round(dt, 4),
                                     round((t0 - (self.t_step0 or t0)) * 1e3, 1)))

    def _acquire(self, idx):
        layer = self.layers[idx]
        if layer.resident:
            return layer
        if layer.flat is None:
            self._fetch(layer)
        self.backend.make_ready(layer)
        self._materialize(layer)
        return layer

    def _free_slots(self):
        held = sum(1 for l in self.layers.values() if l.slot is not None)
        return self.s["window_slots"] - held

    def _prefetch(self, pos, direction):
        if not self.backend.windowed:
            return
        for k in range(1, self.s["prefetch"] + 1):
            p = pos + direction * k
            if p < 0 or p >= len(self.decoders):
                break
            layer = self.layers[self.decoders[p]]
            if layer.flat is None and not layer.pushed:
                if self._free_slots() <= 1:  # keep one slot for the layer needed next
                    break
                self._fetch(layer)

    def _release(self, layer):
        if layer.resident:
            return
        self._dematerialize(layer)
        self.backend.release(layer)

    # ---- hooks ----
    def _on_model_pre(self, module, args, kwargs):
        if self.closed:
            raise SlideDPError(9, "this model was detached from hostd (opt.close())")
        ids = kwargs.get("input_ids", args[0] if args else None)
        if self.step is None:
            if ids is not None and torch.is_grad_enabled():
                self._preflight(ids, module.training)  # before hostd hears of the step
            self._begin()
        if ids is not None and torch.is_grad_enabled():
            self.tokens += ids.numel()
            self.seq = ids.shape[-1]
        if self.offload is not None and torch.is_grad_enabled():
            self.offload.begin_forward()

    def _on_model_post(self, module, args, kwargs, out):
        if not torch.is_grad_enabled():
            for layer in self.layers.values():
                if layer.flat is not None and not layer.resident and \
                        not self._kept_for_backward(layer):
                    self._release(layer)
        else:
            if self.backend.windowed:
                # Backward starts from the end of the decoder stack: fetch its first layers now.
                self._prefetch(len(self.decoders), -1)
            if self.offload is not None:
                # When backward starts (the logits' gradient), the last decoder layer's
                # offloaded activations start coming back.
                self.offload.watch(getattr(out, "logits", None), len(self.decoders))
        return out

    def _preflight(self, ids, training):
        """Refuses a batch whose activations cannot fit the device (preflight.py), once per
        input shape."""
        shape = (tuple(ids.shape), training)
        if ids.dim() < 1 or shape in self.shapes_checked:
            return
        budget = self.s.get("memory_budget")
        device = self.s["device"]
        available = budget if budget is not None else preflight.free_device_bytes(device)
        if available is None:  # the CPU without a budget: nothing to check against
            return
        n = len(self.decoders)
        # Layers recompute only in training mode (like HF's checkpointing).
        recomputes = [training and self._recomputes(pos) for pos in range(n)]
        recomputed = sum(recomputes)
        # Layers keeping their activations whose saved tensors go to host memory (offload_ratio).
        offloaded = 0 if self.offload is None else sum(
            1 for pos in self.offload.positions if not recomputes[pos])
        seq = ids.shape[-1]
        preflight.check_batch_fits(self.model_config, ids.numel() // max(1, seq), seq,
                                   recomputed, n - recomputed, int(available), str(device),
                                   offloaded=offloaded)
        self.shapes_checked.add(shape)

    def _kept_for_backward(self, layer):
        return layer.grads_seen > 0 or (torch.is_grad_enabled() and layer.kind != "decoder")

    def _begin(self):
        t0 = time.perf_counter()
        if self.t_step0 is None:
            self.t_step0 = t0
        self.backend.begin_step(self.next_step)  # a failure leaves no step begun here
        self.step = self.next_step
        self.begin_wait += time.perf_counter() - t0
        self.micro = 0
        self.layers_done = 0
        for layer in self.layers.values():
            layer.pushed = False
            layer.grads_seen = 0

    def _on_pre(self, idxs, module, args):
        for idx in idxs:
            layer = self._acquire(idx)
            if layer.kind == "decoder":
                pos = self.dec_pos[idx]
                self._prefetch(pos, -1 if _in_backward() else 1)

    def _on_post(self, idxs, module, args, out, recompute=False):
        if _in_backward():
            return out
        for idx in idxs:
            layer = self.layers[idx]
            if layer.kind != "decoder" or layer.flat is None:
                continue  # embeddings, norm and lm_head stay until their gradient is pushed
            if not torch.is_grad_enabled():
                self._release(layer)
            elif self.backend.windowed:
                # Saved views of the window become tokens (_pack), so the slot can go; the last
                # `prefetch` layers stay for the start of backward.
                if self.dec_pos[idx] < len(self.decoders) - self.s["prefetch"]:
                    self._release(layer)
            elif recompute:
                # CPU: the recompute fetches the layer again. Without recompute the saved
                # tensors hold the host copy and the parameters stay in place until their
                # gradients have accumulated.
                self._release(layer)
        return out

    def _pack(self, t):
        try:
            in_window = self.backend.is_window_tensor(t)
        except (RuntimeError, NotImplementedError):  # tensors without a plain storage
            in_window = False
        if in_window:
            se = self.backend.slot_elems
            off = t.storage_offset()
            slot = off // se
            for layer in self.layers.values():
                if layer.slot == slot:
                    return _Token(layer.index, off - slot * se, tuple(t.shape), t.stride())
            return t  # window memory is never offloaded
        if self.offload is not None and self.offload.cur is not None:
            # Not the running layer's own parameters (host copies on the CPU backend).
            flat = self.layers[self.decoders[self.offload.cur]].flat
            return self.offload.pack(t, () if flat is None else
                                     (flat.untyped_storage().data_ptr(),))
        return t

    def _unpack(self, x):
        if isinstance(x, OffloadedTensor):
            return self.offload.unpack(x)
        if not isinstance(x, _Token):
            return x
        layer = self._acquire(x.layer)
        if layer.kind == "decoder":
            self._prefetch(self.dec_pos[x.layer], -1)
        base = layer.slot * self.backend.slot_elems
        return self.backend.window.as_strided(x.size, x.stride, base + x.offset)

    def _on_grad(self, idx, ti, p):
        layer = self.layers[idx]
        g = p.grad
        accum = self.s["accumulation_steps"]
        last = self.micro == accum - 1
        if layer.acc is None:
            if accum > 1 or layer.resident:
                layer.acc = torch.zeros(layer.numel, dtype=torch.float32, device=g.device)
            else:
                layer.acc = torch.empty(layer.numel, dtype=_TORCH_DTYPE[self.rank.grad_dtype],
                                        device=g.device)
        seg = layer.acc[ti.offset: ti.offset + ti.numel].view(ti.shape)
        if accum > 1 and self.micro > 0:
            seg.add_(g)
        else:
            seg.copy_(g)
        p.grad = None
        layer.grads_seen += 1
        if layer.grads_seen < layer.nparams:
            return
        layer.grads_seen = 0
        # Release before pushing: once every rank has pushed, hostd may publish the next version,
        # and a slot still held then would fail the release's version check.
        if layer.flat is not None:
            self._release(layer)
        if last and layer.resident:
            layer.pushed = True  # updated on the device at opt.step()
        elif last:
            grad = layer.acc
            if grad.dtype != _TORCH_DTYPE[self.rank.grad_dtype] and self.backend.name != "gpu":
                grad = grad.to(_TORCH_DTYPE[self.rank.grad_dtype])
            self.backend.push(self.step, layer, grad)
            layer.acc = None
            layer.pushed = True
        self.layers_done += 1
        if self.layers_done == len(self.layers):
            self.layers_done = 0
            self.micro += 1

    def install(self):
        model = self.model
        self.hooks.append(model.register_forward_pre_hook(self._on_model_pre, with_kwargs=True))
        self.hooks.append(model.register_forward_hook(self._on_model_post, with_kwargs=True))
        seen = set()
        for idx, layer in self.layers.items():
            for p, ti in layer.params:
                if id(p) in seen:
                    continue
                seen.add(id(p))
                self.hooks.append(p.register_post_accumulate_grad_hook(
                    lambda p, idx=idx, ti=ti: self._on_grad(idx, ti, p)))
        for module, idxs in self.s["modules"]:
            if self.layers[idxs[0]].kind == "decoder":
                self._wrap_decoder(module, idxs)
                continue
            self.hooks.append(module.register_forward_pre_hook(
                lambda m, a, idxs=idxs: self._on_pre(idxs, m, a)))
            self.hooks.append(module.register_forward_hook(
                lambda m, a, o, idxs=idxs: self._on_post(idxs, m, a, o)))

    def _recomputes(self, pos):
        """Whether decoder layer `pos` (forward order) is checkpointed: all ("full"), none, or
        a fraction f of them spread evenly (layer pos when floor((pos+1)f) > floor(pos f))."""
        return _spread(self.s["checkpointing"], pos)

    def _wrap_decoder(self, module, idxs):
        # The fetch runs inside the checkpointed function, so the recompute in backward fetches
        # the layer again (module hooks may run outside a checkpoint, depending on the library).
        orig = module.forward
        pos = self.dec_pos[idxs[0]]
        ckpt = self._recomputes(pos)

        def run(recompute, *args, **kwargs):
            self._on_pre(idxs, module, args)
            out = orig(*args, **kwargs)
            return self._on_post(idxs, module, args, out, recompute)

        def call(*args, **kwargs):
            # Like HF's own checkpointing: only in training mode.
            if ckpt and module.training and torch.is_grad_enabled():
                return torch.utils.checkpoint.checkpoint(run, True, *args, use_reentrant=False,
                                                         **kwargs)
            return run(False, *args, **kwargs)

        def forward(*args, **kwargs):
            off = self.offload
            if off is None or not torch.is_grad_enabled() or _in_backward():
                return call(*args, **kwargs)
            # What autograd saves while this layer runs (with checkpointing: the layer's inputs)
            # is offloaded when the layer is one of offload_ratio's.
            prev = off.begin_layer(pos)
            try:
                out = call(*args, **kwargs)
            finally:
                off.end_layer(prev)
            off.watch(out, pos)  # backward reaches this layer: prefetch the one before it
            return out

        module.forward = forward
        self.restore.append((module, "forward"))

    @contextlib.contextmanager
    def saved_tensor_hooks(self):
        if self.backend.windowed or self.offload is not None:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        else:
            yield

    # ---- resident layers (nondecoder="resident") ----
    def make_resident(self, layer, fp32, compute_dtype, device, from_hostd=False):
        def read(part):
            buf = torch.empty(layer.numel, dtype=torch.float32)
            self.rank.read_client_layer(layer.index, part, 0, buf.data_ptr(), layer.numel)
            return buf.to(device)

        if from_hostd:
            # A resumed job: hostd's copy (master, m, v) is the job's state at this version.
            layer.master, layer.m, layer.v = (read(part) for part in range(3))
            layer.flat = layer.master.to(torch.bfloat16).to(compute_dtype)
            self._materialize(layer)
            return
        if fp32 is None:
            # A meta model: hostd's FP32 master, as its own layers start from. Not its BF16
            # copy: a master on the BF16 grid moves none of the BF16 weights until the updates
            # add up to half a BF16 step (several steps at small learning rates), where an
            # FP32 master's roundings flip from the first update (measured: Qwen3-4B at lr
            # 1e-5, 6 of 36 decoder layers started from BF16 ended 8 steps at loss 5.56 where
            # all from FP32 reached 5.03).
            fp32 = read(0)
        layer.master = fp32.to(device=device, dtype=torch.float32)
        layer.m = torch.zeros_like(layer.master)
        layer.v = torch.zeros_like(layer.master)
        # The compute copy holds the master rounded to BF16, as hostd's streamed layers do.
        layer.flat = layer.master.to(torch.bfloat16).to(compute_dtype)
        self._materialize(layer)

    def _resident_layers(self):
        return [l for l in self.layers.values() if l.resident]

    def _maybe_sync(self):
        """Rank 0 uploads the resident layers when hostd asks (a checkpoint) for the version
        they hold now."""
        if self.rank.rank != 0 or not self._resident_layers():
            return
        want = self.rank.client_sync_step()
        if want != 0 and want == self.resident_version and want != self.sync_started:
            self._start_upload(want)

    def _start_upload(self, version, wait=False):
        """Snapshots the resident layers (a device copy, ordered after their last update on
        the current stream) and uploads it to hostd on a background thread."""
        self._join_upload()
        res = self._resident_layers()
        t0 = time.perf_counter()
        dev = res[0].master.device
        try:
            snap = [(l.index, l.master.clone(), l.m.clone(), l.v.clone()) for l in res]
        except torch.OutOfMemoryError:
            # No room for a copy: upload from the live tensors before the next update.
            log.warning("no device memory for a snapshot of the resident layers; uploading "
                        "them before training goes on")
            snap, wait = [(l.index, l.master, l.m, l.v) for l in res], True
        event = None
        if dev.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        self.sync_started = version
        self.sync_thread = threading.Thread(target=self._upload, args=(version, snap, event),
                                            name="slidedp-upload", daemon=True)
        self.sync_thread.start()
        if wait:
            self._join_upload()
        self.snapshot_s += time.perf_counter() - t0

    def _upload(self, version, snap, event):
        try:
            # Background work: on a host whose cores the optimizer threads fill, the training
            # thread (and hostd's update threads) go first. Linux: a thread id sets one thread.
            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
            except (AttributeError, OSError):
                pass
            t0 = time.perf_counter()
            nbytes = 0
            if event is not None:
                event.synchronize()
            cuda = snap[0][1].device.type == "cuda"
            piece = 1 << 22  # elements per device-to-host copy (one hostd message)
            if cuda:
                staging = torch.empty(piece, dtype=torch.float32, pin_memory=True)
                stream = torch.cuda.Stream(snap[0][1].device)
            for idx, *parts in snap:
                for part, t in enumerate(parts):
                    t = t.reshape(-1)
                    n = t.numel()
                    for off in range(0, n, piece):
                        c = min(piece, n - off)
                        if cuda:
                            with torch.cuda.stream(stream):
                                staging[:c].copy_(t[off:off + c], non_blocking=True)
                            stream.synchronize()
                            ptr = staging.data_ptr()
                        else:
                            ptr = t.data_ptr() + off * 4
                        self.rank.upload_client_layer(version, idx, part, off, ptr, c)
                        nbytes += c * 4
            del snap
            self.sync_done = version
            log.info("rank 0 uploaded its resident layers at version %d to hostd: %.2f GB in "
                     "%.2f s", version, nbytes / 1e9, time.perf_counter() - t0)
        except Exception as e:  # noqa: BLE001 - raised on the training thread (_upload_error)
            if isinstance(e, SlideDPError) and e.code == 6:  # ALREADY_EXISTS: hostd has it
                self.sync_done = version
                return
            if self.sync_error is None:
                self.sync_error = (version, e)
            log.error("uploading the resident layers at version %d failed: %s", version, e)

    def _upload_error(self, what):
        """The failure of a finished upload, as the SlideDPError to raise (once), else None."""
        if self.sync_thread is not None and not self.sync_thread.is_alive():
            self._join_upload()
        if self.sync_error is None:
            return None
        version, e = self.sync_error
        self.sync_error = None
        code = e.code if isinstance(e, SlideDPError) else 13
        detail = e.message if isinstance(e, SlideDPError) else f"{type(e).__name__}: {e}"
        return SlideDPError(code, f"rank 0's upload of the resident layers (client_updated_layers)"
                                  f" at version {version} to hostd failed, {what}: {detail}")

    def _upload_final(self):
        """Rank 0 leaves its resident layers' final state in hostd, so that hostd's final
        checkpoint (a clean stop), ExportHF and a later resume include them. Returns the
        SlideDPError of an upload that failed (this one, or a checkpoint's not raised yet)."""
        if self.rank.rank != 0 or not self._resident_layers():
            return None
        self._join_upload()
        earlier = self._upload_error("so hostd's checkpoint of that version lacks them")
        if self.resident_version != self.sync_done:
            self._start_upload(self.resident_version, wait=True)
        final = self._upload_error(
            "so hostd's copy of them stays at an older version: its final checkpoint (a clean "
            "stop) is not written and ExportHF refuses; hostd --resume from an earlier checkpoint "
            "goes back to it")
        return final or earlier

    def _join_upload(self):
        if self.sync_thread is not None:
            self.sync_thread.join()
            self.sync_thread = None

    def _resident_update(self):
        """AdamW of the resident layers on the device, with hostd's settings for this step."""
        res = [l for l in self.layers.values() if l.resident]
        if not res:
            return 0.0
        t0 = time.perf_counter()
        o = self.rank.optimizer(self.step)
        if o["clip"] == "global":
            raise SlideDPError(9, "resident layers (nondecoder='resident', resident_layers) "
                                  "cannot follow hostd's global gradient clipping (the norm "
                                  "spans hostd's layers); use clip per_layer or none, or "
                                  "nondecoder='host' and resident_layers=0")
        world = self.rank.world_size
        nd = set(o["no_decay_tensors"]) if o["no_decay_norms_and_biases"] else set()
        lr, b1, b2, eps, t = o["lr"], o["beta1"], o["beta2"], o["eps"], self.step
        for l in res:
            if world > 1:
                torch.distributed.all_reduce(l.acc, group=self.s["process_group"])
                if o["scale_by_world_size"]:
                    l.acc.mul_(1.0 / world)
        # One device-to-host sync for every layer's norm.
        norms = torch.stack([l.acc.norm() for l in res]).tolist()
        for l, norm in zip(res, norms):
            g = l.acc
            if not math.isfinite(norm):
                self.resident_skipped += 1  # as hostd: a non-finite gradient skips the update
                continue
            if o["clip"] == "per_layer" and o["max_grad_norm"] > 0:
                coef = min(1.0, o["max_grad_norm"] / (norm + 1e-6))
                if coef < 1.0:
                    g.mul_(coef)
            for _, ti in l.params:
                wd = 0.0 if ti.name in nd else o["weight_decay"]
                if wd:
                    l.master[ti.offset: ti.offset + ti.numel].mul_(1.0 - lr * wd)
            l.m.mul_(b1).add_(g, alpha=1.0 - b1)
            l.v.mul_(b2).addcmul_(g, g, value=1.0 - b2)
            denom = (l.v.sqrt() / math.sqrt(1.0 - b2 ** t)).add_(eps)
            l.master.addcdiv_(l.m, denom, value=-lr / (1.0 - b1 ** t))
            l.flat.copy_(l.master if l.flat.dtype == torch.bfloat16
                         else l.master.to(torch.bfloat16))
        return time.perf_counter() - t0

    # ---- the step boundary ----
    def end_step(self):
        accum = self.s["accumulation_steps"]
        if self.step is None or self.micro != accum:
            missing = [l.info.name for l in self.layers.values() if not l.pushed]
            raise SlideDPError(9, f"opt.step() after {self.micro} complete backward passes; "
                                  f"accumulation_steps={accum} (layers without a pushed gradient: "
                                  f"{missing[:4]}{'...' if len(missing) > 4 else ''})")
        self._maybe_sync()  # a checkpoint of the version before this step's update
        resident_s = self._resident_update()
        self.resident_version = self.step
        self._maybe_sync()  # a checkpoint of this step's version
        t0 = time.perf_counter()
        self.backend.end_step()
        push_wait = time.perf_counter() - t0
        now = time.perf_counter()
        dt = now - self.t_step0
        slot_wait = self.backend.slot_wait_seconds()
        c = self.backend.counters()
        world = self.rank.world_size
        tokens = self.tokens * world
        flops = _flops_per_token(self.model.config, self.nparams, self.seq or 1) * tokens
        stats = {
            "step": self.step, "step_time_s": dt, "tokens": tokens,
            "tokens_per_s": tokens / dt if dt > 0 else 0.0,
            "model_tflops_per_gpu": flops / dt / world / 1e12 if dt > 0 else 0.0,
            "param_fetch_wait_s": self.fetch_wait, "param_slot_wait_s": slot_wait,
            "param_fetch_waits": self.fetch_waits,
            "step_begin_wait_s": self.begin_wait, "push_wait_s": push_wait,
            "resident_update_s": resident_s,
            "resident_snapshot_s": self.snapshot_s,  # rank 0, for a checkpoint of hostd's
            "resident_updates_skipped": self.resident_skipped,  # non-finite, since attach
            "h2d_bytes": c["h2d_bytes"] - self.counters0["h2d_bytes"],
            "d2h_bytes": c["d2h_bytes"] - self.counters0["d2h_bytes"],
        }
        if self.offload is not None:
            # activation_offload_bytes (D2H), activation_prefetch_bytes (H2D),
            # activation_prefetch_wait_s, activation_prefetch_misses, activation_offload_pool_bytes
            stats.update(self.offload.step_stats())
        else:
            stats.update(activation_offload_bytes=0, activation_prefetch_wait_s=0.0)
        self.counters0 = c
        self.next_step = self.step + 1
        self.step = None
        self.micro = 0
        self.t_step0 = now
        self.tokens = 0
        self.fetch_wait = self.begin_wait = 0.0
        self.fetch_waits = []
        self.snapshot_s = 0.0
        log.info("step %d: %.3f s, %.0f tok/s, %.1f TFLOPS/GPU, param wait %.3f+%.3f s, "
                 "begin wait %.3f s, push wait %.3f s", stats["step"], dt, stats["tokens_per_s"],
                 stats["model_tflops_per_gpu"], stats["param_fetch_wait_s"], slot_wait,
                 stats["step_begin_wait_s"], push_wait)
        # The step is complete either way; a checkpoint's upload that failed is not silent.
        err = self._upload_error("so hostd's checkpoint of that version lacks them and fails "
                                 f"(step {stats['step']} itself completed)")
        if err is not None:
            raise err
        return stats

    def fetch_state_dict(self):
        """hostd's BF16 parameters as {HF name: CPU tensor}: between steps the version the last
        step produced (after waiting for its updates), within a step the one it trains on."""
        if self.step is None:
            version = self.next_step - 1
            if version >= self.rank.next_step:  # a step this handle ran: wait for its updates
                self.rank.wait_step(version)
        else:
            version = self.step - 1
        out = {}
        for l in self.layers.values():
            if l.resident:  # the device copy (hostd's is the initial one)
                buf = l.flat.detach().to("cpu", torch.bfloat16)
                for _, ti in l.params:
                    out[ti.name] = buf[ti.offset: ti.offset + ti.numel].view(ti.shape).clone()
                continue
            buf = torch.empty(l.numel, dtype=torch.bfloat16)
            self.rank.fetch_params(l.index, version, buf.data_ptr(), l.numel * 2)
            for _, ti in l.params:
                out[ti.name] = buf[ti.offset: ti.offset + ti.numel].view(ti.shape).clone()
        return out

    def close(self):
        if self.closed:
            return
        self.closed = True
        for h in self.hooks:
            h.remove()
        for module, attr in self.restore:
            module.__dict__.pop(attr, None)
        err = None
        try:
            if self.step is None and self.next_step > self.rank.next_step:
                # Detaching before the last step's updates are applied would abort it.
                self.rank.wait_step(self.next_step - 1)
                err = self._upload_final()
        finally:
            self._join_upload()
            err = err or self._upload_error("so hostd's checkpoint of that version lacks them")
            self.backend.close()
            self.rank.detach()
        if err is not None:
            raise err


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
           process_group=None, memory_budget=None, lib=None):
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
    offload_min_bytes (default 64 KiB). accumulation_steps: micro-batches per optimizer step
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
    if isinstance(resident_layers, bool) or not isinstance(resident_layers, int) or \
            not 0 <= resident_layers <= len(dec_idx):
        raise SlideDPError(3, f"resident_layers: {resident_layers!r}, expected an integer in "
                              f"[0, {len(dec_idx)}] (how many of the model's {len(dec_idx)} "
                              "decoder layers, from the first, stay on the device)")
    resident = [i for i, l in enumerate(mlayers)
                if l["kind"] != "LAYER_KIND_DECODER"] if nondecoder == "resident" else []
    resident = sorted(resident + dec_idx[:resident_layers])
    if len(resident) == len(mlayers):
        # hostd completes a step when the last of its layers is updated: it needs one.
        raise SlideDPError(3, f"resident_layers: {resident_layers} with nondecoder='resident' "
                              "leaves hostd no layer to update; expected at most "
                              f"{len(dec_idx) - 1}, or nondecoder='host'")
    try:
        rh = RankHandle(hostd, rank, mhash, gpu=device.index if device.type == "cuda" else -1,
                        job_id=job_id, timeout_ms=int(timeout_s * 1000), lib=lib,
                        client_updated_layers=resident)
    except SlideDPError as e:
        if e.code == 9 and "manifest" in str(e):
            raise SlideDPError(9, f"the model does not match hostd's job: this model "
                                  f"({family}, {cfg.num_hidden_layers} layers, hidden "
                                  f"{cfg.hidden_size}, vocab {cfg.vocab_size}) has manifest hash "
                                  f"{mhash}; hostd said: {e}") from None
        raise
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
        if resident and rh.world_size > 1 and pg is None:
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
        return _attach(model, base, rh, device, mhash, dict(
            resident=set(resident), process_group=pg,
            checkpointing=checkpointing, accumulation_steps=int(accumulation_steps),
            offload_ratio=float(offload_ratio), offload_min_bytes=offload_min_bytes,
            window_slots=window_slots, prefetch=int(prefetch), h2d_chunk_bytes=h2d_chunk_bytes,
            param_route=param_route, max_pending=int(max_pending_grads), verify=verify_init,
            time_waits=time_waits, cpu_window=bool(cpu_window), device=device,
            memory_budget=memory_budget))
    except BaseException:
        rh.detach()
        raise


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
    if s["offload_ratio"] > 0:
        offload = ActivationOffload(device, [p for p in range(len(decoders))
                                             if _spread(s["offload_ratio"], p)],
                                    s["offload_min_bytes"], s["time_waits"])
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

    def forward(*args, **kwargs):
        r = rt_ref()
        if r is None:
            return orig_forward(*args, **kwargs)
        with r.saved_tensor_hooks():
            return orig_forward(*args, **kwargs)
    model.forward = forward
    log.info("rank %d attached to %s: %d layers (%d decoder), %.2fB parameters, %s backend, "
             "window %d slots, grad route %s, checkpointing %s, non-decoder layers %s, "
             "resident decoder layers %d, activation offload %s",
             rh.rank, rh.socket, len(layers), len(decoders), rt.nparams / 1e9, backend.name,
             slots, rh.grad_route, s["checkpointing"],
             "resident (device AdamW)" if any(layers[i].kind != "decoder" for i in s["resident"])
             else "host-updated", sum(1 for i in s["resident"] if layers[i].kind == "decoder"),
             f"r={s['offload_ratio']:g}: decoder layers {sorted(offload.positions)}"
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
