"""Tokenizer tests: exact ids against llama.cpp's reference, round trips, streaming UTF-8, tiny vocabs."""

import json
import time

import numpy as np
import pytest

from kvchat.runtime.gguf.file import GGUFFile
from kvchat.runtime.text.detokenize import StreamDecoder
from kvchat.runtime.text.tokenizer_bpe import byte_encode
from kvchat.runtime.text.vocab import Vocab

MODELS = ("smollm2", "gemma3")


def _cases(reference_dir, name):
    return json.loads((reference_dir / f"tokenize_{name}.json").read_text(encoding="utf-8"))["cases"]


@pytest.fixture(scope="module")
def vocabs(smollm2_path, gemma3_path):
    out = {}
    for name, path in (("smollm2", smollm2_path), ("gemma3", gemma3_path)):
        with GGUFFile(path) as gf:
            out[name] = Vocab.from_gguf(gf)
    return out


def _case_ids():
    # the reference file is read at collection time so that every case is its own test
    from tests.conftest import REFERENCE_DIR

    return [(m, i) for m in MODELS for i in range(len(_cases(REFERENCE_DIR, m)))]


@pytest.mark.real_model
@pytest.mark.parametrize("model,index", _case_ids(), ids=lambda x: str(x))
def test_ids_match_llama_cpp(vocabs, reference_dir, model, index):
    case = _cases(reference_dir, model)[index]
    ids = vocabs[model].tokenize(case["text"], add_special=True, parse_special=case["parse_special"])
    assert ids == case["ids"], repr(case["text"])


@pytest.mark.real_model
@pytest.mark.parametrize("model", MODELS)
def test_round_trip_reference_texts(vocabs, reference_dir, model):
    """Byte-level BPE and SPM with byte fallback are lossless for all reference texts (BOS is
    a control token, so it renders as nothing; with parse_special the specials render back and
    remove_special drops the BOS the tokenizer added)."""
    vocab = vocabs[model]
    for case in _cases(reference_dir, model):
        assert vocab.detokenize(case["ids"]) == vocab.detokenize(case["ids"], remove_special=True)
        assert vocab.detokenize(case["ids"], special=case["parse_special"], remove_special=True) == case["text"]


@pytest.mark.real_model
def test_metadata_and_special_tokens(vocabs):
    smol, gemma = vocabs["smollm2"], vocabs["gemma3"]
    assert (smol.kind, smol.n_vocab, smol.add_bos, smol.bos, smol.eos) == ("bpe", 49152, False, 1, 2)
    # eos <|im_end|>, <|endoftext|>, and <reponame> (llama.cpp's FIM-repo heuristic) end generation
    assert smol.eog == {0, 2, 4} and smol.eot == 2
    assert (gemma.kind, gemma.n_vocab, gemma.add_bos, gemma.bos, gemma.eos) == ("spm", 262144, True, 2, 1)
    # <eos>, <end_of_turn>, and "</s>" (a user-defined HTML tag llama.cpp's text heuristic also catches)
    assert gemma.eog == {1, 106, 212} and gemma.eot == 106
    assert gemma.is_eog(106) and not gemma.is_eog(2)
    assert smol.token_to_piece(2) == b"<|im_end|>" and smol.token_to_piece(2, special=False) == b""
    assert gemma.token_to_piece(9259) == b"Hello" and gemma.token_to_piece(1902) == b" world"
    assert smol.tokenize("<|im_end|>", parse_special=True) == [2]
    assert gemma.tokenize("<end_of_turn>", parse_special=True) == [2, 106]
    assert gemma.tokenize("x", add_special=False) == [gemma.tokenize("x")[1]]


@pytest.mark.real_model
@pytest.mark.parametrize("model", MODELS)
def test_stream_decoder_holds_split_characters(vocabs, model):
    vocab = vocabs[model]
    text = "🦙🚀 llamas 👍🏽 and 🇯🇵, 日本語のテキスト 解码循环"
    ids = vocab.tokenize(text, add_special=False)
    pieces = [vocab.token_to_piece(i) for i in ids]
    # the text really does split characters across tokens, or the test would prove nothing
    assert any(_invalid_utf8(p) for p in pieces)
    dec = StreamDecoder(vocab)
    chunks = [dec.feed(i) for i in ids]
    assert "".join(chunks) + dec.flush() == text
    assert all("\ufffd" not in c for c in chunks)
    # an answer cut inside a character (-n, end of turn) drops the held bytes: no U+FFFD
    first_emoji = vocab.tokenize("🦙", add_special=False)
    dec = StreamDecoder(vocab)
    if len(first_emoji) > 1:
        assert "".join(dec.feed(i) for i in first_emoji[:-1]) == ""
        assert dec.flush() == ""


def _invalid_utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
        return False
    except UnicodeDecodeError:
        return True


@pytest.mark.real_model
@pytest.mark.parametrize("model", MODELS)
def test_gpl_text_speed_and_round_trip(vocabs, reference_dir, model):
    vocab = vocabs[model]
    text = (reference_dir / "texts" / "GPL-3.txt").read_text(encoding="utf-8")
    t0 = time.perf_counter()
    ids = vocab.tokenize(text)
    elapsed = time.perf_counter() - t0
    assert elapsed < 3.0, f"tokenizing 35 KB took {elapsed:.2f} s"
    assert 6000 < len(ids) < 9000
    assert vocab.detokenize(ids) == text


@pytest.mark.real_model
def test_gemma_vocab_loads_fast(gemma3_path):
    with GGUFFile(gemma3_path) as gf:
        t0 = time.perf_counter()
        Vocab.from_gguf(gf)
        elapsed = time.perf_counter() - t0
    assert elapsed < 2.0, f"building the 262144-token vocab took {elapsed:.2f} s"


# ------------------------------------------------------------------ tiny vocabularies (no model)


def _tiny_spm(**kw):
    tokens = (
        ["<unk>", "<s>", "</s>"]
        + [f"<0x{b:02X}>" for b in range(256)]
        + ["▁", "a", "b", "c", "ab", "bc", "▁a", "▁ab", "abc", "<tool>"]
    )
    types = [2, 3, 3] + [6] * 256 + [1] * 9 + [4]
    scores = np.zeros(len(tokens), np.float32)
    idx = {t: i for i, t in enumerate(tokens)}
    scores[idx["bc"]] = -1.0
    scores[idx["ab"]] = -2.0
    scores[idx["▁a"]] = -0.5
    scores[idx["▁ab"]] = -3.0
    scores[idx["abc"]] = -4.0
    return Vocab(kind="spm", tokens=tokens, token_types=types, scores=scores, **kw), idx


def test_tiny_spm_merges_by_score_and_falls_back_to_bytes():
    vocab, idx = _tiny_spm(add_space_prefix=True)
    # " abc" → ▁ a b c: best pair ▁a (-0.5) beats bc (-1); then "▁a"+"bc" is not a token → stop
    assert vocab.tokenize("abc", add_special=False) == [idx["▁a"], idx["bc"]]
    # without the space prefix: bc (-1) beats ab (-2), then a+bc = abc (-4)
    vocab2, _ = _tiny_spm(add_space_prefix=False)
    assert vocab2.tokenize("abc", add_special=False) == [idx["abc"]]
    assert vocab2.tokenize("abc") == [1, idx["abc"]]
    # "é" is not in the vocab: its two UTF-8 bytes become byte tokens
    assert vocab2.tokenize("é", add_special=False) == [idx["<0xC3>"], idx["<0xA9>"]]
    assert vocab2.detokenize(vocab2.tokenize("é a")) == "é a"
    # a user-defined token is cut out even without parse_special; control tokens only with it
    assert vocab2.tokenize("a<tool>b", add_special=False) == [idx["a"], idx["<tool>"], idx["b"]]
    assert idx["</s>"] not in vocab2.tokenize("a</s>", add_special=False)
    assert vocab2.tokenize("a</s>", add_special=False, parse_special=True) == [idx["a"], idx["</s>"]]


def test_tiny_bpe_merges_by_rank():
    words = ["a", "b", "c", "Ġ", "ab", "bc", "Ġa", "abc", "<|end|>"]
    tokens = words + [c for c in (byte_encode(chr(i)) for i in range(128)) if c not in words]
    types = [1] * len(tokens)
    types[words.index("<|end|>")] = 3
    merges = ["b c", "a b", "a bc", "Ġ a"]
    vocab = Vocab(
        kind="bpe", tokens=tokens, token_types=types, merges=merges, pre="gpt-2", bos=8, eos=8
    )  # without them llama.cpp defaults both to id 11
    idx = vocab.token_to_id
    # rank 0 "b c" first, then "a bc" → abc; " abc" is one pre-token "Ġabc": Ġ a merges last
    assert vocab.tokenize("abc") == [idx["abc"]]
    assert vocab.tokenize(" abc") == [idx["Ġ"], idx["abc"]]
    assert vocab.tokenize("ab") == [idx["ab"]]
    assert vocab.add_bos is False and vocab.eog == {idx["<|end|>"]}
    assert vocab.detokenize(vocab.tokenize("ab c")) == "ab c"
    # gpt-2 pre-tokenizer cleans spaces on detokenize, as llama.cpp does
    assert vocab.detokenize(vocab.tokenize("a ,b")) == "a,b"
