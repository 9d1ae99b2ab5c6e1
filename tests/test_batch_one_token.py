"""Context.decode_one(token, pos, seq), the generated token's path chosen once by its caller, is
Context.decode(Batch.one_seq([token], pos, seq)) without the general allocator's passes: the same
return code and error, the same logits (array_equal) and the same memory, cell by cell and byte by
byte, step after step - on a KV cache, an iSWA pair, a recurrent and a hybrid memory - and for
every batch the allocator refuses."""

import numpy as np
import pytest

from kvchat.runtime.batch import Batch
from kvchat.runtime.context import Context
from kvchat.runtime.cparams import ContextParams
from kvchat.runtime.model import Model
from tests.conftest import REFERENCE_DIR
from tests.helpers.memory_stubs import StubModel, cells_snapshot, make_hparams

PROMPT = [5, 17, 3, 42, 8, 11, 29]


def _memory_of(ctx) -> list:
    """Every cell of every KV cache, and the whole state as bytes (recurrent states included)."""
    return [cells_snapshot(kv) for kv in ctx.memory.kv_caches()] + [ctx.state_get_data()]


def _same_memory(a, b) -> None:
    ma, mb = _memory_of(a), _memory_of(b)
    assert ma[-1] == mb[-1]  # the state bytes: every cell, position, K/V row and recurrent state
    for ca, cb in zip(ma[:-1], mb[:-1]):
        for x, y in zip(ca, cb):
            for u, w in zip(x, y):
                if isinstance(u, np.ndarray):
                    np.testing.assert_array_equal(u, w)
                else:
                    assert u == w


def _pair(model, **params):
    p = dict(n_ctx=256, n_batch=64, n_ubatch=64, n_seq_max=2) | params
    return Context(model, ContextParams(**p)), Context(model, ContextParams(**p))


def _step_both(general, one, token, pos, seq):
    rc = general.decode(Batch.one_seq([token], pos, seq))
    assert one.decode_one(token, pos, seq) == rc
    assert one.last_error == general.last_error
    if rc == 0:
        np.testing.assert_array_equal(one.get_logits(), general.get_logits())
        np.testing.assert_array_equal(one.get_logits_ith(0), general.get_logits_ith(0))
        np.testing.assert_array_equal(one.get_logits_ith(-1), general.get_logits_ith(-1))
    _same_memory(general, one)
    return rc


def _generate_both(general, one, seq=0, n=6):
    for c in (general, one):
        assert c.decode(Batch.one_seq(PROMPT, 0, seq)) == 0
    pos = len(PROMPT)
    for _ in range(n):
        token = int(np.argmax(general.get_logits_ith(-1))) % 60 + 3
        assert _step_both(general, one, token, pos, seq) == 0
        pos += 1
    return pos


@pytest.fixture(scope="module")
def tiny_models(tiny_model):
    return {arch: Model.load(tiny_model(arch, n_layer=2, n_embd=64, n_head=2, n_head_kv=1)) for arch in ("llama",)} | {
        "gemma3": Model.load(tiny_model("gemma3", n_layer=3, n_embd=64, n_head=2, n_head_kv=1, n_swa=4))
    }


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("flash", ["on", "off"])
def test_generated_tokens_give_decodes_logits_and_cells(tiny_models, arch, flash):
    general, one = _pair(tiny_models[arch], flash_attn=flash)
    _generate_both(general, one, seq=1)
    assert _step_both(general, one, 9, 0, 0) == 0  # another sequence, from position 0
    assert _step_both(general, one, 4, 1, 0) == 0


@pytest.mark.parametrize("name", ["mamba_s1", "lfm2_s1"])
def test_recurrent_and_hybrid_memories_step_alike(name):
    path = REFERENCE_DIR / "tiny" / f"{name}.gguf"
    if not path.exists():
        pytest.skip(f"{path} is missing")
    model = Model.load(path)
    general, one = _pair(model, type_k="f32", type_v="f32", flash_attn="off")
    _generate_both(general, one, seq=0, n=5)
    model.close()


def test_refused_tokens_give_decodes_code_error_and_leave_memory_alone():
    general, one = _pair(StubModel(make_hparams(n_vocab=64)), n_seq_max=4)
    for c in (general, one):
        assert c.decode(Batch.one_seq(list(range(10)), 0, 0)) == 0
        assert c.decode(Batch.one_seq([1, 2, 3], 3, 1)) == 0
    cases = [  # (token, pos, seq)
        (70, 10, 0),  # token out of range
        (-3, 10, 0),
        (7, 10, 4),  # sequence out of range
        (7, 10, -1),
        (7, -1, 0),  # position out of range
        (7, 2**31 - 1, 0),
        (7, 11, 0),  # a gap after position 9
        (7, 9, 0),  # position 9 is already stored
        (7, 5, 1),
    ]
    for token, pos, seq in cases:
        assert _step_both(general, one, token, pos, seq) == -1, (token, pos, seq)
        assert one.last_error
    assert _step_both(general, one, 7, 6, 1) == 0  # a valid one after the refusals
    assert _step_both(general, one, 7, 0, 2) == 0  # a new sequence


def test_a_full_cache_refuses_alike():
    general, one = _pair(StubModel(make_hparams(n_vocab=64)), n_ctx=256, n_batch=256, n_seq_max=1)
    for c in (general, one):
        assert c.decode(Batch.one_seq(np.arange(256) % 60, 0, 0)) == 0
    assert _step_both(general, one, 7, 256, 0) == 1


def test_decode_one_takes_the_launch_tuners_threshold_and_decode_does_not():
    """The tuner sees decode_one's steps only: prompts and decode() of one token keep the configured
    threshold and are not timed (kernels/launch_tuner.py)."""
    seen = []

    class Recording(StubModel):
        def forward(self, ub, mctx, min_macs=None):
            seen.append((ub.n_tokens, min_macs))
            return super().forward(ub, mctx)

    ctx = Context(Recording(make_hparams(n_vocab=64)), ContextParams(n_ctx=256, n_batch=64, n_ubatch=64))
    ctx.launch.enabled = True
    assert ctx.decode(Batch.one_seq(PROMPT, 0)) == 0
    assert ctx.decode(Batch.one_seq([5], len(PROMPT))) == 0
    assert ctx.launch.warm == [False, False] and not ctx.launch.history  # not asked, nothing timed
    assert ctx.decode_one(5, len(PROMPT) + 1, 0) == 0
    assert seen[:2] == [(len(PROMPT), None), (1, None)]
    assert seen[2][0] == 1 and seen[2][1] is not None
