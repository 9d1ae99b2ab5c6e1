"""Byte-level BPE (GPT-2 style) tokenization, as llama.cpp's llm_tokenizer_bpe does it.

Three steps for each text fragment:
1. pre-tokenize: the fragment is cut into words by the regexes of the model's
   `tokenizer.ggml.pre` type, applied one after the other; each regex splits every piece made by
   the previous ones, and the text between matches stays a piece of its own;
2. byte-encode: each word's UTF-8 bytes are mapped to the printable stand-in characters of
   GPT-2's byte-to-unicode table (the alphabet the vocabulary and merges are written in);
3. merge: starting from single characters, the adjacent pair with the lowest merge rank is
   joined (ties: the leftmost) until no pair has a rank; each final symbol is a token.

The `regex` package supplies the Unicode classes (\\p{L}, \\p{N}); its \\s is the Unicode
White_Space set, the same set llama.cpp's own tables use.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import regex

from kvchat.runtime.gguf.string_array import StringArray, StringIndex

# The GPT-2 pre-tokenizer and its relatives (contractions, letters, numbers, other, spaces).
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class PreTokenizer:
    """What a `tokenizer.ggml.pre` value means: its regexes and the llama.cpp flags it sets."""

    name: str
    regexes: tuple
    clean_spaces: bool = True  # detokenize: drop the space before ?!., and in some contractions
    ignore_merges: bool = False  # a word that is already a token is taken whole
    add_bos: bool = False  # default when the GGUF has no tokenizer.ggml.add_bos_token


_DEFAULT = PreTokenizer("default", (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"))
_BY_KIND = {
    "default": _DEFAULT,
    "gpt2": PreTokenizer("gpt2", (_GPT2,)),
    "smollm": PreTokenizer("smollm", (r"\p{N}", _GPT2), clean_spaces=False),
    "starcoder": PreTokenizer("starcoder", (r"\p{N}", _GPT2)),
    "qwen2": PreTokenizer("qwen2", (_QWEN2,), clean_spaces=False),
    "stablelm2": PreTokenizer("stablelm2", (_QWEN2,)),
    "llama3": PreTokenizer("llama3", (_LLAMA3,), ignore_merges=True, add_bos=True),
    "dbrx": PreTokenizer("dbrx", (_LLAMA3,)),
}
# tokenizer.ggml.pre values → the kind of pre-tokenizer (names as llama.cpp's converter writes them)
_PRE_NAMES = {
    "default": "default",
    "gpt-2": "gpt2",
    "phi-2": "gpt2",
    "mpt": "gpt2",
    "olmo": "gpt2",
    "jais": "gpt2",
    "smollm": "smollm",
    "starcoder": "starcoder",
    "refact": "starcoder",
    "codeshell": "starcoder",
    "exaone": "starcoder",
    "minerva-7b": "starcoder",
    "qwen2": "qwen2",
    "deepseek-r1-qwen": "qwen2",
    "stablelm2": "stablelm2",
    "llama3": "llama3",
    "llama-v3": "llama3",
    "llama-bpe": "llama3",
    "falcon3": "llama3",
    "pixtral": "llama3",
    "dbrx": "dbrx",
    "smaug-bpe": "dbrx",
}


def pre_tokenizer(pre: str | None) -> PreTokenizer | None:
    """The pre-tokenizer for a `tokenizer.ggml.pre` value (missing → default); None if unknown."""
    if not pre:
        return _DEFAULT
    kind = _PRE_NAMES.get(pre)
    return _BY_KIND[kind] if kind else None


def supported_pre_names() -> list[str]:
    return sorted(_PRE_NAMES)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's table: printable Latin-1 bytes stand for themselves, the rest map to U+0100 upwards."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(0x100 + extra)
            extra += 1
    return table


BYTE_TO_UNICODE: dict[int, str] = _bytes_to_unicode()
UNICODE_TO_BYTE: dict[str, int] = {c: b for b, c in BYTE_TO_UNICODE.items()}
# str.translate table from a Latin-1 decoded byte string to the byte-level alphabet
_LATIN1_TO_BYTE_LEVEL = {b: c for b, c in BYTE_TO_UNICODE.items()}


def byte_encode(word: str) -> str:
    """A word in the byte-level alphabet (one stand-in character per UTF-8 byte)."""
    return word.encode("utf-8").decode("latin-1").translate(_LATIN1_TO_BYTE_LEVEL)


def byte_decode(piece: str) -> bytes | None:
    """Inverse of byte_encode; None if the piece has a character outside the byte-level alphabet."""
    try:
        return bytes(UNICODE_TO_BYTE[c] for c in piece)
    except KeyError:
        return None


class BPETokenizer:
    """Pre-tokenizer + merges for one vocabulary; `tokenize(fragment)` gives ids."""

    _CACHE_LIMIT = 200_000

    def __init__(self, pre: PreTokenizer, token_to_id, merges):
        """token_to_id: text -> id (a dict or kvchat.runtime.gguf.string_array.StringIndex); merges: the
        "left right" strings in rank order (a list or StringArray)."""
        self.pre = pre
        self.token_to_id = token_to_id
        self._patterns = [regex.compile(p) for p in pre.regexes]
        if not isinstance(merges, StringArray):
            merges = StringArray.from_strings(merges)
        self._merges = StringIndex(merges)  # merge text -> its rank (the last one if repeated)
        self._cache: dict[str, list[int]] = {}

    def rank(self, left: str, right: str) -> int | None:
        """The rank of merging left + right, as the converter wrote it: merge m is split at its
        first space after position 0 into (left, right), or is (m, "") without one."""
        get = self._merges.get
        if right:
            r = get(left + " " + right)
            return r if r is not None and left and left.find(" ", 1) < 0 else None
        # (m, "") comes from m without a space, or from m = left + " " (the later rank wins)
        a = get(left) if left.find(" ", 1) < 0 else None
        b = get(left + " ") if left.find(" ", 1) < 0 and left != "" else None
        return a if b is None else b if a is None else max(a, b)

    def split_words(self, text: str) -> list[str]:
        """Pre-tokenize: each regex splits every current piece into matches and the gaps between."""
        pieces = [text] if text else []
        for pat in self._patterns:
            out = []
            for piece in pieces:
                pos = 0
                for m in pat.finditer(piece):
                    a, b = m.span()
                    if a > pos:
                        out.append(piece[pos:a])
                    if b > a:
                        out.append(piece[a:b])
                    pos = b
                if pos < len(piece):
                    out.append(piece[pos:])
            pieces = out
        return pieces

    def tokenize(self, text: str) -> list[int]:
        out: list[int] = []
        cache = self._cache
        for word in self.split_words(text):
            ids = cache.get(word)
            if ids is None:
                ids = self._word_ids(byte_encode(word))
                if len(cache) >= self._CACHE_LIMIT:
                    cache.clear()
                cache[word] = ids
            out.extend(ids)
        return out

    def _word_ids(self, word: str) -> list[int]:
        lookup = self.token_to_id.get
        if self.pre.ignore_merges:
            tid = lookup(word)
            if tid is not None:
                return [tid]
        symbols = self._merge(word)
        out = []
        for sym in symbols:
            tid = lookup(sym)
            if tid is not None:
                out.append(tid)
            else:
                # llama.cpp falls back to the raw bytes as one-character tokens; only ASCII can match
                for b in sym.encode("utf-8"):
                    tid = lookup(chr(b)) if b < 0x80 else None
                    if tid is not None:
                        out.append(tid)
        return out

    def _merge(self, word: str) -> list[str]:
        """Apply merges by rank (lowest first, then leftmost) to the characters of `word`."""
        n = len(word)
        if n <= 1:
            return [word] if n else []
        syms = list(word)
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        prev = list(range(-1, n - 1))
        rank_of = self.rank
        heap: list = []

        def add(left: int, right: int) -> None:
            if left == -1 or right == -1:
                return
            rank = rank_of(syms[left], syms[right])
            if rank is not None:
                heapq.heappush(heap, (rank, left, right, syms[left] + syms[right]))

        for i in range(1, n):
            add(i - 1, i)
        while heap:
            _, left, right, joined = heapq.heappop(heap)
            a, b = syms[left], syms[right]
            if not a or not b or a + b != joined:
                continue  # a merge since this candidate was queued changed one side
            syms[left] = joined
            syms[right] = ""
            after = nxt[right]
            nxt[left] = after
            if after >= 0:
                prev[after] = left
            add(prev[left], left)
            add(left, after)
        return [s for s in syms if s]
