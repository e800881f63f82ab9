"""StreamedRuntime: the per-layer schedule of an attached model (slidedp.hf).

Forward pre-hooks put a layer's parameters in place (a window slot or a host copy, through the
backend) before the layer runs and release them after it; saved views of window slots become
tokens fetched again when autograd unpacks them; post-accumulate-grad hooks gather each layer's
gradient and push it to hostd; end_step() is the step boundary (opt.step()). The resident
layers' update is ResidentLayers' (slidedp/_resident.py). Confined to the training thread, except
the upload thread ResidentLayers owns.
"""
import contextlib
import logging
import time

import torch
import torch.utils.checkpoint

from . import policy, preflight
from ._backends import _TORCH_DTYPE
from ._lib import SlideDPError
from ._resident import ResidentLayers
from .offload import ActivationOffload, OffloadedTensor, spread as _spread

log = logging.getLogger("slidedp")


def _in_backward():
    return torch._C._current_graph_task_id() != -1


def _outside_dispatch_modes():
    """The window's own work (fetching a layer's weights into its slot, prefetching the next
    ones, releasing slots) runs inside a checkpointed layer, but is not the layer's computation:
    a selective checkpoint's caching modes must not see it, since what it does in forward and in
    the replay differs (which layers are prefetched depends on the direction)."""
    try:
        from torch.utils._python_dispatch import _disable_current_modes
    except ImportError:  # pragma: no cover - every supported torch has it
        return contextlib.nullcontext()
    return _disable_current_modes()


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


def fetch_layer(rank, index, numel, tensors, version):
    """hostd's BF16 copy of one layer at `version`, as {HF name: CPU tensor}."""
    buf = torch.empty(numel, dtype=torch.bfloat16)
    rank.fetch_params(index, version, buf.data_ptr(), numel * 2)
    return {ti.name: buf[ti.offset: ti.offset + ti.numel].view(ti.shape).clone()
            for ti in tensors}


class StreamedRuntime(ResidentLayers):
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
        self.auto = None  # policy='auto': the validation of the first steps (slidedp/_auto.py)

    @property
    def device(self):
        return self.s["device"]

    def set_policies(self, policies):
        """A new layout between steps (AutoPolicy's re-solve): the activation kinds and offload
        ratios of the streamed layers; the resident layers stay as attached."""
        if self.step is not None:
            raise SlideDPError(9, "set_policies: a step is running; change the layout between "
                                  "steps")
        old = self.s["policies"]
        if len(policies) != len(old) or any(a.resident != b.resident
                                            for a, b in zip(policies, old)):
            raise SlideDPError(3, f"set_policies: {policy.format_layout(policies)} keeps other "
                                  f"layers resident than {policy.format_layout(old)}; the "
                                  "resident layers are fixed at attach")
        for pos, p in enumerate(policies):
            if p.kind == "Seg":
                policy.check_segmentable(self.model.model.layers[pos], pos)
        ratios = {pos: p.ratio for pos, p in enumerate(policies) if p.ratio > 0}
        if not ratios:
            self.offload = None
        elif self.offload is None or self.offload.ratios != ratios:
            self.offload = ActivationOffload(self.s["device"], ratios,
                                             self.s["offload_min_bytes"], self.s["time_waits"])
        self.s["policies"] = list(policies)
        self.shapes_checked.clear()

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
        # Layers recompute only in training mode (like HF's checkpointing); offloading follows
        # the saved-tensor hooks, on in both modes while gradients are enabled.
        policies = [(p.kind if training else "N", p.ratio) for p in self.s["policies"]]
        seq = ids.shape[-1]
        preflight.check_batch_fits(self.model_config, ids.numel() // max(1, seq), seq, policies,
                                   int(available), str(device))
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
        with _outside_dispatch_modes():
            self._on_pre_unmoded(idxs)

    def _on_pre_unmoded(self, idxs):
        for idx in idxs:
            layer = self._acquire(idx)
            if layer.kind == "decoder":
                pos = self.dec_pos[idx]
                self._prefetch(pos, -1 if _in_backward() else 1)

    def _on_post(self, idxs, module, args, out, recompute=False):
        if _in_backward():
            return out
        with _outside_dispatch_modes():
            self._on_post_unmoded(idxs, recompute)
        return out

    def _on_post_unmoded(self, idxs, recompute):
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
        # The model-level begin and end of a step run in attach's wrapper of model.forward.
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

    def _wrap_decoder(self, module, idxs):
        # The fetch runs inside the checkpointed function, so the recompute in backward fetches
        # the layer again (module hooks may run outside a checkpoint, depending on the library).
        orig = module.forward
        pos = self.dec_pos[idxs[0]]

        def pre(args):
            self._on_pre(idxs, module, args)

        def post(args, out, recompute):
            return self._on_post(idxs, module, args, out, recompute)

        def call(*args, **kwargs):
            # The kind is read at each call: AutoPolicy may change it between steps.
            return policy.run_layer(self.s["policies"][pos].kind, module, orig, pre, post, pos,
                                    args, kwargs)

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
        stats["policy"] = policy.format_layout(self.s["policies"])  # the layout this step ran
        self.counters0 = c
        self.next_step = self.step + 1
        self.step = None
        self.micro = 0
        self.t_step0 = now
        self.tokens = 0
        self.fetch_wait = self.begin_wait = 0.0
        self.fetch_waits = []
        self.snapshot_s = 0.0
        if self.auto is not None:  # between steps: AutoPolicy may change the layout
            self.auto.after_step(stats)
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
            out.update(fetch_layer(self.rank, l.index, l.numel, [ti for _, ti in l.params],
                                   version))
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
