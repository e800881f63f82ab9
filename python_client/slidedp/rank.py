"""Thin object wrappers over the C ABI: a rank's attachment to hostd (RankHandle) and its GPU data
plane (GpuPlane). Everything that fails raises SlideDPError with hostd's status code and message."""
import ctypes
import json

from . import _lib
from ._lib import SlideDPError, check

FOREVER_MS = 0xFFFFFFFF


def manifest_hash(config_json, lib=None):
    """The manifest hash hostd computes for an HF config.json text."""
    lib = lib or _lib.load()
    out = ctypes.create_string_buffer(17)
    check(lib, lib.slidedp_manifest_hash_from_hf_config(config_json.encode(), out, 17),
          "manifest hash of the model's config")
    return out.value.decode()


class TensorInfo:
    __slots__ = ("name", "offset", "numel", "shape")

    def __init__(self, name, offset, numel, shape):
        self.name, self.offset, self.numel, self.shape = name, offset, numel, shape

    def __repr__(self):
        return f"TensorInfo({self.name}, offset={self.offset}, shape={self.shape})"


class LayerInfo:
    __slots__ = ("index", "name", "numel", "tensors")

    def __init__(self, index, name, numel, tensors):
        self.index, self.name, self.numel, self.tensors = index, name, numel, tensors


def manifest_layers(config_json, lib=None):
    """hostd's layers for an HF config (JSON text): [{"name", "kind"}], index = position."""
    lib = lib or _lib.load()
    buf = ctypes.create_string_buffer(1 << 20)
    check(lib, lib.slidedp_manifest_layers_from_hf_config(config_json.encode(), buf, len(buf)),
          "the model's layers")
    return json.loads(buf.value.decode())


class RankHandle:
    """One rank attached to hostd's job (slidedp_rank_attach)."""

    def __init__(self, socket, rank, manifest_hash, gpu=-1, job_id="", timeout_ms=30000, lib=None,
                 client_updated_layers=()):
        if socket.startswith("unix://"):
            socket = socket[len("unix://"):]
        elif socket.startswith("unix:"):
            socket = socket[len("unix:"):]
        self.lib = lib or _lib.load()
        self.socket = socket
        cul = sorted(int(l) for l in client_updated_layers)
        cul_arr = (ctypes.c_uint32 * max(1, len(cul)))(*cul)
        opts = _lib.RankOptions(_lib.ABI_VERSION, socket.encode(), job_id.encode(), rank,
                                manifest_hash.encode(), gpu, timeout_ms, cul_arr, len(cul))
        h = ctypes.c_void_p()
        check(self.lib, self.lib.slidedp_rank_attach(ctypes.byref(opts), ctypes.byref(h)),
              f"attaching rank {rank} to hostd at {socket}")
        self.h = h
        self.rank = rank
        self.num_layers = self._u32(self.lib.slidedp_rank_num_layers)
        self.world_size = self._u32(self.lib.slidedp_rank_world_size)
        v = ctypes.c_int()
        check(self.lib, self.lib.slidedp_rank_grad_dtype(self.h, ctypes.byref(v)), "grad dtype")
        self.grad_dtype = _lib.DType(v.value)
        check(self.lib, self.lib.slidedp_rank_grad_route(self.h, ctypes.byref(v)), "grad route")
        self.grad_route = {1: "cpu_reduction", 2: "gpu_reduction", 3: "reduce_scatter"}[v.value]
        s = ctypes.c_uint64()
        check(self.lib, self.lib.slidedp_rank_next_step(self.h, ctypes.byref(s)), "next step")
        self.next_step = s.value
        self.layers = [self._layer(i) for i in range(self.num_layers)]

    def optimizer(self, step):
        """hostd's optimizer settings with the LR of update `step` (a dict; see
        slidedp_rank_optimizer_json)."""
        buf = ctypes.create_string_buffer(1 << 20)
        check(self.lib, self.lib.slidedp_rank_optimizer_json(self.h, step, buf, len(buf)),
              "optimizer settings")
        return json.loads(buf.value.decode())

    def _u32(self, fn):
        v = ctypes.c_uint32()
        check(self.lib, fn(self.h, ctypes.byref(v)), fn.__name__)
        return v.value

    def _layer(self, i):
        name = ctypes.create_string_buffer(512)
        nt = ctypes.c_uint32()
        check(self.lib, self.lib.slidedp_rank_layer_info(self.h, i, name, 512, ctypes.byref(nt)),
              f"layer {i} info")
        numel = ctypes.c_uint64()
        check(self.lib, self.lib.slidedp_rank_layer_numel(self.h, i, ctypes.byref(numel)),
              f"layer {i} numel")
        tensors = []
        for t in range(nt.value):
            tname = ctypes.create_string_buffer(512)
            off, n = ctypes.c_uint64(), ctypes.c_uint64()
            shape = (ctypes.c_int64 * 8)()
            nd = ctypes.c_uint32()
            check(self.lib, self.lib.slidedp_rank_layer_tensor(
                self.h, i, t, tname, 512, ctypes.byref(off), ctypes.byref(n), shape, 8,
                ctypes.byref(nd)), f"layer {i} tensor {t}")
            tensors.append(TensorInfo(tname.value.decode(), off.value, n.value,
                                      tuple(shape[d] for d in range(nd.value))))
        return LayerInfo(i, name.value.decode(), numel.value, tensors)

    def begin_step(self, step, timeout_ms=FOREVER_MS):
        check(self.lib, self.lib.slidedp_rank_begin_step(self.h, step, timeout_ms),
              f"beginning step {step}")

    def fetch_params(self, layer, version, dst_ptr, nbytes, timeout_ms=FOREVER_MS):
        got = ctypes.c_uint64()
        check(self.lib, self.lib.slidedp_rank_fetch_params(self.h, layer, version, dst_ptr, nbytes,
                                                           timeout_ms, ctypes.byref(got)),
              f"fetching layer {layer} version {version}")
        return got.value

    def push_grad(self, step, layer, ptr, dtype, nbytes, timeout_ms=FOREVER_MS):
        check(self.lib, self.lib.slidedp_rank_push_grad(self.h, step, layer, ptr, dtype, nbytes,
                                                        timeout_ms),
              f"pushing the gradient of layer {layer} for step {step}")

    def wait_step(self, step, timeout_ms=FOREVER_MS):
        check(self.lib, self.lib.slidedp_rank_wait_step(self.h, step, timeout_ms),
              f"waiting for step {step}")

    # ---- layers the ranks update themselves (client_updated_layers) ----
    def client_sync_step(self):
        """The version hostd asks rank 0 to upload the client-updated layers at (0: none)."""
        v = ctypes.c_uint64()
        check(self.lib, self.lib.slidedp_rank_client_sync_step(self.h, ctypes.byref(v)),
              "client sync step")
        return v.value

    def client_layers_current(self):
        """hostd's copy of the client-updated layers was the job's state at attach."""
        v = ctypes.c_int()
        check(self.lib, self.lib.slidedp_rank_client_layers_current(self.h, ctypes.byref(v)),
              "client layers current")
        return bool(v.value)

    def upload_client_layer(self, step, layer, part, offset, ptr, count):
        """FP32 host memory at ptr: `count` elements of part (0 master, 1 m, 2 v) from offset.
        True once hostd holds every client-updated layer at `step`."""
        done = ctypes.c_int()
        check(self.lib, self.lib.slidedp_rank_upload_client_layer(
            self.h, step, layer, part, offset, ptr, count, ctypes.byref(done)),
            f"uploading layer {layer} (part {part}) at version {step}")
        return bool(done.value)

    def read_client_layer(self, layer, part, offset, ptr, count):
        version = ctypes.c_uint64()
        check(self.lib, self.lib.slidedp_rank_read_client_layer(
            self.h, layer, part, offset, ptr, count, ctypes.byref(version)),
            f"reading hostd's copy of layer {layer} (part {part})")
        return version.value

    def detach(self):
        if self.h:
            h, self.h = self.h, None
            check(self.lib, self.lib.slidedp_rank_detach(h), "detaching")


class GpuPlane:
    """The rank's GPU data plane (rankclient/gpu_plane.h) through the C ABI. Streams are passed as
    raw cudaStream_t values (torch.cuda.Stream.cuda_stream)."""

    def __init__(self, rank, device, window_slots=0, h2d_chunk_bytes=0, param_route="replicated",
                 reduce_in_fp32=True, nccl_comm=None, staging_buffers=0):
        self.lib, self.rank = rank.lib, rank
        if not self.lib.slidedp_rank_has_gpu():
            raise SlideDPError(12, "this libslidedp_rank was built without CUDA; use a CUDA build "
                                   "or device='cpu'")
        routes = {"replicated": 1, "sharded": 2}
        if param_route not in routes:
            raise SlideDPError(3, f"param_route: {param_route!r}, expected 'replicated' or "
                                  "'sharded'")
        opts = _lib.GpuPlaneOptions(_lib.ABI_VERSION, device, window_slots, h2d_chunk_bytes,
                                    routes[param_route], 1 if reduce_in_fp32 else 0, nccl_comm,
                                    staging_buffers)
        p = ctypes.c_void_p()
        check(self.lib, self.lib.slidedp_gpu_plane_create(rank.h, ctypes.byref(opts),
                                                          ctypes.byref(p)),
              f"creating the GPU data plane on cuda:{device}")
        self.p = p
        st = self.stats()
        self.window_slots, self.slot_elems = st["window_slots"], st["slot_elems"]

    def begin_step(self, step, timeout_ms=FOREVER_MS):
        check(self.lib, self.lib.slidedp_gpu_begin_step(self.p, step, timeout_ms),
              f"beginning step {step}")

    def fetch(self, layer, version, timeout_ms=FOREVER_MS):
        slot, data, numel = ctypes.c_uint32(), ctypes.c_void_p(), ctypes.c_uint64()
        check(self.lib, self.lib.slidedp_gpu_fetch(self.p, layer, version, timeout_ms,
                                                   ctypes.byref(slot), ctypes.byref(data),
                                                   ctypes.byref(numel)),
              f"fetching layer {layer} version {version}")
        return slot.value, data.value, numel.value

    def wait_slot(self, slot, stream):
        check(self.lib, self.lib.slidedp_gpu_wait_slot(self.p, slot, stream), f"slot {slot}")

    def release_slot(self, slot, stream):
        check(self.lib, self.lib.slidedp_gpu_release_slot(self.p, slot, stream),
              f"releasing slot {slot}")

    def push_grad(self, step, layer, ptr, dtype, stream, timeout_ms=FOREVER_MS):
        check(self.lib, self.lib.slidedp_gpu_push_grad(self.p, step, layer, ptr, dtype, stream,
                                                       timeout_ms),
              f"pushing the gradient of layer {layer} for step {step}")

    def wait_grad_consumed(self, layer, stream):
        check(self.lib, self.lib.slidedp_gpu_wait_grad_consumed(self.p, layer, stream),
              f"layer {layer} gradient")

    def wait_pushes(self, timeout_ms=FOREVER_MS):
        check(self.lib, self.lib.slidedp_gpu_wait_pushes(self.p, timeout_ms), "gradient pushes")

    def stats(self):
        s = _lib.GpuPlaneStats()
        check(self.lib, self.lib.slidedp_gpu_stats(self.p, ctypes.byref(s)), "plane stats")
        return {name: getattr(s, name) for name, _ in s._fields_}

    def destroy(self):
        if self.p:
            p, self.p = self.p, None
            check(self.lib, self.lib.slidedp_gpu_plane_destroy(p), "destroying the GPU plane")
