"""Limits checked before they hurt: KV bytes against free memory, logits no sampler can use, text
that is not UTF-8, an answer cut inside a character."""

import dataclasses

import numpy as np
import pytest

from kvchat.runtime.arch import create_memory
from kvchat.runtime.cparams import ContextParams, check_kv_fits, kv_cache_bytes, resolve_cparams
from kvchat.runtime.errors import CParamsError, ModelOutputError
from kvchat.runtime.sampling import Sampler, SamplingParams, check_logits
from kvchat.runtime.text.utf8 import clean_text, decode_bytes
from tests.helpers.memory_stubs import make_hparams


def resolve(hp, **kw):
    return resolve_cparams(ContextParams(**kw), hp)


@pytest.mark.parametrize(
    "kw",
    [
        dict(n_ctx=512),
        dict(n_ctx=1024, type_k="q8_0", type_v="q4_0"),
        dict(n_ctx=768, flash_attn="off"),
        dict(n_ctx=1024, n_seq_max=4, kv_unified=False),
        dict(n_ctx=512, n_seq_max=3),
    ],
)
@pytest.mark.parametrize("swa", [False, True])
def test_kv_estimate_equals_what_the_memory_allocates(kw, swa):
    hp = make_hparams(
        n_layer=4,
        n_swa=64 if swa else 0,
        swa_layers=[True, True, False, True] if swa else None,
        arch="gemma3" if swa else "llama",
    )
    cp = resolve(hp, **kw)
    mem = create_memory(hp, cp)
    total, per_token = kv_cache_bytes(cp, hp)
    assert total == mem.memory_breakdown()["total_bytes"]
    assert per_token * cp.n_ctx <= total


def test_context_larger_than_free_memory_is_refused_with_the_largest_that_fits(monkeypatch):
    hp = make_hparams(n_layer=2, n_head_kv=2, head_dim=32)  # 2 x (64 + 64) f16 = 512 bytes/token
    cp = resolve(hp, n_ctx=256)
    with pytest.raises(CParamsError) as e:
        check_kv_fits(dataclasses.replace(cp, n_ctx=1 << 22, n_ctx_seq=1 << 22), hp, available=1 << 30)
    msg = str(e.value)
    assert "-c 4194304 needs 2.0 GiB of KV cache (f16/f16)" in msg
    assert "has 1.0 GiB of memory available; the largest -c that fits is 2097152" in msg
    assert "-ctk q8_0" in msg and "\n" not in msg
    import kvchat.runtime.cparams as cparams

    monkeypatch.setattr(cparams, "available_memory", lambda: 100 << 20)
    with pytest.raises(CParamsError, match="largest -c that fits is 204800"):
        resolve(hp, n_ctx=1 << 20)
    with pytest.raises(CParamsError, match=r"-c 262144 for 4 sequences needs"):
        resolve(hp, n_ctx=1 << 18, n_seq_max=4, kv_unified=False)
    resolve(hp, n_ctx=4096)  # fits: accepted


def test_nan_inf_and_all_masked_logits_are_one_line_errors():
    ok = np.zeros(8, np.float32)
    check_logits(ok)
    masked = ok.copy()
    masked[3] = -np.inf  # --ignore-eos masks tokens: fine
    check_logits(masked)
    s = Sampler(SamplingParams(temp=0.0))
    for bad, what in (
        (np.array([0, np.nan], np.float32), "NaN logits: its weights are damaged"),
        (np.array([0, np.inf], np.float32), "infinite logits"),
        (np.full(4, -np.inf, np.float32), "all logits are -inf"),
    ):
        with pytest.raises(ModelOutputError, match=what):
            s.sample(bad)


def test_invalid_utf8_becomes_one_replacement_character_per_byte():
    assert decode_bytes(b"a\xffb") == "a\ufffdb"
    assert decode_bytes(b"x\xe2\x82y") == "x\ufffd\ufffdy"  # llama.cpp: one per byte
    assert decode_bytes("é✓".encode()) == "é✓"
    esc = b"caf\xe9 \xf0\x9f\xa6\x99 \xc3".decode("utf-8", "surrogateescape")
    assert clean_text(esc) == "caf\ufffd 🦙 \ufffd"
    assert clean_text("lone \ud800 high") == "lone \ufffd high"
    assert clean_text("plain") == "plain"


def test_tokenizer_accepts_surrogates_for_both_vocab_kinds(tmp_path):
    from kvchat.runtime.gguf.file import GGUFFile
    from kvchat.runtime.text.vocab import Vocab
    from tests.helpers.gguf_factory import write_tiny_model

    for arch in ("llama", "gemma3"):
        path = write_tiny_model(tmp_path / f"{arch}.gguf", arch=arch)
        with GGUFFile(path) as gf:
            vocab = Vocab.from_gguf(gf)
        bad = b"hi\xff there".decode("utf-8", "surrogateescape")
        assert vocab.tokenize(bad) == vocab.tokenize("hi\ufffd there")


def test_answer_cut_inside_a_character_ends_without_replacement_character(tmp_path):
    from kvchat.runtime.gguf.file import GGUFFile
    from kvchat.runtime.text.detokenize import StreamDecoder
    from kvchat.runtime.text.vocab import Vocab
    from tests.helpers.gguf_factory import write_tiny_model

    path = write_tiny_model(tmp_path / "m.gguf")
    with GGUFFile(path) as gf:
        vocab = Vocab.from_gguf(gf)
    ids = vocab.tokenize("é", add_special=False)
    assert len(ids) == 2  # two byte-level tokens: the cut falls inside the character
    dec = StreamDecoder(vocab)
    assert dec.feed(ids[0]) == "" and dec.flush() == ""
    assert dec.feed(ids[0]) + dec.feed(ids[1]) == "é"  # flush reset it: a new answer decodes whole
    # a byte that can never start a character still shows as U+FFFD mid-answer
    dec.flush()
    assert dec.feed(ids[1]) == "\ufffd"


def test_history_file_keeps_only_the_newest_entries(tmp_path):
    from kvchat.cli.chat.history import BoundedFileHistory, open_history

    path = tmp_path / "history"
    h = BoundedFileHistory(path, max_entries=5)
    for i in range(12):
        h.store_string(f"line {i}\nsecond {i}" if i % 3 == 0 else f"line {i}")
    h.store_string("bad \udcff byte")
    again = BoundedFileHistory(path, max_entries=5)
    loaded = list(again.load_history_strings())
    assert loaded == ["bad \ufffd byte", "line 11", "line 10", "line 9\nsecond 9", "line 8"]
    assert list(BoundedFileHistory(path, max_entries=5).load_history_strings()) == loaded  # file rewritten
    assert path.read_text(encoding="utf-8").count("\n# ") == 5
    not_dir = tmp_path / "f"
    not_dir.write_text("x")
    assert type(open_history(not_dir / "history")).__name__ == "InMemoryHistory"
    d = tmp_path / "dir"
    d.mkdir()
    h = BoundedFileHistory(d)  # a directory where the file should be: ignored, never raises
    assert list(h.load_history_strings()) == []
    h.store_string("x")
