"""BPE merges: the tokenizer applies exactly the pairs of splitting every merge line at its first
space after position 0 (the converter's format), also for lines with more spaces in them, whatever
index it looks the pairs up in."""

import random
from types import SimpleNamespace

from kvchat.runtime.text.tokenizer_bpe import BPETokenizer


def _merge_by_split_pairs(merges, word):
    """Reference: ranks as (left, right) pairs cut at the first space after position 0."""
    ranks = {}
    for rank, m in enumerate(merges):
        cut = m.find(" ", 1)
        ranks[(m, "") if cut < 0 else (m[:cut], m[cut + 1 :])] = rank
    syms = list(word)
    while True:
        best = None
        for i in range(len(syms) - 1):
            r = ranks.get((syms[i], syms[i + 1]))
            if r is not None and (best is None or r < best[0]):
                best = (r, i)
        if best is None:
            return syms
        i = best[1]
        syms[i : i + 2] = [syms[i] + syms[i + 1]]


def test_merges_keyed_by_line_give_the_pairs_the_converter_wrote():
    rng = random.Random(0)
    alphabet = "ab c"
    # "  c" -> " c", "a  c" -> "a c"; "a c b" is the pair ("a", "c b"), never ("a c", "b")
    merges = ["  c", "a  c", "a c b", "a b", "  a", "a  b", "b c", " c a", "ab c", "c  ", "ba b", "junk", "a b"]
    for _ in range(40):
        left = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 3)))
        right = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 3)))
        merges.append(left + " " + right)
    tok = BPETokenizer(SimpleNamespace(regexes=[], ignore_merges=False), {}, merges)
    assert tok._merge("a cb") == _merge_by_split_pairs(merges, "a cb") == ["a c", "b"]
    for _ in range(2000):
        word = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 9)))
        assert tok._merge(word) == _merge_by_split_pairs(merges, word), word
