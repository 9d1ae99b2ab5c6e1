"""Session files: a conversation saved to disk and resumed without re-processing its tokens.

Layout (all integers little-endian):

    magic    8 bytes  b"KVCHATSS"
    version  u32      FORMAT_VERSION
    hlen     u32      length of the JSON header
    header   hlen     UTF-8 JSON: model identity, cache configuration, messages, sampling
                      settings, the token list, and the context-shift bookkeeping
    slen     u64      length of the memory state
    state    slen     Context.state_seq_get_data(seq) of the conversation's sequence
    digest   32 bytes sha256 of everything above

The digest makes truncation and corruption detectable before anything is parsed; the header
is then checked against the live model and cache configuration, so `load_session` either
returns a `SessionData` the caller can apply, or raises SessionError with a one-line reason —
it never touches a context. Reading opens the file without blocking, only if it is a regular
file, and bounds every length by the file's size before reading more (cli/session/file.py); the
header's fields are type- and range-checked (cli/session/schema.py). Writes go to a temp file
beside the (symlink-resolved) target, are fsynced, and renamed over it: an interrupted save
leaves the previous file as it was; a file that is not a session is only replaced when forced.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

from kvchat.cli.session.file import MAGIC, check_save_target, open_regular, read_exact
from kvchat.cli.session.schema import parse_header
from kvchat.runtime.errors import SessionError
from kvchat.runtime.memory.state import atomic_write  # temp file, fsync, rename, fsync the directory
from kvchat.runtime.text.utf8 import clean_tree

FORMAT_VERSION = 1
_DIGEST = 32
_FIXED = len(MAGIC) + 4 + 4  # magic, version, header length
HEADER_FALLBACK_BYTES = 16 << 20  # hashed when a GGUF reader gives no data offset


@dataclass
class SessionData:
    """Everything a session file holds, in memory."""

    model: dict  # model_identity(): file, size, header_sha256
    cache: dict  # cache_config(): n_ctx, type_k, type_v, flash_attn, swa_full
    messages: list  # [{"role": ..., "content": ...}, ...]
    sampling: dict  # SamplingParams.to_dict()
    tokens: list  # the conversation's tokens as if nothing had been dropped
    n_dropped: int = 0  # tokens removed by context shifts, right after the first n_keep
    n_keep: int = 0  # the kept prefix the shifts preserved
    state: bytes = b""  # the sequence's memory state
    extra: dict = field(default_factory=dict)  # free-form (e.g. the system prompt flag)


def model_identity(path, data_offset: int | None = None) -> dict:
    """Identify a model file: name, size, and sha256 of its header (metadata + tensor table).

    data_offset: where tensor data starts (GGUFFile.data_offset); the bytes before it are the
    header. Without it the first HEADER_FALLBACK_BYTES are hashed.
    """
    p = Path(path)
    size = p.stat().st_size
    n = data_offset if data_offset else min(size, HEADER_FALLBACK_BYTES)
    h = hashlib.sha256()
    with open(p, "rb") as f:
        left = n
        while left > 0:
            chunk = f.read(min(left, 1 << 20))
            if not chunk:
                break
            h.update(chunk)
            left -= len(chunk)
    return {"file": p.name, "size": size, "header_sha256": h.hexdigest()}


def cache_config(cparams) -> dict:
    """The parts of the resolved context parameters a memory state depends on."""
    from kvchat.kernels.ggml_types import type_info

    return {
        "n_ctx": int(cparams.n_ctx),
        "type_k": type_info(cparams.type_k).name,
        "type_v": type_info(cparams.type_v).name,
        "flash_attn": bool(cparams.flash_attn),
        "swa_full": bool(cparams.swa_full),
    }


# ---- writing -----------------------------------------------------------------------------------


def encode_session(data: SessionData) -> bytes:
    header = json.dumps(
        {
            "model": data.model,
            "cache": data.cache,
            "messages": clean_tree(data.messages),
            "sampling": data.sampling,
            "tokens": [int(t) for t in data.tokens],
            "n_dropped": int(data.n_dropped),
            "n_keep": int(data.n_keep),
            "extra": data.extra,
        },
        ensure_ascii=False,
        separators=(",", ":"),
    ).encode("utf-8")
    body = b"".join(
        [
            MAGIC,
            struct.pack("<II", FORMAT_VERSION, len(header)),
            header,
            struct.pack("<Q", len(data.state)),
            bytes(data.state),
        ]
    )
    return body + hashlib.sha256(body).digest()


def save_session(path, data: SessionData, force: bool = False) -> int:
    """Encode and write atomically; returns the file size. SessionError if it cannot be written,
    or if `path` is something other than a session file and `force` is not given."""
    check_save_target(path, force)
    blob = encode_session(data)
    try:
        atomic_write(path, blob)
    except OSError as e:
        raise SessionError(f"cannot write session file {path}: {e.strerror or e}") from None
    return len(blob)


# ---- reading -----------------------------------------------------------------------------------


def _bytes(n: int) -> str:
    return "1 byte" if n == 1 else f"{n} bytes"


def _check_fixed(fixed: bytes, size: int, where: str) -> int:
    """Magic, version and header length of the first _FIXED bytes; returns the header length."""
    if size < _FIXED + 8 + _DIGEST:
        if fixed[: len(MAGIC)] != MAGIC[: len(fixed)] or not fixed:
            raise SessionError(f"{where}: not a kvchat session file ({_bytes(size)})")
        raise SessionError(f"{where}: truncated ({_bytes(size)}, shorter than any session file)")
    if fixed[: len(MAGIC)] != MAGIC:
        raise SessionError(f"{where}: not a kvchat session file (bad magic)")
    version, hlen = struct.unpack_from("<II", fixed, len(MAGIC))
    if version != FORMAT_VERSION:
        raise SessionError(f"{where}: format version {version}, this kvchat reads version {FORMAT_VERSION}")
    if hlen > size - _FIXED - 8 - _DIGEST:
        raise SessionError(f"{where}: truncated or corrupted (a {_bytes(hlen)} header does not fit in {_bytes(size)})")
    return hlen


def _check_state_len(slen: int, hlen: int, size: int, where: str) -> None:
    room = size - (_FIXED + hlen + 8 + _DIGEST)  # >= 0 after _check_fixed
    if slen > room:
        raise SessionError(
            f"{where}: truncated or corrupted (the memory state claims "
            f"{_bytes(slen)}, the file has room for {_bytes(room)})"
        )
    if slen < room:
        raise SessionError(f"{where}: has {_bytes(room - slen)} of trailing data after the memory state")


def decode_session(blob: bytes, where: str = "session file") -> SessionData:
    """Parse and check the structure of a session file; SessionError with the first problem."""
    blob = bytes(blob)
    hlen = _check_fixed(blob[:_FIXED], len(blob), where)
    (slen,) = struct.unpack_from("<Q", blob, _FIXED + hlen)
    _check_state_len(slen, hlen, len(blob), where)
    body, digest = blob[:-_DIGEST], blob[-_DIGEST:]
    if hashlib.sha256(body).digest() != digest:
        raise SessionError(f"{where}: corrupted (checksum mismatch)")
    return _from_header(parse_header(body[_FIXED : _FIXED + hlen], where), body[_FIXED + hlen + 8 :])


def _from_header(h: dict, state) -> SessionData:
    return SessionData(
        model=h["model"],
        cache=h["cache"],
        messages=h["messages"],
        sampling=h["sampling"],
        tokens=h["tokens"],
        n_dropped=h["n_dropped"],
        n_keep=h["n_keep"],
        state=bytes(state),
        extra=h.get("extra") or {},
    )


def read_session(path) -> SessionData:
    """Read and structurally check a session file (no model/cache comparison).

    Opened without blocking and only if it is a regular file; the fixed part is read first and
    every length in it is checked against the file's size before more is read, so a FIFO, a
    device or a huge sparse file is refused after a few bytes."""
    p = Path(path)
    where = str(p)
    fd, size = open_regular(p)
    try:
        fixed = read_exact(fd, _FIXED)
        hlen = _check_fixed(fixed, size, where)
        raw = read_exact(fd, hlen + 8)
        if len(raw) < hlen + 8:
            raise SessionError(f"{where}: truncated (the file shrank while it was read)")
        (slen,) = struct.unpack_from("<Q", raw, hlen)
        _check_state_len(slen, hlen, size, where)
        rest = read_exact(fd, slen + _DIGEST)
    except OSError as e:
        raise SessionError(f"cannot read session file {p}: {e.strerror or e}") from None
    finally:
        os.close(fd)
    if len(rest) != slen + _DIGEST:
        raise SessionError(f"{where}: truncated (the file shrank while it was read)")
    h = hashlib.sha256(fixed)
    h.update(raw)
    h.update(memoryview(rest)[:slen])
    if h.digest() != rest[slen:]:
        raise SessionError(f"{where}: corrupted (checksum mismatch)")
    return _from_header(parse_header(raw[:hlen], where), memoryview(rest)[:slen])


def check_compatible(data: SessionData, model: dict, cache: dict, where: str, n_vocab: int | None = None) -> None:
    """Raise SessionError unless the session belongs to this model and cache configuration.

    The model is identified by content (size and the sha256 of its GGUF header: metadata and
    tensor table), not by file name: a renamed or moved model still resumes its sessions."""
    if data.model.get("size") != model["size"] or data.model.get("header_sha256") != model["header_sha256"]:
        raise SessionError(
            f"{where}: saved with model {data.model.get('file')} "
            f"({data.model.get('size')} bytes), not {model['file']} ({model['size']} "
            "bytes): different model contents"
        )
    for key in ("n_ctx", "type_k", "type_v", "flash_attn", "swa_full"):
        if data.cache.get(key) != cache[key]:
            flag = {"n_ctx": "-c", "type_k": "-ctk", "type_v": "-ctv", "flash_attn": "-fa", "swa_full": "--swa-full"}[
                key
            ]
            raise SessionError(
                f"{where}: saved with {key}={data.cache.get(key)}, this chat has "
                f"{key}={cache[key]} (restart with matching {flag})"
            )
    n_cached = len(data.tokens) - data.n_dropped
    if n_cached > cache["n_ctx"]:
        raise SessionError(f"{where}: holds {n_cached} cached tokens, more than n_ctx={cache['n_ctx']}")
    if n_vocab is not None and any(t >= n_vocab for t in data.tokens):
        raise SessionError(f"{where}: holds token ids outside this model's vocabulary ({n_vocab})")


def load_session(path, model: dict, cache: dict, n_vocab: int | None = None) -> SessionData:
    """Read, check structure and compatibility; SessionError with one line if anything is off."""
    data = read_session(path)
    check_compatible(data, model, cache, str(path), n_vocab)
    return data


# ---- a live conversation ↔ a file ----------------------------------------------------------------


def save_conversation(path, conv, model: dict, cache: dict, force: bool = False) -> int:
    """Snapshot a Conversation (messages, tokens, sampling, memory state) into a session file."""
    st = conv.session_state()
    data = SessionData(
        model=model,
        cache=cache,
        messages=st["messages"],
        sampling=conv.sampler.params.to_dict() | {"seed": conv.sampler.seed},
        tokens=st["tokens"],
        n_dropped=st["n_dropped"],
        n_keep=st["n_keep"],
        state=st["state"],
        extra={"reasoning": reasoning_state(conv)},
    )
    return save_session(path, data, force)


REASONING_KEYS = ("reasoning", "reasoning_budget", "reasoning_effort")


def reasoning_state(conv) -> dict:
    """The thinking settings a session keeps (the thinking text itself is in its messages)."""
    return {k: getattr(conv.config, k) for k in REASONING_KEYS}


def apply_saved_reasoning(convs, extra: dict | None, settings=None) -> None:
    """A session's thinking settings onto `convs`, except those given on the command line."""
    from kvchat.cli.options import BY_NAME, ChatSettings, check_value

    saved = (extra or {}).get("reasoning")
    if not isinstance(saved, dict):
        return
    defaults = ChatSettings()
    for key in REASONING_KEYS:
        if key not in saved or (settings is not None and getattr(settings, key) != getattr(defaults, key)):
            continue
        try:
            value = check_value(BY_NAME[key], saved[key])
        except (ValueError, TypeError):
            continue  # a value this version cannot use: keep the flag's
        for conv in convs:
            setattr(conv.config, key, value)


def load_conversation(path, conv, model: dict, cache: dict, n_vocab: int | None = None) -> SessionData:
    """Validate a session file, then replace the conversation with it (all or nothing)."""
    data = load_session(path, model, cache, n_vocab)
    conv.restore(data.messages, data.tokens, data.n_dropped, data.n_keep, data.state)
    return data
