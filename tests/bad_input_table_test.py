#!/usr/bin/env python3
"""The bad-input table (issue #6): every surface a user or a rank process can feed hostd wrong
input through, one row per case with its expected status and a fragment of the message.

Usage: bad_input_table_test.py HOSTD LIBSLIDEDP_RANK.so

Surfaces:
  rpc          slidedp.v1.Control over hostd's unix socket, with grpcio's generic calls and
               requests serialized here by hand (no generated Python code needed); the status is
               the gRPC code.
  c_abi        rankclient's C ABI (rankclient/slidedp_rank.h) through ctypes; the status is the
               code the function returns (absl/gRPC numbering), the message slidedp_rank_last_error.
  config       hostd's configuration (file, environment, flags); hostd exits 2 on a bad key or
               value before anything else happens, 1 when the configuration is valid but the
               machine cannot honour it (the log then names the absl code).
  safetensors  HF checkpoints hostd imports at startup (--model DIR with config.json and weights);
               hostd exits 1 and logs "startup failed: CODE: message".
Each row's result is checked (code and fragment) and the whole table is printed as
`surface | case | expected | got` with per-surface counts, for the issue's tally.
Runs in about 20 s (one hostd for the rpc and c_abi rows, one short-lived hostd per config and
safetensors row).
"""
import ctypes
import json
import os
import signal
import struct
import subprocess
import sys
import tempfile
import time
import unittest

import grpc

HOSTD = LIBPATH = None

CODES = {c.value[0]: c.name for c in grpc.StatusCode}
OK, INVALID_ARGUMENT, DEADLINE_EXCEEDED, NOT_FOUND = 0, 3, 4, 5
ALREADY_EXISTS, PERMISSION_DENIED, RESOURCE_EXHAUSTED, FAILED_PRECONDITION = 6, 7, 8, 9
ABORTED, OUT_OF_RANGE, UNIMPLEMENTED, INTERNAL, UNAVAILABLE = 10, 11, 12, 13, 14
FP32, BF16 = 1, 2

TINY = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 512,
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "hidden_act": "silu",
    "max_position_embeddings": 512, "rms_norm_eps": 1e-06, "rope_theta": 10000.0,
    "attention_bias": False, "tie_word_embeddings": False, "initializer_range": 0.02,
}


# --- protobuf wire format, by hand --------------------------------------------------------------

def varint(v):
    v &= (1 << 64) - 1
    out = b""
    while True:
        b = v & 0x7F
        v >>= 7
        if v:
            out += bytes([b | 0x80])
        else:
            return out + bytes([b])


def pb(*fields):
    """fields: (number, value) with int -> varint, float -> fixed64 double, bytes/str -> bytes."""
    out = b""
    for num, val in fields:
        if isinstance(val, bool) or isinstance(val, int):
            out += varint(num << 3) + varint(int(val))
        elif isinstance(val, float):
            out += varint(num << 3 | 1) + struct.pack("<d", val)
        else:
            raw = val.encode() if isinstance(val, str) else val
            out += varint(num << 3 | 2) + varint(len(raw)) + raw
    return out


# --- safetensors, by hand -------------------------------------------------------------------------

def tiny_tensors():
    h, inter, vocab, hd = 64, 128, 512, 16
    out = [("model.embed_tokens.weight", [vocab, h]), ("model.norm.weight", [h]),
           ("lm_head.weight", [vocab, h])]
    for i in range(4):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", [h]), (p + "post_attention_layernorm.weight", [h]),
                (p + "self_attn.q_proj.weight", [4 * hd, h]),
                (p + "self_attn.k_proj.weight", [2 * hd, h]),
                (p + "self_attn.v_proj.weight", [2 * hd, h]),
                (p + "self_attn.o_proj.weight", [h, 4 * hd]),
                (p + "self_attn.q_norm.weight", [hd]), (p + "self_attn.k_norm.weight", [hd]),
                (p + "mlp.gate_proj.weight", [inter, h]), (p + "mlp.up_proj.weight", [inter, h]),
                (p + "mlp.down_proj.weight", [h, inter])]
    return sorted(out)


def numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def header_entries(tensors, dtype="BF16"):
    entries, off = {}, 0
    for name, shape in tensors:
        n = numel(shape) * (4 if dtype == "F32" else 2)
        entries[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + n]}
        off += n
    return entries, off


def st_bytes(entries, data_len, header_text=None, pad=True):
    text = header_text if header_text is not None else json.dumps(entries).encode()
    if pad:
        text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + bytes(data_len)


class Options(ctypes.Structure):
    _fields_ = [("abi_version", ctypes.c_uint32), ("socket", ctypes.c_char_p),
                ("job_id", ctypes.c_char_p), ("rank", ctypes.c_uint32),
                ("manifest_hash", ctypes.c_char_p), ("gpu", ctypes.c_int32),
                ("timeout_ms", ctypes.c_uint32),
                ("client_updated_layers", ctypes.POINTER(ctypes.c_uint32)),
                ("num_client_updated_layers", ctypes.c_uint32)]


def load_lib():
    lib = ctypes.CDLL(LIBPATH)
    c = ctypes
    lib.slidedp_rank_last_error.restype = c.c_char_p
    lib.slidedp_rank_attach.argtypes = [c.c_void_p, c.c_void_p]
    lib.slidedp_rank_detach.argtypes = [c.c_void_p]
    lib.slidedp_rank_num_layers.argtypes = [c.c_void_p, c.c_void_p]
    lib.slidedp_rank_next_step.argtypes = [c.c_void_p, c.c_void_p]
    lib.slidedp_rank_layer_numel.argtypes = [c.c_void_p, c.c_uint32, c.c_void_p]
    lib.slidedp_rank_layer_info.argtypes = [c.c_void_p, c.c_uint32, c.c_char_p, c.c_size_t,
                                            c.c_void_p]
    lib.slidedp_rank_begin_step.argtypes = [c.c_void_p, c.c_uint64, c.c_uint32]
    lib.slidedp_rank_fetch_params.argtypes = [c.c_void_p, c.c_uint32, c.c_uint64, c.c_void_p,
                                              c.c_size_t, c.c_uint32, c.c_void_p]
    lib.slidedp_rank_push_grad.argtypes = [c.c_void_p, c.c_uint64, c.c_uint32, c.c_void_p,
                                           c.c_int, c.c_size_t, c.c_uint32]
    lib.slidedp_rank_wait_step.argtypes = [c.c_void_p, c.c_uint64, c.c_uint32]
    lib.slidedp_manifest_hash_from_hf_config.argtypes = [c.c_char_p, c.c_char_p, c.c_size_t]
    lib.slidedp_rank_optimizer_json.argtypes = [c.c_void_p, c.c_uint64, c.c_char_p, c.c_size_t]
    lib.slidedp_rank_client_layer_view.argtypes = [c.c_void_p, c.c_uint32, c.c_void_p,
                                                   c.c_void_p]
    return lib


class BadInputTableTest(unittest.TestCase):
    rows = []  # (surface, case, expected, got, ok)

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="slidedp-badinput-")
        cls.sock = os.path.join(cls.tmp, "hostd.sock")
        cls.instance = f"bi{os.getpid()}"
        cls.log = open(os.path.join(cls.tmp, "hostd.log"), "w+")
        cls.hostd = subprocess.Popen(
            [HOSTD, "--model", "tiny", "--world_size", "2", "--socket", cls.sock,
             "--instance", cls.instance, "--chunk_bytes", "4096", "--mlock", "best_effort",
             "--update_threads", "1"], stdout=cls.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 60
        while not os.path.exists(cls.sock):
            if cls.hostd.poll() is not None or time.time() > deadline:
                raise RuntimeError("hostd did not start")
            time.sleep(0.05)
        cls.channel = grpc.insecure_channel("unix:" + cls.sock)
        cls.lib = load_lib()
        buf = ctypes.create_string_buffer(17)
        assert cls.lib.slidedp_manifest_hash_from_hf_config(b"tiny", buf, 17) == OK
        cls.hash = buf.value

    @classmethod
    def tearDownClass(cls):
        cls.channel.close()
        cls.hostd.send_signal(signal.SIGTERM)
        cls.hostd.wait(timeout=30)
        cls.log.close()
        rows = cls.rows
        w1 = max(len(r[1]) for r in rows)
        w2 = max(len(r[2]) for r in rows)
        print("\nsurface     | case" + " " * (w1 - 4) + " | expected" + " " * (w2 - 8) +
              " | got", file=sys.stderr)
        for surface, case, expected, got, ok in rows:
            print(f"{surface:<11} | {case:<{w1}} | {expected:<{w2}} | {got}"
                  f"{'' if ok else '   <-- MISMATCH'}", file=sys.stderr)
        counts = {}
        for r in rows:
            total, passed = counts.get(r[0], (0, 0))
            counts[r[0]] = (total + 1, passed + (1 if r[4] else 0))
        print("counts: " + ", ".join(f"{s} {p}/{t}" for s, (t, p) in counts.items()) +
              f"; total {sum(1 for r in rows if r[4])}/{len(rows)} as expected", file=sys.stderr)

    def record(self, surface, case, expected_code, fragment, got_code, got_msg):
        ok = got_code == expected_code and fragment in got_msg
        exp = f"{expected_code} '{fragment}'"
        got = f"{got_code} '{got_msg[:110]}'"
        self.rows.append((surface, case, exp, got, ok))
        with self.subTest(surface=surface, case=case):
            self.assertEqual(got_code, expected_code, got_msg)
            self.assertIn(fragment, got_msg)

    # --- rpc -------------------------------------------------------------------------------------

    def call(self, method, request):
        fn = self.channel.unary_unary(f"/slidedp.v1.Control/{method}")
        try:
            fn(request, timeout=30)
            return "OK", ""
        except grpc.RpcError as e:
            return e.code().name, e.details() or ""

    def rpc(self, case, method, request, expected, fragment):
        code, msg = self.call(method, request)
        self.record("rpc", case, expected, fragment, code, msg)

    def attach(self, rank, **extra):
        return pb((2, rank), (3, self.hash.decode()), (4, os.getpid()),
                  *[(k, v) for k, v in extra.items()])

    def test_rpc(self):
        # Handshake and job creation.
        self.rpc("Handshake: protocol_version from the future", "Handshake",
                 pb((1, pb((1, "9.9.9"), (3, 999), (6, "rankclient")))), "FAILED_PRECONDITION",
                 "9.9.9")
        manifest = pb((1, "fz"), (2, "other"), (3, pb((1, "l0"), (2, 2), (3, pb(
            (1, "l0.w"), (2, varint(4) + varint(4)), (3, 2))))))
        self.rpc("CreateJob: a second job (another manifest)", "CreateJob",
                 pb((1, pb((1, "job2"), (2, manifest), (5, 2)))), "ALREADY_EXISTS",
                 "a job already exists")
        self.rpc("CreateJob: manifest without layers", "CreateJob",
                 pb((1, pb((1, "job2"), (2, pb((1, "x"), (2, "empty"))), (5, 1)))),
                 "INVALID_ARGUMENT", "layers")
        bad_dim = pb((1, "fz"), (2, "neg"), (3, pb((1, "l0"), (2, 2), (3, pb(
            (1, "l0.w"), (2, varint(4) + varint(-3)), (3, 2))))))
        self.rpc("CreateJob: negative dimension", "CreateJob",
                 pb((1, pb((1, "job3"), (2, bad_dim), (5, 1)))), "INVALID_ARGUMENT", "shape")
        # AttachRank.
        self.rpc("AttachRank: unknown job_id", "AttachRank", pb((1, "nope")) + self.attach(0),
                 "NOT_FOUND", "job_id: unknown job 'nope'")
        self.rpc("AttachRank: wrong manifest_hash", "AttachRank",
                 pb((2, 0), (3, "0123456789abcdef")), "FAILED_PRECONDITION", "manifest_hash")
        self.rpc("AttachRank: rank >= world_size", "AttachRank", self.attach(7), "OUT_OF_RANGE",
                 "rank: expected 0..1")
        self.rpc("AttachRank: client_updated_layers out of range", "AttachRank",
                 self.attach(0) + pb((7, 99)), "OUT_OF_RANGE", "client_updated_layers: layer 99")
        # Ranks 0 and 1 attached for the step rows.
        self.assertEqual(self.call("AttachRank", self.attach(1))[0], "OK")
        self.rpc("AttachRank: the same rank twice", "AttachRank", self.attach(1),
                 "ALREADY_EXISTS", "rank 1")
        self.rpc("DetachRank: wrong attach_token", "DetachRank", pb((2, 1), (3, "forged")),
                 "PERMISSION_DENIED", "attach_token")
        self.rpc("DetachRank: rank not attached", "DetachRank", pb((2, 0), (3, "x")),
                 "FAILED_PRECONDITION", "rank 0 is not attached")
        self.rpc("DetachRank: rank >= world_size", "DetachRank", pb((2, 9), (3, "x")),
                 "OUT_OF_RANGE", "rank")
        # Steps.
        self.rpc("BeginStep: rank not attached", "BeginStep", pb((2, 0), (3, 1)),
                 "FAILED_PRECONDITION", "rank 0 is not attached")
        self.rpc("BeginStep: step 0", "BeginStep", pb((2, 1), (3, 0)), "OUT_OF_RANGE",
                 "(next), got 0")
        # The job's next step (the c_abi rows may have run and aborted steps): from the message.
        msg = self.call("BeginStep", pb((2, 1), (3, 0)))[1]
        nxt = int(msg.split("expected ", 1)[1].split(" ", 1)[0])
        self.rpc("BeginStep: step in the future", "BeginStep", pb((2, 1), (3, nxt + 4)),
                 "OUT_OF_RANGE", f"step: expected {nxt} (next), got {nxt + 4}")
        self.rpc("BeginStep: unknown job_id", "BeginStep", pb((1, "nope"), (2, 1), (3, 1)),
                 "NOT_FOUND", "job_id")
        self.rpc("AbortStep: no step running", "AbortStep", pb((2, 1)), "FAILED_PRECONDITION",
                 "no step is running")
        self.assertEqual(self.call("BeginStep", pb((2, 1), (3, nxt)))[0], "OK")
        self.rpc("BeginStep: two steps ahead of the running one", "BeginStep",
                 pb((2, 1), (3, nxt + 2)), "OUT_OF_RANGE",
                 f"step: expected {nxt} (running) or {nxt + 1}")
        self.rpc("AbortStep: wrong step while one runs", "AbortStep", pb((2, nxt + 3)),
                 "FAILED_PRECONDITION", f"(running: {nxt})")
        self.assertEqual(self.call("AbortStep", pb((2, nxt), (3, "table")))[0], "OK")
        # NCCL id rendezvous.
        self.rpc("PublishCommId: from rank 1", "PublishCommId", pb((2, 1), (3, b"x" * 128)),
                 "PERMISSION_DENIED", "only rank 0")
        self.rpc("PublishCommId: empty unique_id", "PublishCommId", pb((2, 0)),
                 "INVALID_ARGUMENT", "unique_id: expected 1..4096 bytes")
        self.rpc("FetchCommId: nothing published (20 ms)", "FetchCommId",
                 pb((2, 1), (3, 1), (4, 20)), "DEADLINE_EXCEEDED", "has not published")
        self.rpc("FetchCommId: rank >= world_size", "FetchCommId", pb((2, 5)), "OUT_OF_RANGE",
                 "rank: expected 0..1")
        # Hyperparameters.
        self.rpc("UpdateHyperParams: no fields", "UpdateHyperParams", pb((2, pb((1, 1e-3)))),
                 "INVALID_ARGUMENT", "fields: expected at least one")
        self.rpc("UpdateHyperParams: unknown field", "UpdateHyperParams",
                 pb((2, pb((1, 1e-3))), (3, "momentum")), "INVALID_ARGUMENT", "'momentum'")
        self.rpc("UpdateHyperParams: negative lr", "UpdateHyperParams",
                 pb((2, pb((1, -1.0))), (3, "lr")), "INVALID_ARGUMENT", "lr")
        self.rpc("UpdateHyperParams: beta1 = 1", "UpdateHyperParams",
                 pb((2, pb((2, 1.0))), (3, "beta1")), "INVALID_ARGUMENT", "beta1")
        self.rpc("UpdateHyperParams: eps = 0", "UpdateHyperParams",
                 pb((2, pb((4, 0.0))), (3, "eps")), "INVALID_ARGUMENT", "eps")
        self.rpc("UpdateHyperParams: per-layer clip with a NaN max_grad_norm",
                 "UpdateHyperParams",
                 pb((2, pb((11, 2), (12, float("nan")))), (3, "clip"), (3, "max_grad_norm")),
                 "INVALID_ARGUMENT", "max_grad_norm")
        # The ranks' client-updated layers (this job has none).
        self.rpc("UploadClientLayer: rank not attached", "UploadClientLayer",
                 pb((2, 0), (3, "x"), (4, 1), (5, 0), (8, b"\0" * 4)), "FAILED_PRECONDITION",
                 "rank 0 is not attached")
        self.rpc("UploadClientLayer: wrong attach_token", "UploadClientLayer",
                 pb((2, 1), (3, "forged"), (4, 1), (5, 0), (8, b"\0" * 4)), "PERMISSION_DENIED",
                 "attach_token")
        self.rpc("ReadClientLayer: a layer hostd updates", "ReadClientLayer",
                 pb((2, 1), (5, 4)), "FAILED_PRECONDITION", "layer: 1 is not updated by the ranks")
        self.rpc("ReadClientLayer: unknown job_id", "ReadClientLayer", pb((1, "nope"), (2, 0)),
                 "NOT_FOUND", "job_id")
        # Queries and the wire itself.
        self.rpc("ListLayers: unknown job_id", "ListLayers", pb((1, "nope")), "NOT_FOUND",
                 "job_id")
        self.rpc("GetStats: unknown job_id", "GetStats", pb((1, "nope")), "NOT_FOUND", "job_id")
        self.rpc("bytes that are not a request message", "BeginStep", b"\xff\xff\xff\xff",
                 "INTERNAL", "")
        self.rpc("method that does not exist", "Frobnicate", b"", "UNIMPLEMENTED", "")

    # --- c_abi -----------------------------------------------------------------------------------

    def abi(self, case, rc, expected, fragment):
        msg = (self.lib.slidedp_rank_last_error() or b"").decode() if rc != OK else ""
        self.record("c_abi", case, CODES.get(expected, str(expected)), fragment,
                    CODES.get(rc, str(rc)), msg)

    def opts(self, rank, **kw):
        o = Options(2, self.sock.encode(), None, rank, self.hash, -1, 10000, None, 0)
        for k, v in kw.items():
            setattr(o, k, v)
        return o

    def test_c_abi(self):
        lib, c = self.lib, ctypes
        h = c.c_void_p()
        self.abi("attach: null options", lib.slidedp_rank_attach(None, c.byref(h)),
                 INVALID_ARGUMENT, "options")
        o = self.opts(0)
        self.abi("attach: null out", lib.slidedp_rank_attach(c.byref(o), None), INVALID_ARGUMENT,
                 "out")
        o = self.opts(0, abi_version=99)
        self.abi("attach: abi_version 99", lib.slidedp_rank_attach(c.byref(o), c.byref(h)),
                 FAILED_PRECONDITION, "abi_version")
        o = self.opts(0, socket=None)
        self.abi("attach: null socket", lib.slidedp_rank_attach(c.byref(o), c.byref(h)),
                 INVALID_ARGUMENT, "socket")
        o = self.opts(0, manifest_hash=b"00000000deadbeef")
        self.abi("attach: wrong manifest_hash", lib.slidedp_rank_attach(c.byref(o), c.byref(h)),
                 FAILED_PRECONDITION, "manifest_hash")
        o = self.opts(0, socket=os.path.join(self.tmp, "nobody.sock").encode(), timeout_ms=500)
        self.abi("attach: no hostd on the socket", lib.slidedp_rank_attach(c.byref(o), c.byref(h)),
                 UNAVAILABLE, "")
        o = self.opts(0, num_client_updated_layers=3)
        self.abi("attach: null client_updated_layers with a count",
                 lib.slidedp_rank_attach(c.byref(o), c.byref(h)), INVALID_ARGUMENT,
                 "client_updated_layers: null")
        n = c.c_uint32()
        self.abi("num_layers: null handle", lib.slidedp_rank_num_layers(None, c.byref(n)),
                 INVALID_ARGUMENT, "handle")
        buf = c.create_string_buffer(4)
        self.abi("manifest_hash_from_hf_config: out_len 4",
                 lib.slidedp_manifest_hash_from_hf_config(b"tiny", buf, 4), INVALID_ARGUMENT,
                 "out_len >= 17")
        self.abi("manifest_hash_from_hf_config: not JSON",
                 lib.slidedp_manifest_hash_from_hf_config(b"{nope", c.create_string_buffer(17),
                                                          17), INVALID_ARGUMENT, "")
        self.abi("manifest_hash_from_hf_config: null config",
                 lib.slidedp_manifest_hash_from_hf_config(None, c.create_string_buffer(17), 17),
                 INVALID_ARGUMENT, "")
        # An attached rank 0 (rank 1 is held by the rpc rows or not: rank 0 is free either way
        # once its own attach is the only one).
        o = self.opts(0)
        rc = lib.slidedp_rank_attach(c.byref(o), c.byref(h))
        self.assertEqual(rc, OK, (lib.slidedp_rank_last_error() or b"").decode())
        try:
            numel = c.c_uint64()
            self.abi("layer_numel: layer 99", lib.slidedp_rank_layer_numel(h, 99, c.byref(numel)),
                     NOT_FOUND, "layer: 99 does not exist")
            self.abi("layer_numel: null out", lib.slidedp_rank_layer_numel(h, 0, None),
                     INVALID_ARGUMENT, "")
            name = c.create_string_buffer(2)
            self.abi("layer_info: name buffer of 2 bytes",
                     lib.slidedp_rank_layer_info(h, 0, name, 2, None), OUT_OF_RANGE, "")
            small = c.create_string_buffer(8)
            self.abi("optimizer_json: 8-byte buffer",
                     lib.slidedp_rank_optimizer_json(h, 1, small, 8), RESOURCE_EXHAUSTED, "")
            self.assertEqual(lib.slidedp_rank_layer_numel(h, 1, c.byref(numel)), OK)
            grad = (c.c_uint16 * numel.value)()
            self.abi("push_grad: before begin_step (wrong order)",
                     lib.slidedp_rank_push_grad(h, 1, 1, grad, BF16, 2 * numel.value, 1000),
                     OUT_OF_RANGE, "step: 1 is not the current step (0)")
            self.abi("wait_step: step never begun",
                     lib.slidedp_rank_wait_step(h, 1, 100), OUT_OF_RANGE,
                     "step: 1 was not begun by this rank")
            self.abi("begin_step: step 3 (next is 1)", lib.slidedp_rank_begin_step(h, 3, 1000),
                     OUT_OF_RANGE, "step: expected")
            dst = (c.c_uint16 * numel.value)()
            self.abi("fetch_params: dst_bytes one short",
                     lib.slidedp_rank_fetch_params(h, 1, 0, dst, 2 * numel.value - 1, 1000, None),
                     INVALID_ARGUMENT, "")
            self.abi("fetch_params: null dst",
                     lib.slidedp_rank_fetch_params(h, 1, 0, None, 2 * numel.value, 1000, None),
                     INVALID_ARGUMENT, "")
            self.abi("fetch_params: a version that does not come (100 ms)",
                     lib.slidedp_rank_fetch_params(h, 1, 5, dst, 2 * numel.value, 100, None),
                     OUT_OF_RANGE, "version: 5 cannot come in step 0")
            view, nbytes = c.c_void_p(), c.c_uint64()
            self.abi("client_layer_view: a layer hostd updates",
                     lib.slidedp_rank_client_layer_view(h, 1, c.byref(view), c.byref(nbytes)),
                     FAILED_PRECONDITION, "")
            step = c.c_uint64()
            self.assertEqual(lib.slidedp_rank_next_step(h, c.byref(step)), OK)
            status_step = step.value
            self.assertEqual(lib.slidedp_rank_begin_step(h, status_step, 10000), OK,
                             (lib.slidedp_rank_last_error() or b"").decode())
            self.abi("push_grad: dtype 7", lib.slidedp_rank_push_grad(
                h, status_step, 1, grad, 7, 2 * numel.value, 1000), INVALID_ARGUMENT, "dtype")
            self.abi("push_grad: byte size one element short", lib.slidedp_rank_push_grad(
                h, status_step, 1, grad, BF16, 2 * numel.value - 2, 1000), INVALID_ARGUMENT, "")
            self.abi("push_grad: null gradient", lib.slidedp_rank_push_grad(
                h, status_step, 1, None, BF16, 2 * numel.value, 1000), INVALID_ARGUMENT, "")
            self.abi("push_grad: layer 99", lib.slidedp_rank_push_grad(
                h, status_step, 99, grad, BF16, 2, 1000), NOT_FOUND, "layer")
            self.abi("push_grad: a past step", lib.slidedp_rank_push_grad(
                h, status_step - 1, 1, grad, BF16, 2 * numel.value, 1000), OUT_OF_RANGE, "")
        finally:
            self.assertEqual(lib.slidedp_rank_detach(h), OK)

    # --- config ----------------------------------------------------------------------------------

    def hostd_run(self, args, env_extra=None, timeout=60):
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLIDEDP_")}
        env.update(env_extra or {})
        p = subprocess.run([HOSTD] + args, capture_output=True, text=True, env=env,
                           timeout=timeout)
        return p.returncode, p.stdout + p.stderr

    def config(self, case, toml, expected_exit, fragment, args=(), env=None, code=None):
        path = os.path.join(self.tmp, "bad.toml")
        with open(path, "w") as f:
            f.write(toml)
        rc, out = self.hostd_run(["--config", path, "--print-config"] + list(args), env)
        got = f"exit {rc}"
        if code:  # a valid configuration the machine cannot honour: the log names the code
            rc, out = self.hostd_run(["--config", path, "--socket",
                                      os.path.join(self.tmp, "c.sock"),
                                      "--instance", f"bc{os.getpid()}", "--mlock", "off"] +
                                     list(args), env)
            got = f"exit {rc} {code if 'startup failed: ' + code + ':' in out else '?'}"
            out = out.split("startup failed: ", 1)[-1]
            expected = f"exit {expected_exit} {code}"
        else:
            expected = f"exit {expected_exit}"
        self.record("config", case, expected, fragment, got,
                    " ".join(out.split())[-300:])

    def test_config(self):
        self.config("file: unknown key", "lrr = 1e-3\n", 2, "unknown key (did you mean 'lr'?)")
        self.config("file: wrong type (string for a number)", 'lr = "fast"\n', 2,
                    "expected a number, got a string")
        self.config("file: beta1 out of range", "beta1 = 1.5\n", 2,
                    "beta1 (file " + os.path.join(self.tmp, "bad.toml") +
                    ":1): must be in [0, 1), got 1.5")
        self.config("file: world_size 0", "world_size = 0\n", 2, "world_size")
        self.config("file: chunk_bytes not a page multiple", "chunk_bytes = 5000\n", 2,
                    "chunk_bytes")
        self.config("file: enum value not a choice", 'clip = "sometimes"\n', 2,
                    "'sometimes' is not one of none, per_layer, global")
        self.config("file: a table", "[optimizer]\nlr = 1e-3\n", 2, "is a table; hostd's config file has flat keys")
        self.config("file: TOML syntax error", "lr = = 3\n", 2, "bad.toml:1")
        self.config("file: non-loopback listen_tcp", 'listen_tcp = "0.0.0.0:7070"\n', 2,
                    "listen_tcp")
        self.config("file: bad instance name", 'instance = "a/b"\n', 2, "instance")
        self.config("env: SLIDEDP_WORLD_SIZE=abc", "", 2, "env SLIDEDP_WORLD_SIZE",
                    env={"SLIDEDP_WORLD_SIZE": "abc"})
        self.config("flag: unknown flag with a suggestion", "", 2, "unknown flag '--learning",
                    args=["--learning_rate", "1"])
        self.config("flag: shm_group without shm_mode 0660", "", 2, "shm_group",
                    args=["--shm_group", "users"])
        self.config("numa_node that the machine lacks", "numa_node = 63\n", 1,
                    "numa_node: node 63 does not exist", code="NOT_FOUND")
        path = os.path.join(self.tmp, "missing.toml")
        rc, out = self.hostd_run(["--config", path, "--print-config"])
        self.record("config", "config file missing", "exit 2", "cannot open", f"exit {rc}",
                    " ".join(out.split()))

    # --- safetensors -----------------------------------------------------------------------------

    def checkpoint(self, case, files, expected_code, fragment):
        d = tempfile.mkdtemp(dir=self.tmp, prefix="st-")
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(TINY, f)
        for name, data in files.items():
            with open(os.path.join(d, name), "wb") as f:
                f.write(data)
        rc, out = self.hostd_run(["--model", d, "--socket", os.path.join(d, "h.sock"),
                                  "--instance", f"bs{os.getpid()}", "--mlock", "off",
                                  "--update_threads", "1"])
        code = "?"
        if "startup failed: " in out:
            out = out.split("startup failed: ", 1)[1]
            code = out.split(":", 1)[0]
        self.record("safetensors", case, f"exit 1 {expected_code}", fragment,
                    f"exit {rc} {code}", " ".join(out.split()))

    def test_safetensors(self):
        tensors = tiny_tensors()
        good, size = header_entries(tensors)
        name0 = tensors[0][0]

        def with_entry(name, **changes):
            e = json.loads(json.dumps(good))
            e[name].update(changes)
            return e

        st = "model.safetensors"
        self.checkpoint("header length beyond 100 MiB",
                        {st: struct.pack("<Q", (100 << 20) + 8) + b"{}"}, "INVALID_ARGUMENT",
                        "header")
        self.checkpoint("header length beyond the file",
                        {st: struct.pack("<Q", 4096) + b"{}"}, "INVALID_ARGUMENT", "")
        self.checkpoint("file shorter than 8 bytes", {st: b"\x10\x00"}, "INVALID_ARGUMENT", "")
        self.checkpoint("header a bare JSON string (read an empty stack before)",
                        {st: st_bytes(None, 0, b'"F32"   ', pad=False)}, "INVALID_ARGUMENT",
                        "expected a JSON object")
        self.checkpoint("header a bare JSON number (read an empty stack before)",
                        {st: st_bytes(None, 0, b"12345678", pad=False)}, "INVALID_ARGUMENT",
                        "expected a JSON object")
        self.checkpoint("header not JSON", {st: st_bytes(None, size, b"{\"a\": [1, 2")},
                        "INVALID_ARGUMENT", "")
        self.checkpoint("offset beyond the data section",
                        {st: st_bytes(with_entry(name0, data_offsets=[size, size + 2 * 64 * 512]),
                                      size)}, "INVALID_ARGUMENT", name0)
        first, second = tensors[0][0], tensors[1][0]
        overl = json.loads(json.dumps(good))
        b0 = overl[first]["data_offsets"][0]
        n1 = overl[second]["data_offsets"][1] - overl[second]["data_offsets"][0]
        overl[second]["data_offsets"] = [b0, b0 + n1]
        self.checkpoint("two tensors overlap", {st: st_bytes(overl, size)}, "INVALID_ARGUMENT",
                        "overlap")
        self.checkpoint("dtype x shape != bytes",
                        {st: st_bytes(with_entry(name0, dtype="F32"), size)}, "INVALID_ARGUMENT",
                        name0)
        self.checkpoint("unsupported dtype I64",
                        {st: st_bytes(with_entry(name0, dtype="I64"), size)}, "INVALID_ARGUMENT",
                        "I64")
        self.checkpoint("unknown field in a tensor entry",
                        {st: st_bytes(with_entry(name0, strides=[1]), size)}, "INVALID_ARGUMENT",
                        "strides")
        self.checkpoint("duplicate key", {st: st_bytes(None, size, json.dumps(good).encode()[:-1] +
                                                       b', "' + name0.encode() + b'": {}}')},
                        "INVALID_ARGUMENT", "duplicate")
        self.checkpoint("truncated data section", {st: st_bytes(good, size)[:-100]},
                        "INVALID_ARGUMENT", "")
        self.checkpoint("shape differs from the model",
                        {st: st_bytes(with_entry(name0, shape=[256, 128]), size)},
                        "INVALID_ARGUMENT", name0)
        missing = dict(good)
        del missing[tensors[-1][0]]
        self.checkpoint("tensor of the model missing", {st: st_bytes(missing, size)},
                        "INVALID_ARGUMENT", tensors[-1][0])
        idx = "model.safetensors.index.json"
        wm = {n: "shard-1.safetensors" for n, _ in tensors}
        self.checkpoint("index names a missing shard",
                        {idx: json.dumps({"weight_map": wm}).encode()}, "NOT_FOUND",
                        "shard-1.safetensors")
        wm2 = dict(wm)
        wm2[name0] = "../x.safetensors"
        self.checkpoint("index shard path with '/'",
                        {idx: json.dumps({"weight_map": wm2}).encode(),
                         "shard-1.safetensors": st_bytes(good, size)}, "INVALID_ARGUMENT",
                        "../x.safetensors")
        self.checkpoint("index weight_map not an object",
                        {idx: b'{"weight_map": []}'}, "INVALID_ARGUMENT", "weight_map")


def main():
    global HOSTD, LIBPATH
    if len(sys.argv) < 3:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    HOSTD, LIBPATH = sys.argv[1], sys.argv[2]
    unittest.main(argv=sys.argv[:1] + sys.argv[3:], verbosity=2)


if __name__ == "__main__":
    main()
