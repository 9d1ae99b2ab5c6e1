"""Live KV cache-type conversion (runtime/memory/kv_convert.py): after converting a filled
cache, the next token's logits equal those of a fresh context of the new type prefilled with
the same tokens, within that type's own quantization error; cells are untouched; a refused
conversion changes nothing; rotations are undone and redone; iSWA caches convert both halves."""

import numpy as np
import pytest

from kvchat.kernels.ggml_types import cache_type_by_name
from kvchat.kernels.quants import dequantize
from kvchat.runtime.batch import Batch
from kvchat.runtime.context import Context
from kvchat.runtime.cparams import ContextParams
from kvchat.runtime.memory.interface import MemoryOpError
from kvchat.runtime.memory.kv_convert import convert_context_cache_types
from kvchat.runtime.model import Model
from tests.helpers.gguf_factory import write_tiny_model


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    d = tmp_path_factory.mktemp("conv")
    return Model.load(
        write_tiny_model(d / "llama.gguf", arch="llama", n_layer=2, n_embd=256, n_head=4, n_head_kv=2, n_ff=96)
    )  # head 64: quantized caches rotate


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    d = tmp_path_factory.mktemp("conv_g")
    return Model.load(
        write_tiny_model(d / "g.gguf", arch="gemma3", n_layer=6, n_embd=256, n_head=4, n_head_kv=1, n_ff=64, n_swa=16)
    )


PROMPT = list(range(10, 50))


def _ctx(model, tk="f16", tv="f16", fa="on", n_ctx=256):
    return Context(model, ContextParams(n_ctx=n_ctx, n_batch=64, n_ubatch=64, type_k=tk, type_v=tv, flash_attn=fa))


def _prefill(ctx, toks=PROMPT):
    assert ctx.decode(Batch.one_seq(toks, 0)) == 0


def _next(ctx, tok=7, pos=len(PROMPT)):
    assert ctx.decode(Batch.one_seq([tok], pos)) == 0
    return ctx.get_logits()[0].copy()


def _cells(ctx):
    return [(c.pos.copy(), c.seq.copy()) for kv in ctx.memory.kv_caches() for c in kv.cells]


@pytest.mark.parametrize("model_name", ["llama", "gemma"])
@pytest.mark.parametrize("tk,tv", [("q8_0", "q8_0"), ("q4_0", "q4_0"), ("q8_0", "f16"), ("f16", "q4_0")])
def test_converted_cache_answers_like_a_fresh_cache_of_that_type(request, model_name, tk, tv):
    model = request.getfixturevalue(model_name)
    live = _ctx(model)
    _prefill(live)
    cells = _cells(live)
    assert convert_context_cache_types(live, tk, tv)
    assert all(np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1]) for a, b in zip(cells, _cells(live)))
    assert live.cparams.type_k == cache_type_by_name(tk).type_id
    got = _next(live)
    fresh = _ctx(model, tk, tv)
    _prefill(fresh)
    want = _next(fresh)
    f16 = _ctx(model)
    _prefill(f16)
    type_err = np.abs(_next(f16) - want).max()  # what the type itself changes
    assert type_err > 0
    assert np.abs(got - want).max() <= type_err  # converting costs no more than the type does
    assert np.argmax(got) == np.argmax(want)


def test_conversion_back_to_f16_undoes_the_rotation(llama):
    ctx = _ctx(llama)
    _prefill(ctx)
    kv = ctx.memory.kv_caches()[0]
    n = len(PROMPT)
    k0 = dequantize(kv.layers[0].k[0, :n], kv.type_k, kv.layers[0].n_embd_k)
    convert_context_cache_types(ctx, "q4_0", "q8_0")
    assert kv.n_rot_k == 64 and kv.n_rot_v == 64
    convert_context_cache_types(ctx, "f16", "f16")
    assert kv.n_rot_k == 0 and kv.n_rot_v == 0
    k1 = dequantize(kv.layers[0].k[0, :n], kv.type_k, kv.layers[0].n_embd_k)
    rel = np.abs(k1 - k0).max() / np.abs(k0).max()
    assert 0 < rel < 0.1  # q4_0's rounding, in the plain (un-rotated) basis


def test_refused_conversion_leaves_the_cache_as_it_was(llama):
    ctx = _ctx(llama, fa="off")
    _prefill(ctx)
    kv = ctx.memory.kv_caches()[0]
    before = [(l.k.copy(), l.v.copy()) for l in kv.layers]
    with pytest.raises(MemoryOpError, match="needs flash attention"):
        convert_context_cache_types(ctx, "q8_0", "q8_0")
    assert kv.type_k == cache_type_by_name("f16").type_id and kv.n_rot_k == 0
    assert all(np.array_equal(l.k, k) and np.array_equal(l.v, v) for l, (k, v) in zip(kv.layers, before))
    # K alone may change with flash attention off (V stays a transposed f16 row)
    assert convert_context_cache_types(ctx, "q8_0", "f16")
    got = _next(ctx)
    fresh = _ctx(llama, "q8_0", "f16", fa="off")
    _prefill(fresh)
    f16 = _ctx(llama, fa="off")
    _prefill(f16)
    want = _next(fresh)
    assert np.abs(got - want).max() <= np.abs(_next(f16) - want).max()


def test_same_types_are_a_no_op(llama):
    ctx = _ctx(llama)
    _prefill(ctx)
    k = ctx.memory.kv_caches()[0].layers[0].k
    assert not convert_context_cache_types(ctx, "f16", "f16")
    assert ctx.memory.kv_caches()[0].layers[0].k is k


def _chat(path, fa="on", tmp=None):
    import io
    import threading

    from rich.console import Console

    from kvchat.cli.chat.render import Renderer
    from kvchat.cli.chat.repl import Repl
    from kvchat.cli.chat.setup import make_conversation, open_engine
    from kvchat.cli.options import ChatSettings

    settings = ChatSettings(model=str(path), ctx_size=256, temp=0.0, n_predict=5, flash_attn=fa)
    buf = io.StringIO()
    r = Renderer(out=io.StringIO(), err=Console(file=buf, width=200))
    ev = threading.Event()
    engine = open_engine(settings, r, ev)
    conv = make_conversation(engine, settings, r, ev)
    return Repl(engine, conv, settings, r), conv, engine, buf


def test_set_cache_type_in_the_chat_converts_and_the_conversation_goes_on(tmp_path):
    from kvchat.runtime.errors import KvchatError

    path = write_tiny_model(tmp_path / "chat.gguf", arch="llama", n_layer=2, n_embd=256, n_head=4, n_head_kv=2, n_ff=96)
    repl, conv, engine, buf = _chat(path)
    conv.ask("hello there")
    n = conv.n_cached
    cells = _cells(engine.ctx)
    repl.cmd_set("cache-type-k Q8_0")
    repl.cmd_set("cache-type-v q4_0")
    assert engine.cache["type_k"] == "q8_0" and engine.cache["type_v"] == "q4_0"  # what /save records
    assert repl.settings.cache_type_k == "q8_0"
    assert conv.n_cached == n and all(np.array_equal(a[0], b[0]) for a, b in zip(cells, _cells(engine.ctx)))
    repl.cmd_mem("")
    per_tok = 2 * (256 // 2) // 32 * 34 + 2 * (256 // 2) // 32 * 18  # 2 layers, n_embd_k_gqa 128
    assert f"K q8_0 / V q4_0: {per_tok:,} bytes per token" in buf.getvalue()
    stats = conv.ask("and then?")  # the conversation goes on on the converted cache
    assert conv.n_cached > n and stats is not None
    with pytest.raises(KvchatError, match="invalid cache type 'q3_k'"):
        repl.cmd_set("cache-type-k q3_k")
    assert engine.cache["type_k"] == "q8_0"

    repl, conv, engine, _ = _chat(path, fa="off")
    conv.ask("hello")
    with pytest.raises(KvchatError, match="^/set cache-type-v: a q8_0 V cache needs flash attention"):
        repl.cmd_set("cache-type-v q8_0")
    assert engine.cache["type_v"] == "f16"
