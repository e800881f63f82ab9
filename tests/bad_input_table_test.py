#!/usr/bin/env python3
"""The bad-input table (issue #6, issue #17 acceptance 2): every surface a user or a rank process
can feed hostd wrong input through, one row per case with its expected status and a fragment of
the message that names the field.

Usage: bad_input_table_test.py HOSTD LIBSLIDEDP_RANK.so

Surfaces:
  rpc          slidedp.v1.Control over hostd's unix socket, with grpcio's generic calls and
               requests serialized here by hand (no generated Python code needed); the status is
               the gRPC code. Every field of every request message of proto/slidedp/v1/control.proto
               has at least one row: bad values with the code and a fragment naming the field, and,
               for a field with no bad value (informational strings, booleans, a seed), a row
               showing that hostd takes it as it is. Two hostds: one with the built-in tiny model
               (world size 2), one started with --model none for CreateJob (its rows all fail
               before a job exists; the last creates one with client-updated layers for the
               UploadClientLayer / ReadClientLayer rows). Rows for a job setting also run
               `hostd --print-config --KEY VALUE` and require the RPC's text after "FIELD: " to
               equal the configuration's after "KEY (flag --KEY): " (`= config`): the same bounds
               and the same words; for an enum, which the configuration takes by name, the list of
               choices must be the same (`= config choices`).
  c_abi        rankclient's C ABI (rankclient/slidedp_rank.h) through ctypes; the status is the
               code the function returns (absl/gRPC numbering), the message slidedp_rank_last_error.
  config       hostd's configuration (file, environment, flags); hostd exits 2 on a bad key or
               value before anything else happens, 1 when the configuration is valid but the
               machine cannot honour it (the log then names the absl code).
  safetensors  HF checkpoints hostd imports at startup (--model DIR with config.json and weights);
               hostd exits 1 and logs "startup failed: CODE: message".
Each row's result is checked (code and fragment) and the whole table is printed as
`surface | case | expected | got` with per-surface counts and, for rpc, per-method counts.
Fields without a bad value: OptimizerConfig.no_decay_norms_and_biases and scale_by_world_size,
TensorSpec.no_decay, ModelManifest.tie_word_embeddings, ListLayersRequest.checksums,
CheckpointRequest.wait and ExportHFRequest.overwrite are booleans (overwrite has rows for what it
replaces); Heartbeat.step/layer are reported, not checked; GetStatusRequest and GetConfigRequest
have no fields (an unknown field is ignored: one row each).
Runs in about 35 s (two hostds for the rpc and c_abi rows, one short-lived hostd per config and
safetensors row).
"""
import ctypes
import json
import os
import re
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
import unittest

import grpc

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import HostdProcess, use_python_client  # noqa: E402
from pbwire import pb, varint  # noqa: E402

use_python_client()
from slidedp import _lib  # noqa: E402
from slidedp._lib import RankOptions  # noqa: E402

HOSTD = LIBPATH = None

CODES = {c.value[0]: c.name for c in grpc.StatusCode}
OK, INVALID_ARGUMENT, DEADLINE_EXCEEDED, NOT_FOUND = 0, 3, 4, 5
ALREADY_EXISTS, PERMISSION_DENIED, RESOURCE_EXHAUSTED, FAILED_PRECONDITION = 6, 7, 8, 9
ABORTED, OUT_OF_RANGE, UNIMPLEMENTED, INTERNAL, UNAVAILABLE = 10, 11, 12, 13, 14
FP32, BF16 = 1, 2
U64_MAX = (1 << 64) - 1
NAN, INF = float("nan"), float("inf")
# A client string far beyond gRPC's default 8 KiB metadata limit: echoed whole into a status
# message, the client sees RESOURCE_EXHAUSTED "received initial metadata size exceeds limit"
# instead of hostd's answer.
HUGE = 64 << 10

TINY = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 512,
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "hidden_act": "silu",
    "max_position_embeddings": 512, "rms_norm_eps": 1e-06, "rope_theta": 10000.0,
    "attention_bias": False, "tie_word_embeddings": False, "initializer_range": 0.02,
}


# --- protobuf wire format (writing it: tests/pbwire.py) ------------------------------------------

def read_varint(buf, i):
    v, shift = 0, 0
    while True:
        b = buf[i]
        i += 1
        v |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return v, i


def decode(buf):
    """The top-level fields of a serialized message: {number: [int | bytes, ...]}."""
    out, i = {}, 0
    while i < len(buf):
        key, i = read_varint(buf, i)
        num, wire = key >> 3, key & 7
        if wire == 0:
            v, i = read_varint(buf, i)
        elif wire == 1:
            v, i = buf[i:i + 8], i + 8
        elif wire == 2:
            n, i = read_varint(buf, i)
            v, i = buf[i:i + n], i + n
        elif wire == 5:
            v, i = buf[i:i + 4], i + 4
        else:
            raise ValueError(f"wire type {wire}")
        out.setdefault(num, []).append(v)
    return out


# Messages of control.proto by field number.
def tensor(name, shape, dtype=BF16):
    return pb((1, name), (2, b"".join(varint(d) for d in shape)), (3, dtype))


def layer(name, kind, *tensors):
    return pb((1, name), (2, kind), *[(3, t) for t in tensors])


def manifest(*layers, **extra):
    """extra: family (1), name (2), tie_word_embeddings (4), manifest_hash (5)."""
    nums = {"family": 1, "name": 2, "tie_word_embeddings": 4, "manifest_hash": 5}
    fields = {"family": "fz", "name": "table"}
    fields.update(extra)
    return pb(*[(nums[k], v) for k, v in fields.items()], *[(3, lay) for lay in layers])


# Two layers, the first of them client-updated in the job test_rpc_job creates: 128 + 64 params.
GOOD_MANIFEST = manifest(layer("l0", 1, tensor("l0.w", [16, 8])),
                         layer("l1", 2, tensor("l1.w", [8, 8])))
OPT = {"lr": 1, "beta1": 2, "beta2": 3, "eps": 4, "weight_decay": 5,
       "no_decay_norms_and_biases": 6, "schedule": 7, "warmup_steps": 8, "total_steps": 9,
       "min_lr_ratio": 10, "clip": 11, "max_grad_norm": 12, "grad_dtype": 13,
       "scale_by_world_size": 14}
LINEAR, PER_LAYER, GLOBAL = 2, 2, 3


def optimizer(**kw):
    return pb(*[(OPT[k], v) for k, v in kw.items()])


def create_job(mani=GOOD_MANIFEST, job_id="", opt=None, routes=None, world_size=1, seed=None,
               resume_path=None):
    spec = [(1, job_id)] if job_id else []
    spec += [(2, mani)] if mani is not None else []
    spec += [(3, opt)] if opt is not None else []
    spec += [(4, routes)] if routes is not None else []
    spec += [(5, world_size)] if world_size else []
    spec += [(6, seed)] if seed is not None else []
    req = [(1, pb(*spec))]
    if resume_path is not None:
        req.append((100, resume_path))
    return pb(*req)


def routes(param_route=None, grad_route=None, chunk_bytes=None):
    f = [(1, param_route)] if param_route is not None else []
    f += [(2, grad_route)] if grad_route is not None else []
    f += [(3, chunk_bytes)] if chunk_bytes is not None else []
    return pb(*f)


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


class BadInputTableTest(unittest.TestCase):
    rows = []  # (surface, case, expected, got, ok)

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="slidedp-badinput-")
        cls.sock = os.path.join(cls.tmp, "hostd.sock")
        cls.sock_none = os.path.join(cls.tmp, "none.sock")
        cls.instance = f"bi{os.getpid()}"
        cls.roots = os.path.join(cls.tmp, "roots")
        os.makedirs(cls.roots)
        common = ["--mlock", "best_effort", "--update_threads", "1", "--output_roots", cls.roots]
        cls.hostd = HostdProcess(
            HOSTD, "--model", "tiny", "--world_size", "2", "--chunk_bytes", "4096", *common,
            tmp=cls.tmp, instance=cls.instance, socket=cls.sock, log_name="hostd.log",
            wait_ready=False).start()
        # CreateJob's rows: a hostd without a job.
        cls.hostd_none = HostdProcess(
            HOSTD, "--model", "none", *common, tmp=cls.tmp, instance=f"bn{os.getpid()}",
            socket=cls.sock_none, log_name="hostd-none.log", wait_ready=False).start()
        try:
            cls.hostd.wait_socket()
            cls.hostd_none.wait_socket()
        except BaseException:
            cls.hostd.abort()
            cls.hostd_none.abort()
            raise
        cls.channel = grpc.insecure_channel("unix:" + cls.sock)
        cls.channel_none = grpc.insecure_channel("unix:" + cls.sock_none)
        cls.lib = _lib.load(LIBPATH)
        buf = ctypes.create_string_buffer(17)
        assert cls.lib.slidedp_manifest_hash_from_hf_config(b"tiny", buf, 17) == OK
        cls.hash = buf.value

    @classmethod
    def tearDownClass(cls):
        cls.channel.close()
        cls.channel_none.close()
        for h in (cls.hostd, cls.hostd_none):
            h.proc.send_signal(signal.SIGTERM)
        for h in (cls.hostd, cls.hostd_none):
            h.stop(timeout_s=30)
            h.abort()  # a hostd that died leaves its segments: nobody adopts them
        rows = cls.rows
        w1 = max(len(r[1]) for r in rows)
        w2 = min(100, max(len(r[2]) for r in rows))
        print("\nsurface     | case" + " " * (w1 - 4) + " | expected" + " " * (w2 - 8) +
              " | got", file=sys.stderr)
        for surface, case, expected, got, ok in rows:
            print(f"{surface:<11} | {case:<{w1}} | {expected:<{w2}} | {got}"
                  f"{'' if ok else '   <-- MISMATCH'}", file=sys.stderr)
        counts = {}
        methods = {}
        for r in rows:
            total, passed = counts.get(r[0], (0, 0))
            counts[r[0]] = (total + 1, passed + (1 if r[4] else 0))
            if r[0] == "rpc":
                m = r[1].split(":", 1)[0]
                total, passed = methods.get(m, (0, 0))
                methods[m] = (total + 1, passed + (1 if r[4] else 0))
        print("rpc per method: " + ", ".join(f"{m} {p}/{t}" for m, (t, p) in methods.items()),
              file=sys.stderr)
        print("counts: " + ", ".join(f"{s} {p}/{t}" for s, (t, p) in counts.items()) +
              f"; total {sum(1 for r in rows if r[4])}/{len(rows)} as expected", file=sys.stderr)

    def record(self, surface, case, expected_code, fragment, got_code, got_msg, config=None):
        """config: (same, the configuration's text) for a row compared with hostd's config."""
        ok = got_code == expected_code and fragment in got_msg
        exp = f"{expected_code} '{fragment}'"
        if config is not None:
            ok = ok and config[0]
            exp += " = config" if config[0] else f" (config: '{config[1][:80]}')"
        got = f"{got_code} '{got_msg[:110]}'"
        self.rows.append((surface, case, exp, got, ok))
        with self.subTest(surface=surface, case=case):
            self.assertEqual(got_code, expected_code, got_msg[:2000])
            self.assertIn(fragment, got_msg)
            if config is not None:
                self.assertTrue(config[0], f"the RPC says '{got_msg}', the config '{config[1]}'")

    # --- rpc -------------------------------------------------------------------------------------

    def call(self, method, request, channel=None, timeout=30):
        """(code name, message, response bytes)."""
        fn = (channel or self.channel).unary_unary(f"/slidedp.v1.Control/{method}")
        try:
            return "OK", "", fn(request, timeout=timeout)
        except grpc.RpcError as e:
            return e.code().name, e.details() or "", b""

    def config_says(self, args):
        """The key and the text hostd's configuration gives for these flags."""
        rc, out = self.hostd_run(["--print-config"] + list(args))
        m = re.search(r"hostd: (\S+) \(flag --\S+\): (.*)", out)
        if rc != 2 or not m:
            return None, f"exit {rc}: " + " ".join(out.split())[-200:]
        return m.group(1), m.group(2).strip()

    def same_as_config(self, msg, args, choices=False):
        key, text = self.config_says(args)
        if key is None or f"{key}: " not in msg:
            return False, text
        said = msg.split(f"{key}: ", 1)[1]
        if choices:  # the configuration names the values: compare the lists of choices
            return said.split("one of ", 1)[-1] == text.split("one of ", 1)[-1], text
        return said == text, text

    def rpc(self, case, method, request, expected, fragment, config=None, choices=False,
            channel=None, timeout=30, describe=None):
        """config: flags for `hostd --print-config` that must be refused with the same text.
        describe: for an OK answer, a function of the response bytes giving the 'message'."""
        code, msg, resp = self.call(method, request, channel, timeout)
        if code == "OK" and describe is not None:
            msg = describe(resp)
        same = self.same_as_config(msg, config, choices) if config is not None else None
        self.record("rpc", case, expected, fragment, code, msg, same)
        return code, resp

    def attach_req(self, rank, job_id=None, mhash=None, **extra):
        f = [(1, job_id)] if job_id else []
        f += [(2, rank), (3, mhash if mhash is not None else self.hash.decode()),
              (4, os.getpid())]
        return pb(*f, *[(k, v) for k, v in extra.items()])

    def attach(self, rank, channel=None, req=None):
        code, msg, resp = self.call("AttachRank", req or self.attach_req(rank), channel)
        self.assertEqual(code, "OK", msg)
        return decode(resp)[2][0].decode()

    def session(self, messages, channel=None, hold=None, timeout=10):
        """Opens a Session stream sending `messages`; returns (code, message, first event). With
        `hold` (a threading.Event) the stream stays open until it is set: returns the call."""
        fn = (channel or self.channel).stream_stream("/slidedp.v1.Control/Session")

        def requests():
            yield from messages
            if hold is not None:
                hold.wait()

        it = fn(requests(), timeout=timeout)
        if hold is not None:
            return it
        try:
            first = next(it, None)
            for _ in it:
                pass
            return "OK", "", first
        except grpc.RpcError as e:
            return e.code().name, e.details() or "", None

    def session_row(self, case, messages, expected, fragment, channel=None):
        code, msg, _ = self.session(messages, channel)
        self.record("rpc", case, expected, fragment, code, msg)

    def test_rpc(self):
        """The tiny-model hostd (world size 2). The c_abi rows ran first and detached."""
        self.rpc_handshake_and_queries()
        self.rpc_attach_detach_session()
        self.rpc_steps()
        self.rpc_comm_ids()
        self.rpc_hyperparams()
        self.rpc_export()
        self.rpc_checkpoint()
        # This job has no client-updated layers.
        self.rpc("UploadClientLayer: layer of a job whose ranks update none", "UploadClientLayer",
                 pb((2, 0), (3, self.tok[0]), (4, 1), (5, 0), (8, b"\0" * 4)),
                 "FAILED_PRECONDITION", "layer: 0 is not updated by the ranks")
        self.rpc("ReadClientLayer: layer of a job whose ranks update none", "ReadClientLayer",
                 pb((2, 1), (5, 4), (6, 0), (7, self.tok[0])), "FAILED_PRECONDITION",
                 "layer: 1 is not updated by the ranks")
        # The wire itself.
        self.rpc("(wire): bytes that are not a request message", "BeginStep", b"\xff\xff\xff\xff",
                 "INTERNAL", "")
        self.rpc("(wire): method that does not exist", "Frobnicate", b"", "UNIMPLEMENTED", "")
        self.still_serving("hostd --model tiny", self.hostd.proc)

    def rpc_handshake_and_queries(self):
        msg = self.call("Handshake", b"")[1]
        proto = int(re.search(r"hostd \S+ speaks protocol_version (\d+)", msg).group(1))
        self.rpc("Handshake: client absent (protocol_version 0)", "Handshake", b"",
                 "FAILED_PRECONDITION", "client  speaks protocol_version 0")
        self.rpc("Handshake: client.protocol_version from the future", "Handshake",
                 pb((1, pb((1, "9.9.9"), (3, 999), (6, "rankclient")))), "FAILED_PRECONDITION",
                 "rankclient 9.9.9 speaks protocol_version 999")
        self.rpc("Handshake: client.shm_abi_version 999", "Handshake",
                 pb((1, pb((3, proto), (4, 999)))), "FAILED_PRECONDITION",
                 "uses shm_abi_version 999")
        self.rpc("Handshake: client.component of 64 KiB with a protocol skew", "Handshake",
                 pb((1, pb((3, 999), (6, "c" * HUGE)))), "FAILED_PRECONDITION", "version skew")
        self.rpc("Handshake: client.version of 64 KiB with a protocol skew", "Handshake",
                 pb((1, pb((1, "v" * HUGE), (3, 999)))), "FAILED_PRECONDITION", "version skew")
        self.rpc("Handshake: client.git_revision (4 KiB) and features (unknown) are informational",
                 "Handshake", pb((1, pb((2, "g" * 4096), (3, proto), (5, "no-such-feature"),
                                        (6, "rankclient")))), "OK", "")
        self.rpc("GetStatus: an unknown field (GetStatusRequest has none) is ignored", "GetStatus",
                 pb((99, 1)), "OK", "")
        self.rpc("GetConfig: an unknown field (GetConfigRequest has none) is ignored", "GetConfig",
                 pb((99, 1)), "OK", "")
        self.rpc("ListLayers: job_id unknown", "ListLayers", pb((1, "nope"), (2, 1)), "NOT_FOUND",
                 "job_id: unknown job 'nope'")
        self.rpc("ListRanks: job_id unknown", "ListRanks", pb((1, "nope")), "NOT_FOUND",
                 "job_id: unknown job 'nope'")
        self.rpc("GetStats: job_id unknown", "GetStats", pb((1, "nope")), "NOT_FOUND",
                 "job_id: unknown job 'nope'")
        self.rpc("GetStats: job_id of 64 KiB", "GetStats", pb((1, "j" * HUGE)), "NOT_FOUND",
                 "job_id: unknown job")
        manifest2 = manifest(layer("l0", 2, tensor("l0.w", [4, 4])), name="other")
        self.rpc("CreateJob: a second job (another manifest)", "CreateJob",
                 create_job(manifest2, job_id="job2", world_size=2), "ALREADY_EXISTS",
                 "a job already exists")

    def rpc_attach_detach_session(self):
        self.tok = {}
        A = "AttachRank"
        self.rpc("AttachRank: job_id unknown", A, self.attach_req(0, job_id="nope"), "NOT_FOUND",
                 "job_id: unknown job 'nope'")
        self.rpc("AttachRank: job_id of 64 KiB", A, self.attach_req(0, job_id="j" * HUGE),
                 "NOT_FOUND", "job_id: unknown job")
        self.rpc("AttachRank: manifest_hash of another model", A,
                 self.attach_req(0, mhash="0123456789abcdef"), "FAILED_PRECONDITION",
                 "manifest_hash: the rank's model has manifest 0123456789abcdef")
        self.rpc("AttachRank: manifest_hash empty", A, self.attach_req(0, mhash=""),
                 "FAILED_PRECONDITION", "manifest_hash: the rank's model has manifest (empty)")
        self.rpc("AttachRank: manifest_hash of 64 KiB", A, self.attach_req(0, mhash="f" * HUGE),
                 "FAILED_PRECONDITION", "manifest_hash: the rank's model has manifest")
        self.rpc("AttachRank: rank >= world_size", A, self.attach_req(7), "OUT_OF_RANGE",
                 "rank: expected 0..1 (world_size 2), got 7")
        self.rpc("AttachRank: rank 2^32-1", A, self.attach_req(2**32 - 1), "OUT_OF_RANGE",
                 "rank: expected 0..1 (world_size 2), got 4294967295")
        self.rpc("AttachRank: client_updated_layers out of range", A,
                 self.attach_req(0) + pb((7, 99)), "OUT_OF_RANGE",
                 "client_updated_layers: layer 99 does not exist; expected 0..6")
        self.rpc("AttachRank: client_updated_layers lists a layer twice", A,
                 self.attach_req(0) + pb((7, 3), (7, 3)), "INVALID_ARGUMENT",
                 "client_updated_layers: layer 3 is listed twice")
        # Rank 1 attached, rank 0 not: the rows that need an unattached rank.
        code, resp = self.rpc(
            "AttachRank: pid -1, hostname of 4 KiB and gpu -7 are reported as given", A,
            pb((2, 1), (3, self.hash.decode()), (4, -1), (5, "h" * 4096), (6, -7)), "OK",
            "token", describe=lambda r: "token " + decode(r)[2][0].decode())
        self.assertEqual(code, "OK")
        self.tok[1] = decode(resp)[2][0].decode()
        self.rpc("AttachRank: the same rank twice", A, self.attach_req(1), "ALREADY_EXISTS",
                 "rank 1 is already attached (pid -1)")
        self.rpc("AttachRank: client_updated_layers differ from the attached ranks'", A,
                 self.attach_req(0) + pb((7, 2)), "FAILED_PRECONDITION",
                 "client_updated_layers: rank 0 sent [2] but the attached ranks update [] (none)")
        D = "DetachRank"
        self.rpc("DetachRank: rank not attached", D, pb((2, 0), (3, "x")), "FAILED_PRECONDITION",
                 "rank 0 is not attached")
        self.rpc("DetachRank: rank >= world_size", D, pb((2, 9), (3, "x")), "OUT_OF_RANGE",
                 "rank: expected 0..1 (world_size 2), got 9")
        self.rpc("DetachRank: job_id unknown", D, pb((1, "nope"), (2, 1), (3, self.tok[1])),
                 "NOT_FOUND", "job_id: unknown job 'nope'")
        self.rpc("DetachRank: attach_token forged", D, pb((2, 1), (3, "forged")),
                 "PERMISSION_DENIED", "attach_token: does not match the token issued to rank 1")
        self.rpc("DetachRank: attach_token empty", D, pb((2, 1)), "PERMISSION_DENIED",
                 "attach_token: does not match the token issued to rank 1 (none sent")
        self.rpc("BeginStep: rank not attached", "BeginStep", pb((2, 0), (3, 1), (4, "x")),
                 "FAILED_PRECONDITION", "rank 0 is not attached")
        # Session: SessionClientMessage { open = 1 (job_id 1, rank 2, attach_token 3),
        # heartbeat = 2 }.

        def opening(**f):
            nums = {"job_id": 1, "rank": 2, "attach_token": 3}
            return pb((1, pb(*[(nums[k], v) for k, v in f.items()])))

        self.session_row("Session: the first message is a heartbeat, not open",
                         [pb((2, pb((1, 1), (2, 0))))], "INVALID_ARGUMENT",
                         "the first message must be 'open'")
        self.session_row("Session: closed without any message", [], "OK", "")
        self.session_row("Session: open.job_id unknown",
                         [opening(job_id="nope", rank=1, attach_token=self.tok[1])], "NOT_FOUND",
                         "job_id: unknown job 'nope'")
        self.session_row("Session: open.rank >= world_size", [opening(rank=5, attach_token="x")],
                         "OUT_OF_RANGE", "rank: expected 0..1 (world_size 2), got 5")
        self.session_row("Session: open.rank not attached", [opening(rank=0, attach_token="x")],
                         "FAILED_PRECONDITION", "rank 0 is not attached")
        self.session_row("Session: open.attach_token forged",
                         [opening(rank=1, attach_token="forged")], "PERMISSION_DENIED",
                         "attach_token: does not match the token issued to rank 1")
        self.tok[0] = self.attach(0)
        # A second session of an attachment that has one open.
        hold = threading.Event()
        first = self.session([opening(rank=0, attach_token=self.tok[0])], hold=hold,
                             timeout=30)
        next(first)  # SessionOpened: the session is open in hostd
        self.session_row("Session: a second open of a rank whose session is open",
                         [opening(rank=0, attach_token=self.tok[0])], "ALREADY_EXISTS",
                         "rank 0 already has an open session")
        hold.set()
        first.cancel()
        # The session's end is rank 0's: it is detached; attach it again.
        deadline = time.time() + 10
        while True:
            code, msg, resp = self.call("AttachRank", self.attach_req(0))
            if code == "OK" or time.time() > deadline:
                break
            time.sleep(0.05)
        self.assertEqual(code, "OK", msg)
        self.tok[0] = decode(resp)[2][0].decode()

    def begin(self, rank, step, token=None):
        return self.call("BeginStep", pb((2, rank), (3, step),
                                         (4, self.tok[rank] if token is None else token)))

    def rpc_steps(self):
        B = "BeginStep"
        t1 = self.tok[1]
        self.rpc("BeginStep: attach_token empty", B, pb((2, 1), (3, 1)), "PERMISSION_DENIED",
                 "attach_token: does not match the token issued to rank 1 (none sent")
        self.rpc("BeginStep: attach_token of another rank", B, pb((2, 1), (3, 1),
                                                                  (4, self.tok[0])),
                 "PERMISSION_DENIED", "attach_token: does not match the token issued to rank 1")
        self.rpc("BeginStep: rank >= world_size", B, pb((2, 5), (3, 1), (4, t1)), "OUT_OF_RANGE",
                 "rank: expected 0..1 (world_size 2), got 5")
        self.rpc("BeginStep: job_id unknown", B, pb((1, "nope"), (2, 1), (3, 1), (4, t1)),
                 "NOT_FOUND", "job_id: unknown job 'nope'")
        self.rpc("BeginStep: step 0", B, pb((2, 1), (3, 0), (4, t1)), "OUT_OF_RANGE",
                 "(next), got 0")
        # The job's next step (the c_abi rows ran and aborted steps): from the message.
        msg = self.begin(1, 0)[1]
        nxt = int(msg.split("expected ", 1)[1].split(" ", 1)[0])
        self.rpc("BeginStep: step in the future", B, pb((2, 1), (3, nxt + 4), (4, t1)),
                 "OUT_OF_RANGE", f"step: expected {nxt} (next), got {nxt + 4}")
        self.rpc("BeginStep: step 2^64-1", B, pb((2, 1), (3, U64_MAX), (4, t1)), "OUT_OF_RANGE",
                 f"step: expected {nxt} (next), got {U64_MAX}")
        AB = "AbortStep"
        self.rpc("AbortStep: no step running", AB, pb((2, nxt)), "FAILED_PRECONDITION",
                 "no step is running")
        self.assertEqual(self.begin(1, nxt)[0], "OK")
        self.rpc("BeginStep: two steps ahead of the running one", B,
                 pb((2, 1), (3, nxt + 2), (4, t1)), "OUT_OF_RANGE",
                 f"step: expected {nxt} (running) or {nxt + 1}")
        self.rpc("AbortStep: step other than the running one", AB, pb((2, nxt + 3)),
                 "FAILED_PRECONDITION", f"step: {nxt + 3} is not running (running: {nxt})")
        self.rpc("AbortStep: job_id unknown", AB, pb((1, "nope"), (2, nxt)), "NOT_FOUND",
                 "job_id: unknown job 'nope'")
        self.rpc("AbortStep: the running step (reason 'table')", AB, pb((2, nxt), (3, "table")),
                 "OK", "")
        self.rpc("BeginStep: a step aborted before the rank began it", B,
                 pb((2, 0), (3, nxt), (4, self.tok[0])), "ABORTED",
                 f"step {nxt} was aborted before rank 0 began it (table); begin step {nxt + 1}")
        self.assertEqual(self.begin(1, nxt + 1)[0], "OK")
        self.rpc("AbortStep: reason of 64 KiB (hostd keeps the cause)", AB,
                 pb((2, nxt + 1), (3, "r" * HUGE)), "OK", "")
        self.rpc("BeginStep: a step aborted before the rank began it, for a 64 KiB reason", B,
                 pb((2, 0), (3, nxt + 1), (4, self.tok[0])), "ABORTED",
                 f"step {nxt + 1} was aborted before rank 0 began it")

    def rpc_comm_ids(self):
        P, F = "PublishCommId", "FetchCommId"
        t0, t1 = self.tok[0], self.tok[1]
        uid = b"u" * 128
        self.rpc("PublishCommId: from rank 1", P, pb((2, 1), (3, uid), (4, 1), (5, t1)),
                 "PERMISSION_DENIED", "rank: only rank 0 publishes the communicator id")
        self.rpc("PublishCommId: rank >= world_size", P, pb((2, 5), (3, uid), (4, 1), (5, t1)),
                 "OUT_OF_RANGE", "rank: expected 0..1 (world_size 2), got 5")
        self.rpc("PublishCommId: attach_token empty", P, pb((2, 0), (3, uid), (4, 1)),
                 "PERMISSION_DENIED", "attach_token: does not match the token issued to rank 0")
        self.rpc("PublishCommId: job_id unknown", P,
                 pb((1, "nope"), (2, 0), (3, uid), (4, 1), (5, t0)), "NOT_FOUND",
                 "job_id: unknown job 'nope'")
        self.rpc("PublishCommId: unique_id empty", P, pb((2, 0), (4, 1), (5, t0)),
                 "INVALID_ARGUMENT", "unique_id: expected 1..4096 bytes (128 for NCCL), got 0")
        self.rpc("PublishCommId: unique_id of 4097 bytes", P,
                 pb((2, 0), (3, b"u" * 4097), (4, 1), (5, t0)), "INVALID_ARGUMENT",
                 "unique_id: expected 1..4096 bytes (128 for NCCL), got 4097")
        self.rpc("PublishCommId: generation 0", P, pb((2, 0), (3, uid), (5, t0)),
                 "INVALID_ARGUMENT", "generation: expected >= 1, got 0")
        self.assertEqual(self.call(P, pb((2, 0), (3, uid), (4, 1), (5, t0)))[0], "OK")
        self.rpc("PublishCommId: a generation published twice by one attachment", P,
                 pb((2, 0), (3, uid), (4, 1), (5, t0)), "ALREADY_EXISTS",
                 "generation: 1 is already published")
        self.rpc("FetchCommId: generation not published (wait_ms 20)", F,
                 pb((2, 1), (3, 2), (4, 20), (5, t1)), "DEADLINE_EXCEEDED",
                 "rank 0 has not published the communicator id of generation 2 within 20 ms")
        self.rpc("FetchCommId: generation 0 (never published)", F,
                 pb((2, 1), (3, 0), (4, 20), (5, t1)), "INVALID_ARGUMENT",
                 "generation: expected >= 1, got 0")
        self.rpc("FetchCommId: rank >= world_size", F, pb((2, 5), (3, 1), (5, t1)),
                 "OUT_OF_RANGE", "rank: expected 0..1 (world_size 2), got 5")
        self.rpc("FetchCommId: attach_token empty", F, pb((2, 1), (3, 1)), "PERMISSION_DENIED",
                 "attach_token: does not match the token issued to rank 1")
        self.rpc("FetchCommId: job_id unknown", F, pb((1, "nope"), (2, 1), (3, 1), (5, t1)),
                 "NOT_FOUND", "job_id: unknown job 'nope'")
        t = time.time()
        self.rpc("FetchCommId: wait_ms 2^64-1 (capped at 600000) for a published generation", F,
                 pb((2, 1), (3, 1), (4, U64_MAX), (5, t1)), "OK", "128 bytes",
                 describe=lambda r: f"{len(decode(r)[1][0])} bytes")
        self.assertLess(time.time() - t, 5)
        # An unpublished one waits (up to 10 minutes) for rank 0: the client's deadline ends it.
        t = time.time()
        self.rpc("FetchCommId: wait_ms 2^64-1 for an unpublished generation, 1 s deadline", F,
                 pb((2, 1), (3, 3), (4, U64_MAX), (5, t1)), "DEADLINE_EXCEEDED", "",
                 timeout=1)
        self.assertLess(time.time() - t, 5)

    def rpc_hyperparams(self):
        U = "UpdateHyperParams"

        def hp(fields, **opt):
            return pb((2, optimizer(**opt)), *[(3, f) for f in fields])

        self.rpc("UpdateHyperParams: fields empty", U, hp([], lr=1e-3), "INVALID_ARGUMENT",
                 "fields: expected at least one")
        self.rpc("UpdateHyperParams: fields names an unknown setting", U, hp(["momentum"]),
                 "INVALID_ARGUMENT", "fields: 'momentum' cannot be changed")
        self.rpc("UpdateHyperParams: fields holds an empty name", U, hp([""]),
                 "INVALID_ARGUMENT", "fields: '' cannot be changed")
        self.rpc("UpdateHyperParams: fields holds a name of 64 KiB", U, hp(["f" * HUGE]),
                 "INVALID_ARGUMENT", "fields: ")
        for fixed in ("grad_dtype", "no_decay_norms_and_biases", "scale_by_world_size"):
            self.rpc(f"UpdateHyperParams: fields names {fixed} (fixed by the job)", U,
                     hp([fixed], grad_dtype=FP32, no_decay_norms_and_biases=True,
                        scale_by_world_size=True), "INVALID_ARGUMENT",
                     f"fields: '{fixed}' cannot be changed")
        self.rpc("UpdateHyperParams: job_id unknown", U, pb((1, "nope")) + hp(["lr"], lr=1e-3),
                 "NOT_FOUND", "job_id: unknown job 'nope'")
        # Each settable field with the values the configuration refuses, in the config's words.
        cases = [
            ("lr", NAN, {}), ("lr", INF, {}), ("lr", -INF, {}), ("lr", -1.0, {}),
            ("beta1", 1.0, {}), ("beta1", -0.5, {}), ("beta1", NAN, {}),
            ("beta2", 1.0, {}), ("beta2", INF, {}),
            ("eps", 0.0, {}), ("eps", -1e-8, {}), ("eps", INF, {}), ("eps", NAN, {}),
            ("weight_decay", -1.0, {}), ("weight_decay", NAN, {}), ("weight_decay", INF, {}),
            ("min_lr_ratio", 2.0, {}), ("min_lr_ratio", -0.5, {}), ("min_lr_ratio", NAN, {}),
            ("max_grad_norm", -1.0, {}), ("max_grad_norm", NAN, {}), ("max_grad_norm", INF, {}),
            ("max_grad_norm", 0.0, {"clip": PER_LAYER}),
            ("max_grad_norm", 0.0, {"clip": GLOBAL}),
            # No clipping: still refused by the configuration, whatever clip is.
            ("max_grad_norm", 0.0, {}),
        ]
        for field, value, extra in cases:
            fields = [field] + list(extra)
            flags = [f"--{field}", repr(value)]
            for k, v in extra.items():
                flags = [f"--{k}", {PER_LAYER: "per_layer", GLOBAL: "global"}[v]] + flags
            label = ", ".join([f"{field} {value}"] + [f"{k} {flags[1]}" for k in extra])
            self.rpc(f"UpdateHyperParams: {label}", U, hp(fields, **{field: value}, **extra),
                     "INVALID_ARGUMENT", f"optimizer.{field}: ", config=flags)
        self.rpc("UpdateHyperParams: warmup_steps > total_steps with a linear schedule", U,
                 hp(["schedule", "warmup_steps", "total_steps"], schedule=LINEAR,
                    warmup_steps=10, total_steps=5), "INVALID_ARGUMENT",
                 "optimizer.warmup_steps: 10 exceeds total_steps (5)",
                 config=["--schedule", "linear", "--warmup_steps", "10", "--total_steps", "5"])
        self.rpc("UpdateHyperParams: schedule 99", U, hp(["schedule"], schedule=99),
                 "INVALID_ARGUMENT", "optimizer.schedule: invalid value 99",
                 config=["--schedule", "99"], choices=True)
        self.rpc("UpdateHyperParams: clip 99", U, hp(["clip"], clip=99), "INVALID_ARGUMENT",
                 "optimizer.clip: invalid value 99", config=["--clip", "99"], choices=True)
        # beta1 0 and beta2 0 are in bounds; eps 0 is not, and a request that names all three
        # is not a request that left them unset.
        self.rpc("UpdateHyperParams: beta1 0, beta2 0 and eps 0 named in fields", U,
                 hp(["beta1", "beta2", "eps"], beta1=0.0, beta2=0.0, eps=0.0),
                 "INVALID_ARGUMENT", "optimizer.eps: must be a finite number > 0, got 0.0",
                 config=["--beta1", "0", "--beta2", "0", "--eps", "0"])

    def rpc_export(self):
        E = "ExportHF"
        good = os.path.join(self.roots, "export")
        full = os.path.join(self.roots, "full")
        os.makedirs(full)
        with open(os.path.join(full, "notes.txt"), "w") as f:
            f.write("the user's\n")
        self.rpc("ExportHF: dtype 99", E, pb((2, good), (3, 99)), "INVALID_ARGUMENT",
                 "dtype: expected DTYPE_BF16 or DTYPE_FP32, got 99")
        self.rpc("ExportHF: out_dir empty", E, pb((3, BF16)), "INVALID_ARGUMENT",
                 "out_dir: expected an absolute path")
        self.rpc("ExportHF: out_dir relative", E, pb((2, "rel/export")), "INVALID_ARGUMENT",
                 "out_dir: expected an absolute path (hostd has its own working directory), got "
                 "'rel/export'")
        self.rpc("ExportHF: out_dir outside output_roots", E,
                 pb((2, os.path.join(self.tmp, "outside", "export"))), "PERMISSION_DENIED",
                 "out_dir: ")
        self.rpc("ExportHF: out_dir is the output root itself", E, pb((2, self.roots)),
                 "PERMISSION_DENIED", "is not below one of output_roots")
        self.rpc("ExportHF: out_dir through .. out of the root", E,
                 pb((2, os.path.join(self.roots, "..", "export"))), "PERMISSION_DENIED",
                 "(resolved: ")
        self.rpc("ExportHF: out_dir of 64 KiB", E, pb((2, self.roots + "/" + "d" * HUGE)),
                 "INVALID_ARGUMENT", "out_dir: ")
        self.rpc("ExportHF: out_dir whose parent does not exist", E,
                 pb((2, os.path.join(self.roots, "no", "such"))), "NOT_FOUND",
                 "out_dir: the parent directory")
        self.rpc("ExportHF: out_dir not empty, without overwrite", E, pb((2, full)),
                 "ALREADY_EXISTS", "exists and is not empty")
        self.rpc("ExportHF: overwrite of a directory hostd did not write", E,
                 pb((2, full), (5, True)), "FAILED_PRECONDITION", "notes.txt")
        self.rpc("ExportHF: config_json malformed", E, pb((2, good), (6, "{nope")),
                 "INVALID_ARGUMENT", "config_json: malformed JSON")
        other = dict(TINY, hidden_size=128)
        self.rpc("ExportHF: config_json of another model", E,
                 pb((2, good), (6, json.dumps(other))), "INVALID_ARGUMENT",
                 "config_json: describes a model with manifest hash")
        self.rpc("ExportHF: job_id unknown", E, pb((1, "nope"), (2, good)), "NOT_FOUND",
                 "job_id: unknown job 'nope'")
        self.rpc("ExportHF: max_shard_bytes 1 (every tensor a shard of its own)", E,
                 pb((2, good), (4, 1)), "OK", "49 files",
                 describe=lambda r: f"{len(decode(r).get(3, []))} files")

    def rpc_checkpoint(self):
        C = "Checkpoint"
        self.rpc("Checkpoint: dir empty and no checkpoint.dir configured", C, pb((2, True)),
                 "FAILED_PRECONDITION", "dir: no checkpoint directory")
        self.rpc("Checkpoint: dir relative", C, pb((3, "rel/ckpt")), "INVALID_ARGUMENT",
                 "dir: expected an absolute path (hostd has its own working directory), got "
                 "'rel/ckpt'")
        self.rpc("Checkpoint: dir outside output_roots", C,
                 pb((3, os.path.join(self.tmp, "outside"))), "PERMISSION_DENIED",
                 "is neither hostd's checkpoint.dir (none set)")
        self.rpc("Checkpoint: dir of 64 KiB", C, pb((3, self.roots + "/" + "d" * HUGE)),
                 "INVALID_ARGUMENT", "dir: ")
        self.rpc("Checkpoint: job_id unknown", C,
                 pb((1, "nope"), (3, os.path.join(self.roots, "ckpt"))), "NOT_FOUND",
                 "job_id: unknown job 'nope'")

    # --- CreateJob and the client-updated layers: the hostd started with --model none ---------

    def job(self, case, request, expected, fragment, **kw):
        return self.rpc(f"CreateJob: {case}", "CreateJob", request, expected, fragment,
                        channel=self.channel_none, **kw)

    def test_rpc_job(self):
        self.rpc_create_job_spec()
        self.rpc_create_job_manifest()
        self.rpc_create_job_resume()
        self.rpc_client_layers()

    def rpc_create_job_spec(self):
        job = self.job
        job("spec absent", b"", "INVALID_ARGUMENT", "manifest.layers is empty")
        job("spec.job_id with '/'", create_job(job_id="a/b"), "INVALID_ARGUMENT",
            "spec.job_id: 'a/b' is not 1 to 64 characters of [A-Za-z0-9_.-]")
        job("spec.job_id of 65 characters", create_job(job_id="j" * 65), "INVALID_ARGUMENT",
            "spec.job_id: '" + "j" * 65 + "' is not 1 to 64 characters")
        job("spec.job_id of 64 KiB", create_job(job_id="j" * HUGE), "INVALID_ARGUMENT",
            "spec.job_id: ")
        for w in (65, 2**32 - 1):
            job(f"spec.world_size {w}", create_job(world_size=w), "INVALID_ARGUMENT",
                f"spec.world_size: must be in 1..64, got {w}", config=["--world_size", str(w)])
        job("spec.routes.param_route 99", create_job(routes=routes(param_route=99)),
            "INVALID_ARGUMENT", "spec.routes.param_route: invalid value 99",
            config=["--param_route", "99"], choices=True)
        job("spec.routes.grad_route 99", create_job(routes=routes(grad_route=99)),
            "INVALID_ARGUMENT", "spec.routes.grad_route: invalid value 99",
            config=["--grad_route", "99"], choices=True)
        for c, label in [(1 << 62, "2^62"), (U64_MAX, "2^64-1"), ((1 << 30) + 4096,
                                                                  "1 GiB + 4096"),
                         (5000, "5000"), (4095, "4095"), (2048, "2048"), (1, "1")]:
            job(f"spec.routes.chunk_bytes {label}", create_job(routes=routes(chunk_bytes=c)),
                "INVALID_ARGUMENT", f"spec.routes.chunk_bytes: must be a multiple of 4096 from "
                f"4KiB to 1GiB, got {c}", config=["--chunk_bytes", str(c)])
        # OptimizerConfig: each field with each out-of-bound value the configuration refuses.
        # The betas and eps are given with it (a message with all three 0 means "unset").
        adam = {"beta1": 0.9, "beta2": 0.999, "eps": 1e-8}
        cases = [
            ("lr", NAN, {}), ("lr", INF, {}), ("lr", -INF, {}), ("lr", -1.0, {}),
            ("beta1", 1.0, {}), ("beta1", -0.5, {}), ("beta1", NAN, {}), ("beta1", INF, {}),
            ("beta2", 1.0, {}), ("beta2", -1.0, {}), ("beta2", NAN, {}),
            ("eps", 0.0, {}), ("eps", -1e-8, {}), ("eps", INF, {}), ("eps", NAN, {}),
            ("weight_decay", -1.0, {}), ("weight_decay", NAN, {}), ("weight_decay", INF, {}),
            ("min_lr_ratio", 2.0, {}), ("min_lr_ratio", -0.5, {}), ("min_lr_ratio", NAN, {}),
            ("max_grad_norm", -1.0, {}), ("max_grad_norm", NAN, {}), ("max_grad_norm", INF, {}),
            ("max_grad_norm", 0.0, {"clip": PER_LAYER}),
            ("max_grad_norm", 0.0, {"clip": GLOBAL}),
        ]
        for field, value, extra in cases:
            opt = dict(adam, **extra)
            opt[field] = value
            flags = [f"--{field}", repr(value)]
            for k, v in extra.items():
                flags = [f"--{k}", {PER_LAYER: "per_layer", GLOBAL: "global"}[v]] + flags
            label = ", ".join([f"{field} {value}"] + [f"{k} {flags[1]}" for k in extra])
            job(f"spec.optimizer.{label}", create_job(opt=optimizer(**opt)), "INVALID_ARGUMENT",
                f"spec.optimizer.{field}: ", config=flags)
        for kind, name in ((LINEAR, "linear"), (3, "cosine")):
            job(f"spec.optimizer.warmup_steps > total_steps ({name})",
                create_job(opt=optimizer(schedule=kind, warmup_steps=10, total_steps=5)),
                "INVALID_ARGUMENT", "spec.optimizer.warmup_steps: 10 exceeds total_steps (5)",
                config=["--schedule", name, "--warmup_steps", "10", "--total_steps", "5"])
        job("spec.optimizer.schedule 99", create_job(opt=optimizer(schedule=99)),
            "INVALID_ARGUMENT", "spec.optimizer.schedule: invalid value 99",
            config=["--schedule", "99"], choices=True)
        job("spec.optimizer.clip 99", create_job(opt=optimizer(clip=99)), "INVALID_ARGUMENT",
            "spec.optimizer.clip: invalid value 99", config=["--clip", "99"], choices=True)
        job("spec.optimizer.grad_dtype 99", create_job(opt=optimizer(grad_dtype=99)),
            "INVALID_ARGUMENT", "spec.optimizer.grad_dtype: invalid value 99",
            config=["--grad_dtype", "99"], choices=True)

    def rpc_create_job_manifest(self):
        job = self.job
        t = tensor("t", [4])
        job("spec.manifest.layers empty", create_job(manifest()), "INVALID_ARGUMENT",
            "manifest.layers is empty")
        many = manifest(*[layer(f"l{i}", 2, tensor(f"t{i}", [1])) for i in range(100001)])
        job("spec.manifest.layers: 100001", create_job(many), "INVALID_ARGUMENT",
            "manifest.layers has 100001 layers; at most 100000")
        job("spec.manifest.layers[].name empty", create_job(manifest(layer("", 2, t))),
            "INVALID_ARGUMENT", "manifest.layers[0].name is empty")
        job("spec.manifest.layers[].name twice",
            create_job(manifest(layer("l0", 2, t), layer("l0", 2, tensor("u", [4])))),
            "INVALID_ARGUMENT", "manifest.layers[1] ('l0').name: duplicate layer name")
        for kind in (0, 99):
            job(f"spec.manifest.layers[].kind {kind}", create_job(manifest(layer("l0", kind, t))),
                "INVALID_ARGUMENT", f"manifest.layers[0] ('l0').kind is {kind}; expected one of")
        job("spec.manifest.layers[].name of 64 KiB (and kind 0)",
            create_job(manifest(layer("l" * HUGE, 0, t))), "INVALID_ARGUMENT",
            ".kind is 0; expected one of")
        job("spec.manifest.layers[].tensors empty", create_job(manifest(layer("l0", 2))),
            "INVALID_ARGUMENT", "manifest.layers[0] ('l0').tensors is empty")
        job("spec.manifest.layers[].tensors[].name empty",
            create_job(manifest(layer("l0", 2, tensor("", [4])))), "INVALID_ARGUMENT",
            "manifest.layers[0] ('l0').tensors[0].name is empty")
        job("spec.manifest.layers[].tensors[].name twice (across layers)",
            create_job(manifest(layer("l0", 2, t), layer("l1", 2, t))), "INVALID_ARGUMENT",
            "manifest.layers[1] ('l1').tensors[0] ('t').name: duplicate tensor name")
        job("spec.manifest.layers[].tensors[].name of 64 KiB (and shape [0])",
            create_job(manifest(layer("l0", 2, tensor("t" * HUGE, [0])))), "INVALID_ARGUMENT",
            ".shape[0] is 0; every dimension must be >= 1")
        job("spec.manifest.layers[].tensors[].shape without dimensions",
            create_job(manifest(layer("l0", 2, tensor("t", [])))), "INVALID_ARGUMENT",
            "tensors[0] ('t').shape has 0 dimensions; expected 1 to 8")
        job("spec.manifest.layers[].tensors[].shape of 9 dimensions",
            create_job(manifest(layer("l0", 2, tensor("t", [1] * 9)))), "INVALID_ARGUMENT",
            "tensors[0] ('t').shape has 9 dimensions; expected 1 to 8")
        job("spec.manifest.layers[].tensors[].shape[1] 0",
            create_job(manifest(layer("l0", 2, tensor("t", [4, 0])))), "INVALID_ARGUMENT",
            "tensors[0] ('t').shape[1] is 0; every dimension must be >= 1")
        job("spec.manifest.layers[].tensors[].shape[1] -3",
            create_job(manifest(layer("l0", 2, tensor("t", [4, -3])))), "INVALID_ARGUMENT",
            "tensors[0] ('t').shape[1] is -3; every dimension must be >= 1")
        job("spec.manifest.layers[].tensors[].shape 2^32 x 2^32 (2^64 elements: wraps)",
            create_job(manifest(layer("l0", 2, tensor("t", [2**32, 2**32])))),
            "INVALID_ARGUMENT", "tensors[0] ('t').shape: element count overflows")
        job("spec.manifest.layers[].tensors[].shape 2^40 x 2^20 (past 2^56)",
            create_job(manifest(layer("l0", 2, tensor("t", [2**40, 2**20])))),
            "INVALID_ARGUMENT", "tensors[0] ('t').shape: element count overflows; at most "
            f"{2**56} elements")
        job("spec.manifest.layers[].tensors: two of 2^56 elements in one layer",
            create_job(manifest(layer("l0", 2, tensor("t", [2**56]), tensor("u", [2**56])))),
            "INVALID_ARGUMENT", "manifest.layers[0] ('l0'): element count overflows")
        job("spec.manifest.layers: two layers of 2^56 elements",
            create_job(manifest(layer("l0", 2, tensor("t", [2**56])),
                                layer("l1", 2, tensor("u", [2**56])))),
            "INVALID_ARGUMENT", "manifest: total element count exceeds")
        job("spec.manifest of 2^56 elements (in bounds; no machine holds its 768 PiB)",
            create_job(manifest(layer("l0", 2, tensor("t", [2**56])))), "RESOURCE_EXHAUSTED",
            "needs")
        for dtype in (0, 99):
            job(f"spec.manifest.layers[].tensors[].dtype {dtype}",
                create_job(manifest(layer("l0", 2, tensor("t", [4], dtype)))),
                "INVALID_ARGUMENT", f"tensors[0] ('t').dtype is {dtype}; expected DTYPE_BF16")

    def rpc_create_job_resume(self):
        job = self.job
        nothing = os.path.join(self.tmp, "no-such-checkpoint")
        job("resume_path that does not exist", create_job(None, resume_path=nothing),
            "NOT_FOUND", f"resume_path: checkpoint path {nothing} does not exist")
        job("resume_path a directory that holds no checkpoint",
            create_job(None, resume_path=self.roots), "NOT_FOUND",
            "resume_path: no committed checkpoint in")
        notes = os.path.join(self.tmp, "hostd.log")
        job("resume_path a file", create_job(None, resume_path=notes), "NOT_FOUND",
            "is not a directory")
        job("resume_path relative", create_job(None, resume_path="rel/ckpt"),
            "INVALID_ARGUMENT", "resume_path: expected an absolute path")
        job("resume_path of 64 KiB", create_job(None, resume_path="/" + "r" * HUGE),
            "INVALID_ARGUMENT", "resume_path: ")

    def rpc_client_layers(self):
        # The job: world size 2, layer 0 (128 parameters) updated by the ranks. Its seed, a
        # wrong manifest_hash (hostd computes it) and a long model name are taken as they are.
        mani = manifest(layer("l0", 1, tensor("l0.w", [16, 8])),
                        layer("l1", 2, tensor("l1.w", [8, 8])),
                        name="n" * 256, manifest_hash="0000000000000000")

        def effective(resp):
            spec = decode(decode(resp)[1][0])
            m = decode(spec[2][0])
            return f"seed {spec[6][0]}, manifest_hash {m[5][0].decode()}"

        code, resp = self.job("spec.seed 2^64-1 and a wrong manifest.manifest_hash are taken "
                              "(hostd computes the hash)",
                              create_job(mani, job_id="cj", world_size=2, seed=U64_MAX), "OK",
                              f"seed {U64_MAX}, manifest_hash ", describe=effective)
        self.assertEqual(code, "OK")
        spec = decode(decode(resp)[1][0])
        mhash = decode(spec[2][0])[5][0].decode()
        self.assertNotEqual(mhash, "0000000000000000")
        self.job("the job's own manifest again (idempotent) with spec.optimizer.lr nan",
                 create_job(mani, job_id="cj", world_size=2, opt=optimizer(lr=NAN)),
                 "INVALID_ARGUMENT", "spec.optimizer.lr: must be a finite number >= 0, got nan",
                 config=["--lr", "nan"])
        ch = self.channel_none
        tok0 = self.attach(0, ch, self.attach_req(0, job_id="cj", mhash=mhash) + pb((7, 0)))
        U, R = "UploadClientLayer", "ReadClientLayer"

        def up(case, expected, fragment, **f):
            nums = {"job_id": 1, "rank": 2, "attach_token": 3, "step": 4, "layer": 5, "part": 6,
                    "offset": 7, "data": 8}
            fields = {"rank": 0, "attach_token": tok0, "step": 0, "layer": 0, "part": 0,
                      "offset": 0, "data": b"\0" * 16}
            fields.update(f)
            self.rpc(f"UploadClientLayer: {case}", U,
                     pb(*[(nums[k], v) for k, v in fields.items()]), expected, fragment,
                     channel=ch)

        def read(case, expected, fragment, **f):
            nums = {"job_id": 1, "layer": 2, "part": 3, "offset": 4, "count": 5, "rank": 6,
                    "attach_token": 7}
            fields = {"layer": 0, "part": 0, "offset": 0, "count": 4, "rank": 0,
                      "attach_token": tok0}
            fields.update(f)
            self.rpc(f"ReadClientLayer: {case}", R,
                     pb(*[(nums[k], v) for k, v in fields.items()]), expected, fragment,
                     channel=ch, describe=lambda r: f"{len(decode(r).get(2, [b''])[0])} bytes")

        up("rank not attached", "FAILED_PRECONDITION", "rank 1 is not attached", rank=1)
        read("rank not attached", "FAILED_PRECONDITION", "rank 1 is not attached", rank=1)
        tok1 = self.attach(1, ch, self.attach_req(1, job_id="cj", mhash=mhash) + pb((7, 0)))
        up("job_id unknown", "NOT_FOUND", "job_id: unknown job 'nope'", job_id="nope")
        up("rank >= world_size", "OUT_OF_RANGE", "rank: expected 0..1 (world_size 2), got 2",
           rank=2)
        up("attach_token forged", "PERMISSION_DENIED", "attach_token: does not match",
           attach_token="forged")
        up("attach_token empty", "PERMISSION_DENIED", "(none sent", attach_token="")
        up("from rank 1 (only rank 0 uploads)", "FAILED_PRECONDITION",
           "rank: only rank 0 uploads", rank=1, attach_token=tok1)
        up("step other than the last completed one", "FAILED_PRECONDITION",
           "step: hostd accepts an unasked upload only between steps, of the last completed "
           "step (0)", step=7)
        up("layer hostd updates", "FAILED_PRECONDITION", "layer: 1 is not updated by the ranks",
           layer=1)
        up("layer that does not exist", "OUT_OF_RANGE", "layer: 99 does not exist", layer=99)
        up("part 3", "INVALID_ARGUMENT", "part: expected 0 (master), 1 (m) or 2 (v), got 3",
           part=3)
        up("offset past the end", "OUT_OF_RANGE",
           "offset: 128 + 4 elements pass the end of layer 0 (128 elements)", offset=128)
        up("offset 2^64-1", "OUT_OF_RANGE", f"offset: {U64_MAX} + 4 elements pass the end",
           offset=U64_MAX)
        up("data empty", "INVALID_ARGUMENT", "data: expected 1..4194304 FP32 values", data=b"")
        up("data not a multiple of 4 bytes", "INVALID_ARGUMENT",
           "data: expected 1..4194304 FP32 values (a multiple of 4 bytes), got 6 bytes",
           data=b"\0" * 6)
        up("data of 4194305 values (16 MiB + 4 bytes)", "INVALID_ARGUMENT",
           "got 16777220 bytes", data=b"\0" * (4 * 4194305))
        read("job_id unknown", "NOT_FOUND", "job_id: unknown job 'nope'", job_id="nope")
        read("rank >= world_size", "OUT_OF_RANGE", "rank: expected 0..1 (world_size 2), got 2",
             rank=2)
        read("attach_token forged", "PERMISSION_DENIED", "attach_token: does not match",
             attach_token="forged")
        read("layer hostd updates", "FAILED_PRECONDITION", "layer: 1 is not updated by the ranks",
             layer=1)
        read("layer that does not exist", "OUT_OF_RANGE", "layer: 99 does not exist", layer=99)
        read("part 3", "INVALID_ARGUMENT", "part: expected 0 (master), 1 (m) or 2 (v), got 3",
             part=3)
        read("offset past the end", "OUT_OF_RANGE",
             "offset: 126 + 4 elements pass the end of layer 0 (128 elements)", offset=126)
        read("offset 2^64-1", "OUT_OF_RANGE", f"offset: {U64_MAX} + 4 elements pass the end",
             offset=U64_MAX)
        read("count 0", "INVALID_ARGUMENT", "count: expected 1..4194304, got 0", count=0)
        read("count 4194305", "INVALID_ARGUMENT", "count: expected 1..4194304, got 4194305",
             count=4194305)
        read("the whole layer (its copy is current)", "OK", "512 bytes", count=128)
        self.rpc("ExportHF: config_json empty for a job created over RPC", "ExportHF",
                 pb((2, os.path.join(self.roots, "cj-export"))), "INVALID_ARGUMENT",
                 "config_json: the job has no HF config (it was created over RPC)", channel=ch)
        # Last: the old hostd crashed here (an upload of version 0 indexed the per-layer progress
        # of an upload that had never begun).
        up("version 0 of a fresh job (hostd's copy is at it)", "ALREADY_EXISTS",
           "hostd's copy of the client-updated layers is at version 0 already")
        self.still_serving("hostd --model none", self.hostd_none.proc)

    def still_serving(self, which, proc):
        try:  # a crash a row caused may take a moment to end the process
            rc = proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            rc = None
        self.record("rpc", f"(wire): {which} is still running after its rows", "running", "",
                    "running" if rc is None else
                    (f"killed by signal {-rc}" if rc < 0 else f"exited {rc}"), "")

    # --- c_abi -----------------------------------------------------------------------------------

    def abi(self, case, rc, expected, fragment):
        msg = (self.lib.slidedp_rank_last_error() or b"").decode() if rc != OK else ""
        self.record("c_abi", case, CODES.get(expected, str(expected)), fragment,
                    CODES.get(rc, str(rc)), msg)

    def opts(self, rank, **kw):
        o = RankOptions(2, self.sock.encode(), None, rank, self.hash, -1, 10000, None, 0)
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
