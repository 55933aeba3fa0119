"""Plain data between the judge and the sandboxed program: tagged JSON, framed by length.

Only exact built-in types cross (None, bool, int, float, complex, str, bytes, list, tuple, dict,
set, frozenset). Subclasses of int, float and str arrive as their base value; any other object
(a class whose __eq__ always says True, a generator) cannot be sent, so a test that compares a
program's result always compares plain values in the judge. Standard library only: this file also
runs as part of the sandboxed worker's source.
"""

import json
import math
import struct

MAX_FRAME = 16 << 20
MAX_DEPTH = 200


class WireError(ValueError):
    pass


def encode(x, depth=0):
    if depth > MAX_DEPTH:
        raise WireError("value nested too deeply")
    t = type(x)
    if x is None or t is bool:
        return x
    if isinstance(x, int):   # (bool is handled above)
        return int.__index__(x)
    if isinstance(x, float):
        v = float.__float__(x)
        return v if math.isfinite(v) else {"f": repr(v)}
    if isinstance(x, str):
        return str.__str__(x)
    d = depth + 1
    if t is list:
        return [encode(v, d) for v in x]
    if t is tuple:
        return {"t": [encode(v, d) for v in x]}
    if t is dict:
        return {"d": [[encode(k, d), encode(v, d)] for k, v in x.items()]}
    if t is set or t is frozenset:
        return {"s" if t is set else "fs": [encode(v, d) for v in x]}
    if t is bytes:
        return {"b": x.decode("latin-1")}
    if t is complex:
        return {"c": [encode(x.real, d), encode(x.imag, d)]}
    raise WireError(f"cannot send a {t.__name__} value")


def decode(x):
    if isinstance(x, list):
        return [decode(v) for v in x]
    if not isinstance(x, dict):
        return x
    (tag, v), = x.items()
    if tag == "t":
        return tuple(decode(i) for i in v)
    if tag == "d":
        return {decode(k): decode(val) for k, val in v}
    if tag == "s":
        return {decode(i) for i in v}
    if tag == "fs":
        return frozenset(decode(i) for i in v)
    if tag == "f":
        return float(v)
    if tag == "b":
        return v.encode("latin-1")
    if tag == "c":
        return complex(decode(v[0]), decode(v[1]))
    raise WireError(f"unknown tag {tag!r}")


def frame(msg) -> bytes:
    body = json.dumps(msg, separators=(",", ":")).encode()
    if len(body) > MAX_FRAME:
        raise WireError(f"message of {len(body)} bytes is over the {MAX_FRAME}-byte limit")
    return struct.pack(">I", len(body)) + body


def parse(body: bytes):
    return json.loads(body)
