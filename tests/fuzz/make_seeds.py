#!/usr/bin/env python3
"""Writes the seed corpora of the fuzz targets (tests/fuzz/corpus/<target>/): small valid inputs of
each surface, in each target's input format (see the targets' opening comments). Re-run after a
format change; the files are checked in."""
import json
import os
import struct
import sys

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus")


def put(target, name, data):
    d = os.path.join(OUT, target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data if isinstance(data, bytes) else data.encode())


def safetensors(tensors, metadata=None):
    """tensors: list of (name, dtype, shape, bytes)."""
    header, data, off = {}, b"", 0
    for name, dtype, shape, raw in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + len(raw)]}
        data += raw
        off += len(raw)
    if metadata is not None:
        header["__metadata__"] = metadata
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + data


# --- fuzz_safetensors: byte 0 = mode
f32 = struct.pack("<4f", 1.0, -2.5, 3.0e-39, float("inf"))
single = safetensors([("a", "F32", [2, 2], f32), ("b", "BF16", [3], b"\x80\x3f\x00\xc0\xc0\x7f"),
                      ("c", "F16", [], b"\x00\x3c")], {"format": "pt"})
put("fuzz_safetensors", "file_three_dtypes", b"\x00" + single)
put("fuzz_safetensors", "file_empty_tensor", b"\x00" + safetensors([("z", "F32", [0, 4], b"")]))
index = json.dumps({"metadata": {"total_size": 22},
                    "weight_map": {"a": "a.safetensors", "b": "a.safetensors"}})
put("fuzz_safetensors", "index", b"\x01" + index.encode())
put("fuzz_safetensors", "checkpoint", b"\x02" + index.encode() + b"\n--SHARD--\n" + single)
hdr = json.dumps({"w": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [4, 16]}})
put("fuzz_safetensors", "header", b"\x03" + struct.pack("<Q", 16) + hdr.encode())

# --- fuzz_config: TOML \n%%\n env lines \n%%\n argv lines
put("fuzz_config", "file_only", """lr = 3e-4
beta1 = 0.9
world_size = 4
chunk_bytes = "16MiB"
grad_route = "reduce_scatter"
schedule = "cosine"
warmup_steps = 10
total_steps = 100
clip = "global"
max_grad_norm = 1.0
socket = "/tmp/hostd.sock"
mlock = "off"
""")
put("fuzz_config", "all_sources", """instance = "fz"
numa_node = 0
shm_mode = "0660"
shm_group = "users"
update_granularity = "layer"
\n%%\nLR=1e-3
SLIDEDP_WORLD_SIZE=2
CHUNK_BYTES=4M
\n%%\n--eps
1e-6
--listen_tcp=127.0.0.1:7070
--no_decay_norms_and_biases
false
""")
put("fuzz_config", "flags_only", "\n%%\n\n%%\n--print-config\n--isa\nscalar\n--heartbeat_deadline_ms=2000\n")

# --- fuzz_shm: byte 0 mode (route % 3, bit 2 FP32, bits 3-4 granularity), 128 mask bytes,
# then 16-byte records [op, rank, field, value (8), fill, flags, pad (3)].
def rec(op, rank, field=0, value=0, fill=0x3c, flags=0):
    return bytes([op, rank, field]) + struct.pack("<Q", value) + bytes([fill, flags, 0, 0, 0])


step = b"".join(rec(0, r) for _ in range(28) for r in (0, 1))
for mode, name in [(0, "sum_bf16"), (4, "sum_fp32"), (1, "shards_bf16"), (5, "shards_fp32"),
                   (2, "gpu_bf16"), (1 | 8, "shards_layer"), (2 | 16, "gpu_chunk")]:
    put("fuzz_shm", name, bytes([mode]) + bytes(128) + step + rec(7, 0) + step + rec(5, 0))
put("fuzz_shm", "corrupt_and_abort", bytes([1]) + bytes(128) + rec(0, 0) + rec(4, 1, 3, 7) +
    rec(5, 0) + rec(6, 0) + step)


# --- fuzz_rpc: records [method, flags, len, serialized request]
def varint(v):
    out = b""
    while True:
        b = v & 0x7F
        v >>= 7
        if v:
            out += bytes([b | 0x80])
        else:
            return out + bytes([b])


def field(num, wire, payload):
    key = varint(num << 3 | wire)
    if wire == 0:
        return key + varint(payload)
    if wire == 1:
        return key + struct.pack("<d", payload)
    return key + varint(len(payload)) + payload


def r(method, flags, msg=b""):
    return bytes([method, flags, len(msg)]) + msg


HASH, TOKEN, STEP, RANK = 1, 2, 4, 8
attach0 = r(2, HASH | RANK, field(2, 0, 0) + field(4, 0, 1234) + field(5, 2, b"host") +
            field(6, 0, 0xFFFFFFFF))
attach1 = r(2, HASH | RANK, field(2, 0, 1) + field(4, 0, 1235))
open0 = r(14, TOKEN, field(1, 2, b"default") + field(2, 0, 0))
open1 = r(14, TOKEN, field(2, 0, 1))
begin0 = r(4, STEP | RANK, field(2, 0, 0))
begin1 = r(4, STEP | RANK, field(2, 0, 1))
abort = r(5, 0, field(2, 0, 1) + field(3, 2, b"fuzz"))
hp = r(13, 0, field(2, 2, field(1, 1, 2e-4) + field(12, 1, 0.5)) + field(3, 2, b"lr") +
       field(3, 2, b"max_grad_norm"))
status = r(8, 0) + r(9, 0, field(2, 0, 1)) + r(10, 0) + r(11, 0) + r(12, 0)
handshake = r(0, 0, field(1, 2, field(1, 2, b"0.1.0") + field(3, 0, 2) + field(4, 0, 2) +
                                 field(6, 2, b"rankclient")))
comm = r(6, TOKEN, field(2, 0, 0) + field(3, 2, bytes(128)) + field(4, 0, 1)) + \
    r(7, TOKEN, field(2, 0, 1) + field(3, 0, 1) + field(4, 0, 1))
detach = r(3, TOKEN, field(2, 0, 1))
put("fuzz_rpc", "attach_begin_abort", handshake + attach0 + attach1 + open0 + open1 + begin0 +
    begin1 + status + abort + r(17, 0) + r(16, 1) + status)
put("fuzz_rpc", "hyperparams_comm_detach", attach0 + hp + comm + detach + status)
manifest = field(1, 2, b"fz") + field(2, 2, b"test") + field(
    3, 2, field(1, 2, b"l0") + field(2, 0, 2) + field(3, 2, field(1, 2, b"l0.w") +
                                                    field(2, 2, varint(8) + varint(4)) +
                                                    field(3, 0, 2)))
create = r(1, 0, field(1, 2, field(1, 2, b"job") + field(2, 2, manifest) + field(5, 0, 1)))
put("fuzz_rpc", "create_job", create + r(2, HASH, field(1, 2, b"job")) + status)

# Patches (flags bit 4, (flags >> 5) + 1 pairs [target, value] before the message): extreme
# sizes and settings by index into fuzz_rpc.cc's kU64s / kDoubles. CreateJob targets: 0
# chunk_bytes, 1 world_size, 2 first dimension, 3 last dimension, 4 a copy of layer 0, 5..15 the
# optimizer (lr, beta1, beta2, eps, weight_decay, min_lr_ratio, max_grad_norm, warmup_steps,
# total_steps, schedule, clip), 16 grad_dtype, 17 param_route, 18 grad_route, 19 seed.
# UpdateHyperParams targets: 0..10, the same optimizer fields.
U64 = {v: i for i, v in enumerate([
    0, 1, 2, 3, 63, 64, 65, 4095, 4096, 4097, 8192, 1 << 20, (1 << 30) - 4096, 1 << 30,
    (1 << 30) + 4096, 1 << 31, (1 << 32) - 1, 1 << 32, 1 << 40, 1 << 44, 1 << 56, (1 << 56) + 1,
    1 << 62, 1 << 63, (1 << 64) - 1])}
DBL = {"0": 0, "-0": 1, "1": 2, "-1": 3, "0.5": 4, "0.9": 5, "0.999": 6, "1-": 7, "1e-8": 8,
       "1e-308": 9, "denormal": 10, "1e308": 11, "max": 12, "inf": 13, "-inf": 14, "nan": 15,
       "-nan": 16, "2": 17, "1e-3": 18}


def patched(method, patches, msg=b""):
    assert 1 <= len(patches) <= 8
    flags = 16 | (len(patches) - 1) << 5
    return r(method, flags, b"".join(bytes(p) for p in patches) + msg)


def cj(*patches):
    return patched(1, list(patches))


for name, patches in [
        ("chunk_2_62", [(0, U64[1 << 62])]),
        ("chunk_2_64_minus_1", [(0, U64[(1 << 64) - 1])]),
        ("chunk_1g_plus_page", [(0, U64[(1 << 30) + 4096])]),
        ("chunk_4095", [(0, U64[4095])]),
        ("chunk_1g_world_64", [(0, U64[1 << 30]), (1, U64[64])]),
        ("chunk_1m_world_64", [(0, U64[1 << 20]), (1, U64[64])]),
        ("world_65", [(1, U64[65])]),
        ("world_2_32_minus_1", [(1, U64[(1 << 32) - 1])]),
        ("dim_2_44", [(2, U64[1 << 44])]),
        ("dim_2_56_twice", [(2, U64[1 << 56]), (4, U64[1 << 56])]),
        ("dim_2_32_squared", [(2, U64[1 << 32]), (3, U64[1 << 32])]),
        ("dim_2_64_minus_1", [(3, U64[(1 << 64) - 1])]),
        ("dim_4096_layers", [(4, U64[4096]), (4, U64[4096]), (4, U64[4097])]),
        ("optimizer_nan_lr", [(5, DBL["nan"])]),
        ("optimizer_beta1_one", [(6, DBL["1"])]),
        ("optimizer_beta2_below_one", [(7, DBL["1-"])]),
        ("optimizer_eps_denormal_wd_1e308", [(8, DBL["denormal"]), (9, DBL["1e308"])]),
        ("optimizer_min_lr_negative_zero", [(10, DBL["-0"])]),
        ("optimizer_clip_global_norm_zero", [(15, U64[3]), (11, DBL["0"])]),
        ("optimizer_warmup_past_total", [(14, U64[2]), (12, U64[4097]), (13, U64[4096])]),
        ("enums_out_of_range", [(16, U64[3]), (17, U64[63]), (18, U64[4095])]),
        ("seed_max", [(19, U64[(1 << 64) - 1])])]:
    put("fuzz_rpc", f"create_job_{name}", cj(*patches) + attach0 + status)


def hp_patched(*patches):
    return patched(13, list(patches))


put("fuzz_rpc", "hyperparams_extremes",
    hp_patched((0, DBL["1e308"])) + hp_patched((3, DBL["denormal"])) +
    hp_patched((2, DBL["1-"])) + hp_patched((5, DBL["-0"])) + hp_patched((0, DBL["nan"])) +
    hp_patched((1, DBL["1"])) + hp_patched((3, DBL["0"])) + hp_patched((6, DBL["inf"])) +
    hp_patched((10, U64[2]), (6, DBL["0"])) + hp_patched((6, DBL["0"])) +
    hp_patched((1, DBL["0"]), (2, DBL["0"]), (3, DBL["0"])) +
    hp_patched((9, U64[3]), (7, U64[4097]), (8, U64[4096])) + status)
print("seeds written under", OUT, file=sys.stderr)
