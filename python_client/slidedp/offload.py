"""Activation offload: saved activations of chosen decoder layers go to host memory during forward
and come back for backward, one layer ahead (attach(..., offload_ratio=r)).

The runtime (hf.StreamedRuntime) calls
  begin_forward()      at each forward with gradients (the per-layer records start afresh);
  begin_layer(pos) / end_layer(prev)  around decoder layer pos's forward: while an offloaded
                       layer runs, the tensors autograd saves are offloaded (pack);
  pack(t, skip) / unpack(h)  from its saved-tensor hooks (skip: storage pointers never offloaded,
                       the layer's parameters);
  watch(out, pos)      on a decoder layer's output: when backward reaches layer pos (the gradient of
                       its output is ready), layer pos's saved tensors must be on the device and
                       layer pos-1's are prefetched (reach);
  step_stats()         at opt.step().

CUDA: pack enqueues the D2H into a pinned host buffer on a side stream (after the compute stream's
work so far; the source's memory is kept from reuse by record_stream), prefetch enqueues the H2D
into a fresh device tensor on the same stream and records one event per layer, unpack makes the
compute stream wait for that event. D2H and H2D share the side stream, so a host buffer given back
to the pool (when autograd drops the saved tensor) is only written again after every copy that
read or wrote it before. CPU: the same path with plain synchronous copies (tests).

Host buffers come from a pool keyed by size: the first step allocates them, later steps of the
same shapes reuse them (activation_offload_pool_bytes says how much is held).
"""
import collections
import threading
import time
import weakref

import torch

from .policy import spread  # noqa: F401 (re-exported: attach and tests choose layers so)


def _dense(t):
    """Non-overlapping and dense: some order of the dimensions is contiguous (transposes and
    permutes of a contiguous tensor are; slices of an inner dimension and expands are not)."""
    expect = 1
    for stride, size in sorted((st, s) for s, st in zip(t.shape, t.stride()) if s != 1):
        if stride != expect:
            return False
        expect *= size
    return True


class _Batch:
    """The H2D copies of one prefetch (a layer's saved tensors, or one tensor unpacked without a
    prefetch): one event on the side stream; the compute stream waits for it once."""
    __slots__ = ("event", "waited")

    def __init__(self, event):
        self.event, self.waited = event, False


class OffloadedTensor:
    """A saved tensor held in a host buffer. Autograd keeps it until the saved tensor is no longer
    needed; then the buffer returns to the pool and the device copy (if prefetched) is freed."""
    __slots__ = ("owner", "buf", "host", "shape", "stride", "dtype", "version", "dev", "batch",
                 "__weakref__")

    def __init__(self, owner, buf, host, t):
        self.owner, self.buf, self.host = owner, buf, host
        self.shape, self.stride, self.dtype = tuple(t.shape), t.stride(), t.dtype
        self.version = t._version
        self.dev = None  # the tensor back on the compute device (prefetched or unpacked)
        self.batch = None

    def __del__(self):
        try:
            self.owner._give(self.buf)
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


class ActivationOffload:
    def __init__(self, device, positions, min_bytes=64 << 10, time_waits=True):
        """positions: the decoder positions (forward order) that offload, as {pos: ratio} (the
        fraction of the layer's saved bytes moved, tensor by tensor) or an iterable (ratio 1)."""
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())  # as tensors say
        self.cuda = self.device.type == "cuda"
        ratios = dict(positions) if isinstance(positions, dict) else dict.fromkeys(positions, 1.0)
        self.ratios = {pos: float(r) for pos, r in ratios.items() if r > 0}
        self.positions = frozenset(self.ratios)  # decoder positions (forward order) offloaded
        self.seen_bytes = self.moved_bytes = 0  # the running layer's eligible and moved bytes
        self.min_bytes = int(min_bytes)
        self.time_waits = time_waits
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.lock = threading.Lock()
        self.pool = collections.defaultdict(list)  # nbytes -> [uint8 host buffer]
        self.pool_bytes = 0
        self.cur = None  # the offloaded layer whose forward runs (decoder position)
        self.dedup = {}  # one copy of a tensor saved by several nodes of the same layer
        self.records = {}  # pos -> [weakref to OffloadedTensor] not yet prefetched
        self.d2h_bytes = self.h2d_bytes = 0
        self.misses = 0  # tensors unpacked before their prefetch was issued
        self.wait_s = 0.0
        self.wait_events = []

    # ---- host buffers ----
    def _take(self, nbytes):
        with self.lock:
            free = self.pool.get(nbytes)
            if free:
                return free.pop()
            self.pool_bytes += nbytes
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.cuda)

    def _give(self, buf):
        with self.lock:
            self.pool[buf.numel()].append(buf)

    # ---- forward ----
    def begin_forward(self):
        self.records.clear()
        self.dedup.clear()

    def begin_layer(self, pos):
        prev = self.cur
        self.cur = pos if pos in self.positions else None
        self.seen_bytes = self.moved_bytes = 0
        return prev

    def end_layer(self, prev):
        self.cur = prev
        self.dedup.clear()

    def pack(self, t, skip=()):
        pos = self.cur
        if pos is None:
            return t
        try:
            if t.layout != torch.strided or t.device != self.device:
                return t
            nbytes = t.numel() * t.element_size()
            if nbytes == 0 or nbytes < self.min_bytes or isinstance(t, torch.nn.Parameter):
                return t
            sp = t.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):  # tensors without a plain storage
            return t
        if sp in skip or not _dense(t):
            return t  # the layer's parameters; views that are not dense (slices, expands)
        key = (sp, t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        hit = self.dedup.get(key)
        if hit is not None:
            src, handle = hit[0](), hit[1]()
            if src is t and handle is not None and handle.version == t._version:
                return handle
        # A fraction r of the layer's bytes, tensor by tensor in the order autograd saves them:
        # a tensor moves when the bytes moved, with half of it, stay within r of those seen
        # (r=1: all; r=0.5 of one tensor: it moves; of two equal ones: the second).
        self.seen_bytes += nbytes
        r = self.ratios[pos]
        if r < 1.0 and self.moved_bytes + nbytes / 2 > r * self.seen_bytes:
            return t
        self.moved_bytes += nbytes
        buf = self._take(nbytes)
        # The host copy keeps the source's strides (the storage span of a dense tensor is its
        # size): backward computes on the same layout, so the results are the same bits.
        host = buf.view(t.dtype).as_strided(t.shape, t.stride(), 0)
        with torch.no_grad():
            if self.cuda:
                self.stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(self.stream):
                    host.copy_(t, non_blocking=True)
                t.record_stream(self.stream)  # no reuse of t's memory before the copy is done
            else:
                host.copy_(t)
        h = OffloadedTensor(self, buf, host, t)
        self.d2h_bytes += nbytes
        self.records.setdefault(pos, []).append(weakref.ref(h))
        self.dedup[key] = (weakref.ref(t), weakref.ref(h))
        return h

    # ---- backward ----
    def _h2d(self, handles):
        t0 = time.perf_counter()
        with torch.no_grad():
            if self.cuda:
                with torch.cuda.stream(self.stream):
                    for h in handles:
                        d = torch.empty_strided(h.shape, h.stride, dtype=h.dtype,
                                                device=self.device)
                        d.copy_(h.host, non_blocking=True)
                        h.dev = d
                    batch = _Batch(self.stream.record_event())
            else:
                for h in handles:
                    d = torch.empty_strided(h.shape, h.stride, dtype=h.dtype)
                    d.copy_(h.host)
                    h.dev = d
                batch = _Batch(None)
                self.wait_s += time.perf_counter() - t0  # backward waits for host copies
        for h in handles:
            self.h2d_bytes += h.buf.numel()
            h.batch = batch

    def prefetch(self, pos):
        rec = self.records.pop(pos, None)
        if rec:
            handles = [h for h in (r() for r in rec) if h is not None and h.dev is None]
            if handles:
                self._h2d(handles)

    def reach(self, pos):
        """Backward is at decoder layer `pos` (len(decoders) for the head): its saved tensors must
        be back, and the layer before it is prefetched."""
        self.prefetch(pos)
        self.prefetch(pos - 1)

    def watch(self, out, pos):
        t = out if isinstance(out, torch.Tensor) else next(
            (x for x in (out if isinstance(out, (tuple, list)) else ())
             if isinstance(x, torch.Tensor)), None)
        if t is not None and t.requires_grad:
            ref = weakref.ref(self)

            def hook(grad, pos=pos):
                o = ref()
                if o is not None:
                    o.reach(pos)
            t.register_hook(hook)

    def unpack(self, h):
        if h.dev is None:
            self.misses += 1
            self._h2d([h])
        d = h.dev
        if self.cuda:
            s = torch.cuda.current_stream(self.device)
            b = h.batch
            if not b.waited:
                if self.time_waits:
                    e0 = torch.cuda.Event(enable_timing=True)
                    e1 = torch.cuda.Event(enable_timing=True)
                    e0.record(s)
                    s.wait_event(b.event)
                    e1.record(s)
                    self.wait_events.append((e0, e1))
                else:
                    s.wait_event(b.event)
                b.waited = True
            # d was allocated on the side stream: its memory is not reused before the compute
            # stream's work on it is done.
            d.record_stream(s)
        return d

    def step_stats(self):
        wait = self.wait_s
        for e0, e1 in self.wait_events:
            e1.synchronize()
            wait += e0.elapsed_time(e1) / 1e3
        out = {"activation_offload_bytes": self.d2h_bytes,
               "activation_prefetch_bytes": self.h2d_bytes,
               "activation_prefetch_wait_s": wait,
               "activation_prefetch_misses": self.misses,
               "activation_offload_pool_bytes": self.pool_bytes}
        self.d2h_bytes = self.h2d_bytes = self.misses = 0
        self.wait_s = 0.0
        self.wait_events = []
        return out
