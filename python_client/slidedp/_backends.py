"""Where a layer's parameters come from and its gradient goes: the backends of slidedp.hf.

_CpuBackend: host copies through the rank's fetch / push (CPU training, tests).
_CpuWindowBackend: the GPU window's discipline (slots, release) on the host (cpu_window=True).
_GpuBackend: the GPU data plane (rank.GpuPlane): window slots filled by H2D on the plane's
  stream, gradients pushed from device memory.
Each is owned by one StreamedRuntime and used from the training thread.
"""
import collections

import torch

from ._lib import DTYPE_BF16, DTYPE_FP32, SlideDPError
from .rank import GpuPlane

_TORCH_DTYPE = {DTYPE_FP32: torch.float32, DTYPE_BF16: torch.bfloat16}


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
