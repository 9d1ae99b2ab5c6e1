"""ContextParams -> CParams resolution, as llama_context's constructor does it."""

import pytest

from kvchat.kernels.ggml_types import GGMLType
from kvchat.runtime.cparams import QUANT_V_NEEDS_FA, ContextParams, resolve_cparams
from kvchat.runtime.errors import CParamsError, KvchatError
from tests.helpers.memory_stubs import make_hparams


def resolve(**kw):
    hp = kw.pop("hp", None) or make_hparams(n_ctx_train=kw.pop("n_ctx_train", 1000))
    return resolve_cparams(ContextParams(**kw), hp)


def test_n_ctx_zero_uses_training_length_padded():
    cp = resolve(n_ctx=0)
    assert cp.n_ctx == 1024 and cp.n_ctx_seq == 1024 and cp.n_ctx_train == 1000


def test_n_ctx_padded_to_256():
    assert resolve(n_ctx=300).n_ctx == 512
    assert resolve(n_ctx=512).n_ctx == 512
    assert resolve(n_ctx=1).n_ctx == 256


def test_non_unified_splits_into_streams_and_rounds():
    cp = resolve(n_ctx=1000, n_seq_max=3, kv_unified=False)
    # 1000 -> 1024; per stream pad256(1024 // 3 = 341) = 512; n_ctx = 512 * 3
    assert cp.n_ctx_seq == 512 and cp.n_ctx == 1536 and cp.n_stream == 3
    assert any("rounding" in w for w in cp.warnings)
    cp = resolve(n_ctx=1024, n_seq_max=4, kv_unified=False)
    assert cp.n_ctx_seq == 256 and cp.n_ctx == 1024 and not cp.warnings


def test_unified_keeps_one_stream():
    cp = resolve(n_ctx=1024, n_seq_max=4)
    assert cp.n_ctx_seq == 1024 and cp.n_stream == 1


def test_batch_sizes_clamped():
    cp = resolve(n_ctx=512, n_batch=2048, n_ubatch=1024)
    assert cp.n_batch == 512 and cp.n_ubatch == 512
    cp = resolve(n_ctx=4096, n_batch=100, n_ubatch=0)
    assert cp.n_batch == 100 and cp.n_ubatch == 100
    cp = resolve(n_ctx=4096, n_batch=2048, n_ubatch=512)
    assert cp.n_batch == 2048 and cp.n_ubatch == 512


def test_cache_types_and_flash_attention():
    cp = resolve(n_ctx=256, type_k="q8_0", type_v="q4_0", flash_attn="auto")
    assert cp.type_k == GGMLType.Q8_0 and cp.type_v == GGMLType.Q4_0
    assert cp.flash_attn is True and cp.v_trans is False
    cp = resolve(n_ctx=256, type_k="q8_0", type_v="f16", flash_attn="off")
    assert cp.flash_attn is False and cp.v_trans is True
    assert resolve(n_ctx=256, type_v="BF16", flash_attn=False).type_v == GGMLType.BF16


def test_quantized_v_without_flash_attention_is_refused_with_llamacpp_message():
    with pytest.raises(CParamsError) as e:
        resolve(n_ctx=256, type_v="q8_0", flash_attn="off")
    assert QUANT_V_NEEDS_FA in str(e.value)
    assert QUANT_V_NEEDS_FA == "quantized V cache was requested, but this requires Flash Attention"


@pytest.mark.parametrize(
    "kw, needle",
    [
        (dict(type_k="q4_K"), "valid cache types"),
        (dict(type_v="f17"), "valid cache types"),
        (dict(flash_attn="maybe"), "on, off or auto"),
        (dict(n_seq_max=257), "n_seq_max must be <= 256"),
        (dict(n_ctx=-5), "n_ctx"),
        (dict(n_batch=0), "n_batch"),
        (dict(n_ubatch=-1), "n_ubatch"),
        (dict(n_threads=0), "n_threads"),
    ],
)
def test_bad_values_raise_user_errors(kw, needle):
    with pytest.raises(CParamsError) as e:
        resolve(n_ctx=kw.pop("n_ctx", 256), **kw)
    assert needle in str(e.value)
    assert isinstance(e.value, (KvchatError, ValueError))


def test_k_block_must_divide_head_size():
    hp = make_hparams(head_dim=48)
    with pytest.raises(CParamsError, match="does not divide n_embd_head_k=48"):
        resolve_cparams(ContextParams(n_ctx=256, type_k="q8_0"), hp)
    assert resolve_cparams(ContextParams(n_ctx=256, type_k="f16"), hp).type_k == GGMLType.F16


def test_swa_full_and_threads_passed_through():
    cp = resolve(n_ctx=256, swa_full=True, n_threads=1)
    assert cp.swa_full is True and cp.n_threads == 1
