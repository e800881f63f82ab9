"""policy="auto" in attach (the default): the selection runs at the first forward, when the batch
shape is known and hostd has heard of no step; then the attach proper; then the first training
steps validate the prediction against the memory torch really used (slidedp/autopolicy.py has the
selection itself).

Between attach and the first forward the model keeps its weights and `model.slidedp` is a
PendingAttach: the rank is attached already (so a model that does not match hostd's job, a wrong
world size, a stale resident copy are refused at attach), with the layers it would update itself
in any case (nondecoder="resident"). At the first forward:
  1. the buffers (rotary tables) go to the device and AutoPolicy selects at that (batch, seq);
     with several ranks and a process group, rank 0 selects and the others take its choice;
  2. when the chosen layout keeps decoder layers resident, the rank attaches again with the new
     set of layers it updates (hostd allows that before any step, with no rank attached; several
     ranks detach together, then attach together);
  3. _attach places the window and the resident layers, and the activation kinds are solved
     again against the memory free then;
  4. after each of the first training steps (at most MAX_RESOLVES times) the peak memory the
     step's activations took is compared with the prediction, the ratio scales the candidates'
     memory, and the kinds are solved again (the resident layers stay).
"""
import contextlib
import functools
import logging
import sys
import time
import weakref

import torch

from . import autopolicy
from . import policy as _policy
from ._lib import SlideDPError
from .rank import RankHandle

log = logging.getLogger("slidedp")


def _move_buffers(model, device):
    for module in model.modules():
        for name, b in list(module._buffers.items()):
            if b is not None and not b.is_meta and b.device != device:
                module._buffers[name] = b.to(device)


def _batch_shape(args, kwargs):
    ids = kwargs.get("input_ids", args[0] if args else None)
    if isinstance(ids, torch.Tensor) and ids.dim() >= 1:
        seq = int(ids.shape[-1])
        return ids.numel() // max(1, seq), seq
    emb = kwargs.get("inputs_embeds")
    if isinstance(emb, torch.Tensor) and emb.dim() == 3:
        return int(emb.shape[0]), int(emb.shape[1])
    raise SlideDPError(3, "policy='auto': the first forward has neither input_ids nor "
                          "inputs_embeds, so the batch shape to select for is unknown; pass "
                          "input_ids (batch, seq) or a layout, e.g. policy='36F-r0'")


class PendingAttach:
    """model.slidedp from attach until the first forward (policy="auto")."""

    pending = True

    def __init__(self, model, base, rh, device, mhash, s, reattach):
        self.model = model
        self.base = base
        self.rank = rh
        self.device = device
        self.mhash = mhash
        self.s = s
        self.reattach = reattach  # client_updated_layers -> a new RankHandle
        self.step = None
        self.closed = False
        self.runtime = None
        self.optimizer = None
        self.orig_forward = orig = model.forward
        ref = weakref.ref(self)

        @functools.wraps(orig)  # its signature stays inspectable (HF Trainer reads it)
        def forward(*args, **kwargs):
            p = ref()
            if p is None:
                return orig(*args, **kwargs)
            return p.first_forward(args, kwargs)
        model.forward = self.wrapper = forward

    @property
    def next_step(self):
        return self.rank.next_step

    def first_forward(self, args, kwargs):
        if self.closed:
            raise SlideDPError(9, "this model was detached from hostd (opt.close())")
        if self.runtime is None:
            self._finish(args, kwargs)
        return self.model.forward(*args, **kwargs)

    def _select(self, batch, seq, allow_resident):
        s, rh = self.s, self.rank
        nondec = len(s["resident"])  # the nondecoder layers resident from attach
        n_nondec_streamed = sum(1 for l in s["mlayers"] if l["kind"] != "LAYER_KIND_DECODER") \
            - nondec
        slots = s["window_slots"] or n_nondec_streamed + 2 * s["prefetch"] + 2
        reclaim = sum(p.numel() * p.element_size() for p in self.model.parameters()
                      if p.device == self.device) if self.device.type == "cuda" else 0
        return autopolicy.select(
            self.model, self.base, self.device, batch, seq, world_size=rh.world_size,
            grad_route=rh.grad_route, window_slots=slots, nondecoder_resident=nondec > 0,
            allow_resident=allow_resident, memory_budget=s["memory_budget"],
            lib_path=getattr(rh.lib, "_name", None), rank=rh.rank, reclaimable=reclaim)

    def _select_or_fallback(self, batch, seq, allow_resident):
        """The selection; a refusal (nothing fits: code 8) is raised, any other failure of the
        selection (slidedpctl missing, a profile that cannot run, a solver error) logs a
        warning and falls back to every layer F-r0, the fixed default, so a job is not stopped
        by its optimizer of the layout."""
        try:
            return self._select(batch, seq, allow_resident)
        except SlideDPError as e:
            if e.code == 8:
                raise
            err = e
        except Exception as e:  # noqa: BLE001 - any failure of the selection: the fallback
            err = e
        layers = len(self.s["dec_idx"])
        log.warning("policy='auto': the selection failed (%s: %s); training with every layer "
                    "F-r0", type(err).__name__, err, exc_info=err)
        sel = autopolicy.Selection()
        sel.layers = layers
        sel.policies = [_policy.LayerPolicy("F", 0.0)] * layers
        sel.info = {"why": f"the selection failed ({type(err).__name__}: {err}); every layer "
                           "F-r0", "selection_s": 0.0, "failed": repr(err)}
        return sel

    def _finish(self, args, kwargs):
        from .hf import _attach, _reinit_meta_buffers
        s, rh = self.s, self.rank
        batch, seq = _batch_shape(args, kwargs)
        _reinit_meta_buffers(self.model, self.device)
        _move_buffers(self.model, self.device)
        world = rh.world_size
        pg = s["process_group"]
        allow_resident = (world == 1 or pg is not None) and (
            self.device.type == "cuda" or s["nondecoder"] == "resident")
        t0 = time.perf_counter()
        if world > 1 and pg is not None:
            box = [None]
            if rh.rank == 0:
                try:
                    box = [self._select_or_fallback(batch, seq, allow_resident)]
                except SlideDPError as e:
                    box = [e]
            torch.distributed.broadcast_object_list(box, src=0, group=pg)
            if isinstance(box[0], BaseException):
                raise box[0]
            sel = box[0]
        else:
            sel = self._select_or_fallback(batch, seq, allow_resident)
        n_res = sum(p.resident for p in sel.policies)
        resident = sorted(set(s["resident"]) | set(s["dec_idx"][:n_res]))
        if resident != sorted(s["resident"]):
            # The set of layers this rank updates changes: hostd takes a new set only while no
            # rank of the job is attached and no step has run.
            if world > 1:
                torch.distributed.barrier(group=pg)
            rh.detach()
            self.rank = None
            if world > 1:
                torch.distributed.barrier(group=pg)
            try:
                self.rank = rh = self.reattach(resident)
            except BaseException:
                self.closed = True
                raise
        s = dict(s, resident=set(resident), policies=list(sel.policies))
        for key in ("mlayers", "dec_idx", "nondecoder"):
            s.pop(key, None)
        self.model.forward = self.orig_forward
        try:
            _, opt = _attach(self.model, self.base, rh, self.device, self.mhash, s)
        except BaseException:
            # The model has given up its weights: it stays behind the wrapper, which refuses.
            self.closed = True
            self.model.forward = self.wrapper
            with contextlib.suppress(SlideDPError):  # a dead hostd: the first error is the one
                rh.detach()
            raise
        rt = opt._rt
        rt.auto = AutoValidation(rt, sel, batch, seq)
        rt.auto.after_attach()
        sel.info["attach_s"] = time.perf_counter() - t0
        self.runtime = rt
        if self.optimizer is not None:
            self.optimizer._rt = rt
        if rh.rank == 0:
            table = autopolicy.format_table(sel, batch, seq)
            sys.stderr.write(table + "\n")
            sys.stderr.flush()
            log.info("%s", table)

    def end_step(self):
        raise SlideDPError(9, "opt.step() before the first forward: policy='auto' chooses the "
                              "layout at the first forward, and no step has begun")

    def fetch_state_dict(self):
        """hostd's BF16 parameters as {HF name: CPU tensor} (no step has run on this handle)."""
        from ._runtime import fetch_layer
        out = {}
        for info in self.rank.layers:
            out.update(fetch_layer(self.rank, info.index, info.numel, info.tensors,
                                   self.rank.next_step - 1))
        return out

    def close(self):
        if self.closed:
            return
        self.closed = True
        self.model.forward = self.orig_forward  # never attached: the model has its weights
        if self.rank is not None:
            self.rank.detach()


class AutoValidation:
    """The first training steps under policy="auto": predicted against measured memory, and
    the kinds solved again when they differ (autopolicy.resolve)."""

    def __init__(self, rt, sel, batch, seq):
        self.rt = rt
        self.sel = sel
        self.batch, self.seq = batch, seq
        self.cuda = rt.s["device"].type == "cuda"
        self.steps = 0
        self.done = not self.cuda or sel.costs is None  # no costs: the fallback layout
        self.base_alloc = 0
        self.history = []

    def _avail(self):
        from . import preflight
        free = preflight.free_device_bytes(self.rt.s["device"])
        avail = free * autopolicy.FREE_MARGIN
        budget = self.rt.s.get("memory_budget")
        return min(avail, float(budget)) if budget is not None else avail

    def _predicted(self, policies):
        sel = self.sel
        mem = sum(sel.costs[p]["mem"] for p in policies if not p.resident)
        return (mem + sel.transient) * sel.mem_scale

    def _apply(self, new, why):
        old = _policy.format_layout(self.rt.s["policies"])
        self.rt.set_policies(new)
        self.sel.policies = list(new)
        self.sel.resolves += 1
        self.history.append((old, self.sel.layout, why))
        log.info("AutoPolicy: %s -> %s (%s)", old, self.sel.layout, why)

    def after_attach(self):
        """The window and the resident layers are in place: solve the kinds against what is
        free now."""
        if self.done:
            return
        dev = self.rt.s["device"]
        new = autopolicy.resolve(self.sel, self._avail())
        if new is not None:
            self._apply(new, "solved again against the memory free after attach")
        torch.cuda.reset_peak_memory_stats(dev)
        self.base_alloc = torch.cuda.memory_allocated(dev)

    def after_step(self, stats):
        """Called by end_step with the step's figures."""
        plan = self.sel.info.get("plan")
        if plan is not None:
            stats["policy_predicted_step_s"] = plan["step_s"]
        if self.done:
            return
        dev = self.rt.s["device"]
        self.steps += 1
        peak = torch.cuda.max_memory_allocated(dev) - self.base_alloc
        predicted = self._predicted(self.rt.s["policies"])
        stats["policy_activation_peak_bytes"] = int(peak)
        stats["policy_activation_predicted_bytes"] = int(predicted)
        stats["policy_peak_reserved_bytes"] = int(torch.cuda.max_memory_reserved(dev))
        if predicted > 0 and peak > 0:
            # Down by at most 15% a step: a smaller prediction lets the next solve keep more,
            # and the next step measures again before it goes further.
            self.sel.mem_scale *= max(0.85, peak / predicted)
        new = autopolicy.resolve(self.sel, self._avail()) \
            if self.sel.resolves < autopolicy.MAX_RESOLVES else None
        if new is not None:
            self._apply(new, f"step {stats['step']}: activations peaked at "
                             f"{peak / 2 ** 30:.2f} GiB, predicted {predicted / 2 ** 30:.2f} GiB")
            torch.cuda.reset_peak_memory_stats(dev)
            self.base_alloc = torch.cuda.memory_allocated(dev)
        else:
            self.done = self.steps >= 1
            self.sel.validated = True
