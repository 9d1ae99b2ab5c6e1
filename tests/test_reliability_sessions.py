"""Session files under hostile input and mistakes: nothing read whole that should not be, nothing
overwritten that is not ours, links and modes kept, two processes never sharing one file."""

import hashlib
import json
import os
import stat
import struct
import subprocess
import sys
import time

import pytest

from kvchat.cli.session.file import SessionLock, check_save_target
from kvchat.cli.session.schema import json_depth
from kvchat.cli.session.session import (
    FORMAT_VERSION,
    MAGIC,
    SessionData,
    check_compatible,
    decode_session,
    encode_session,
    read_session,
    save_session,
)
from kvchat.runtime.errors import SessionError
from kvchat.runtime.memory.state import TMP_TAG, remove_stale_temps
from tests.conftest import ROOT

MODEL = {"file": "m.gguf", "size": 1234, "header_sha256": "ab" * 32}
CACHE = {"n_ctx": 256, "type_k": "f16", "type_v": "f16", "flash_attn": True, "swa_full": False}


def sample(**kw):
    d = dict(
        model=dict(MODEL),
        cache=dict(CACHE),
        messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
        sampling={"temp": 0.5, "top_k": 40, "top_p": 0.9, "seed": 7},
        tokens=[1, 2, 3],
        n_dropped=0,
        n_keep=0,
        state=b"\x01\x02\x03",
    )
    d.update(kw)
    return SessionData(**d)


def with_header(header: dict | bytes, state: bytes = b"") -> bytes:
    """A session blob whose digest is recomputed over an edited header (what a script could do)."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    body = MAGIC + struct.pack("<II", FORMAT_VERSION, len(raw)) + raw + struct.pack("<Q", len(state)) + state
    return body + hashlib.sha256(body).digest()


def header_of(data: SessionData) -> dict:
    blob = encode_session(data)
    hlen = struct.unpack_from("<I", blob, 12)[0]
    return json.loads(blob[16 : 16 + hlen])


# ---- reading: FIFOs, devices, sparse files --------------------------------------------------------


def test_fifo_session_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "s.kvs"
    os.mkfifo(fifo)
    t0 = time.monotonic()
    with pytest.raises(SessionError, match="is a FIFO, not a regular file"):
        read_session(fifo)
    assert time.monotonic() - t0 < 5  # a plain open() would block until a writer appears


def test_symlink_to_dev_zero_is_refused_without_reading(tmp_path):
    link = tmp_path / "s.kvs"
    link.symlink_to("/dev/zero")
    with pytest.raises(SessionError, match="is a device, not a regular file"):
        read_session(link)


def test_sparse_huge_file_is_refused_after_a_few_bytes(tmp_path, monkeypatch):
    big = tmp_path / "s.kvs"
    with open(big, "wb") as f:
        f.truncate(3 << 30)  # 3 GiB of holes: reading it whole took 3.5 GB of memory
    reads = []
    real_read = os.read
    monkeypatch.setattr(os, "read", lambda fd, n: reads.append(n) or real_read(fd, n))
    with pytest.raises(SessionError, match="not a kvchat session file"):
        read_session(big)
    assert sum(reads) <= 64


def test_lengths_are_bounded_by_the_file_size(tmp_path):
    good = encode_session(sample())
    hlen = struct.unpack_from("<I", good, 12)[0]
    # a state length field of 2^64-1 (the old message printed an unsigned wrap)
    bad = bytearray(good)
    bad[16 + hlen : 24 + hlen] = struct.pack("<Q", 2**64 - 1)
    p = tmp_path / "s.kvs"
    p.write_bytes(bytes(bad))
    with pytest.raises(SessionError) as e:
        read_session(p)
    msg = str(e.value)
    assert "memory state claims 18446744073709551615 bytes" in msg and "room for 3 bytes" in msg
    assert "18446744073709552" not in msg.replace("18446744073709551615", "")
    # a header length past the end of the file
    bad = bytearray(good)
    bad[12:16] = struct.pack("<I", 2**32 - 1)
    p.write_bytes(bytes(bad))
    with pytest.raises(SessionError, match="header does not fit"):
        read_session(p)


def test_tiny_files_name_the_problem_in_good_english(tmp_path):
    p = tmp_path / "s.kvs"
    p.write_bytes(b"K")
    with pytest.raises(SessionError) as e:
        read_session(p)
    assert "1 byte," in str(e.value) and "(1 bytes)" not in str(e.value)
    p.write_bytes(b"hello world, this is text")
    with pytest.raises(SessionError, match="not a kvchat session file"):
        read_session(p)


def test_read_matches_decode_for_every_truncation(tmp_path):
    blob = encode_session(sample())
    p = tmp_path / "s.kvs"
    for cut in (0, 1, 8, 15, 16, 40, len(blob) - 33, len(blob) - 1):
        p.write_bytes(blob[:cut])
        with pytest.raises(SessionError):
            read_session(p)
        with pytest.raises(SessionError):
            decode_session(blob[:cut])
    p.write_bytes(blob)
    assert read_session(p) == decode_session(blob) == sample()


# ---- header schema ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "edit,what",
    [
        (lambda h: h["sampling"].update(temp="abc"), "sampling.temp"),
        (lambda h: h["sampling"].update(top_k=None), "sampling.top_k"),
        (lambda h: h["sampling"].update(top_k=-5), "sampling.top_k"),
        (lambda h: h["sampling"].update(top_p=5), "sampling.top_p"),
        (lambda h: h["sampling"].update(repeat_penalty=0), "sampling.repeat_penalty"),
        (lambda h: h["sampling"].update(seed=-1), "sampling.seed"),
        (lambda h: h["sampling"].update(temp=True), "sampling.temp"),
        (lambda h: h["cache"].update(n_ctx="256"), "cache.n_ctx"),
        (lambda h: h["cache"].update(flash_attn=1), "cache.flash_attn"),
        (lambda h: h["model"].update(size=-1), "model.size"),
        (lambda h: h["model"].update(header_sha256="xyz"), "model.header_sha256"),
        (lambda h: h["messages"].append({"role": "wizard", "content": "x"}), "role 'wizard'"),
        (lambda h: h["messages"].append({"role": "user", "content": 5}), "lacks role or content"),
        (lambda h: h.update(n_keep="0"), "n_keep"),
        (lambda h: h.update(tokens=[1, True]), "token ids"),
        (lambda h: h.update(tokens=[1, 2**40]), "token ids"),
        (lambda h: h.update(extra=[1]), "extra"),
    ],
)
def test_edited_header_with_recomputed_digest_is_refused(edit, what):
    h = header_of(sample())
    edit(h)
    with pytest.raises(SessionError) as e:
        decode_session(with_header(h, b"\x01\x02\x03"))
    assert "invalid header" in str(e.value) and what in str(e.value)


def test_deeply_nested_json_is_refused_without_recursion_error():
    deep = b'{"x":' + b"[" * 200_000 + b"]" * 200_000 + b"}"
    with pytest.raises(SessionError, match="nested 200001 levels deep"):
        decode_session(with_header(deep))
    assert json_depth(b'{"a": "[[[[[[", "b": [1, {"c": "}}"}]}') == 3


def test_oversized_header_is_refused(monkeypatch):
    import kvchat.cli.session.schema as schema

    monkeypatch.setattr(schema, "MAX_HEADER_BYTES", 100)
    with pytest.raises(SessionError, match="larger than any session"):
        decode_session(encode_session(sample(messages=[{"role": "user", "content": "x" * 200}])))


def test_invalid_utf8_in_messages_is_saved_as_replacement_characters(tmp_path):
    data = sample(messages=[{"role": "user", "content": "a\udcffb\ud800c"}])
    p = tmp_path / "s.kvs"
    save_session(p, data)
    assert read_session(p).messages[0]["content"] == "a\ufffdb\ufffdc"


# ---- model identity ----------------------------------------------------------------------------------


def test_renamed_model_file_still_matches_its_sessions():
    data = sample()
    renamed = dict(MODEL, file="renamed-copy.gguf")
    check_compatible(data, renamed, CACHE, "s.kvs")  # same size + header sha: same model
    with pytest.raises(SessionError, match="different model contents"):
        check_compatible(data, dict(renamed, header_sha256="cd" * 32), CACHE, "s.kvs")


# ---- writing: links, modes, temp files, what may be replaced ----------------------------------------


def test_save_through_a_symlink_updates_the_target_and_keeps_the_link(tmp_path):
    real_dir = tmp_path / "real"
    real_dir.mkdir()
    target = real_dir / "talk.kvs"
    save_session(target, sample(tokens=[1]))
    link = tmp_path / "link.kvs"
    link.symlink_to(os.path.relpath(target, tmp_path))
    save_session(link, sample(tokens=[1, 2, 3, 4]))
    assert link.is_symlink()
    assert read_session(target).tokens == [1, 2, 3, 4]
    assert sorted(os.listdir(real_dir)) == ["talk.kvs"] and sorted(os.listdir(tmp_path)) == ["link.kvs", "real"]


def test_save_keeps_the_file_mode(tmp_path):
    p = tmp_path / "s.kvs"
    save_session(p, sample())
    os.chmod(p, 0o640)
    save_session(p, sample(tokens=[5]))
    assert stat.S_IMODE(os.stat(p).st_mode) == 0o640
    q = tmp_path / "new.kvs"
    old = os.umask(0o022)
    try:
        save_session(q, sample())
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(q).st_mode) == 0o644  # not mkstemp's 0600


def test_stale_temp_files_of_a_killed_save_are_removed(tmp_path):
    p = tmp_path / "s.kvs"
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    ).stdout.strip()
    stale = tmp_path / f".s.kvs{TMP_TAG}{dead}-abcd1234"
    stale.write_bytes(b"KVCHATSS" + b"\0" * 100)
    live = tmp_path / f".s.kvs{TMP_TAG}{os.getpid()}-live0000"  # a save in progress: kept
    live.write_bytes(b"x")
    legacy = tmp_path / ".tmp-abcdefgh"
    legacy.write_bytes(b"KVCHATSS" + b"\0" * 10)
    os.utime(legacy, (time.time() - 7200, time.time() - 7200))
    foreign = tmp_path / ".tmp-zzzzzzzz"  # someone else's temp file: not ours, kept
    foreign.write_bytes(b"not ours")
    os.utime(foreign, (time.time() - 7200, time.time() - 7200))
    save_session(p, sample())
    assert sorted(os.listdir(tmp_path)) == sorted(["s.kvs", live.name, foreign.name])
    assert remove_stale_temps(p) == []


def test_save_refuses_to_overwrite_what_is_not_a_session(tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("my notes")
    with pytest.raises(SessionError, match="not a kvchat session file: not overwriting it"):
        save_session(text, sample())
    assert text.read_text() == "my notes"
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + b"\0" * 100)
    with pytest.raises(SessionError, match=r"/save! FILE or --force"):
        save_session(model, sample())
    save_session(text, sample(), force=True)  # forced: replaced
    assert read_session(text) == sample()
    save_session(text, sample(tokens=[9]))  # a session now: replaced without asking
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    save_session(empty, sample())


@pytest.mark.parametrize("kind", ["dir", "fifo", "device"])
def test_save_never_replaces_a_non_regular_file(tmp_path, kind):
    if kind == "dir":
        p = tmp_path / "d"
        p.mkdir()
    elif kind == "fifo":
        p = tmp_path / "f"
        os.mkfifo(p)
    else:
        p = tmp_path / "null"
        p.symlink_to("/dev/null")
    with pytest.raises(SessionError, match="cannot save to"):
        check_save_target(p, force=True)
    with pytest.raises(SessionError):
        save_session(p, sample(), force=True)
    assert os.path.exists("/dev/null") and not os.path.isfile("/dev/null")


# ---- the lock ----------------------------------------------------------------------------------------

HOLD = """
import sys, time
sys.path.insert(0, {root!r})
from kvchat.cli.session.file import SessionLock
lock = SessionLock({path!r}).acquire()
print("locked", flush=True)
time.sleep(60)
"""


def test_second_process_on_a_session_is_refused_with_the_holders_pid(tmp_path):
    p = tmp_path / "s.kvs"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD.format(root=str(ROOT), path=str(p))], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(SessionError) as e:
            SessionLock(p).acquire()
        assert f"in use by process {holder.pid}" in str(e.value)
        link = tmp_path / "alias.kvs"  # the same file through a link is the same lock
        link.symlink_to(p)
        with pytest.raises(SessionError, match="in use by process"):
            SessionLock(link).acquire()
    finally:
        holder.kill()
        holder.wait()
    with SessionLock(p) as lock:  # the kernel released it with the process
        assert lock.held
    assert not (tmp_path / ".s.kvs.lock").exists()  # release removes the lock file


def test_lock_in_a_read_only_place_does_not_block_reading(tmp_path):
    lock = SessionLock("/proc/self/nonexistent-dir/s.kvs").acquire()
    assert not lock.held
