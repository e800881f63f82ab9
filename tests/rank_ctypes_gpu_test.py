#!/usr/bin/env python3
"""The GPU data plane through the C ABI (slidedp_gpu_*), from Python with ctypes and PyTorch.

Usage: rank_ctypes_gpu_test.py HOSTD SLIDEDPCTL LIBSLIDEDP_RANK.so

Two hostd instances with the built-in tiny model and the same seed: one trained through the C
ABI's GPU plane (torch tensors as device buffers, torch's current stream; GPU-reduction route, so
hostd applies AdamW chunk by chunk), one through the host-memory C ABI (CPU-reduction route,
whole-layer updates), with the same BF16 gradients for 3 steps. Every layer fetched into the GPU
window must equal the host fetch byte for byte, and both hostd instances must end with equal
per-layer checksums of master, m, v and params. Bad input through the GPU calls gets its code.
Exits 77 (skipped) without torch + CUDA or when the library has no GPU plane.
"""
import ctypes
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import HostdProcess, ctl_json, use_python_client  # noqa: E402

use_python_client()
from slidedp import _lib  # noqa: E402
from slidedp._lib import GpuPlaneOptions, RankOptions  # noqa: E402

HOSTD = SLIDEDPCTL = LIBPATH = None
OK, INVALID_ARGUMENT, NOT_FOUND, FAILED_PRECONDITION, OUT_OF_RANGE = 0, 3, 5, 9, 11
BF16 = 2
STEPS = 3


class RankCtypesGpuTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="slidedp-ctgpu-")
        self.hostds = []
        self.lib = _lib.load(LIBPATH)

    def tearDown(self):
        for h in self.hostds:
            h.abort()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def ok(self, rc, what):
        self.assertEqual(rc, OK, f"{what}: {self.lib.slidedp_rank_last_error().decode()}")

    def hostd(self, tag, route):
        h = HostdProcess(
            HOSTD, "--model", "tiny", "--seed", "5", "--mlock", "best_effort", "--grad_route",
            route, "--chunk_bytes", "65536", "--update_threads", "4", tmp=self.tmp,
            instance=f"ctg{os.getpid()}{tag}", socket=os.path.join(self.tmp, f"{tag}.sock"),
            slidedpctl=SLIDEDPCTL, log_name=f"{tag}.log")
        self.hostds.append(h)
        return h.start(), h.socket

    def attach(self, sock):
        h = ctypes.create_string_buffer(17)
        self.ok(self.lib.slidedp_manifest_hash_from_hf_config(b"tiny", h, 17), "hash")
        o = RankOptions(2, sock.encode(), None, 0, h.value, 0, 60000)
        handle = ctypes.c_void_p()
        self.ok(self.lib.slidedp_rank_attach(ctypes.byref(o), ctypes.byref(handle)), "attach")
        return handle

    def checksums(self, sock):
        return [(l["name"], l["version"], l["checksum"])
                for l in ctl_json(SLIDEDPCTL, "layers", "--checksums", socket=sock)]

    def test_gpu_plane_matches_host_path(self):
        import torch
        cudart = ctypes.CDLL("libcudart.so.13")
        lib = self.lib
        hg, sock_g = self.hostd("gpu", "gpu_reduction")
        hc, sock_c = self.hostd("cpu", "cpu_reduction")
        g, c = self.attach(sock_g), self.attach(sock_c)
        n = ctypes.c_uint32()
        self.ok(lib.slidedp_rank_num_layers(g, ctypes.byref(n)), "num_layers")
        layers = n.value
        numel = []
        for l in range(layers):
            v = ctypes.c_uint64()
            self.ok(lib.slidedp_rank_layer_numel(g, l, ctypes.byref(v)), "numel")
            numel.append(v.value)

        po = GpuPlaneOptions(2, 0, 2, 8192, 1, 1, None)
        plane = ctypes.c_void_p()
        self.ok(lib.slidedp_gpu_plane_create(g, ctypes.byref(po), ctypes.byref(plane)), "create")
        stream = torch.cuda.current_stream()
        sp = ctypes.c_void_p(stream.cuda_stream)
        # Bad input through the GPU calls.
        bad = GpuPlaneOptions(2, 0, 2, 8192, 7, 1, None)
        other = ctypes.c_void_p()
        self.assertEqual(lib.slidedp_gpu_plane_create(g, ctypes.byref(bad), ctypes.byref(other)),
                         INVALID_ARGUMENT)
        self.assertIn(b"param_route", lib.slidedp_rank_last_error())
        self.assertEqual(lib.slidedp_gpu_wait_slot(plane, 1, sp), FAILED_PRECONDITION)

        rng = random.Random(11)
        grads = {}
        for t in range(1, STEPS + 1):
            self.ok(lib.slidedp_gpu_begin_step(plane, t, 60000), "gpu begin_step")
            self.ok(lib.slidedp_rank_begin_step(c, t, 60000), "cpu begin_step")
            slot, ptr, cnt = ctypes.c_uint32(), ctypes.c_void_p(), ctypes.c_uint64()
            self.assertEqual(lib.slidedp_gpu_fetch(plane, layers, t - 1, 1000, ctypes.byref(slot),
                                                   ctypes.byref(ptr), ctypes.byref(cnt)),
                             NOT_FOUND)
            self.assertEqual(lib.slidedp_gpu_fetch(plane, 0, t, 1000, ctypes.byref(slot),
                                                   ctypes.byref(ptr), ctypes.byref(cnt)),
                             OUT_OF_RANGE)
            for l in range(layers):
                self.ok(lib.slidedp_gpu_fetch(plane, l, t - 1, 60000, ctypes.byref(slot),
                                              ctypes.byref(ptr), ctypes.byref(cnt)), "fetch")
                self.assertEqual(cnt.value, numel[l])
                self.ok(lib.slidedp_gpu_wait_slot(plane, slot.value, sp), "wait_slot")
                stream.synchronize()
                got = ctypes.create_string_buffer(numel[l] * 2)
                self.assertEqual(cudart.cudaMemcpy(got, ptr, numel[l] * 2, 2), 0)
                self.ok(lib.slidedp_gpu_release_slot(plane, slot.value, sp), "release")
                want = ctypes.create_string_buffer(numel[l] * 2)
                self.ok(lib.slidedp_rank_fetch_params(c, l, t - 1, want, numel[l] * 2, 60000,
                                                      None), "host fetch")
                # Both hostd instances hold the same parameters at every version.
                self.assertEqual(got.raw, want.raw, f"layer {l} step {t}")
            for l in reversed(range(layers)):
                vals = [rng.gauss(0.0, 1e-2) for _ in range(numel[l])]
                gt = torch.tensor(vals, dtype=torch.float32).to(torch.bfloat16).cuda()
                grads[(t, l)] = gt  # stays alive until its push is consumed
                host = gt.view(torch.int16).cpu().numpy().tobytes()
                self.ok(lib.slidedp_gpu_push_grad(plane, t, l, ctypes.c_void_p(gt.data_ptr()),
                                                  BF16, sp, 60000), "gpu push")
                self.ok(lib.slidedp_rank_push_grad(c, t, l, host, BF16, len(host), 60000),
                        "host push")
            self.ok(lib.slidedp_gpu_wait_pushes(plane, 60000), "wait_pushes")
            self.ok(lib.slidedp_rank_wait_step(g, t, 60000), "gpu wait_step")
            self.ok(lib.slidedp_rank_wait_step(c, t, 60000), "cpu wait_step")
        self.ok(lib.slidedp_gpu_plane_destroy(plane), "destroy")
        a, b = self.checksums(sock_g), self.checksums(sock_c)
        self.assertEqual([x[1] for x in a], [STEPS] * layers)
        self.assertEqual(a, b)
        r = subprocess.run([SLIDEDPCTL, "--socket", sock_g, "stats", "--json"],
                           capture_output=True, text=True, timeout=60)
        stats = json.loads(r.stdout)
        print("gpu-route hostd stats:", stats, flush=True)
        self.assertEqual(stats["layer_updates_streamed"], STEPS * layers,
                         "hostd applied the GPU route's gradients chunk by chunk")
        self.ok(lib.slidedp_rank_detach(g), "detach")
        self.ok(lib.slidedp_rank_detach(c), "detach")
        for h in (hg, hc):
            h.finish()  # SIGTERM, exit 0, no segment left


if __name__ == "__main__":
    if len(sys.argv) < 4:
        sys.exit("usage: rank_ctypes_gpu_test.py HOSTD SLIDEDPCTL LIBSLIDEDP_RANK.so")
    HOSTD, SLIDEDPCTL, LIBPATH = sys.argv[1:4]
    try:
        import torch
        have = torch.cuda.is_available()
    except ImportError:
        have = False
    if not have or ctypes.CDLL(LIBPATH).slidedp_rank_has_gpu() != 1:
        print("SKIP: needs torch with CUDA and a libslidedp_rank built with CUDA")
        sys.exit(77)
    unittest.main(argv=[sys.argv[0], "-v"])
