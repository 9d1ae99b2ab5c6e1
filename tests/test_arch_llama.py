"""llama with Llama-3.1/3.2 RoPE scaling (rope_freqs.weight) against llama.cpp on the tiny
reference model llama3rope_s1, and on factory variants."""

import numpy as np
import pytest

from tests.helpers import arch_refs

NAME = "llama3rope_s1"


class TestAgainstLlamaCpp(arch_refs.ReferenceChecks):
    name = NAME


# ---- factory variants --------------------------------------------------------------------


def _model(tmp_path, name, factors=None, **kw):
    from kvchat.runtime.model import Model
    from tests.helpers.gguf_factory import write_tiny_model

    extra = {} if factors is None else {"rope_freqs.weight": np.asarray(factors, np.float32)}
    return Model.load(
        write_tiny_model(tmp_path / name, arch="llama", n_layer=2, extra_tensors=extra, rope_freq_base=500000.0, **kw)
    )


def _logits(model, tokens, pos0=0):
    return arch_refs.all_logits(model, tokens) if pos0 == 0 else _at(model, tokens, pos0)


def _at(model, tokens, pos0):
    from kvchat.runtime.batch import Batch
    from kvchat.runtime.context import Context
    from kvchat.runtime.cparams import ContextParams

    ctx = Context(model, ContextParams(**arch_refs.REF_PARAMS))
    assert ctx.decode(Batch.one_seq(tokens, pos0, all_logits=True)) == 0
    return ctx.get_logits().copy()


TOKENS = list(range(5, 45))


def test_unit_rope_freqs_change_nothing_and_real_ones_do(tmp_path):
    plain = _logits(_model(tmp_path, "a.gguf"), TOKENS)
    ones = _logits(_model(tmp_path, "b.gguf", factors=np.ones(8)), TOKENS)
    np.testing.assert_array_equal(ones, plain)
    scaled = _logits(_model(tmp_path, "c.gguf", factors=[1, 1, 1, 1, 3.29, 32, 32, 32]), TOKENS)
    assert np.abs(scaled - plain).max() > 1e-3


def test_context_shift_re_ropes_keys_with_the_factors(tmp_path):
    """Keys shifted by +9 in the cache give the logits of a fresh decode at the new positions."""
    from kvchat.runtime.batch import Batch
    from kvchat.runtime.context import Context
    from kvchat.runtime.cparams import ContextParams

    m = _model(tmp_path, "s.gguf", factors=[1, 1, 1, 1, 3.29, 32, 32, 32])
    ctx = Context(m, ContextParams(**arch_refs.REF_PARAMS))
    assert ctx.decode(Batch.one_seq(TOKENS, 0)) == 0
    ctx.memory.seq_add(0, 0, -1, 9)
    ctx.memory_update()
    assert ctx.decode(Batch.one_seq([7], len(TOKENS) + 9)) == 0
    fresh = _at(m, TOKENS + [7], 9)[-1]
    np.testing.assert_allclose(ctx.get_logits_ith(-1), fresh, atol=2e-4)


def test_rope_freqs_of_the_wrong_size_is_a_one_line_error(tmp_path):
    from kvchat.runtime.errors import ModelFileError

    with pytest.raises(ModelFileError, match=r"rope_freqs.weight.*shape \[8\]"):
        _model(tmp_path, "bad.gguf", factors=np.ones(5))
