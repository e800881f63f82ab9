"""Protobuf wire format by hand, for tests that call hostd's gRPC service through grpcio's
generic calls (no generated Python code needed)."""
import struct


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
    """fields: (number, value) with int/bool -> varint, float -> fixed64 double, bytes/str ->
    length-delimited."""
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
