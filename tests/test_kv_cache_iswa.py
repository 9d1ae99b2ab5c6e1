"""KVCacheISWA: cache sizes, layer routing, the SWA cache keeping only the window and reusing
masked cells, and operations reaching both caches."""

import numpy as np
import pytest

from kvchat.kernels.ggml_types import GGMLType
from kvchat.runtime.arch import create_memory
from kvchat.runtime.batch import Batch, BatchAllocator
from kvchat.runtime.context import Context
from kvchat.runtime.cparams import ContextParams, resolve_cparams
from kvchat.runtime.memory.kv_cache import KVCache
from kvchat.runtime.memory.kv_cache_iswa import KVCacheISWA
from tests.helpers.memory_stubs import StubModel, make_hparams

SWA = [True, True, False, True]  # layers 0, 1, 3 slide; layer 2 is global


def hp_swa(n_swa=8, layers=SWA):
    return make_hparams(n_layer=len(layers), n_swa=n_swa, swa_layers=layers)


def memory_for(hp, **kw):
    return create_memory(hp, resolve_cparams(ContextParams(**kw), hp))


@pytest.mark.parametrize(
    "kw, base, swa",
    [
        (dict(n_ctx=4096, n_ubatch=512), 4096, 1024),  # pad256(min(4096, 512 + 512))
        (dict(n_ctx=4096, n_ubatch=512, n_seq_max=2), 4096, 1536),  # n_swa * 2 seqs + n_ubatch
        (dict(n_ctx=4096, n_ubatch=512, n_seq_max=2, kv_unified=False), 2048, 1024),
        (dict(n_ctx=4096, n_ubatch=100), 4096, 768),  # pad256(612)
        (dict(n_ctx=512, n_ubatch=512), 512, 512),  # capped by n_ctx_seq
        (dict(n_ctx=4096, n_ubatch=512, swa_full=True), 4096, 4096),
    ],
)
def test_swa_cache_size_formula(kw, base, swa):
    mem = memory_for(hp_swa(n_swa=512), **kw)
    assert isinstance(mem, KVCacheISWA)
    assert mem.kv_base.kv_size == base and mem.kv_swa.kv_size == swa
    assert [l.il for l in mem.kv_base.layers] == [2]
    assert [l.il for l in mem.kv_swa.layers] == [0, 1, 3]
    assert mem.kv_swa.n_swa == 512 and mem.kv_base.n_swa == 0
    mb = mem.memory_breakdown()
    assert mb["total_bytes"] == mb["base"]["total_bytes"] + mb["swa"]["total_bytes"]
    assert mb["swa"]["kv_size"] == swa


def test_create_memory_picks_by_architecture():
    assert type(memory_for(make_hparams(), n_ctx=256)) is KVCache
    # a window size without sliding layers is not iSWA
    assert type(memory_for(make_hparams(n_swa=8), n_ctx=256)) is KVCache
    assert type(memory_for(hp_swa(), n_ctx=256)) is KVCacheISWA


def test_can_shift_only_with_full_swa_cache():
    assert not memory_for(hp_swa(), n_ctx=1024, n_ubatch=64).get_can_shift()
    assert memory_for(hp_swa(), n_ctx=1024, n_ubatch=64, swa_full=True).get_can_shift()


def make_ctx(n_ctx=512, n_ubatch=8, n_seq_max=1, **kw):
    hp = hp_swa()
    model = StubModel(hp)
    ctx = Context(model, ContextParams(n_ctx=n_ctx, n_ubatch=n_ubatch, n_batch=n_ctx, n_seq_max=n_seq_max, **kw))
    return ctx, model


def test_swa_cache_keeps_the_window_and_reuses_masked_cells():
    ctx, _ = make_ctx()
    mem = ctx.memory
    base, swa = mem.kv_base, mem.kv_swa
    assert swa.kv_size == 256
    for i in range(33):  # 264 tokens in 8-token decodes
        assert ctx.decode(Batch.one_seq((np.arange(8) + i) % 64, 8 * i)) == 0
    cb, cs = base.cells[0], swa.cells[0]
    # the base cache holds everything
    assert (base.seq_pos_min(0), base.seq_pos_max(0)) == (0, 263) and cb.get_used() == 264
    # the SWA cache wrapped: cells 0..7 (positions 0..7, long outside the window of 8) were
    # reused for positions 256..263; the rest still holds 8..255 in place
    assert cs.get_used() == 256
    assert cs.pos[:8].tolist() == list(range(256, 264))
    assert cs.pos[8:256].tolist() == list(range(8, 256))
    assert (mem.seq_pos_min(0), mem.seq_pos_max(0)) == (8, 263)
    cs.check_invariants()
    cb.check_invariants()


def test_swa_find_slot_only_takes_masked_cells():
    ctx, _ = make_ctx()
    for i in range(32):  # fill the SWA cache exactly: positions 0..255
        assert ctx.decode(Batch.one_seq(np.arange(8), 8 * i)) == 0
    swa = ctx.memory.kv_swa
    ba = BatchAllocator()
    assert ba.init(Batch.one_seq(np.arange(8), 256), 64, 1, swa)
    ub = ba.split_simple(8)
    # max pos 255 -> a cell at p is masked when 256 - p >= 8, i.e. p <= 248
    usable = swa._usable(swa.cells[0])
    assert np.flatnonzero(usable).tolist() == list(range(0, 249))
    assert swa.find_slot(ub).idxs[0].tolist() == list(range(0, 8))


def test_masked_cell_of_one_sequence_is_reused_by_another():
    hp = make_hparams(n_layer=1, n_swa=4, swa_layers=[True])
    kv = KVCache(hp, int(GGMLType.F16), int(GGMLType.F16), False, True, 256, 2, n_swa=4)
    ba = BatchAllocator()
    assert ba.init(Batch.one_seq(np.arange(256) % 64, 0), 64, 2, kv)
    mctx = kv.init_batch(ba, 256)
    mctx.apply()  # seq 0 fills all 256 cells, positions 0..255
    assert ba.init(Batch.one_seq([1, 2], 0, seq_id=1), 64, 2, kv)
    mctx = kv.init_batch(ba, 256)
    # head wrapped to 256 -> restart; cells 0 and 1 hold seq 0 positions far outside its window
    assert mctx.sinfos[0].idxs[0].tolist() == [0, 1]
    mctx.apply()
    c = kv.cells[0]
    assert c.seq_get(0) == 1 and c.seq_get(1) == 1
    # seq 0 keeps one contiguous range: positions 0 and 1 purged
    assert kv.seq_pos_min(0) == 2 and kv.seq_pos_min(1) == 0
    c.check_invariants()


def test_layers_are_routed_to_their_cache():
    ctx, model = make_ctx()
    for i in range(4):
        assert ctx.decode(Batch.one_seq(np.arange(8), 8 * i)) == 0
    ba = BatchAllocator()
    assert ba.init(Batch.one_seq([1], 32), 64, 1, ctx.memory)
    mctx = ctx.memory.init_batch(ba, 8)
    mctx.apply()
    k_swa, _ = mctx.get_k(0)
    k_base, _ = mctx.get_k(2)
    assert np.shares_memory(k_swa, ctx.memory.kv_swa.layer(0).k)
    assert np.shares_memory(k_base, ctx.memory.kv_base.layer(2).k)
    m_swa, _ = mctx.kq_mask(1)
    m_base, _ = mctx.kq_mask(2)
    assert mctx.kq_mask(3) is mctx.kq_mask(0)
    # token at 32 sees 25..32 in sliding layers (window 8), 0..32 in the global one
    assert np.flatnonzero(np.isfinite(m_swa[0])).tolist() == list(range(25, 33))
    assert np.flatnonzero(np.isfinite(m_base[0])).tolist() == list(range(0, 33))
    assert mctx.get_n_kv(0) == 256 and mctx.get_n_kv(2) == 256
    mctx.cpy_k(3, np.ones((1, 64), np.float32))
    assert ctx.memory.kv_swa.layer(3).k[0, 32].any()
    mctx.rollback()
    assert ctx.memory.seq_pos_max(0) == 31


def test_sequence_operations_reach_both_caches():
    ctx, _ = make_ctx(n_seq_max=2)
    assert ctx.decode(Batch.one_seq(np.arange(8), 0)) == 0
    mem = ctx.memory
    mem.seq_cp(0, 1, -1, -1)
    assert mem.kv_base.seq_pos_max(1) == 7 and mem.kv_swa.seq_pos_max(1) == 7
    mem.seq_rm(0, 4, -1)
    assert mem.kv_base.seq_pos_max(0) == 3 and mem.kv_swa.seq_pos_max(0) == 3
    mem.seq_keep(1)
    assert mem.kv_base.seq_pos_max(0) == -1 and mem.kv_swa.seq_pos_max(0) == -1
    mem.seq_add(1, 0, -1, 5)
    assert mem.kv_base.seq_pos_min(1) == 5 and mem.kv_swa.seq_pos_min(1) == 5
    mem.seq_div(1, 0, -1, 2)
    assert mem.kv_base.seq_pos_max(1) == 6 and mem.kv_swa.seq_pos_max(1) == 6
    mem.clear()
    assert mem.seq_pos_max(1) == -1 and mem.kv_base.seq_pos_max(1) == -1
