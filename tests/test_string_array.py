"""StringArray / StringIndex (runtime/string_array.py) behave as the list and dict they replace."""
import random

import pytest

from runtime.string_array import StringArray, StringIndex
from runtime.text.tokenizer_bpe import BPETokenizer, pre_tokenizer


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


def _old_ranks(merges):
    ranks = {}
    for rank, m in enumerate(merges):
        cut = m.find(" ", 1)
        ranks[(m, "") if cut < 0 else (m[:cut], m[cut + 1:])] = rank
    return ranks


def test_bpe_merge_rank_equals_the_tuple_dict_of_the_converter_split_for_every_pair():
    merges = ["a b", "Ġ a", "ab b", "a b", "x", "x ", " y", "  z", "a b c", "q  r", ""] + \
             [a + " " + b for a, b in zip(_words(4, 300), _words(5, 300))]
    old = _old_ranks(merges)
    bpe = BPETokenizer(pre_tokenizer("gpt-2"), {}, merges)
    pieces = sorted({p for m in merges for p in m.split(" ")} | {"a b", " ", "", "x", "x "})
    for left in pieces:
        for right in pieces:
            assert bpe.rank(left, right) == old.get((left, right)), (left, right)
