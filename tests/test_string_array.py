"""StringArray / StringIndex (runtime/gguf/string_array.py) behave as the list and dict they replace."""

import random

import numpy as np
import pytest

from kvchat.runtime.gguf.string_array import StringArray, StringIndex
from kvchat.runtime.text.tokenizer_bpe import BPETokenizer, pre_tokenizer


def _words(seed: int, n: int) -> list[str]:
    rng = random.Random(seed)
    alphabet = ["a", "b", "Ġ", "é", "▁", " ", "\udcff", "\u4e2d", "<", "|", ">"]
    return ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 4))) for _ in range(n)]


def test_string_array_items_equal_the_strings_it_was_built_from_including_surrogate_escapes():
    words = _words(1, 2000)
    arr = StringArray.from_strings(words)
    assert len(arr) == len(words) and list(arr) == words and arr == words
    assert arr[-1] == words[-1] and arr[3:9] == words[3:9]
    with pytest.raises(IndexError):
        arr[len(words)]
    assert arr.has_empty() == ("" in words)


@pytest.mark.parametrize("nul_inside", [False, True])
def test_iterating_decodes_every_text_as_indexing_it_does_including_invalid_utf8(nul_inside):
    """Iteration decodes runs of NUL-separated texts at once; byte strings that are not UTF-8
    (cut sequences, lone continuation bytes, surrogates) come out as the per-text decode."""
    rng = random.Random(7)
    pieces = [
        bytes(rng.choice(b"ab\x80\xbf\xc3\xa9\xe2\x82\xac\xed\xa0\xf0\x9f\xff ") for _ in range(rng.randint(0, 6)))
        for _ in range(40000)
    ]
    if nul_inside:
        pieces[20001] = b"a\0b"
    blob = b"\0".join(pieces)
    ends = np.cumsum([len(p) + 1 for p in pieces]) - 1
    arr = StringArray(blob, ends - [len(p) for p in pieces], ends)
    want = [p.decode("utf-8", "surrogateescape") for p in pieces]
    assert list(arr) == want and [arr[i] for i in range(len(arr))] == want
    assert list(StringArray.from_strings(want)) == want


def test_string_index_gives_the_last_position_of_each_text_as_a_dict_built_from_the_list_does():
    words = _words(2, 3000)  # many repeats
    want = dict(zip(words, range(len(words))))
    idx = StringIndex(StringArray.from_strings(words))
    assert len(idx) == len(want)
    for w, i in want.items():
        assert idx.get(w) == i and idx[w] == i and w in idx
    for w in _words(3, 500):
        assert idx.get(w) == want.get(w)
    with pytest.raises(KeyError):
        idx["never a token \u2603"]


def test_the_index_hashes_are_zlibs_crc32_of_each_texts_bytes():
    """get() hashes its key with zlib.crc32; the compiled build must give the same numbers."""
    import zlib

    words = _words(6, 500) + ["", "\u4e2d\u6587", "a" * 300]
    idx = StringIndex(StringArray.from_strings(words))
    want = [zlib.crc32(w.encode("utf-8", "surrogateescape")) for w in words]
    assert list(idx._hash) == want
    assert idx.get("\ud800") is None and idx.get(3) is None  # no text holds a lone high surrogate


def _old_ranks(merges):
    ranks = {}
    for rank, m in enumerate(merges):
        cut = m.find(" ", 1)
        ranks[(m, "") if cut < 0 else (m[:cut], m[cut + 1 :])] = rank
    return ranks


def test_bpe_merge_rank_equals_the_tuple_dict_of_the_converter_split_for_every_pair():
    merges = ["a b", "Ġ a", "ab b", "a b", "x", "x ", " y", "  z", "a b c", "q  r", ""] + [
        a + " " + b for a, b in zip(_words(4, 300), _words(5, 300))
    ]
    old = _old_ranks(merges)
    bpe = BPETokenizer(pre_tokenizer("gpt-2"), {}, merges)
    pieces = sorted({p for m in merges for p in m.split(" ")} | {"a b", " ", "", "x", "x "})
    for left in pieces:
        for right in pieces:
            assert bpe.rank(left, right) == old.get((left, right)), (left, right)


def test_the_python_twins_of_the_vocabulary_kernels_give_the_same_arrays():
    """scan_strings_py / _build_table_py (a first run's, kernels/compile_plan.compiling_behind)
    against the kernels: random texts with repeats and NULs, valid and truncated buffers."""
    import struct

    from kvchat.kernels.gguf_strings import scan_strings, scan_strings_py
    from kvchat.runtime.gguf.string_array import StringArray, _build_table, _build_table_py, table_args

    rng = np.random.default_rng(7)
    for _ in range(300):
        texts = [
            bytes(rng.integers(0, 3, int(rng.integers(0, 5))).astype(np.uint8)) for _ in range(int(rng.integers(0, 30)))
        ]
        lead = bytes(int(rng.integers(0, 4)))
        data = lead + b"".join(struct.pack("<Q", len(t)) + t for t in texts)
        if texts and rng.random() < 0.3:
            data = data[: int(rng.integers(len(lead), len(data)))]  # runs past the end
        buf = np.frombuffer(data, np.uint8)
        want, got = scan_strings(buf, len(lead), len(texts)), scan_strings_py(buf, len(lead), len(texts))
        assert want[2:] == got[2:]
        if want[3] < 0:
            np.testing.assert_array_equal(got[0], want[0])
            np.testing.assert_array_equal(got[1], want[1])
        strings = StringArray.from_strings([t.decode("latin-1") for t in texts] or ["x"])
        args = table_args(strings, 1 << max(4, (2 * len(strings) - 1).bit_length()))
        for a, b in zip(_build_table_py(*args), _build_table(*args), strict=True):
            np.testing.assert_array_equal(a, b)
