"""Memory.kv_caches(): the KV caches each memory holds, and the one answer every caller gets on a
hybrid memory (its attention cache is listed; its recurrent states are not cells, so the prefix
cache refuses it). The four copies of this question disagreed on hybrids: the prompt cache and
branches saw no KV cache, the cache-type conversion and /kv saw the attention part."""

import numpy as np

from kvchat.kernels.ggml_types import cache_type_by_name
from kvchat.runtime.batch import Batch
from kvchat.runtime.chat.branches import shared_cells_from
from kvchat.runtime.context import Context
from kvchat.runtime.cparams import ContextParams
from kvchat.runtime.memory.kv_cache import KVCache
from kvchat.runtime.memory.kv_cache_iswa import KVCacheISWA
from kvchat.runtime.memory.kv_convert import convert_cache_types
from kvchat.runtime.serving.prompt_cache import prefill
from kvchat.runtime.serving.prompt_keys import cache_salt, cacheable
from tests.helpers.memory_stubs import StubModel, make_hparams
from tests.helpers.recurrent_stubs import make_rctx

TOKENS = (np.arange(12) * 5 + 1) % 64


def _attn_ctx(hp, n_seq_max=2):
    return Context(StubModel(hp), ContextParams(n_ctx=256, n_batch=64, n_ubatch=64, n_seq_max=n_seq_max))


def test_each_memory_lists_the_kv_caches_it_holds():
    kv = _attn_ctx(make_hparams()).memory
    assert type(kv) is KVCache and kv.kv_caches() == [kv]
    iswa = _attn_ctx(make_hparams(n_layer=4, n_swa=8, swa_layers=[True, True, True, False])).memory
    assert type(iswa) is KVCacheISWA
    assert iswa.kv_caches() == [iswa.kv_base, iswa.kv_swa] and [c.name for c in iswa.kv_caches()] == ["base", "swa"]
    assert make_rctx(hybrid=False).memory.kv_caches() == []
    hyb = make_rctx(hybrid=True).memory
    assert hyb.kv_caches() == [hyb.mem_attn] and [c.name for c in hyb.kv_caches()] == ["attn"]


def test_a_hybrid_memory_gives_every_caller_its_attention_cache_and_no_prefix_cache():
    ctx = make_rctx(hybrid=True, n_seq_max=2)
    mem = ctx.memory
    assert ctx.decode(Batch.one_seq(TOKENS, 0)) == 0
    mem.seq_cp(0, 1, -1, -1)
    # branches: the 12 cells of seq 0 are shared with seq 1 in the attention cache
    assert shared_cells_from(mem, 0, 0) == len(TOKENS)
    assert shared_cells_from(mem, 0, 5) == len(TOKENS) - 5
    # the prefix cache: not a memory of cells only (the conv / SSM states are not restorable from cells)
    assert not cacheable(mem) and prefill(ctx, 0, list(range(300)), cache=None) == (0, 0)
    assert cache_salt("0" * 64, ctx.cparams, mem) == cache_salt("0" * 64, ctx.cparams, make_rctx().memory)
    # the cache-type conversion re-stores the attention layer of the hybrid
    f32 = cache_type_by_name("f32").type_id
    assert convert_cache_types(mem, "f32", "f32") is True
    assert (mem.mem_attn.type_k, mem.mem_attn.type_v) == (f32, f32)
    assert [l.k.shape[-1] for l in mem.mem_attn.layers] == [8 * 4]  # one attention layer, head 8, one kv head


def test_kv_memories_are_cacheable_and_recurrent_ones_are_not():
    assert cacheable(_attn_ctx(make_hparams()).memory)
    assert cacheable(_attn_ctx(make_hparams(n_layer=2, n_swa=8, swa_layers=[True, False])).memory)
    assert not cacheable(make_rctx().memory)
