"""The memory contract in code: every memory implements the whole Memory interface, every
memory context the MemoryContext one (rollback included), and what the forward pass of an
attention layer uses is exactly AttentionMemoryContext."""

import inspect

import numpy as np

from kvchat.runtime.batch import Batch
from kvchat.runtime.context import Context
from kvchat.runtime.cparams import ContextParams
from kvchat.runtime.memory.hybrid import HybridContext, MemoryHybrid
from kvchat.runtime.memory.interface import AttentionMemoryContext, Memory, MemoryContext
from kvchat.runtime.memory.kv_cache import KVCache
from kvchat.runtime.memory.kv_cache_context import KVCacheContext
from kvchat.runtime.memory.kv_cache_iswa import KVCacheISWA, KVCacheISWAContext
from kvchat.runtime.memory.recurrent import MemoryRecurrent, RecurrentContext
from tests.helpers.memory_stubs import StubModel, make_hparams


def _abstract_names(base):
    """Public methods of an interface that only raise NotImplementedError."""
    return [
        n
        for n, f in vars(base).items()
        if inspect.isfunction(f) and not n.startswith("_") and "raise NotImplementedError" in inspect.getsource(f)
    ]


def test_every_memory_overrides_every_method_of_the_interface():
    assert "seq_rm" in _abstract_names(Memory) and "state_apply" in _abstract_names(Memory)
    for cls in (KVCache, KVCacheISWA, MemoryRecurrent, MemoryHybrid):
        for name in _abstract_names(Memory):
            assert getattr(cls, name) is not getattr(Memory, name), f"{cls.__name__}.{name}"


def test_every_memory_context_overrides_every_method_including_rollback():
    assert "rollback" in _abstract_names(MemoryContext)
    for cls in (KVCacheContext, KVCacheISWAContext, RecurrentContext, HybridContext):
        for name in _abstract_names(MemoryContext):
            assert getattr(cls, name) is not getattr(MemoryContext, name), f"{cls.__name__}.{name}"


class _Recorder:
    """Wraps a memory context and records which attributes the forward pass touches."""

    def __init__(self, inner, seen):
        self._inner, self._seen = inner, seen

    def __getattr__(self, name):
        self._seen.add(name)
        return getattr(self._inner, name)


def test_kv_and_iswa_contexts_satisfy_the_attention_protocol_the_forward_uses():
    seen: set = set()
    for hp in (make_hparams(n_layer=2), make_hparams(n_layer=2, n_swa=8, swa_layers=[True, False], arch="gemma3")):
        ctx = Context(StubModel(hp), ContextParams(n_ctx=256, n_batch=64, n_ubatch=16))
        mctx_seen = []
        orig = ctx.model.forward

        def forward(ub, mctx, min_macs=None, orig=orig):
            assert isinstance(mctx, AttentionMemoryContext)
            mctx_seen.append(type(mctx))
            return orig(ub, _Recorder(mctx, seen))

        ctx.model.forward = forward
        assert ctx.decode(Batch.one_seq(np.arange(20), 0)) == 0
        assert mctx_seen
    protocol = {n for n in dir(AttentionMemoryContext) if not n.startswith("_")}
    protocol |= set(getattr(AttentionMemoryContext, "__annotations__", {}))
    assert seen <= protocol, f"the forward used {seen - protocol}, which the protocol does not state"
