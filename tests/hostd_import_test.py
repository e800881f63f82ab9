#!/usr/bin/env python3
"""hostd imports HF safetensors weights at startup (init auto / a path), checked end to end.

Usage: hostd_import_test.py HOSTD SLIDEDPCTL LIBSLIDEDP_RANK.so   (CTest passes the built files)
Python standard library only: the checkpoints are written by hand (8-byte header length, JSON
header, data), so no safetensors/torch install is needed.

For the built-in `tiny` shape (a Qwen3 config.json written here), checkpoints stored as BF16, F16
and F32, single-file and sharded (model.safetensors.index.json), must give hostd a master that is
the exact FP32 widening of the stored values, m = v = 0 and BF16 params that are their
round-to-nearest-even cast: the per-layer checksums of `slidedpctl layers --checksums` (xxh64
over master | m | v | params) are recomputed here, and the version-0 params are fetched through
libslidedp_rank's C ABI and compared byte for byte. Bad checkpoints (shape mismatch, missing
tensor, unsupported dtype, truncated file) make hostd exit non-zero naming the tensor, before it
serves anything and without leaving shared memory behind.
"""
import array
import ctypes
import json
import os
import random
import shutil
import struct
import subprocess
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import HostdProcess, ctl_json, shm_names, use_python_client  # noqa: E402

use_python_client()
from slidedp import _lib  # noqa: E402
from slidedp._lib import RankOptions  # noqa: E402

HOSTD = SLIDEDPCTL = LIBPATH = None

TINY = {
    "_name_or_path": "tiny-import", "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
    "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "hidden_act": "silu",
    "max_position_embeddings": 512, "rms_norm_eps": 1e-06, "rope_theta": 10000.0,
    "attention_bias": False, "tie_word_embeddings": False, "initializer_range": 0.02,
    "torch_dtype": "bfloat16",
}


def tiny_tensors(tied):
    """(name, shape) of the HF Qwen3ForCausalLM state_dict for TINY, in HF's sorted order."""
    h, inter, vocab, hd = 64, 128, 512, 16
    out = [("model.embed_tokens.weight", [vocab, h]), ("model.norm.weight", [h])]
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
    if not tied:
        out.append(("lm_head.weight", [vocab, h]))
    return sorted(out)


def numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


# --- values: stored bytes and the FP32 bits hostd must hold -------------------------------------

def make_values(dtype, n, rng):
    """(stored little-endian bytes, expected FP32 bit patterns) for n finite values."""
    if dtype == "F32":
        bits = array.array("I", (rng.getrandbits(32) for _ in range(n)))
        for i in range(n):
            b = bits[i]
            if i % 5 == 0:
                b = (b & 0xFFFF0000) | 0x8000  # an exact tie of the BF16 rounding
            if b & 0x7F800000 == 0x7F800000:
                b &= 0xBFFFFFFF  # no Inf/NaN
            bits[i] = b
        return bits.tobytes(), bits
    halves = array.array("H", (rng.getrandbits(16) for _ in range(n)))
    exp_mask = 0x7F80 if dtype == "BF16" else 0x7C00
    for i in range(n):
        if halves[i] & exp_mask == exp_mask:
            halves[i] &= 0xBFFF
    if dtype == "BF16":
        return halves.tobytes(), array.array("I", (h << 16 for h in halves))
    floats = struct.unpack(f"<{n}e", halves.tobytes())  # binary16 -> double: exact
    return halves.tobytes(), array.array("I", struct.unpack(f"<{n}I", struct.pack(f"<{n}f",
                                                                                  *floats)))


def bf16_rne(bits):
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF


# --- safetensors writer ------------------------------------------------------------------------

def safetensors_bytes(tensors, metadata=None):
    """tensors: list of (name, dtype, shape, data bytes)."""
    header, data = {}, bytearray()
    if metadata:
        header["__metadata__"] = metadata
    for name, dtype, shape, raw in tensors:
        header[name] = {"dtype": dtype, "shape": shape,
                        "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + bytes(data)


def write_checkpoint(directory, tensors, shards):
    """Writes model.safetensors (shards == 1) or `shards` files plus the index."""
    os.makedirs(directory, exist_ok=True)
    if shards == 1:
        with open(os.path.join(directory, "model.safetensors"), "wb") as f:
            f.write(safetensors_bytes(tensors, {"format": "pt"}))
        return os.path.join(directory, "model.safetensors")
    weight_map = {}
    for s in range(shards):
        name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = tensors[s::shards]
        for t in part:
            weight_map[t[0]] = name
        with open(os.path.join(directory, name), "wb") as f:
            f.write(safetensors_bytes(part, {"format": "pt"}))
    index = os.path.join(directory, "model.safetensors.index.json")
    with open(index, "w") as f:
        json.dump({"metadata": {"total_size": sum(len(t[3]) for t in tensors)},
                   "weight_map": weight_map}, f)
    return index


def write_config(directory, tied=False):
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(dict(TINY, tie_word_embeddings=tied), f)


# --- xxh64 (the checksum slidedpctl reports), standard library only ----------------------------

P1, P2, P3 = 0x9E3779B185EBCA87, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9
P4, P5, M64 = 0x85EBCA77C2B2AE63, 0x27D4EB2F165667C5, (1 << 64) - 1


def _round(acc, lane):
    acc = (acc + lane * P2) & M64
    return (((acc << 31) | (acc >> 33)) & M64) * P1 & M64


def _rotl(x, r):
    return ((x << r) | (x >> (64 - r))) & M64


def xxh64(data, seed=0):
    n, i = len(data), 0
    if n >= 32:
        v1, v2, v3, v4 = (seed + P1 + P2) & M64, (seed + P2) & M64, seed, (seed - P1) & M64
        limit = n - n % 32
        for a, b, c, d in struct.iter_unpack("<4Q", memoryview(data)[:limit]):
            v1 = _round(v1, a)
            v2 = _round(v2, b)
            v3 = _round(v3, c)
            v4 = _round(v4, d)
        i = limit
        h = (_rotl(v1, 1) + _rotl(v2, 7) + _rotl(v3, 12) + _rotl(v4, 18)) & M64
        for v in (v1, v2, v3, v4):
            h = ((h ^ _round(0, v)) * P1 + P4) & M64
    else:
        h = (seed + P5) & M64
    h = (h + n) & M64
    while i + 8 <= n:
        h ^= _round(0, struct.unpack_from("<Q", data, i)[0])
        h = (_rotl(h, 27) * P1 + P4) & M64
        i += 8
    if i + 4 <= n:
        h ^= (struct.unpack_from("<I", data, i)[0] * P1) & M64
        h = (_rotl(h, 23) * P2 + P3) & M64
        i += 4
    while i < n:
        h ^= (data[i] * P5) & M64
        h = (_rotl(h, 11) * P1) & M64
        i += 1
    h ^= h >> 33
    h = (h * P2) & M64
    h ^= h >> 29
    h = (h * P3) & M64
    return h ^ (h >> 32)


# --- the rank C ABI, for the layout and the version-0 params -----------------------------------

class HostdImportTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.lib = _lib.load(LIBPATH)
        cls.counter = 0

    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="slidedp-import-")
        # Cleanups run last first: the hostds serve() registers stop before this removes tmp.
        self.addCleanup(shutil.rmtree, self.tmp, ignore_errors=True)

    def start(self, model, *extra):
        """Starts hostd; returns its HostdProcess. Does not wait."""
        HostdImportTest.counter += 1
        return HostdProcess(
            HOSTD, "--model", model, "--chunk_bytes", "4096", "--mlock", "best_effort",
            "--update_threads", "2", *extra, tmp=self.tmp,
            instance=f"imp{os.getpid()}-{HostdImportTest.counter}", slidedpctl=SLIDEDPCTL,
            wait_ready=False, start_timeout_s=120).start()

    def read(self, path):
        with open(path) as f:
            return f.read()

    def serve(self, model, *extra):
        """hostd serving `model`; stopped at cleanup (exit 0, no segment left). Returns (socket,
        log path)."""
        h = self.start(model, *extra)
        try:
            h.wait_socket()
        except BaseException:
            h.abort()
            raise
        self.addCleanup(h.finish)
        return h.socket, h.log_path

    def ctl_json(self, sock, *args):
        return ctl_json(SLIDEDPCTL, *args, socket=sock)

    def expect_failure(self, model, needles, *extra):
        h = self.start(model, *extra)
        try:
            rc = h.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            h.abort()
            self.fail("hostd kept running on a bad checkpoint: " + h.output())
        h.close()
        text = h.output()
        self.assertNotEqual(rc, 0, text)
        for needle in needles:
            self.assertIn(needle, text)
        self.assertFalse(os.path.exists(h.socket), "hostd served before failing")
        self.assertEqual(shm_names(h.instance), [])
        return text

    # The checks: checksums of every layer and the version-0 params through the rank ABI.
    def check_weights(self, sock, expected_bits):
        """expected_bits: tensor name -> array('I') of the FP32 master bits hostd must hold."""
        status = self.ctl_json(sock, "status")
        checksums = {l["layer"]: l["checksum"]
                     for l in self.ctl_json(sock, "layers", "--checksums")}
        lib = self.lib
        opts = RankOptions(2, sock.encode(), None, 0, status["job"]["manifest_hash"].encode(),
                           -1, 10000)
        h = ctypes.c_void_p()
        self.assertEqual(lib.slidedp_rank_attach(ctypes.byref(opts), ctypes.byref(h)), 0,
                         lib.slidedp_rank_last_error())
        try:
            n = ctypes.c_uint32()
            self.assertEqual(lib.slidedp_rank_num_layers(h, ctypes.byref(n)), 0)
            self.assertEqual(lib.slidedp_rank_begin_step(h, 1, 10000), 0,
                             lib.slidedp_rank_last_error())
            seen = set()
            for layer in range(n.value):
                count = ctypes.c_uint32()
                self.assertEqual(lib.slidedp_rank_layer_info(h, layer, None, 0,
                                                             ctypes.byref(count)), 0)
                master = array.array("I")
                for t in range(count.value):
                    name = ctypes.create_string_buffer(256)
                    off, cnt = ctypes.c_uint64(), ctypes.c_uint64()
                    self.assertEqual(lib.slidedp_rank_layer_tensor(
                        h, layer, t, name, 256, ctypes.byref(off), ctypes.byref(cnt), None, 0,
                        None), 0, lib.slidedp_rank_last_error())
                    tname = name.value.decode()
                    self.assertEqual(off.value, len(master), tname)
                    self.assertEqual(cnt.value, len(expected_bits[tname]), tname)
                    master.extend(expected_bits[tname])
                    seen.add(tname)
                params = array.array("H", (bf16_rne(b) for b in master))
                got = ctypes.create_string_buffer(2 * len(master))
                version = ctypes.c_uint64()
                self.assertEqual(lib.slidedp_rank_fetch_params(
                    h, layer, 0, got, 2 * len(master), 10000, ctypes.byref(version)), 0,
                    lib.slidedp_rank_last_error())
                if got.raw != params.tobytes():
                    fetched = array.array("H", got.raw)
                    i = next(i for i in range(len(params)) if fetched[i] != params[i])
                    self.fail(f"layer {layer}: params[{i}] = {fetched[i]:#06x}, expected "
                              f"{params[i]:#06x} (bf16 RNE of {master[i]:#010x})")
                blob = master.tobytes() + bytes(8 * len(master)) + params.tobytes()
                self.assertEqual(checksums[layer], f"{xxh64(blob, layer):016x}",
                                 f"layer {layer}: master, m or v differ from the checkpoint")
            self.assertEqual(seen, set(expected_bits), "tensors hostd does not hold")
        finally:
            lib.slidedp_rank_detach(h)
        return status

    def checkpoint(self, directory, dtype, shards, tied=False, extra=(), seed=1):
        """Writes a checkpoint of TINY; returns (path written, name -> expected FP32 bits)."""
        rng = random.Random(f"{dtype}-{shards}-{tied}-{seed}")
        tensors, expected = [], {}
        for name, shape in tiny_tensors(tied):
            raw, bits = make_values(dtype, numel(shape), rng)
            tensors.append((name, dtype, shape, raw))
            expected[name] = bits
        for name, dtype_x, shape in extra:
            raw, _ = make_values(dtype_x, numel(shape), rng)
            tensors.append((name, dtype_x, shape, raw))
        return write_checkpoint(directory, tensors, shards), expected

    # --- tests -----------------------------------------------------------------------------------

    def test_xxh64_matches_reference_vectors(self):
        self.assertEqual(xxh64(b""), 0xEF46DB3751D8E999)
        self.assertEqual(xxh64(b"abc"), 0x44BC2CF5AD770999)
        self.assertEqual(xxh64(b"Nobody inspects the spammish repetition"), 0xFBCEA83C8A378BF1)

    def test_every_dtype_single_and_sharded(self):
        cases = [("BF16", 1, "auto"), ("F16", 1, "path"), ("F32", 1, "auto"),
                 ("BF16", 3, "path"), ("F16", 2, "auto"), ("F32", 4, "dir")]
        for dtype, shards, how in cases:
            with self.subTest(dtype=dtype, shards=shards, init=how):
                model_dir = os.path.join(self.tmp, f"{dtype}-{shards}")
                write_config(model_dir)
                if how == "auto":  # the weights beside config.json, init left at its default
                    written, expected = self.checkpoint(model_dir, dtype, shards)
                    sock, log = self.serve(model_dir)
                elif how == "path":  # --init naming the file (or the index)
                    written, expected = self.checkpoint(os.path.join(model_dir, "w"), dtype,
                                                        shards)
                    sock, log = self.serve(model_dir, "--init", written)
                else:  # SLIDEDP_INIT naming the directory, config.json given as a file
                    written, expected = self.checkpoint(os.path.join(model_dir, "w"), dtype,
                                                        shards)
                    os.environ["SLIDEDP_INIT"] = os.path.join(model_dir, "w")
                    try:
                        sock, log = self.serve(os.path.join(model_dir, "config.json"))
                    finally:
                        del os.environ["SLIDEDP_INIT"]
                status = self.check_weights(sock, expected)
                want = f"safetensors {written}" + (f" ({shards} files)" if shards > 1 else "")
                self.assertEqual(status["job"]["weights_source"], want)
                human = subprocess.run([SLIDEDPCTL, "--socket", sock, "status"],
                                       capture_output=True, text=True, check=True).stdout
                self.assertIn(want, human)

    def test_tied_model_ignores_lm_head_and_buffers(self):
        model_dir = os.path.join(self.tmp, "tied")
        write_config(model_dir, tied=True)
        extra = [("lm_head.weight", "BF16", [512, 64]),
                 ("model.layers.0.self_attn.rotary_emb.inv_freq", "F32", [8])]
        _, expected = self.checkpoint(model_dir, "BF16", 2, tied=True, extra=extra)
        self.assertNotIn("lm_head.weight", expected)
        sock, log = self.serve(model_dir)
        self.check_weights(sock, expected)
        self.assertIn("ignoring 2 checkpoint tensor(s) the model does not use: lm_head.weight, "
                      "model.layers.0.self_attn.rotary_emb.inv_freq", self.read(log))

    def test_init_random_and_print_config(self):
        model_dir = os.path.join(self.tmp, "random")
        write_config(model_dir)
        _, expected = self.checkpoint(model_dir, "F32", 1)
        printed = subprocess.run([HOSTD, "--model", model_dir, "--print-config"],
                                 capture_output=True, text=True, check=True).stdout
        self.assertRegex(printed, r'init = "auto"\s+# default')
        printed = subprocess.run([HOSTD, "--init", "random", "--print-config"],
                                 capture_output=True, text=True, check=True).stdout
        self.assertRegex(printed, r'init = "random"\s+# flag')
        sock, _ = self.serve(model_dir, "--init", "random", "--seed", "5")
        status = self.ctl_json(sock, "status")
        self.assertEqual(status["job"]["weights_source"], "random (seed 5)")
        with self.assertRaises(AssertionError):
            self.check_weights(sock, expected)

    def test_bad_checkpoints_stop_hostd_naming_the_tensor(self):
        model_dir = os.path.join(self.tmp, "bad")
        write_config(model_dir)
        rng = random.Random(3)
        good = []
        for name, shape in tiny_tensors(False):
            raw, _ = make_values("BF16", numel(shape), rng)
            good.append((name, "BF16", shape, raw))
        k_proj = "model.layers.2.self_attn.k_proj.weight"

        def write(tensors, shards=1):
            for f in os.listdir(model_dir):
                if f != "config.json":
                    os.remove(os.path.join(model_dir, f))
            return write_checkpoint(model_dir, tensors, shards)

        # The shape is transposed: [64, 32] instead of [32, 64].
        write([(n, d, list(reversed(s)) if n == k_proj else s, r) for n, d, s, r in good])
        self.expect_failure(model_dir, [k_proj, "shape [64, 32] does not match the model's [32, 64]",
                                        "model.safetensors"])
        # A tensor is missing from a sharded checkpoint.
        index = write([t for t in good if t[0] != k_proj], shards=2)
        self.expect_failure(model_dir, [k_proj, index, "lacks 1 of the model's tensors"])
        # An unsupported dtype.
        path = write([(n, "I16" if n == k_proj else d, s, r) for n, d, s, r in good])
        self.expect_failure(model_dir, [k_proj, "dtype 'I16' is not supported", path])
        # A NaN in a tensor.
        nan = [list(t) for t in good]
        for t in nan:
            if t[0] == k_proj:
                t[3] = t[3][:10] + struct.pack("<H", 0x7FC0) + t[3][12:]
        write([tuple(t) for t in nan])
        self.expect_failure(model_dir, [k_proj, "element 5 is NaN"])
        # A header length beyond the file.
        with open(path, "r+b") as f:
            f.write(struct.pack("<Q", os.path.getsize(path)))
        self.expect_failure(model_dir, ["exceeds the file", path])
        # A path that is not there (and one that is not a path).
        self.expect_failure(model_dir, ["no such file or directory"], "--init",
                            os.path.join(self.tmp, "nope"))
        self.expect_failure("tiny", ["init (flag --init): 'weights' is not one of auto, random, "
                                     "zeros, or a path"], "--init", "weights")


if __name__ == "__main__":
    HOSTD, SLIDEDPCTL, LIBPATH = sys.argv[1:4]
    unittest.main(argv=sys.argv[:1], verbosity=2)
