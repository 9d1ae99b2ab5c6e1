"""KVCache: storage sizes, slot search into holes, dry-run prepare, masks, K/V writes,
K-shift, sequence ops, stream copies and compaction - checked cell by cell."""

import numpy as np
import pytest

from kvchat.kernels.ggml_types import GGMLType, row_bytes
from kvchat.kernels.quants import dequantize, quantize
from kvchat.runtime.batch import Batch, BatchAllocator
from kvchat.runtime.context import Context
from kvchat.runtime.cparams import ContextParams
from kvchat.runtime.memory.attn_rotation import rotate
from kvchat.runtime.memory.interface import MemoryOpError, MemoryStatus
from kvchat.runtime.memory.kv_cache import KVCache
from tests.helpers.memory_stubs import StubModel, assert_same_cells, cells_snapshot, make_hparams, roped_k

F16, Q8_0, F32 = int(GGMLType.F16), int(GGMLType.Q8_0), int(GGMLType.F32)


def make_ctx(
    n_ctx=256, n_seq_max=3, type_k="f16", type_v="f16", flash="on", unified=True, n_ubatch=512, n_layer=2, **hp_kw
):
    hp = make_hparams(n_layer=n_layer, **hp_kw)
    model = StubModel(hp)
    ctx = Context(
        model,
        ContextParams(
            n_ctx=n_ctx,
            n_seq_max=n_seq_max,
            type_k=type_k,
            type_v=type_v,
            flash_attn=flash,
            kv_unified=unified,
            n_ubatch=n_ubatch,
            n_batch=n_ctx,
        ),
    )
    return ctx, model


def interleaved(seqs, n_each, pos0=0, tok0=0):
    toks, sids, pos = [], [], []
    for k in range(n_each):
        for s in seqs:
            toks.append((tok0 + 7 * s + k) % 64)
            sids.append([s])
            pos.append(pos0 + k)
    return Batch(toks, pos=pos, seq_ids=sids, logits=[True] * len(toks))


# ---- storage --------------------------------------------------------------------------------


def test_storage_sizes_follow_the_block_formula():
    hp = make_hparams(n_layer=3, n_head_kv=2, head_dim=32)  # n_embd_k_gqa = 64
    kv = KVCache(hp, Q8_0, F16, v_trans=False, unified=True, kv_size=256, n_seq_max=1)
    assert row_bytes(Q8_0, 64) == 2 * 34  # q8_0: 34 bytes per 32 values
    for l in kv.layers:
        assert l.k.shape == (1, 256, 68) and l.k.dtype == np.uint8
        assert l.v.shape == (1, 256, 128)
        assert not l.k.any() and not l.v.any()  # zero-filled
    assert kv.size_k_bytes() == 3 * 256 * 68
    assert kv.size_v_bytes() == 3 * 256 * 128
    mb = kv.memory_breakdown()
    assert mb["total_bytes"] == 3 * 256 * (68 + 128) and mb["type_k"] == "q8_0"
    line = kv.log_line()
    assert line.startswith("llama_kv_cache: size =    0.14 MiB (   256 cells,   3 layers,  1/1 seqs)")
    assert "K (q8_0):    0.05 MiB, V (f16):    0.09 MiB" in line


def test_transposed_v_and_streams_layout():
    hp = make_hparams(n_layer=1, n_head_kv=2, head_dim=32)
    kv = KVCache(hp, F16, F32, v_trans=True, unified=False, kv_size=256, n_seq_max=2)
    assert kv.layers[0].k.shape == (2, 256, 128)
    assert kv.layers[0].v.shape == (2, 64, 256 * 4)  # [n_stream, n_embd_v_gqa, kv_size * 4]
    with pytest.raises(MemoryOpError, match="requires Flash Attention"):
        KVCache(hp, F16, Q8_0, v_trans=True, unified=True, kv_size=256, n_seq_max=1)


def test_layer_filter_and_reuse():
    hp = make_hparams(n_layer=4)
    kv = KVCache(hp, F16, F16, False, True, 256, 1, filter=lambda il: il != 3, reuse=lambda il: 0 if il == 2 else -1)
    assert [l.il for l in kv.layers] == [0, 1, 2]
    assert kv.layer(2) is kv.layer(0)
    assert 3 not in kv.map_layer_ids


# ---- slots ----------------------------------------------------------------------------------


def test_interleaved_cache_with_holes_takes_new_ubatch_into_the_holes():
    ctx, _ = make_ctx()
    assert ctx.decode(interleaved([0, 1, 2], 4)) == 0
    kv = ctx.memory
    c = kv.cells[0]
    assert c.pos[:12].tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    assert [c.seq_get(i) for i in range(12)] == [0, 1, 2] * 4
    assert kv.heads[0] == 12
    kv.seq_rm(1, -1, -1)  # holes at 1, 4, 7, 10
    assert c.pos[:12].tolist() == [0, -1, 0, 1, -1, 1, 2, -1, 2, 3, -1, 3]
    assert kv.heads[0] == 1 and c.get_used() == 8
    assert ctx.decode(Batch([9, 9, 9, 9], pos=[0, 1, 2, 3], seq_ids=[[1]] * 4)) == 0
    assert c.pos[:12].tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    assert [c.seq_get(i) for i in (1, 4, 7, 10)] == [1, 1, 1, 1]
    assert c.ext[[1, 4, 7, 10]].tolist() == [9, 9, 9, 9]
    assert kv.heads[0] == 11 and c.get_used() == 12 and c.used_max_p1() == 12
    # the next token of seq 0 goes to the first free cell after the head
    assert ctx.decode(Batch([5], pos=[4], seq_ids=[[0]])) == 0
    assert c.pos[12] == 4 and c.seq_get(12) == 0
    c.check_invariants()


def test_find_slot_restarts_from_zero_when_head_is_far_past_the_used_cells():
    ctx, _ = make_ctx(n_seq_max=1)
    assert ctx.decode(Batch.one_seq(np.arange(40) % 64, 0)) == 0
    kv = ctx.memory
    kv.seq_rm(0, 0, 30)  # cells 0..29 free, head -> 0
    kv.heads[0] = 40  # as if head were left at the end
    ba = BatchAllocator()
    assert ba.init(Batch([1, 2]), 64, 1, kv)
    ub = ba.split_simple(8)
    # head 40 > used 10 + 2*2 -> scan from 0
    assert kv.find_slot(ub).idxs[0].tolist() == [0, 1]


def test_prepare_is_a_dry_run_and_sees_earlier_ubatches():
    ctx, _ = make_ctx()
    assert ctx.decode(interleaved([0, 1, 2], 4)) == 0
    kv = ctx.memory
    kv.seq_rm(1, 2, -1)  # holes at cells 7 and 10
    before = cells_snapshot(kv)
    ba = BatchAllocator()
    assert ba.init(Batch(np.arange(6), seq_ids=[[1]] * 6), 64, 3, kv)
    ubs = []
    while (ub := ba.split_simple(3)) is not None:
        ubs.append(ub)
    sinfos = kv.prepare(ubs)
    assert [s.idxs[0].tolist() for s in sinfos] == [[7, 10, 12], [13, 14, 15]]
    assert_same_cells(before, cells_snapshot(kv))
    kv.cells[0].check_invariants()


def test_prepare_fails_without_room_and_changes_nothing():
    ctx, _ = make_ctx(n_ctx=256, n_seq_max=1)
    assert ctx.decode(Batch.one_seq(np.arange(250) % 64, 0)) == 0
    kv = ctx.memory
    before = cells_snapshot(kv)
    ba = BatchAllocator()
    assert ba.init(Batch(np.arange(10)), 64, 1, kv)
    assert kv.init_batch(ba, 512).get_status() == MemoryStatus.FAILED_PREPARE
    assert_same_cells(before, cells_snapshot(kv))


def test_n_kv_is_used_max_padded_to_256():
    ctx, model = make_ctx(n_ctx=1024, n_seq_max=1)
    assert ctx.decode(Batch.one_seq(np.arange(10) % 64, 0)) == 0
    assert model.seen[-1][1] == 256
    assert ctx.decode(Batch.one_seq(np.arange(300) % 64, 10)) == 0
    assert model.seen[-1][1] == 512  # used_max_p1 = 310 -> 512
    ctx.memory.seq_rm(0, 100, -1)
    assert ctx.decode(Batch.one_seq([1], 100)) == 0
    assert model.seen[-1][1] == 256


# ---- masks and K/V writes -------------------------------------------------------------------


def test_kq_mask_same_sequence_and_causal_cell_by_cell():
    ctx, _ = make_ctx()
    assert ctx.decode(interleaved([0, 1], 2)) == 0  # cells: s0p0 s1p0 s0p1 s1p1
    kv = ctx.memory
    ba = BatchAllocator()
    b = Batch([1, 2, 3], pos=[2, 2, 3], seq_ids=[[0], [1], [0]])
    assert ba.init(b, 64, 3, kv)
    mctx = kv.init_batch(ba, 512)
    mctx.apply()  # cells 4: s0p2, 5: s1p2, 6: s0p3
    mask, strm = mctx.kq_mask(0)
    assert mask.shape == (3, 256) and strm.tolist() == [0, 0, 0]
    vis = np.isfinite(mask[:, :8])
    assert vis.astype(int).tolist() == [
        [1, 0, 1, 0, 1, 0, 0, 0],  # seq 0 at 2 sees s0p0, s0p1, itself
        [0, 1, 0, 1, 0, 1, 0, 0],  # seq 1 at 2
        [1, 0, 1, 0, 1, 0, 1, 0],  # seq 0 at 3 sees its cells up to 3
    ]
    assert np.all(mask[np.isfinite(mask)] == 0) and np.all(np.isneginf(mask[:, 8:]))
    assert mctx.kq_mask(1) is mctx.kq_mask(0)  # built once per ubatch
    mctx.rollback()


def test_kq_mask_sliding_window():
    hp = make_hparams(n_layer=1)
    kv = KVCache(hp, F16, F16, False, True, 256, 1, n_swa=3)
    ba = BatchAllocator()
    assert ba.init(Batch.one_seq(np.arange(6), 0, all_logits=True), 64, 1, kv)
    mctx = kv.init_batch(ba, 512)
    mctx.apply()
    vis = np.isfinite(mctx.kq_mask(0)[0][:, :6]).astype(int)
    # token at p sees p-2..p (masked when p - p0 >= 3)
    assert vis.tolist() == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [0, 1, 1, 1, 0, 0],
        [0, 0, 1, 1, 1, 0],
        [0, 0, 0, 1, 1, 1],
    ]


@pytest.mark.parametrize("type_k, flash", [("q8_0", "on"), ("f16", "off"), ("f32", "off")])
def test_cpy_k_v_write_quantized_rows_into_slot_cells(type_k, flash):
    ctx, _ = make_ctx(n_seq_max=1, type_k=type_k, type_v="f16", flash=flash)
    kv = ctx.memory
    kv.heads[0] = 5  # start the slot mid-cache
    ba = BatchAllocator()
    assert ba.init(Batch.one_seq([3, 4, 5], 0), 64, 1, kv)
    mctx = kv.init_batch(ba, 512)
    mctx.apply()
    assert mctx.get_sinfo().idxs[0].tolist() == [5, 6, 7]
    k = np.random.default_rng(0).standard_normal((3, 64)).astype(np.float32)
    v = np.random.default_rng(1).standard_normal((3, 64)).astype(np.float32)
    mctx.cpy_k(1, k)
    mctx.cpy_v(1, v)
    tk = kv.type_k
    kc, tk2 = mctx.get_k(1)
    assert tk2 == tk and kc.shape[:2] == (1, 256)
    np.testing.assert_array_equal(kc[0, 5:8], quantize(k, tk))
    assert not kc[0, :5].any() and not kc[0, 8:].any()
    vc, tv = mctx.get_v(1)
    if flash == "off":
        assert vc.shape == (1, 64, 256 * 2)
        got = vc[0].view(np.float16)[:, 5:8].T  # [3, 64]
        np.testing.assert_array_equal(got, v.astype(np.float16))
        assert not vc[0].view(np.float16)[:, :5].any()
    else:
        np.testing.assert_array_equal(vc[0, 5:8], quantize(v, tv))
    assert not kv.layer(0).k.any()  # other layers untouched


# ---- K-shift --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "type_k, atol, head_dim",
    [("f16", 2e-3, 32), ("q8_0", 3e-2, 32), ("f32", 1e-5, 32), ("q8_0", 5e-2, 64), ("q4_0", 0.6, 128)],
)
@pytest.mark.parametrize("rope_type", ["neox", "norm"])
def test_k_shift_equals_rotating_fresh_keys(type_k, atol, head_dim, rope_type):
    """Head sizes of 64 and 128 with a quantized K make the cache store Hadamard-rotated keys
    (n_rot_k 64 / 128): the shift must rotate them back, apply RoPE, and rotate again."""
    ctx, model = make_ctx(n_seq_max=1, type_k=type_k, rope_type=rope_type, head_dim=head_dim)
    hp = model.hparams
    kv = ctx.memory
    assert kv.n_rot_k == (head_dim if (type_k.startswith("q") and head_dim >= 64) else 0)
    unrot = (lambda x: rotate(x, kv.n_rot_k)) if kv.n_rot_k else (lambda x: x)
    toks = (np.arange(20) * 5) % 64
    assert ctx.decode(Batch.one_seq(toks, 0)) == 0
    # context shift: drop positions 2..7, move 8..19 down by 6
    kv.seq_rm(0, 2, 8)
    kv.seq_add(0, 8, -1, -6)
    c = kv.cells[0]
    assert c.get_has_shift() and c.shift[8:20].tolist() == [-6] * 12
    assert ctx.memory_update() is True
    assert not c.get_has_shift() and not c.shift.any()
    cells = np.flatnonzero(c.pos >= 0)
    assert c.pos[cells].tolist() == [0, 1] + list(range(2, 14))
    n_embd_k = hp.n_embd_k_gqa(0)
    for il in range(hp.n_layer):
        cached = unrot(dequantize(kv.layer(il).k[0, cells], kv.type_k, n_embd_k))
        fresh = roped_k(hp, il, toks[cells], c.pos[cells])
        np.testing.assert_allclose(cached, fresh, atol=atol, rtol=0)
        if kv.n_rot_k:
            # shifting requantizes once more: the error may grow like two independent roundings
            # (about sqrt(2) times one), not more
            direct = unrot(dequantize(quantize(rotate(fresh, kv.n_rot_k), kv.type_k), kv.type_k, n_embd_k))
            rms = lambda e: float(np.sqrt(np.mean(e**2)))  # noqa: E731
            assert rms(cached - fresh) <= 1.8 * rms(direct - fresh)
        # unshifted cells 0, 1 are bit-identical to what the forward pass stored
        stored = (
            unrot(roped_k(hp, il, toks[:2], np.arange(2))) if kv.n_rot_k else roped_k(hp, il, toks[:2], np.arange(2))
        )
        np.testing.assert_array_equal(kv.layer(il).k[0, :2], quantize(stored, kv.type_k))


def test_k_shift_refused_when_model_cannot_shift():
    ctx, model = make_ctx(n_seq_max=1)
    assert ctx.decode(Batch.one_seq([1, 2, 3], 0)) == 0
    model.hparams.rope_type = "none"
    ctx.memory.seq_add(0, 0, -1, 2)
    with pytest.raises(MemoryOpError, match="does not support K-shift"):
        ctx.memory_update()


def test_seq_div_records_shift():
    ctx, _ = make_ctx(n_seq_max=1)
    assert ctx.decode(Batch.one_seq(np.arange(8), 0)) == 0
    kv = ctx.memory
    kv.seq_div(0, 4, -1, 2)
    c = kv.cells[0]
    assert c.pos[:8].tolist() == [0, 1, 2, 3, 2, 2, 3, 3]
    assert c.shift[:8].tolist() == [0, 0, 0, 0, 2, 3, 3, 4]
    assert kv.seq_pos_max(0) == 3


# ---- sequence operations --------------------------------------------------------------------


def test_seq_cp_and_seq_keep_within_a_stream():
    ctx, _ = make_ctx()
    assert ctx.decode(Batch.one_seq(np.arange(5), 0)) == 0
    kv = ctx.memory
    kv.seq_cp(0, 2, 1, 4)
    c = kv.cells[0]
    assert [bool(c.seq[i, 2]) for i in range(5)] == [False, True, True, True, False]
    assert (kv.seq_pos_min(2), kv.seq_pos_max(2)) == (1, 3)
    kv.seq_keep(2)
    assert c.pos[:5].tolist() == [-1, 1, 2, 3, -1] and kv.seq_pos_max(0) == -1
    assert kv.heads[0] == 0
    kv.seq_rm(-1, 2, 3)
    assert c.pos[:5].tolist() == [-1, 1, -1, 3, -1]
    c.check_invariants()


def test_seq_cp_across_streams_copies_buffers_at_update():
    ctx, _ = make_ctx(n_ctx=512, n_seq_max=2, unified=False)
    kv = ctx.memory
    assert kv.n_stream == 2
    assert ctx.decode(Batch.one_seq(np.arange(6), 0)) == 0
    assert not kv.layer(0).k[1].any()
    kv.seq_cp(0, 1, -1, -1)
    assert kv.cells[1].pos[:6].tolist() == list(range(6)) and kv.seq_pos_max(1) == 5
    assert ctx.memory_update() is True
    for l in kv.layers:
        np.testing.assert_array_equal(l.k[1], l.k[0])
        np.testing.assert_array_equal(l.v[1], l.v[0])
    # each stream continues independently
    assert ctx.decode(Batch([1, 2], pos=[6, 6], seq_ids=[[0], [1]])) == 0
    assert kv.cells[0].pos[6] == 6 and kv.cells[1].pos[6] == 6
    with pytest.raises(MemoryOpError):
        kv.seq_cp(0, 1, 2, 4)


def test_streams_each_sequence_in_its_own_cells_and_mask():
    ctx, _ = make_ctx(n_ctx=512, n_seq_max=2, unified=False)
    kv = ctx.memory
    b = Batch([1, 2, 3, 4, 5], pos=[0, 0, 1, 1, 2], seq_ids=[[0], [1], [0], [1], [0]])
    ba = BatchAllocator()
    assert ba.init(b, 64, 2, kv)
    mctx = kv.init_batch(ba, 512)
    # equal split per stream: 2 tokens of each sequence, then seq 0's third token alone
    assert [u.seq0.tolist() for u in mctx.ubatches] == [[0, 0, 1, 1], [0]]
    mctx.apply()
    assert [i.tolist() for i in mctx.get_sinfo().idxs] == [[0, 1], [0, 1]]
    assert mctx.get_sinfo().strm == [0, 1]
    mask, strm = mctx.kq_mask(0)
    assert strm.tolist() == [0, 0, 1, 1]
    assert np.isfinite(mask[:, :3]).astype(int).tolist() == [[1, 0, 0], [1, 1, 0], [1, 0, 0], [1, 1, 0]]
    assert kv.cells[0].pos[:2].tolist() == [0, 1] and kv.cells[1].pos[:2].tolist() == [0, 1]
    assert kv.cells[0].seq[:2, 0].all() and kv.cells[1].seq[:2, 1].all()
    mctx.rollback()
    assert kv.seq_pos_max(0) == -1 and kv.seq_pos_max(1) == -1


def test_optimize_compacts_cells_and_rows():
    ctx, model = make_ctx(n_seq_max=2)
    assert ctx.decode(interleaved([0, 1], 5)) == 0
    kv = ctx.memory
    kv.seq_rm(1, -1, -1)  # holes at odd cells
    c = kv.cells[0]
    rows_by_pos = {int(c.pos[i]): kv.layer(0).k[0, i].copy() for i in np.flatnonzero(c.pos >= 0)}
    assert c.used_max_p1() == 9
    assert ctx.memory_update(optimize=True) is True
    # the top cells moved down into the holes: [0, 3, 1, 4, 2] (order is irrelevant to attention)
    assert c.pos[:6].tolist() == [0, 3, 1, 4, 2, -1] and c.used_max_p1() == 5
    for i in range(5):
        np.testing.assert_array_equal(kv.layer(0).k[0, i], rows_by_pos[int(c.pos[i])])
    c.check_invariants()
    assert ctx.memory_update(optimize=True) is False  # nothing left to do
    assert ctx.decode(Batch([3], pos=[5], seq_ids=[[0]])) == 0
    assert c.pos[5] == 5


def test_clear():
    ctx, _ = make_ctx(n_seq_max=1)
    assert ctx.decode(Batch.one_seq(np.arange(5), 0)) == 0
    kv = ctx.memory
    kv.clear(data=False)
    assert kv.cells[0].get_used() == 0 and kv.layer(0).k.any()
    kv.clear(data=True)
    assert not kv.layer(0).k.any() and kv.seq_pos_max(0) == -1
