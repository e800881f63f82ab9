"""ctypes bindings of rankclient's C ABI (rankclient/slidedp_rank.h).

The library is found, in order: the SLIDEDP_RANK_LIB environment variable; slidedp/lib/ inside
this package (wheels and bundles put it there); the bundle's lib/ and the build trees next to this
source tree (build*/rankclient/); the dynamic loader's search path.
"""
import ctypes
import ctypes.util
import enum
import glob
import os
import threading

ABI_VERSION = 2


class DType(enum.IntEnum):
    """A gradient's element type: SLIDEDP_DTYPE_* of the C ABI (the shared-memory DType)."""
    FP32 = 1
    BF16 = 2


DTYPE_FP32, DTYPE_BF16 = DType.FP32, DType.BF16

STATUS_NAMES = {
    0: "OK", 1: "CANCELLED", 2: "UNKNOWN", 3: "INVALID_ARGUMENT", 4: "DEADLINE_EXCEEDED",
    5: "NOT_FOUND", 6: "ALREADY_EXISTS", 7: "PERMISSION_DENIED", 8: "RESOURCE_EXHAUSTED",
    9: "FAILED_PRECONDITION", 10: "ABORTED", 11: "OUT_OF_RANGE", 12: "UNIMPLEMENTED",
    13: "INTERNAL", 14: "UNAVAILABLE", 15: "DATA_LOSS", 16: "UNAUTHENTICATED",
}


class SlideDPError(RuntimeError):
    """An error from hostd, rankclient or the client's own checks. `code` is the absl/gRPC status
    code (0 for errors the Python side raises before calling into the library), `status` its name."""

    def __init__(self, code, message):
        self.code = code
        self.message = message
        self.status = STATUS_NAMES.get(code, str(code))
        super().__init__(f"{self.status}: {message}" if code else message)


class RankOptions(ctypes.Structure):
    _fields_ = [("abi_version", ctypes.c_uint32), ("socket", ctypes.c_char_p),
                ("job_id", ctypes.c_char_p), ("rank", ctypes.c_uint32),
                ("manifest_hash", ctypes.c_char_p), ("gpu", ctypes.c_int32),
                ("timeout_ms", ctypes.c_uint32),
                ("client_updated_layers", ctypes.POINTER(ctypes.c_uint32)),
                ("num_client_updated_layers", ctypes.c_uint32)]


class GpuPlaneOptions(ctypes.Structure):
    _fields_ = [("abi_version", ctypes.c_uint32), ("device", ctypes.c_int32),
                ("window_slots", ctypes.c_uint32), ("h2d_chunk_bytes", ctypes.c_uint64),
                ("param_route", ctypes.c_int32), ("reduce_in_fp32", ctypes.c_int32),
                ("nccl_comm", ctypes.c_void_p),
                ("staging_buffers", ctypes.c_uint32)]


class GpuPlaneStats(ctypes.Structure):
    _fields_ = [("h2d_bytes", ctypes.c_uint64), ("d2h_bytes", ctypes.c_uint64),
                ("chunks_pushed", ctypes.c_uint64), ("layers_fetched", ctypes.c_uint64),
                ("register_seconds", ctypes.c_double), ("nccl_init_seconds", ctypes.c_double),
                ("copier_wait_seconds", ctypes.c_double), ("window_slots", ctypes.c_uint32),
                ("slot_elems", ctypes.c_uint64)]


_P = ctypes.c_void_p
_U32, _U64, _I32, _SZ = ctypes.c_uint32, ctypes.c_uint64, ctypes.c_int32, ctypes.c_size_t
_PROTOS = {
    "slidedp_rank_abi_version": ([], ctypes.c_int),
    "slidedp_rank_last_error": ([], ctypes.c_char_p),
    "slidedp_clip_scale": ([ctypes.c_double, ctypes.c_double, ctypes.POINTER(ctypes.c_int),
                            ctypes.POINTER(ctypes.c_double)], ctypes.c_int),
    "slidedp_manifest_hash_from_hf_config": ([ctypes.c_char_p, ctypes.c_char_p, _SZ], ctypes.c_int),
    "slidedp_manifest_layers_from_hf_config": ([ctypes.c_char_p, ctypes.c_char_p, _SZ],
                                               ctypes.c_int),
    "slidedp_rank_attach": ([ctypes.POINTER(RankOptions), ctypes.POINTER(_P)], ctypes.c_int),
    "slidedp_rank_detach": ([_P], ctypes.c_int),
    "slidedp_rank_num_layers": ([_P, ctypes.POINTER(_U32)], ctypes.c_int),
    "slidedp_rank_world_size": ([_P, ctypes.POINTER(_U32)], ctypes.c_int),
    "slidedp_rank_layer_numel": ([_P, _U32, ctypes.POINTER(_U64)], ctypes.c_int),
    "slidedp_rank_layer_info": ([_P, _U32, ctypes.c_char_p, _SZ, ctypes.POINTER(_U32)],
                                ctypes.c_int),
    "slidedp_rank_layer_tensor": ([_P, _U32, _U32, ctypes.c_char_p, _SZ, ctypes.POINTER(_U64),
                                   ctypes.POINTER(_U64), ctypes.POINTER(ctypes.c_int64), _U32,
                                   ctypes.POINTER(_U32)], ctypes.c_int),
    "slidedp_rank_grad_dtype": ([_P, ctypes.POINTER(ctypes.c_int)], ctypes.c_int),
    "slidedp_rank_grad_route": ([_P, ctypes.POINTER(ctypes.c_int)], ctypes.c_int),
    "slidedp_rank_next_step": ([_P, ctypes.POINTER(_U64)], ctypes.c_int),
    "slidedp_rank_client_layer_view": ([_P, _U32, ctypes.POINTER(ctypes.c_void_p),
                                        ctypes.POINTER(_U64)], ctypes.c_int),
    "slidedp_rank_client_sync_step": ([_P, ctypes.POINTER(_U64)], ctypes.c_int),
    "slidedp_rank_client_layers_current": ([_P, ctypes.POINTER(ctypes.c_int)], ctypes.c_int),
    "slidedp_rank_upload_client_layer": ([_P, _U64, _U32, _U32, _U64, _P, _U64,
                                          ctypes.POINTER(ctypes.c_int)], ctypes.c_int),
    "slidedp_rank_read_client_layer": ([_P, _U32, _U32, _U64, _P, _U64, ctypes.POINTER(_U64)],
                                       ctypes.c_int),
    "slidedp_rank_optimizer_json": ([_P, _U64, ctypes.c_char_p, ctypes.c_size_t], ctypes.c_int),
    "slidedp_rank_begin_step": ([_P, _U64, _U32], ctypes.c_int),
    "slidedp_rank_fetch_params": ([_P, _U32, _U64, _P, _SZ, _U32, ctypes.POINTER(_U64)],
                                  ctypes.c_int),
    "slidedp_rank_push_grad": ([_P, _U64, _U32, _P, ctypes.c_int, _SZ, _U32], ctypes.c_int),
    "slidedp_rank_wait_step": ([_P, _U64, _U32], ctypes.c_int),
    "slidedp_rank_has_gpu": ([], ctypes.c_int),
    "slidedp_gpu_plane_create": ([_P, ctypes.POINTER(GpuPlaneOptions), ctypes.POINTER(_P)],
                                 ctypes.c_int),
    "slidedp_gpu_plane_destroy": ([_P], ctypes.c_int),
    "slidedp_gpu_begin_step": ([_P, _U64, _U32], ctypes.c_int),
    "slidedp_gpu_fetch": ([_P, _U32, _U64, _U32, ctypes.POINTER(_U32), ctypes.POINTER(_P),
                           ctypes.POINTER(_U64)], ctypes.c_int),
    "slidedp_gpu_wait_slot": ([_P, _U32, _P], ctypes.c_int),
    "slidedp_gpu_release_slot": ([_P, _U32, _P], ctypes.c_int),
    "slidedp_gpu_push_grad": ([_P, _U64, _U32, _P, ctypes.c_int, _P, _U32], ctypes.c_int),
    "slidedp_gpu_wait_grad_consumed": ([_P, _U32, _P], ctypes.c_int),
    "slidedp_gpu_wait_pushes": ([_P, _U32], ctypes.c_int),
    "slidedp_gpu_stats": ([_P, ctypes.POINTER(GpuPlaneStats)], ctypes.c_int),
}

_lock = threading.Lock()
_loaded = {}


def _candidates():
    env = os.environ.get("SLIDEDP_RANK_LIB")
    if env:
        yield env
        return
    here = os.path.dirname(os.path.abspath(__file__))
    yield os.path.join(here, "lib", "libslidedp_rank.so")
    root = os.path.dirname(os.path.dirname(here))  # the source tree or the bundle
    yield os.path.join(root, "lib", "libslidedp_rank.so")
    for d in ["build"] + sorted(glob.glob(os.path.join(root, "build*"))):
        yield os.path.join(root, d, "rankclient", "libslidedp_rank.so")
    found = ctypes.util.find_library("slidedp_rank")
    if found:
        yield found


def load(path=None):
    """Loads (once per path) and returns the library with its prototypes set."""
    with _lock:
        tried = []
        for cand in ([path] if path else _candidates()):
            if cand in _loaded:
                return _loaded[cand]
            if not (os.path.isabs(cand) and not os.path.exists(cand)):
                try:
                    lib = ctypes.CDLL(cand)
                except OSError as e:
                    tried.append(f"{cand}: {e}")
                    continue
                for name, (args, res) in _PROTOS.items():
                    fn = getattr(lib, name)
                    fn.argtypes, fn.restype = args, res
                if lib.slidedp_rank_abi_version() != ABI_VERSION:
                    raise SlideDPError(9, f"{cand} has C ABI version "
                                          f"{lib.slidedp_rank_abi_version()}; this package needs "
                                          f"{ABI_VERSION}")
                _loaded[cand] = lib
                return lib
            tried.append(f"{cand}: not found")
        raise SlideDPError(5, "libslidedp_rank.so not found; set SLIDEDP_RANK_LIB to its path "
                              "(tried: " + "; ".join(tried) + ")")


def check(lib, rc, what):
    if rc != 0:
        msg = lib.slidedp_rank_last_error()
        raise SlideDPError(rc, f"{what}: {msg.decode() if msg else 'no message'}")


def clip_scale(grad_norm, max_grad_norm, lib=None):
    """hostd's clip / skip rule (slidedp_clip_scale): (skip, scale) for a gradient of norm
    `grad_norm` (NaN/Inf: non-finite) under threshold `max_grad_norm` (<= 0: no clipping)."""
    lib = lib or load()
    skip, scale = ctypes.c_int(), ctypes.c_double()
    check(lib, lib.slidedp_clip_scale(float(grad_norm), float(max_grad_norm), ctypes.byref(skip),
                                      ctypes.byref(scale)), "clip scale")
    return bool(skip.value), scale.value
