"""Q|K fused at load when V has another format (QK_FUSION, runtime/arch/base.py).

Q4_K_M files hold V in Q6_K in half the layers and Q, K in Q4_K, so Q|K|V cannot be one matrix
there; Q|K still can, which saves a decoded token one matmul launch in each such layer. The fused
rows are the parts' rows, each computed from its own row and the token's activation, so the
logits must be bit-identical to the three separate matmuls (QK_FUSION left out), in one batch
and token by token, with the biases folded into bqkv (gpt-oss) added to the right columns."""

from __future__ import annotations

import numpy as np
import pytest

from kvchat.kernels.ggml_types import GGMLType
from kvchat.runtime.arch.base import QK_FUSION
from kvchat.runtime.model import Model
from tests.helpers import moe_models
from tests.helpers.arch_refs import all_logits
from tests.helpers.gguf_factory import quantized_copy, write_tiny_model

TOKENS = [1, 17, 33, 5, 60, 2, 41, 9, 12, 50]


def _v_in_q8_0(src, dst):
    """src with every attn_v in Q8_0 and the rest as it is (F32): Q|K|V cannot fuse."""
    return quantized_copy(src, dst, GGMLType.Q8_0, only=lambda name: name.endswith("attn_v.weight"))


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda tmp: moe_models.model_file("olmoe_s1"), id="olmoe"),
        pytest.param(lambda tmp: moe_models.model_file("gpt_oss_s1"), id="gpt-oss-biases"),
        pytest.param(lambda tmp: write_tiny_model(tmp / "q2.gguf", arch="qwen2", n_layer=2), id="qwen2-biases"),
    ],
)
def test_qk_fused_beside_a_v_of_another_format_gives_the_same_bits(make, tmp_path, monkeypatch):
    path = _v_in_q8_0(make(tmp_path), tmp_path / "v_q8_0.gguf")
    fused = Model.load(path)
    L = fused.weights.layers[0]
    assert L.wqkv is None and L.wq is None and L.wk is None  # Q|K fused, V on its own
    assert L.wqk is not None and L.wqk.t == GGMLType.F32 and L.wv.t == GGMLType.Q8_0
    hp = fused.hparams
    assert L.wqk.m == hp.n_embd_head_k * hp.n_head + hp.n_embd_k_gqa(0)
    one = all_logits(fused, TOKENS)
    by_token = all_logits(fused, TOKENS, call=1)
    fused.close()

    arch = fused.arch
    monkeypatch.setattr(type(arch), "fusions", tuple(f for f in arch.fusions if f is not QK_FUSION))
    apart = Model.load(path)
    L = apart.weights.layers[0]
    assert getattr(L, "wqk", None) is None and L.wq is not None and L.wk is not None
    ref = all_logits(apart, TOKENS)
    apart.close()
    assert np.array_equal(one, ref)
    assert np.array_equal(by_token, ref)


def test_qkv_still_fuses_when_all_three_share_a_format(tmp_path):
    m = Model.load(write_tiny_model(tmp_path / "q.gguf", arch="qwen2", n_layer=2))
    L = m.weights.layers[0]
    assert L.wqkv is not None and getattr(L, "wqk", None) is None and L.wq is None and L.wv is None
    m.close()
