"""read_hparams (kvchat.runtime.arch): values of the two real models (as llama.cpp prints them when loading)
and of the tiny factory models, incl. gemma3's sliding-window layout and rope bases."""

from __future__ import annotations

import math

import pytest

from kvchat.kernels.ggml_types import GGMLType
from kvchat.runtime.arch import expected_tensors, get_arch, read_hparams
from kvchat.runtime.gguf.file import GGUFFile
from tests.helpers.gguf_factory import write_tiny_model


@pytest.mark.real_model
def test_smollm2(smollm2_path):
    hp = read_hparams(GGUFFile(smollm2_path))
    assert (hp.arch, hp.n_layer, hp.n_head, hp.n_head_kv, hp.n_embd) == ("llama", 30, 9, 3, 576)
    assert (hp.n_embd_head_k, hp.n_embd_head_v, hp.n_rot, hp.n_ff) == (64, 64, 64, 1536)
    assert (hp.n_vocab, hp.n_ctx_train) == (49152, 8192)
    assert hp.n_embd_k_gqa(0) == hp.n_embd_v_gqa(29) == 192
    assert hp.rope_type == "norm" and hp.rope_freq_base == 100000.0 and hp.rope_freq_scale == 1.0
    assert hp.norm_eps == pytest.approx(1e-5)
    assert hp.n_swa == 0 and hp.swa_layers == [False] * 30 and not hp.is_swa(7)
    assert hp.tied_output and not hp.use_qk_norm and hp.can_shift
    ends = get_arch(hp.arch).model_spec(hp)
    assert ends.embed_scale == 1.0 and hp.kq_scale == 1 / 8 and ends.logit_softcap == 0.0
    assert all(hp.has_kv(il) for il in range(30)) and not hp.has_kv(30)


@pytest.mark.real_model
def test_gemma3(gemma3_path):
    hp = read_hparams(GGUFFile(gemma3_path))
    assert (hp.arch, hp.n_layer, hp.n_head, hp.n_head_kv, hp.n_embd) == ("gemma3", 18, 4, 1, 640)
    assert (hp.n_embd_head_k, hp.n_embd_head_v, hp.n_rot, hp.n_ff) == (256, 256, 256, 2048)
    assert (hp.n_vocab, hp.n_ctx_train) == (262144, 32768)
    assert hp.n_embd_k_gqa(0) == 256
    assert hp.n_swa == 512 and hp.swa_pattern == 6
    # llama.cpp: "swa_layers = 1 1 1 1 1 0 ..." — every 6th layer (5, 11, 17) is global
    assert [il for il in range(18) if not hp.is_swa(il)] == [5, 11, 17]
    assert hp.rope_type == "neox" and hp.rope_freq_base == 1e6 and hp.rope_freq_base_swa == 1e4
    assert hp.rope_base(0) == 1e4 and hp.rope_base(5) == 1e6
    assert hp.norm_eps == pytest.approx(1e-6)
    assert hp.use_qk_norm and hp.tied_output and hp.can_shift
    assert hp.embed_scale == pytest.approx(math.sqrt(640)) and hp.kq_scale == 1 / 16


@pytest.mark.parametrize(
    "arch,rope,qk_norm",
    [("llama", "norm", False), ("qwen2", "neox", False), ("qwen3", "neox", True), ("gemma3", "neox", True)],
)
def test_tiny_models(tmp_path, arch, rope, qk_norm):
    gf = GGUFFile(
        write_tiny_model(
            tmp_path / "m.gguf",
            arch=arch,
            n_layer=3,
            n_embd=64,
            n_head=4,
            n_head_kv=2,
            n_ff=96,
            weight_type=GGMLType.Q8_0,
        )
    )
    hp = read_hparams(gf)
    assert (hp.arch, hp.n_layer, hp.n_embd, hp.n_head, hp.n_head_kv, hp.n_ff) == (arch, 3, 64, 4, 2, 96)
    assert (hp.n_embd_head_k, hp.n_embd_head_v, hp.n_rot) == (16, 16, 16)
    assert hp.n_embd_k_gqa(1) == hp.n_embd_v_gqa(2) == 32 and hp.n_gqa == 2
    assert hp.rope_type == rope and hp.use_qk_norm == qk_norm and hp.tied_output
    assert hp.n_vocab == len(gf.metadata["tokenizer.ggml.tokens"]) == gf.tensors["token_embd.weight"].shape[1]
    assert hp.n_ctx_train == 512 and hp.norm_eps == pytest.approx(1e-6)
    if arch == "gemma3":  # 3 layers < pattern 6: all slide, as in llama.cpp
        assert hp.n_swa == 16 and hp.swa_layers == [True, True, True]
        assert hp.embed_scale == pytest.approx(8.0)
    else:
        assert hp.n_swa == 0 and hp.swa_layers == [False] * 3 and get_arch(arch).model_spec(hp).embed_scale == 1.0
    assert ("blk.0.attn_q.bias" in gf.tensors) == (arch == "qwen2")


def test_gemma3_swa_pattern_variants(tmp_path):
    def layers(**kw):
        gf = GGUFFile(write_tiny_model(tmp_path / "g.gguf", arch="gemma3", n_layer=8, **kw))
        return read_hparams(gf)

    assert layers(swa_pattern=3).swa_layers == [True, True, False, True, True, False, True, True]
    assert layers(swa_pattern=0).swa_layers == [True] * 8
    assert layers().swa_layers == [True] * 5 + [False] + [True] * 2
    explicit = [True, False] * 4
    hp = layers(metadata={"gemma3.attention.sliding_window_pattern": explicit})
    assert hp.swa_layers == explicit and hp.swa_pattern == 0
    no_swa = layers(n_swa=0)
    assert no_swa.n_swa == 0 and no_swa.swa_layers == [False] * 8
    hp = layers(metadata={"gemma3.rope.freq_base_swa": 500.0}, rope_freq_base=2e5)
    assert hp.rope_base(0) == 500.0 and hp.rope_base(5) == 2e5


def test_head_dim_from_key_length_and_untied_output(tmp_path):
    gf = GGUFFile(
        write_tiny_model(tmp_path / "m.gguf", arch="qwen3", n_embd=64, n_head=4, n_head_kv=1, head_dim=32, tied=False)
    )
    hp = read_hparams(gf)
    assert hp.n_embd_head_k == hp.n_embd_head_v == hp.n_rot == 32
    assert gf.tensors["blk.0.attn_q.weight"].shape == (64, 128)
    assert gf.tensors["blk.0.attn_output.weight"].shape == (128, 64)
    assert not hp.tied_output and gf.tensors["output.weight"].shape == (64, hp.n_vocab)


def test_rope_scaling_factor(tmp_path):
    gf = GGUFFile(write_tiny_model(tmp_path / "m.gguf", metadata={"llama.rope.scaling.factor": 4.0}))
    assert read_hparams(gf).rope_freq_scale == 0.25
    gf = GGUFFile(write_tiny_model(tmp_path / "n.gguf", metadata={"llama.rope.scale_linear": 2.0}))
    assert read_hparams(gf).rope_freq_scale == 0.5


def test_expected_tensors_cover_every_factory_tensor(tmp_path):
    for arch in ("llama", "qwen2", "qwen3", "gemma3"):
        gf = GGUFFile(write_tiny_model(tmp_path / f"{arch}.gguf", arch=arch, tied=False))
        exp = expected_tensors(read_hparams(gf))
        assert set(gf.tensors) <= set(exp)
        assert {n for n, (_, req) in exp.items() if req} <= set(gf.tensors)


@pytest.mark.real_model
def test_real_models_have_only_expected_tensors(smollm2_path, gemma3_path):
    for p in (smollm2_path, gemma3_path):
        gf = GGUFFile(p)
        assert set(gf.tensors) <= set(expected_tensors(read_hparams(gf)))
