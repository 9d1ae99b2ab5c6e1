"""smollm3 (NoPE on every fourth layer) against llama.cpp on the tiny reference model
smollm3_s1, and on factory variants."""

import numpy as np

from tests.helpers import arch_refs

NAME = "smollm3_s1"


class TestAgainstLlamaCpp(arch_refs.ReferenceChecks):
    name = NAME


def test_every_fourth_layer_has_no_rope(tmp_path):
    from kvchat.runtime.arch import read_hparams
    from kvchat.runtime.gguf.file import GGUFFile
    from tests.helpers.gguf_factory import write_tiny_model

    hp = read_hparams(GGUFFile(write_tiny_model(tmp_path / "s.gguf", arch="smollm3", n_layer=8)))
    assert [il for il in range(8) if not hp.has_rope(il)] == [3, 7]
    assert hp.rope_args(3, 2048)["n_rot"] == 0 and hp.rope_args(2, 2048)["n_rot"] == hp.n_rot


def test_context_shift_leaves_nope_keys_and_matches_a_fresh_decode(tmp_path):
    """Shift by +11: logits of the next token equal a fresh decode at the shifted positions
    (the NoPE layer's keys are position-free, so re-roping them would break this)."""
    from kvchat.runtime.batch import Batch
    from kvchat.runtime.context import Context
    from kvchat.runtime.cparams import ContextParams
    from kvchat.runtime.model import Model
    from tests.helpers.gguf_factory import write_tiny_model

    m = Model.load(write_tiny_model(tmp_path / "s.gguf", arch="smollm3", n_layer=4))
    tokens = list(range(5, 41))
    ctx = Context(m, ContextParams(**arch_refs.REF_PARAMS))
    assert ctx.decode(Batch.one_seq(tokens, 0)) == 0
    ctx.memory.seq_add(0, 0, -1, 11)
    ctx.memory_update()
    assert ctx.decode(Batch.one_seq([9], len(tokens) + 11)) == 0
    fresh = Context(m, ContextParams(**arch_refs.REF_PARAMS))
    assert fresh.decode(Batch.one_seq(tokens + [9], 11)) == 0
    np.testing.assert_allclose(ctx.get_logits_ith(-1), fresh.get_logits_ith(-1), atol=2e-4)
