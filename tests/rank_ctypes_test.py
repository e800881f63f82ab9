#!/usr/bin/env python3
"""rankclient's C ABI from Python through ctypes (standard library only), against a real hostd.

Usage: rank_ctypes_test.py HOSTD SLIDEDPCTL LIBSLIDEDP_RANK.so

Completes a training step on the built-in tiny model and checks that every bad input through the
ABI (unknown layer, wrong byte size, wrong dtype, a second push of a chunk's layer, a push for a
past or future step, the fetch of a version that cannot come, a wrong manifest hash) returns its
specific status code and leaves hostd's state untouched (per-layer checksums before and after).
"""
import array
import ctypes
import json
import os
import random
import struct
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import HostdProcess, use_python_client  # noqa: E402

use_python_client()
from slidedp import _lib  # noqa: E402
from slidedp._lib import RankOptions as Options  # noqa: E402

HOSTD = SLIDEDPCTL = LIBPATH = None

OK, INVALID_ARGUMENT, NOT_FOUND, ALREADY_EXISTS = 0, 3, 5, 6
UNIMPLEMENTED = 12
FAILED_PRECONDITION, OUT_OF_RANGE, RESOURCE_EXHAUSTED = 9, 11, 8
FP32, BF16 = _lib.DType.FP32, _lib.DType.BF16


def load():
    """The library through slidedp._lib (its prototypes, ABI version check)."""
    return _lib.load(LIBPATH)


def bf16(x):
    bits = struct.unpack("<I", struct.pack("<f", x))[0]
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF


class RankCtypesTest(unittest.TestCase):
    def setUp(self):
        self.lib = load()
        # Stopped with SIGTERM at the end of the test: exit 0, no segment of the instance left.
        self.hostd = self.enterContext(HostdProcess(
            HOSTD, "--model", "tiny", "--chunk_bytes", "4096", "--mlock", "best_effort",
            "--update_threads", "1", tag="ct", slidedpctl=SLIDEDPCTL))
        self.sock = self.hostd.socket

    def layers(self):
        return {l["layer"]: (l["version"], l["checksum"])
                for l in self.hostd.ctl_json("layers", "--checksums")}

    def expect(self, code, rc, needle=None):
        msg = self.lib.slidedp_rank_last_error().decode()
        self.assertEqual(rc, code, msg)
        if needle:
            self.assertIn(needle, msg)

    def attach(self, manifest_hash):
        opts = Options(2, self.sock.encode(), None, 0, manifest_hash, -1, 10000)
        h = ctypes.c_void_p()
        return self.lib.slidedp_rank_attach(ctypes.byref(opts), ctypes.byref(h)), h

    def test_client_updated_layers(self):
        """A rank that updates layers itself: a bad index is refused at attach; its gradient push
        for such a layer is refused naming it; a view of it reads hostd's (untouched) BF16."""
        lib = self.lib
        buf = ctypes.create_string_buffer(17)
        self.assertEqual(lib.slidedp_manifest_hash_from_hf_config(b"tiny", buf, 17), OK)
        bad = (ctypes.c_uint32 * 1)(7)
        opts = Options(2, self.sock.encode(), None, 0, buf.value, -1, 10000, bad, 1)
        h = ctypes.c_void_p()
        self.expect(OUT_OF_RANGE, lib.slidedp_rank_attach(ctypes.byref(opts), ctypes.byref(h)),
                    "client_updated_layers: layer 7 does not exist")
        opts = Options(2, self.sock.encode(), None, 0, buf.value, -1, 10000, None, 2)
        self.expect(INVALID_ARGUMENT, lib.slidedp_rank_attach(ctypes.byref(opts), ctypes.byref(h)),
                    "client_updated_layers: null")
        layers = (ctypes.c_uint32 * 2)(6, 0)
        opts = Options(2, self.sock.encode(), None, 0, buf.value, -1, 10000, layers, 2)
        self.expect(OK, lib.slidedp_rank_attach(ctypes.byref(opts), ctypes.byref(h)))
        numel = ctypes.c_uint64()
        self.expect(OK, lib.slidedp_rank_layer_numel(h, 0, ctypes.byref(numel)))
        ptr, nbytes = ctypes.c_void_p(), ctypes.c_uint64()
        self.expect(OK, lib.slidedp_rank_client_layer_view(h, 0, ctypes.byref(ptr),
                                                           ctypes.byref(nbytes)))
        self.assertEqual(nbytes.value, 2 * numel.value)
        copy = (ctypes.c_uint16 * numel.value)()
        self.expect(OK, lib.slidedp_rank_fetch_params(h, 0, 0, copy, 2 * numel.value, 1000, None))
        self.assertEqual(ctypes.string_at(ptr.value, nbytes.value), bytes(copy))
        self.expect(OK, lib.slidedp_rank_begin_step(h, 1, 10000))
        self.expect(FAILED_PRECONDITION, lib.slidedp_rank_push_grad(
            h, 1, 0, copy, BF16, 2 * numel.value, 1000), "updated by the ranks themselves")
        self.expect(OK, lib.slidedp_rank_detach(h))

    def test_step_and_bad_input(self):
        lib = self.lib
        self.assertEqual(lib.slidedp_rank_abi_version(), 2)
        buf = ctypes.create_string_buffer(17)
        self.assertEqual(lib.slidedp_manifest_hash_from_hf_config(b"tiny", buf, 17), OK)
        good_hash = buf.value

        rc, _ = self.attach(b"0123456789abcdef")
        self.expect(FAILED_PRECONDITION, rc, "manifest_hash")
        opts = Options(7, self.sock.encode(), None, 0, good_hash, -1, 10000)
        h = ctypes.c_void_p()
        self.expect(FAILED_PRECONDITION, lib.slidedp_rank_attach(ctypes.byref(opts),
                                                                  ctypes.byref(h)), "abi_version")
        rc, h = self.attach(good_hash)
        self.expect(OK, rc)
        n = ctypes.c_uint32()
        self.assertEqual(lib.slidedp_rank_num_layers(h, ctypes.byref(n)), OK)
        self.assertEqual(n.value, 7)
        dtype = ctypes.c_int()
        lib.slidedp_rank_grad_dtype(h, ctypes.byref(dtype))
        self.assertEqual(dtype.value, BF16)
        route, nxt = ctypes.c_int(), ctypes.c_uint64()
        self.expect(OK, lib.slidedp_rank_grad_route(h, ctypes.byref(route)))
        self.assertEqual(route.value, 1)  # CPU reduction, hostd's default
        self.expect(OK, lib.slidedp_rank_next_step(h, ctypes.byref(nxt)))
        self.assertEqual(nxt.value, 1)  # a fresh job
        # hostd's optimizer for layers a rank updates itself, the manifest's layer list, and
        # views of client-updated layers only.
        js = ctypes.create_string_buffer(1 << 16)
        self.expect(OK, lib.slidedp_rank_optimizer_json(h, 1, js, len(js)))
        opt = json.loads(js.value.decode())
        self.assertEqual(opt["clip"], "none")
        self.assertGreater(opt["lr"], 0)
        self.assertIn("model.norm.weight", opt["no_decay_tensors"])
        self.assertNotIn("lm_head.weight", opt["no_decay_tensors"])
        self.expect(RESOURCE_EXHAUSTED, lib.slidedp_rank_optimizer_json(h, 1, js, 8), "needs")
        self.expect(OK, lib.slidedp_manifest_layers_from_hf_config(b"tiny", js, len(js)))
        kinds = [l["kind"] for l in json.loads(js.value.decode())]
        self.assertEqual(len(kinds), 7)
        self.assertEqual(kinds[0], "LAYER_KIND_EMBEDDING")
        self.assertEqual(kinds[-1], "LAYER_KIND_LM_HEAD")
        ptr, nbytes = ctypes.c_void_p(), ctypes.c_uint64()
        self.expect(FAILED_PRECONDITION, lib.slidedp_rank_client_layer_view(
            h, 0, ctypes.byref(ptr), ctypes.byref(nbytes)), "updated by hostd")
        self.expect(INVALID_ARGUMENT, lib.slidedp_rank_client_layer_view(h, 0, None, None),
                    "non-null")
        self.expect(INVALID_ARGUMENT, lib.slidedp_rank_grad_route(h, None), "route")
        self.expect(INVALID_ARGUMENT, lib.slidedp_rank_next_step(h, None), "step")
        self.expect(INVALID_ARGUMENT, lib.slidedp_rank_next_step(None, ctypes.byref(nxt)),
                    "handle")
        numel = []
        for l in range(n.value):
            v = ctypes.c_uint64()
            self.assertEqual(lib.slidedp_rank_layer_numel(h, l, ctypes.byref(v)), OK)
            numel.append(v.value)
        self.expect(NOT_FOUND, lib.slidedp_rank_layer_numel(h, 7, ctypes.byref(ctypes.c_uint64())))

        # The per-tensor layout: HF names, contiguous offsets covering each layer, shapes.
        names = []
        for l in range(n.value):
            name = ctypes.create_string_buffer(256)
            count = ctypes.c_uint32()
            self.expect(OK, lib.slidedp_rank_layer_info(h, l, name, 256, ctypes.byref(count)))
            self.assertTrue(name.value.startswith(b"model.") or name.value == b"lm_head", name.value)
            self.assertGreater(count.value, 0)
            offset = 0
            for i in range(count.value):
                tname = ctypes.create_string_buffer(256)
                off, cnt = ctypes.c_uint64(), ctypes.c_uint64()
                shape = (ctypes.c_int64 * 8)()
                nd = ctypes.c_uint32()
                self.expect(OK, lib.slidedp_rank_layer_tensor(h, l, i, tname, 256, ctypes.byref(off),
                                                             ctypes.byref(cnt), shape, 8,
                                                             ctypes.byref(nd)))
                self.assertTrue(tname.value.startswith(name.value + b"."), tname.value)
                self.assertEqual(off.value, offset, tname.value)
                prod = 1
                for d in range(nd.value):
                    prod *= shape[d]
                self.assertEqual(prod, cnt.value, tname.value)
                offset += cnt.value
                names.append(tname.value)
            self.assertEqual(offset, numel[l], f"layer {l}'s tensors cover it")
        self.assertIn(b"model.layers.0.self_attn.q_proj.weight", names)
        self.expect(NOT_FOUND, lib.slidedp_rank_layer_info(h, 7, None, 0, None), "layer")
        self.expect(NOT_FOUND, lib.slidedp_rank_layer_tensor(h, 0, 99, None, 0, None, None, None,
                                                            0, None), "index")
        self.expect(OUT_OF_RANGE, lib.slidedp_rank_layer_info(h, 1, ctypes.create_string_buffer(4),
                                                             4, None), "name_len")
        self.expect(OUT_OF_RANGE, lib.slidedp_rank_layer_tensor(
            h, 1, 0, None, 0, None, None, (ctypes.c_int64 * 1)(), 0, None), "max_dims")

        before = self.layers()
        params = [ctypes.create_string_buffer(2 * k) for k in numel]
        got = ctypes.c_uint64()
        # Before the step begins only the committed version can be fetched, and nothing pushed.
        self.expect(OUT_OF_RANGE, lib.slidedp_rank_fetch_params(h, 0, 1, params[0], 2 * numel[0],
                                                                1000, ctypes.byref(got)))
        self.expect(OK, lib.slidedp_rank_fetch_params(h, 0, 0, params[0], 2 * numel[0], 1000,
                                                      ctypes.byref(got)))
        self.assertEqual(lib.slidedp_rank_begin_step(h, 1, 10000), OK)
        self.expect(OUT_OF_RANGE, lib.slidedp_rank_begin_step(h, 3, 1000), "step")
        for l in range(n.value):
            self.expect(OK, lib.slidedp_rank_fetch_params(h, l, 0, params[l], 2 * numel[l], 10000,
                                                          ctypes.byref(got)))
            self.assertEqual(got.value, 0)
        self.expect(NOT_FOUND, lib.slidedp_rank_fetch_params(h, 9, 0, params[0], 2 * numel[0],
                                                             1000, None), "layer")
        self.expect(INVALID_ARGUMENT, lib.slidedp_rank_fetch_params(h, 0, 0, params[0],
                                                                    2 * numel[0] - 2, 1000, None),
                    "dst_bytes")
        self.expect(OUT_OF_RANGE, lib.slidedp_rank_fetch_params(h, 0, 1, params[0], 2 * numel[0],
                                                                1000, None), "cannot come")

        rng = random.Random(5)
        grads = [array.array("H", (bf16(rng.gauss(0, 1e-2)) for _ in range(k))) for k in numel]
        ptr = lambda a: a.buffer_info()[0]
        last = n.value - 1
        g = grads[last]
        self.expect(INVALID_ARGUMENT, lib.slidedp_rank_push_grad(h, 1, last, ptr(g), FP32,
                                                                 2 * len(g), 1000), "dtype")
        self.expect(INVALID_ARGUMENT, lib.slidedp_rank_push_grad(h, 1, last, ptr(g), BF16,
                                                                 2 * len(g) + 2, 1000), "bytes")
        self.expect(NOT_FOUND, lib.slidedp_rank_push_grad(h, 1, 42, ptr(g), BF16, 2 * len(g),
                                                          1000), "layer")
        self.expect(OUT_OF_RANGE, lib.slidedp_rank_push_grad(h, 2, last, ptr(g), BF16, 2 * len(g),
                                                             1000), "step")
        self.expect(OUT_OF_RANGE, lib.slidedp_rank_push_grad(h, 0, last, ptr(g), BF16, 2 * len(g),
                                                             1000), "step")
        self.assertEqual(self.layers(), before, "bad input changed the state")

        # The GPU plane's calls: a null handle is INVALID_ARGUMENT; creating a plane fails with a
        # specific code where it cannot work (UNIMPLEMENTED without CUDA, FAILED_PRECONDITION
        # naming CUDA without a usable device) and leaves the rank usable.
        vp = ctypes.c_void_p
        lib.slidedp_gpu_wait_pushes.argtypes = [vp, ctypes.c_uint32]
        lib.slidedp_gpu_begin_step.argtypes = [vp, ctypes.c_uint64, ctypes.c_uint32]
        lib.slidedp_gpu_plane_create.argtypes = [vp, vp, ctypes.POINTER(vp)]
        lib.slidedp_gpu_plane_destroy.argtypes = [vp]
        has_gpu = lib.slidedp_rank_has_gpu()
        if has_gpu:
            self.expect(INVALID_ARGUMENT, lib.slidedp_gpu_wait_pushes(None, 10), "plane handle")
            self.expect(INVALID_ARGUMENT, lib.slidedp_gpu_begin_step(None, 1, 10), "plane handle")
            self.expect(INVALID_ARGUMENT, lib.slidedp_gpu_plane_create(h, None, ctypes.byref(vp())),
                        "options")
        popts = (ctypes.c_uint32 * 16)()
        popts[0] = 2  # abi_version; device 0, defaults, replicated, no comm
        plane = vp()
        rc = lib.slidedp_gpu_plane_create(h, ctypes.cast(popts, vp), ctypes.byref(plane))
        if not has_gpu:
            self.expect(UNIMPLEMENTED, rc, "without CUDA")
        elif rc != OK:
            self.expect(FAILED_PRECONDITION, rc, "CUDA")
        else:
            self.expect(OK, lib.slidedp_gpu_plane_destroy(plane))
        self.assertEqual(self.layers(), before, "a failed plane changed the state")

        for l in reversed(range(n.value)):
            g = grads[l]
            self.expect(OK, lib.slidedp_rank_push_grad(h, 1, l, ptr(g), BF16, 2 * len(g), 10000))
        g = grads[0]
        self.expect(ALREADY_EXISTS, lib.slidedp_rank_push_grad(h, 1, 0, ptr(g), BF16, 2 * len(g),
                                                               1000))
        self.expect(OK, lib.slidedp_rank_wait_step(h, 1, 10000))
        after = self.layers()
        for l in range(n.value):
            self.assertEqual(after[l][0], 1)
            self.assertNotEqual(after[l][1], before[l][1], f"layer {l} was not updated")
        # Step 2 sees version 1.
        self.expect(OK, lib.slidedp_rank_begin_step(h, 2, 10000))
        self.expect(OK, lib.slidedp_rank_fetch_params(h, 0, 1, params[0], 2 * numel[0], 10000,
                                                      ctypes.byref(got)))
        self.assertEqual(got.value, 1)
        self.expect(OUT_OF_RANGE, lib.slidedp_rank_fetch_params(h, 0, 0, params[0], 2 * numel[0],
                                                                1000, None), "past")
        self.expect(OK, lib.slidedp_rank_detach(h))


if __name__ == "__main__":
    HOSTD, SLIDEDPCTL, LIBPATH = sys.argv[1:4]
    unittest.main(argv=sys.argv[:1], verbosity=2)
