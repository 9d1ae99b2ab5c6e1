"""State save/restore: byte-identical round trips, sequence restore into a fragmented cache,
and refusal (with nothing changed) of corrupted or mismatched blobs."""

import os
import struct

import numpy as np
import pytest

from kvchat.runtime.batch import Batch
from kvchat.runtime.context import Context
from kvchat.runtime.cparams import ContextParams
from kvchat.runtime.memory.state import StateError, StateReader, StateWriter, atomic_write
from tests.helpers.memory_stubs import StubModel, assert_same_cells, cells_snapshot, make_hparams


def make(n_ctx=256, n_seq_max=3, hp=None, **kw):
    hp = hp or make_hparams(n_layer=2)
    return Context(
        StubModel(hp),
        ContextParams(n_ctx=n_ctx, n_seq_max=n_seq_max, n_batch=n_ctx, n_ubatch=kw.pop("n_ubatch", 16), **kw),
    )


def rows_by_pos(kv, seq):
    """{pos: bytes of K and V of that cell in every layer} for one sequence."""
    out = {}
    for s, c in enumerate(kv.cells):
        for i in np.flatnonzero(c.seq[:, seq]).tolist():
            parts = []
            for l in kv.layers:
                parts.append(l.k[s, i].tobytes())
                if kv.v_trans:
                    parts.append(l.v[s][:, kv.trans_cols(np.array([i]))].tobytes())
                else:
                    parts.append(l.v[s, i].tobytes())
            out[int(c.pos[i])] = b"".join(parts)
    return out


def all_bytes(mem):
    kvs = [mem.kv_base, mem.kv_swa] if hasattr(mem, "kv_swa") else [mem]
    return [(l.k.tobytes(), l.v.tobytes()) for kv in kvs for l in kv.layers]


def snapshot(ctx):
    mem = ctx.memory
    kvs = [mem.kv_base, mem.kv_swa] if hasattr(mem, "kv_swa") else [mem]
    return [cells_snapshot(kv) for kv in kvs], all_bytes(mem)


def assert_unchanged(ctx, snap):
    cells, data = snapshot(ctx)
    for a, b in zip(snap[0], cells):
        assert_same_cells(a, b)
    assert data == snap[1]


def two_seqs(ctx, n=20):
    toks, sids, pos = [], [], []
    for k in range(n):
        for s in (0, 1):
            toks.append((3 * k + 11 * s) % 64)
            sids.append([s])
            pos.append(k)
    assert ctx.decode(Batch(toks, pos=pos, seq_ids=sids)) == 0


@pytest.mark.parametrize(
    "kw", [dict(), dict(type_k="q8_0"), dict(flash_attn="off", type_v="f32"), dict(type_k="q4_0", type_v="q8_0")]
)
def test_sequence_save_clear_restore_into_fragmented_cache_is_byte_identical(kw):
    ctx = make(**kw)
    two_seqs(ctx)
    kv = ctx.memory
    want = rows_by_pos(kv, 0)
    blob = ctx.state_seq_get_data(0)
    kv.seq_rm(0, -1, -1)  # clear the sequence: every other cell is now a hole
    assert ctx.decode(Batch.one_seq(np.arange(6), 0, seq_id=2)) == 0  # fill some holes
    c = kv.cells[0]
    assert c.pos[:12].tolist() == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5]
    assert ctx.state_seq_set_data(blob, 0) == len(blob)
    got = rows_by_pos(kv, 0)
    assert got == want  # same positions, byte-identical K/V rows
    cells0 = np.flatnonzero(c.seq[:, 0])
    assert np.any(np.diff(cells0) > 1)  # landed non-contiguously, in the holes
    assert (kv.seq_pos_min(0), kv.seq_pos_max(0)) == (0, 19)
    c.check_invariants()
    # the restored sequence continues normally
    assert ctx.decode(Batch([1], pos=[20], seq_ids=[[0]])) == 0


def test_sequence_restore_into_another_sequence_id():
    ctx = make()
    two_seqs(ctx, 5)
    blob = ctx.state_seq_get_data(1)
    want = rows_by_pos(ctx.memory, 1)
    assert ctx.state_seq_set_data(blob, 2) == len(blob)
    assert rows_by_pos(ctx.memory, 2) == want


def test_whole_state_round_trip():
    a = make(type_k="q8_0")
    two_seqs(a, 30)
    a.memory.seq_rm(1, 10, -1)
    blob = a.state_get_data()
    b = make(type_k="q8_0")
    assert b.decode(Batch.one_seq([1, 2, 3], 0, seq_id=2)) == 0  # replaced by the restore
    assert b.state_set_data(blob) == len(blob)
    assert b.state_get_data() == blob
    for s in (0, 1, 2):
        assert rows_by_pos(b.memory, s) == rows_by_pos(a.memory, s)
    assert b.memory.seq_pos_max(2) == -1 and b.memory.heads[0] == 0
    b.memory.cells[0].check_invariants()


def seq_blob_offsets():
    # u32 magic, i32 seq, u32 n_stream, u32 cell_count, then cell 0: i32 pos, u32 n_seq, i32 seq
    return dict(magic=0, n_stream=8, cell_count=12, pos0=16, n_seq0=20, seq0=24)


def patch(blob, off, fmt, value):
    b = bytearray(blob)
    struct.pack_into(fmt, b, off, value)
    return bytes(b)


def test_corrupted_sequence_blobs_are_refused_and_change_nothing():
    ctx = make()
    two_seqs(ctx, 8)
    blob = ctx.state_seq_get_data(0)
    o = seq_blob_offsets()
    bad = {
        "truncated": blob[:-3],
        "trailing": blob + b"\0",
        "magic": patch(blob, o["magic"], "<I", 0x12345678),
        "n_stream": patch(blob, o["n_stream"], "<I", 2),
        "cell_count": patch(blob, o["cell_count"], "<I", 10**6),
        "n_seq_id": patch(blob, o["n_seq0"], "<I", 2),
        "seq id": patch(blob, o["seq0"], "<i", 7),
        "negative pos": patch(blob, o["pos0"], "<i", -4),
        "empty": b"",
    }
    snap = snapshot(ctx)
    for name, b in bad.items():
        assert ctx.state_seq_set_data(b, 0) == 0, name
        assert ctx.last_error, name
        assert_unchanged(ctx, snap)
    assert ctx.state_seq_set_data(blob, 5) == 0  # destination out of range
    assert_unchanged(ctx, snap)


def test_type_row_and_layout_mismatches_are_refused():
    src = make()
    two_seqs(src, 4)
    seq_blob, whole = src.state_seq_get_data(0), src.state_get_data()
    others = {
        "type_k": make(type_k="q8_0"),
        "type_v": make(type_v="bf16"),
        "v_trans": make(flash_attn="off"),
        "n_layer": make(hp=make_hparams(n_layer=3)),
        "row size": make(hp=make_hparams(n_layer=2, n_head_kv=2, head_dim=64)),
        "n_stream": make(n_ctx=768, kv_unified=False),
        "arch": make(hp=make_hparams(n_layer=2, arch="qwen2")),
    }
    for name, dst in others.items():
        two_seqs(dst, 3)
        snap = snapshot(dst)
        if name != "arch":
            assert dst.state_seq_set_data(seq_blob, 0) == 0, name
            assert_unchanged(dst, snap)
        assert dst.state_set_data(whole) == 0, name
        assert_unchanged(dst, snap)
    assert "wrong model arch" in others["arch"].last_error


def test_whole_state_larger_than_capacity_is_refused():
    big = make(n_ctx=512)
    assert big.decode(Batch.one_seq(np.arange(300) % 64, 0)) == 0
    small = make(n_ctx=256)
    snap = snapshot(small)
    assert small.state_set_data(big.state_get_data()) == 0
    assert "not enough cells" in small.last_error
    assert_unchanged(small, snap)


def test_sequence_that_does_not_fit_is_refused_and_old_cells_kept():
    src = make(n_ctx=512)
    assert src.decode(Batch.one_seq(np.arange(100) % 64, 0)) == 0
    blob = src.state_seq_get_data(0)
    dst = make(n_ctx=256)
    assert dst.decode(Batch.one_seq(np.arange(20) % 64, 0, seq_id=0)) == 0
    assert dst.decode(Batch.one_seq(np.arange(200) % 64, 0, seq_id=1)) == 0
    snap = snapshot(dst)
    # 220 used; removing seq 0 frees 20 -> 56 free < 100
    assert dst.state_seq_set_data(blob, 0) == 0
    assert "failed to find 100 available cells" in dst.last_error
    assert_unchanged(dst, snap)


def test_iswa_sequence_state_keeps_only_the_window_in_the_swa_part():
    hp = make_hparams(n_layer=3, n_swa=8, swa_layers=[True, False, True])
    ctx = make(n_ctx=512, n_seq_max=1, hp=hp, n_ubatch=8)
    for i in range(6):
        assert ctx.decode(Batch.one_seq(np.arange(8) + i, 8 * i)) == 0
    mem = ctx.memory
    blob = ctx.state_seq_get_data(0)
    # base part: 48 cells; SWA part: cells with 47 - p < 8 -> positions 40..47
    r = StateReader(blob)
    r.read_u32(), r.read_i32(), r.read_u32()
    assert r.read_u32() == 48
    want_base, want_swa = rows_by_pos(mem.kv_base, 0), rows_by_pos(mem.kv_swa, 0)
    mem.clear()
    assert ctx.state_seq_set_data(blob, 0) == len(blob)
    assert rows_by_pos(mem.kv_base, 0) == want_base
    got_swa = rows_by_pos(mem.kv_swa, 0)
    assert sorted(got_swa) == list(range(40, 48))
    assert all(got_swa[p] == want_swa[p] for p in got_swa)
    assert (mem.seq_pos_min(0), mem.seq_pos_max(0)) == (40, 47)
    assert ctx.decode(Batch([1], pos=[48])) == 0


def test_iswa_failed_swa_part_undoes_the_base_part():
    hp = make_hparams(n_layer=2, n_swa=300, swa_layers=[True, False])
    src = make(n_ctx=1024, n_seq_max=1, hp=hp, n_ubatch=8)
    assert src.decode(Batch.one_seq(np.arange(300) % 64, 0)) == 0
    blob = src.state_seq_get_data(0)
    # destination: same layers, smaller window -> SWA cache of pad256(200 + 8) = 256 cells;
    # the base part (300 cells) fits, the SWA part (300 visible cells) does not
    hp2 = make_hparams(n_layer=2, n_swa=200, swa_layers=[True, False])
    dst = make(n_ctx=1024, n_seq_max=1, hp=hp2, n_ubatch=8)
    assert dst.memory.kv_swa.kv_size == 256
    assert dst.decode(Batch.one_seq(np.arange(10), 0)) == 0
    snap = snapshot(dst)
    assert dst.state_seq_set_data(blob, 0) == 0  # 300 SWA cells do not fit in 256
    assert_unchanged(dst, snap)


def test_writer_reader_bounds():
    w = StateWriter()
    w.write_u32(7)
    w.write_i32(-2)
    w.write_u64(2**40)
    w.write_string("gemma3")
    r = StateReader(w.getvalue())
    assert (r.read_u32(), r.read_i32(), r.read_u64(), r.read_string()) == (7, -2, 2**40, "gemma3")
    r.expect_end()
    with pytest.raises(StateError, match="truncated"):
        r.read_u32()
    with pytest.raises(StateError, match="implausibly long"):
        StateReader(struct.pack("<I", 2**31)).read_string()


def test_atomic_write(tmp_path, monkeypatch):
    p = tmp_path / "s.bin"
    atomic_write(p, b"one")
    assert p.read_bytes() == b"one"
    atomic_write(p, b"two")
    assert p.read_bytes() == b"two"
    assert os.listdir(tmp_path) == ["s.bin"]

    def fail(*a):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError):
        atomic_write(p, b"three")
    assert p.read_bytes() == b"two" and os.listdir(tmp_path) == ["s.bin"]


def test_atomic_write_with_a_writer_gives_exactly_what_it_wrote_seeks_included(tmp_path):
    p = tmp_path / "pack.bin"
    p.write_bytes(b"old")
    os.chmod(p, 0o640)

    def writer(f):
        f.write(b"head")
        f.seek(10)
        f.write(b"tail")
        f.seek(2)
        f.write(b"XY")
        f.truncate(16)

    atomic_write(p, writer=writer)
    assert p.read_bytes() == b"heXY" + b"\0" * 6 + b"tail" + b"\0" * 2
    assert os.stat(p).st_mode & 0o777 == 0o640 and os.listdir(tmp_path) == ["pack.bin"]


@pytest.mark.parametrize("exc", [OSError(28, "No space left on device"), KeyboardInterrupt(), ValueError("bug")])
def test_a_failing_writer_leaves_the_old_file_and_no_temp(tmp_path, exc):
    p = tmp_path / "pack.bin"
    p.write_bytes(b"old content")
    seen = []

    def writer(f):
        f.write(b"half of the new content")
        f.flush()
        seen.extend(n for n in os.listdir(tmp_path) if n != "pack.bin")  # the temp exists meanwhile
        raise exc

    with pytest.raises(type(exc)):
        atomic_write(p, writer=writer)
    assert len(seen) == 1 and seen[0].startswith(".pack.bin.kvchat-tmp-")
    assert p.read_bytes() == b"old content" and os.listdir(tmp_path) == ["pack.bin"]
    with pytest.raises(type(exc)):
        atomic_write(tmp_path / "new.bin", writer=writer)
    assert os.listdir(tmp_path) == ["pack.bin"]  # a failed first write creates nothing


def test_atomic_write_takes_data_or_a_writer_not_both(tmp_path):
    p = tmp_path / "f"
    with pytest.raises(TypeError):
        atomic_write(p)
    with pytest.raises(TypeError):
        atomic_write(p, b"x", writer=lambda f: f.write(b"y"))
    assert os.listdir(tmp_path) == []
