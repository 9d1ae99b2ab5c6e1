"""What a session header may contain: a bounded JSON parse and a type/range check of every field.

The digest at the end of a session file is a plain sha256 (there is no key), so it proves the
file is whole, not that a person or a script did not edit it: anything in the header must be
checked before it reaches the conversation or the sampler. `parse_header` refuses JSON nested
deeper than any header kvchat writes (json.loads would recurse until RecursionError) and
`check_header` checks each field's type and range, so a bad file is one SessionError line.
"""

from __future__ import annotations

import json
import math
import re

import numpy as np

from kvchat.runtime.errors import SessionError

MAX_HEADER_BYTES = 64 << 20  # tokens of a very long chat are ~7 bytes each in JSON
MAX_JSON_DEPTH = 16  # kvchat writes 3 (header → messages → message)
MAX_TOKEN_ID = 2**31 - 1
ROLES = ("system", "user", "assistant")
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.S)
_NOT_BRACKET = re.compile(rb"[^\[\]{}]")


def json_depth(text: bytes) -> int:
    """Deepest nesting of arrays/objects in a JSON text (strings skipped), without recursion."""
    brackets = _NOT_BRACKET.sub(b"", _STRING.sub(b"", text))
    if not brackets:
        return 0
    a = np.frombuffer(brackets, dtype=np.uint8)
    step = np.where((a == ord("[")) | (a == ord("{")), 1, -1).astype(np.int64)
    return int(np.cumsum(step).max())


def parse_header(raw: bytes, where: str) -> dict:
    if len(raw) > MAX_HEADER_BYTES:
        raise SessionError(
            f"{where}: header of {len(raw)} bytes is larger than any session "
            f"kvchat writes ({MAX_HEADER_BYTES} bytes at most)"
        )
    depth = json_depth(raw)
    if depth > MAX_JSON_DEPTH:
        raise SessionError(f"{where}: invalid header (JSON nested {depth} levels deep)")
    try:
        h = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise SessionError(f"{where}: corrupted header ({str(e).splitlines()[0][:120]})") from None
    check_header(h, where)
    return h


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return (_is_int(v) or isinstance(v, float)) and math.isfinite(v)


# sampling key → (check, what it must be)
SAMPLING_FIELDS = {
    "temp": (lambda v: _is_num(v) and v >= 0, "a number >= 0"),
    "top_k": (lambda v: _is_int(v) and v >= 0, "an integer >= 0"),
    "top_p": (lambda v: _is_num(v) and 0 <= v <= 1, "a number within 0..1"),
    "min_p": (lambda v: _is_num(v) and 0 <= v <= 1, "a number within 0..1"),
    "repeat_penalty": (lambda v: _is_num(v) and v > 0, "a number > 0"),
    "repeat_last_n": (lambda v: _is_int(v) and v >= -1, "an integer >= -1"),
    "seed": (lambda v: v is None or (_is_int(v) and 0 <= v < 2**64), "null or an integer within 0..2^64-1"),
}
CACHE_FIELDS = {
    "n_ctx": (lambda v: _is_int(v) and 0 < v <= MAX_TOKEN_ID, "a positive integer"),
    "type_k": (lambda v: isinstance(v, str), "a type name"),
    "type_v": (lambda v: isinstance(v, str), "a type name"),
    "flash_attn": (lambda v: isinstance(v, bool), "true or false"),
    "swa_full": (lambda v: isinstance(v, bool), "true or false"),
}
MODEL_FIELDS = {
    "file": (lambda v: isinstance(v, str), "a file name"),
    "size": (lambda v: _is_int(v) and v >= 0, "an integer >= 0"),
    "header_sha256": (lambda v: isinstance(v, str) and re.fullmatch(r"[0-9a-f]{64}", v) is not None, "64 hex digits"),
}


def _check_fields(obj: dict, spec: dict, section: str, bad, required: bool) -> None:
    for key, (ok, what) in spec.items():
        if key not in obj:
            if required:
                bad(f"'{section}.{key}' is missing")
            continue
        if not ok(obj[key]):
            bad(f"'{section}.{key}' must be {what}, got {json.dumps(obj[key])[:40]}")


def check_header(h, where: str) -> None:
    """SessionError naming the first field of the wrong type or out of range."""

    def bad(what):
        raise SessionError(f"{where}: invalid header ({what})")

    if not isinstance(h, dict):
        bad("not an object")
    for key, typ in (("model", dict), ("cache", dict), ("messages", list), ("sampling", dict), ("tokens", list)):
        if not isinstance(h.get(key), typ):
            bad(f"'{key}' missing or of the wrong type")
    for key in ("n_dropped", "n_keep"):
        if not (_is_int(h.get(key)) and h[key] >= 0):
            bad(f"'{key}' must be an integer >= 0")
    if "extra" in h and not isinstance(h["extra"], (dict, type(None))):
        bad("'extra' must be an object")
    _check_fields(h["model"], MODEL_FIELDS, "model", bad, required=True)
    _check_fields(h["cache"], CACHE_FIELDS, "cache", bad, required=True)
    _check_fields(h["sampling"], SAMPLING_FIELDS, "sampling", bad, required=False)
    for i, m in enumerate(h["messages"]):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            bad(f"message {i} lacks role or content")
        if m["role"] not in ROLES:
            bad(f"message {i} has role {m['role'][:20]!r} (expected one of {', '.join(ROLES)})")
    if not all(_is_int(t) and 0 <= t <= MAX_TOKEN_ID for t in h["tokens"]):
        bad("token ids must be non-negative integers")
    n_keep, n_dropped = h["n_keep"], h["n_dropped"]
    if n_dropped and n_keep + n_dropped > len(h["tokens"]):
        bad("context-shift counters do not fit the token list")
