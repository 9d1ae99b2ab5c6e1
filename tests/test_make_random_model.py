"""benchmarks/make_random_model.py: the seeded random-weight llama GGUF used to measure a 7B-shaped
model's memory (docs/performance.md "Memory"), checked on a tiny shape with the factory's tokenizer.

What a measurement relies on: the same seed gives the same bytes (so a run can be repeated), the
header says the requested shape with the source's tokenizer, kvchat decodes it to the float64
reference's tokens, and a failed or refused write leaves no file behind.
"""

from __future__ import annotations

import codecs
import importlib.util
from pathlib import Path

import gguf
import numpy as np
import pytest

from kvchat.runtime.model import Model
from tests.helpers.arch_refs import greedy_ids
from tests.helpers.cli_inproc import kvchat
from tests.helpers.gguf_factory import write_tiny_model
from tests.test_forward_logits import reference_forward

ROOT = Path(__file__).resolve().parent.parent
SHAPE = dict(n_embd=64, n_layer=2, n_ff=96, n_head=4, n_head_kv=2)


def load_generator():
    spec = importlib.util.spec_from_file_location("make_random_model", ROOT / "benchmarks" / "make_random_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def gen():
    return load_generator()


@pytest.fixture(scope="module")
def tok_source(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tok") / "src.gguf", n_embd=32, n_layer=1)


def argv(out: Path, src: Path, seed: int = 0, **shape) -> list[str]:
    args = [str(out), "--tokenizer-from", str(src), "--seed", str(seed)]
    for key, value in dict(SHAPE, **shape).items():
        args += ["--" + key.replace("_", "-"), str(value)]
    return args


@pytest.fixture(scope="module")
def model_path(gen, tok_source, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("gen") / "random.gguf"
    assert gen.main(argv(out, tok_source)) == 0
    return out


def test_the_same_seed_writes_a_byte_identical_file_and_another_seed_does_not(gen, tok_source, model_path, tmp_path):
    again, other = tmp_path / "again.gguf", tmp_path / "other.gguf"
    assert gen.main(argv(again, tok_source)) == 0
    assert gen.main(argv(other, tok_source, seed=1)) == 0
    assert again.read_bytes() == model_path.read_bytes()
    assert other.stat().st_size == model_path.stat().st_size
    assert other.read_bytes() != model_path.read_bytes()


def field_values(reader: gguf.GGUFReader, prefix: str) -> dict:
    return {k: f.contents() for k, f in reader.fields.items() if k.startswith(prefix)}


def test_the_header_has_the_requested_shape_and_the_source_tokenizer(model_path, tok_source):
    r = gguf.GGUFReader(model_path)
    kv = field_values(r, "")
    assert kv["general.architecture"] == "llama"
    assert kv["general.file_type"] == int(gguf.LlamaFileType.MOSTLY_F16)
    assert {
        k: kv[k]
        for k in (
            "llama.embedding_length",
            "llama.block_count",
            "llama.feed_forward_length",
            "llama.attention.head_count",
            "llama.attention.head_count_kv",
            "llama.rope.dimension_count",
        )
    } == {
        "llama.embedding_length": 64,
        "llama.block_count": 2,
        "llama.feed_forward_length": 96,
        "llama.attention.head_count": 4,
        "llama.attention.head_count_kv": 2,
        "llama.rope.dimension_count": 16,
    }
    src_tok = field_values(gguf.GGUFReader(tok_source), "tokenizer.")
    assert field_values(r, "tokenizer.") == src_tok
    n_vocab = len(src_tok["tokenizer.ggml.tokens"])
    assert kv["llama.vocab_size"] == n_vocab

    tensors = {t.name: t for t in r.tensors}
    assert len(tensors) == 3 + 9 * 2
    want = {
        "token_embd.weight": (n_vocab, 64),
        "output.weight": (n_vocab, 64),
        "output_norm.weight": (64,),
        "blk.1.attn_q.weight": (64, 64),
        "blk.1.attn_k.weight": (32, 64),
        "blk.1.attn_v.weight": (32, 64),
        "blk.1.attn_output.weight": (64, 64),
        "blk.1.ffn_gate.weight": (96, 64),
        "blk.1.ffn_up.weight": (96, 64),
        "blk.1.ffn_down.weight": (64, 96),
        "blk.1.ffn_norm.weight": (64,),
    }
    for name, shape in want.items():
        t = tensors[name]
        assert tuple(int(n) for n in reversed(t.shape)) == shape, name
        if len(shape) == 1:
            assert t.tensor_type == gguf.GGMLQuantizationType.F32
            np.testing.assert_array_equal(t.data, np.ones(shape, np.float32))
        else:
            assert t.tensor_type == gguf.GGMLQuantizationType.F16
            std = float(np.asarray(t.data, np.float32).std())
            assert 0.018 < std < 0.022, (name, std)  # --scale 0.02


def test_kvchat_greedy_decodes_the_float64_references_tokens_and_the_same_tokens_twice(model_path):
    model = Model.load(model_path)
    try:
        prompt = model.vocab.tokenize("hello world", add_special=True, parse_special=True)
        ids = greedy_ids(model, prompt, 8)
        assert greedy_ids(model, prompt, 8) == ids
    finally:
        model.close()
    ref = reference_forward(model_path, prompt + ids)[len(prompt) - 1 : -1]  # logits that chose each id
    top2 = np.sort(ref, axis=1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > 2e-3  # kvchat's F16 path is ~1e-4 from the reference here
    assert clear.sum() >= 4, f"too few clear margins to check: {top2[:, 1] - top2[:, 0]}"
    assert [i for i, c in zip(ids, clear) if c] == [int(t) for t, c in zip(ref.argmax(1), clear) if c]


def test_kvchat_run_prints_the_greedy_tokens_of_a_generated_model(model_path):
    run = kvchat(
        "run",
        "-m",
        model_path,
        "--raw",
        "-p",
        "hello world",
        "-n",
        "8",
        "--temp",
        "0",
        "-c",
        "128",
        "--no-prompt-cache",
    )
    assert run.returncode == 0, run.stderr
    model = Model.load(model_path)
    try:
        prompt = model.vocab.tokenize("hello world", add_special=True, parse_special=True)
        ids = greedy_ids(model, prompt, 8)
        eog = [k for k, t in enumerate(ids) if model.vocab.is_eog(t)]
        pieces = b"".join(model.vocab.token_to_piece(t, False) for t in (ids[: eog[0]] if eog else ids))
    finally:
        model.close()
    # the random tokens are mostly byte pieces: printed as UTF-8 decoding makes them, a last
    # unfinished character dropped
    text = codecs.getincrementaldecoder("utf-8")(errors="replace").decode(pieces)
    assert run.stdout.rstrip("\n") == text.rstrip("\n")


def test_an_existing_output_is_refused_and_left_untouched(gen, tok_source, tmp_path, capsys):
    out = tmp_path / "taken.gguf"
    out.write_bytes(b"precious")
    with pytest.raises(SystemExit) as e:
        gen.main(argv(out, tok_source))
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].endswith(f"{out} exists; remove it or choose another path")
    assert out.read_bytes() == b"precious"
    assert not (tmp_path / "taken.gguf.part").exists()


@pytest.mark.parametrize("error", [OSError("disk full"), KeyboardInterrupt()], ids=["oserror", "interrupt"])
def test_a_write_that_fails_midway_leaves_neither_the_output_nor_a_part_file(
    gen, tok_source, tmp_path, monkeypatch, error
):
    out = tmp_path / "half.gguf"
    made = []
    real = gen.make_tensor

    def failing(shape, index, seed, scale):
        if index == 5:
            assert (tmp_path / "half.gguf.part").stat().st_size > 0  # the header and 5 tensors are on disk
            raise error
        made.append(index)
        return real(shape, index, seed, scale)

    monkeypatch.setattr(gen, "make_tensor", failing)
    with pytest.raises(type(error)):
        gen.main(argv(out, tok_source))
    assert made == [0, 1, 2, 3, 4]
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_tokenizer_source_that_is_not_a_gguf_is_a_one_line_error(gen, tmp_path, capsys):
    bad = tmp_path / "notes.txt"
    bad.write_text("not a model")
    with pytest.raises(SystemExit) as e:
        gen.main(argv(tmp_path / "x.gguf", bad))
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert f"{bad}" in err[-1] and "GGUF" in err[-1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_q4_k_m_puts_q6_k_where_llama_quantize_does_and_every_block_is_finite(gen, tok_source, tmp_path):
    """--ftype q4_k_m: output Q6_K, attn_v / ffn_down Q6_K in llama-quantize's "more bits" layers
    (the first and last eighth, every third between), Q4_K elsewhere; each matrix dequantizes
    (gguf-py's reference) to finite values whose spread is about --scale."""
    out = tmp_path / "k.gguf"
    assert gen.main(argv(out, tok_source, n_embd=256, n_layer=8, n_ff=512) + ["--ftype", "q4_k_m"]) == 0
    r = gguf.GGUFReader(out)
    types = {t.name: t.tensor_type.name for t in r.tensors}
    more = [0, 3, 6, 7]  # n_layer 8: i < 1, i >= 7, (i - 1) % 3 == 2
    for i in range(8):
        want = "Q6_K" if i in more else "Q4_K"
        assert types[f"blk.{i}.attn_v.weight"] == want and types[f"blk.{i}.ffn_down.weight"] == want, i
        assert types[f"blk.{i}.ffn_up.weight"] == "Q4_K" and types[f"blk.{i}.attn_q.weight"] == "Q4_K"
    assert types["output.weight"] == "Q6_K" and types["token_embd.weight"] == "Q4_K"
    assert types["output_norm.weight"] == "F32"
    for t in r.tensors:
        if t.tensor_type.name in ("Q4_K", "Q6_K"):
            x = gguf.quants.dequantize(t.data, t.tensor_type)
            assert np.isfinite(x).all() and 0.005 < float(x.std()) < 0.08, (t.name, float(x.std()))
    with pytest.raises(SystemExit):  # K-quant blocks need multiples of 256
        gen.main(argv(tmp_path / "bad.gguf", tok_source) + ["--ftype", "q4_k_m"])
    assert not (tmp_path / "bad.gguf").exists()


# ---- mixture of experts (--n-expert): an OLMoE-shaped file ------------------------------------

MOE = dict(n_embd=256, n_layer=2, n_ff=256, n_head=4, n_head_kv=4, n_expert=8, n_expert_used=2)


@pytest.mark.parametrize("ftype", ["f16", "q4_k_m"])
def test_an_moe_file_has_olmoes_tensors_and_kvchat_decodes_it_the_same_in_any_ubatch(gen, tok_source, tmp_path, ftype):
    from tests.helpers.arch_refs import all_logits

    out = tmp_path / f"moe-{ftype}.gguf"
    assert gen.main(argv(out, tok_source, **MOE) + ["--ftype", ftype]) == 0
    r = gguf.GGUFReader(out)
    kv = field_values(r, "olmoe.")
    assert (kv["olmoe.expert_count"], kv["olmoe.expert_used_count"], kv["olmoe.feed_forward_length"]) == (8, 2, 256)
    t = {x.name: x for x in r.tensors}
    assert tuple(int(n) for n in t["blk.1.ffn_gate_exps.weight"].shape) == (256, 256, 8)
    assert tuple(int(n) for n in t["blk.0.ffn_down_exps.weight"].shape) == (256, 256, 8)
    assert t["blk.0.ffn_gate_inp.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    assert tuple(int(n) for n in t["blk.0.attn_k_norm.weight"].shape) == (256,)
    if ftype == "q4_k_m":
        Q = gguf.GGMLQuantizationType
        assert t["blk.0.ffn_gate_exps.weight"].tensor_type == Q.Q4_K
        assert t["blk.0.ffn_down_exps.weight"].tensor_type == Q.Q4_K
        assert t["blk.1.ffn_down_exps.weight"].tensor_type == Q.Q6_K  # a "more bits" layer of llama-quantize
        assert t["output.weight"].tensor_type == Q.Q6_K
    model = Model.load(out)
    try:
        assert model.hparams.n_expert == 8 and model.hparams.n_expert_used == 2
        assert model.hparams.n_ff_exp == 256  # no expert_feed_forward_length key (as OLMoE's files): n_ff
        tokens = model.vocab.tokenize("hello world and the chat of a model", add_special=True)
        one = all_logits(model, tokens)
        assert np.all(np.isfinite(one))
        np.testing.assert_array_equal(all_logits(model, tokens, n_ubatch=1, call=1), one)
    finally:
        model.close()


def test_moe_options_that_cannot_make_olmoe_are_refused(gen, tok_source, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        gen.main(argv(tmp_path / "x.gguf", tok_source, **dict(MOE, n_head_kv=2)))
    assert e.value.code == 2 and "--n-head-kv equal to --n-head" in capsys.readouterr().err


# ---- gpt-oss (--arch gpt-oss): MXFP4 experts, Q8_0 matrices, a padded vocabulary ----------------

GPT_OSS = dict(n_embd=128, n_layer=2, n_ff=64, n_head=4, n_head_kv=2, n_expert=8, n_expert_used=2)


def test_a_gpt_oss_file_has_mxfp4_experts_a_padded_vocabulary_and_kvchat_decodes_it_in_any_ubatch(
    gen, tok_source, tmp_path
):
    from tests.helpers.arch_refs import all_logits

    Q = gguf.GGMLQuantizationType
    out = tmp_path / "gpt-oss.gguf"
    args = argv(out, tok_source, **GPT_OSS) + ["--arch", "gpt-oss", "--head-dim", "32", "--n-vocab", "1000"]
    assert gen.main(args) == 0
    r = gguf.GGUFReader(out)
    kv = field_values(r, "")
    assert kv["general.architecture"] == "gpt-oss" and kv["general.file_type"] == 38
    assert (kv["gpt-oss.expert_count"], kv["gpt-oss.expert_used_count"], kv["gpt-oss.attention.key_length"]) == (
        8,
        2,
        32,
    )
    tokens, types = kv["tokenizer.ggml.tokens"], kv["tokenizer.ggml.token_type"]
    n_src = len(field_values(gguf.GGUFReader(tok_source), "tokenizer.")["tokenizer.ggml.tokens"])
    assert len(tokens) == len(types) == 1000 and tokens[-1] == f"<|unused_{999 - n_src}|>" and types[-1] == 5
    t = {x.name: x for x in r.tensors}
    assert t["blk.1.ffn_gate_exps.weight"].tensor_type == Q.MXFP4
    assert tuple(int(n) for n in t["blk.1.ffn_down_exps.weight"].shape) == (64, 128, 8)
    assert t["blk.0.attn_q.weight"].tensor_type == Q.Q8_0 and t["output.weight"].tensor_type == Q.Q8_0
    assert tuple(int(n) for n in t["blk.0.attn_q.weight"].shape) == (128, 4 * 32)
    assert t["blk.0.ffn_gate_inp.weight"].tensor_type == Q.F32 and "blk.0.attn_sinks.weight" in t
    for name in ("blk.0.ffn_up_exps.weight", "blk.1.attn_output.weight"):
        x = gguf.quants.dequantize(t[name].data, t[name].tensor_type)
        assert np.isfinite(x).all() and 0.01 < float(x.std()) < 0.04, (name, float(x.std()))  # --scale 0.02
    model = Model.load(out)
    try:
        assert (model.hparams.n_expert, model.hparams.n_vocab) == (8, 1000)
        ids = model.vocab.tokenize("hello world and the chat of a model", add_special=True)
        one = all_logits(model, ids)
        assert np.all(np.isfinite(one))
        np.testing.assert_array_equal(all_logits(model, ids, n_ubatch=1, call=1), one)
    finally:
        model.close()
