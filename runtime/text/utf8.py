"""Text that is not valid UTF-8, made valid the way llama.cpp's input handling does it.

Python hands us undecodable input as lone surrogates: argv and stdin (in a UTF-8 locale) and
prompt_toolkit's terminal input decode with `surrogateescape`, so a byte 0xFF arrives as
U+DCFF; a JSON file or a paste can carry a lone U+D800..U+DFFF too. Such a string cannot be
encoded to UTF-8, so the tokenizer, the session file and the terminal would all fail on it.

llama.cpp's `unicode_cpts_from_utf8` replaces every byte that does not start a valid sequence
with one U+FFFD and goes on at the next byte; `clean_text` / `decode_bytes` do the same, so an
invalid byte costs one replacement character, wherever it came from.
"""

from __future__ import annotations

import codecs

REPLACEMENT = "\ufffd"


def _per_byte_replace(err: UnicodeError):
    """Decode errors: one U+FFFD per offending byte (not one per maximal subpart, as 'replace')."""
    if isinstance(err, UnicodeDecodeError):
        return REPLACEMENT * (err.end - err.start), err.end
    raise err


codecs.register_error("kvchat-per-byte", _per_byte_replace)


def decode_bytes(data: bytes) -> str:
    """UTF-8 bytes → str; each invalid byte becomes U+FFFD."""
    return bytes(data).decode("utf-8", errors="kvchat-per-byte")


def _has_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
        return False
    except UnicodeEncodeError:
        return True


def clean_text(text: str) -> str:
    """A str that encodes to UTF-8: surrogate-escaped bytes are turned back into the bytes they
    stand for and decoded (invalid ones → U+FFFD); any other lone surrogate → U+FFFD."""
    if not _has_surrogate(text):
        return text
    out = []
    run: list[int] = []  # surrogate-escaped bytes waiting to be decoded together
    for ch in text:
        c = ord(ch)
        if 0xDC80 <= c <= 0xDCFF:
            run.append(c - 0xDC00)
            continue
        if run:
            out.append(decode_bytes(bytes(run)))
            run = []
        if 0xD800 <= c <= 0xDFFF:
            out.append(REPLACEMENT)
        else:
            out.append(ch)
    if run:
        out.append(decode_bytes(bytes(run)))
    return "".join(out)


def clean_tree(value):
    """clean_text applied to every string inside lists / dicts (messages, headers)."""
    if isinstance(value, str):
        return clean_text(value)
    if isinstance(value, list):
        return [clean_tree(v) for v in value]
    if isinstance(value, dict):
        return {clean_text(k) if isinstance(k, str) else k: clean_tree(v) for k, v in value.items()}
    return value


def read_stream(stream) -> str:
    """All of a text stream (stdin), decoded here whatever the locale's error mode (a strict
    one would raise on the first bad byte): each invalid byte becomes U+FFFD."""
    buf = getattr(stream, "buffer", None)
    return decode_bytes(buf.read()) if buf is not None else clean_text(stream.read())


def read_stream_line(stream) -> str:
    """One line of a text stream ("" at end of input), decoded as read_stream does."""
    buf = getattr(stream, "buffer", None)
    return decode_bytes(buf.readline()) if buf is not None else clean_text(stream.readline())
