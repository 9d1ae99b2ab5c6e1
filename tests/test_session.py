"""Session files: byte-exact round trip, atomic writes, and every refusal before anything changes."""

import hashlib
import os
import struct

import pytest

from kvchat.cli.session.session import (
    FORMAT_VERSION,
    MAGIC,
    SessionData,
    atomic_write,
    check_compatible,
    decode_session,
    encode_session,
    load_session,
    model_identity,
    read_session,
    save_session,
)
from kvchat.runtime.errors import SessionError

MODEL = {"file": "m.gguf", "size": 1234, "header_sha256": "ab" * 32}
CACHE = {"n_ctx": 256, "type_k": "f16", "type_v": "f16", "flash_attn": True, "swa_full": False}


def sample_data(**kw):
    d = dict(
        model=dict(MODEL),
        cache=dict(CACHE),
        messages=[
            {"role": "system", "content": "S"},
            {"role": "user", "content": "héllo ✓"},
            {"role": "assistant", "content": "hi"},
        ],
        sampling={"temp": 0.0, "top_k": 40, "seed": 7},
        tokens=[1, 2, 3, 4, 5, 6],
        n_dropped=2,
        n_keep=1,
        state=bytes(range(256)) * 3,
        extra={"note": 1},
    )
    d.update(kw)
    return SessionData(**d)


def test_round_trip_is_exact(tmp_path):
    data = sample_data()
    path = tmp_path / "s.kvs"
    n = save_session(path, data)
    blob = path.read_bytes()
    assert n == len(blob) and blob[:8] == MAGIC
    assert struct.unpack_from("<I", blob, 8)[0] == FORMAT_VERSION
    assert blob[-32:] == hashlib.sha256(blob[:-32]).digest()
    back = load_session(path, MODEL, CACHE)
    assert back == data
    assert encode_session(back) == blob  # byte-exact re-encode


def test_every_truncation_is_refused(tmp_path):
    blob = encode_session(sample_data())
    for cut in list(range(0, 64)) + [len(blob) // 2, len(blob) - 33, len(blob) - 1]:
        with pytest.raises(SessionError):
            decode_session(blob[:cut])


@pytest.mark.parametrize("where", [3, 9, 20, 100, -100, -5])
def test_any_flipped_byte_is_refused(where):
    blob = bytearray(encode_session(sample_data()))
    blob[where] ^= 0x40
    with pytest.raises(SessionError) as e:
        decode_session(bytes(blob))
    assert "\n" not in str(e.value)


def test_trailing_bytes_and_bad_magic_and_version():
    blob = encode_session(sample_data())
    with pytest.raises(SessionError, match="trailing"):
        decode_session(blob + b"x")
    with pytest.raises(SessionError, match="magic"):
        decode_session(b"GGUF" + blob[4:])
    bumped = blob[:8] + struct.pack("<I", FORMAT_VERSION + 1) + blob[12:]
    with pytest.raises(SessionError, match="version"):
        decode_session(bumped)


def test_header_with_valid_checksum_but_bad_fields_is_refused():
    body = MAGIC + struct.pack("<II", FORMAT_VERSION, 2) + b"{}" + struct.pack("<Q", 0)
    with pytest.raises(SessionError, match="invalid header"):
        decode_session(body + hashlib.sha256(body).digest())
    data = sample_data(tokens=[1, -2])
    with pytest.raises(SessionError, match="token ids"):
        decode_session(encode_session(data))
    data = sample_data(tokens=[1, 2], n_dropped=5, n_keep=1)
    with pytest.raises(SessionError, match="counters"):
        decode_session(encode_session(data))


@pytest.mark.parametrize(
    "field,value,flag",
    [
        ("n_ctx", 512, "-c"),
        ("type_k", "q8_0", "-ctk"),
        ("type_v", "q4_0", "-ctv"),
        ("flash_attn", False, "-fa"),
        ("swa_full", True, "--swa-full"),
    ],
)
def test_cache_config_mismatch(field, value, flag):
    data = sample_data()
    other = dict(CACHE, **{field: value})
    with pytest.raises(SessionError) as e:
        check_compatible(data, MODEL, other, "s.kvs")
    assert flag in str(e.value) and field in str(e.value)


@pytest.mark.parametrize("field,value", [("size", 99), ("header_sha256", "cd" * 32)])
def test_model_mismatch(field, value):
    data = sample_data()
    with pytest.raises(SessionError, match="saved with model m.gguf"):
        check_compatible(data, dict(MODEL, **{field: value}), CACHE, "s.kvs")


def test_token_ids_beyond_vocab_and_too_many_tokens():
    with pytest.raises(SessionError, match="vocabulary"):
        check_compatible(sample_data(), MODEL, CACHE, "s", n_vocab=5)
    with pytest.raises(SessionError, match="more than n_ctx"):
        check_compatible(sample_data(tokens=list(range(300)), n_dropped=0), MODEL, CACHE, "s")


def test_missing_and_directory(tmp_path):
    with pytest.raises(SessionError, match="does not exist"):
        read_session(tmp_path / "nope")
    with pytest.raises(SessionError, match="directory"):
        read_session(tmp_path)


def test_atomic_write_keeps_old_file_on_failure(tmp_path, monkeypatch):
    path = tmp_path / "s.kvs"
    save_session(path, sample_data())
    old = path.read_bytes()

    def boom(*a, **k):
        raise KeyboardInterrupt  # Ctrl-C in the middle of a save

    monkeypatch.setattr(os, "fsync", boom)
    with pytest.raises(KeyboardInterrupt):
        save_session(path, sample_data(messages=[]))
    assert path.read_bytes() == old
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.kvs"]  # no temp file left behind


def test_atomic_write_replaces(tmp_path):
    path = tmp_path / "f"
    atomic_write(path, b"one")
    atomic_write(path, b"two")
    assert path.read_bytes() == b"two"


def test_model_identity_hashes_header_region(tmp_path):
    p = tmp_path / "m.gguf"
    p.write_bytes(b"H" * 100 + b"D" * 1000)
    ident = model_identity(p, data_offset=100)
    assert ident == {"file": "m.gguf", "size": 1100, "header_sha256": hashlib.sha256(b"H" * 100).hexdigest()}
    p.write_bytes(b"H" * 100 + b"E" * 1000)  # tensor data change: same header identity
    assert model_identity(p, data_offset=100)["header_sha256"] == ident["header_sha256"]
    p.write_bytes(b"h" + b"H" * 99 + b"D" * 1000)
    assert model_identity(p, data_offset=100)["header_sha256"] != ident["header_sha256"]


@pytest.mark.real_model
def test_model_identity_of_smollm2(smollm2_path):
    from kvchat.runtime.gguf.file import GGUFFile

    gf = GGUFFile(smollm2_path)
    ident = model_identity(smollm2_path, gf.data_offset)
    with open(smollm2_path, "rb") as f:
        head = f.read(gf.data_offset)
    assert ident["header_sha256"] == hashlib.sha256(head).hexdigest()
    assert ident["size"] == smollm2_path.stat().st_size
    gf.close()
