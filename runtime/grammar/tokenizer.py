"""The model's vocabulary as llguidance sees it: every token's bytes, the end tokens, a tokenizer.

Built the way llama.cpp's llguidance backend builds it from a llama_vocab (common/llguidance.cpp):
each token's piece as `token_to_piece(special=True)` renders it, control tokens (and user-defined
ones that look like `<...>`) prefixed with the byte 0xff so that a grammar can never spell them
out of ordinary text, and the end-of-generation set as llguidance's EOS tokens (a grammar that is
satisfied allows exactly these). Building it walks the whole vocabulary (~0.8 s for a 49k one), so
it is made once per Vocab and only when a grammar is used.
"""

from __future__ import annotations

from kvchat.runtime.text.vocab import ATTR_CONTROL, ATTR_USER_DEFINED

_CACHE_ATTR = "_llg_tokenizer"


class _VocabTokenizer:
    """The object llguidance's TokenizerWrapper expects: tokens, eos/bos ids, and a call that
    tokenizes text (bytes or str) as plain text without special tokens."""

    def __init__(self, vocab, tokens: list[bytes]):
        self.vocab = vocab
        self.tokens = tokens
        self.eos_token_id = vocab.eos if vocab.eos is not None else min(vocab.eog, default=0)
        self.bos_token_id = vocab.bos
        self.special_token_ids = sorted(vocab.eog)

    def __call__(self, text):
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self.vocab.tokenize(text, add_special=False, parse_special=False)


def token_bytes(vocab) -> list[bytes]:
    """Every token's bytes for llguidance (index = token id); special tokens behind 0xff."""
    out = []
    attrs = vocab.attrs
    for tid in range(vocab.n_vocab):
        piece = vocab.token_to_piece(tid, True)
        a = int(attrs[tid])
        if a & ATTR_CONTROL or (a & ATTR_USER_DEFINED and piece.startswith(b"<") and piece.endswith(b">")):
            piece = b"\xff" + piece
        out.append(piece)
    return out


def lltokenizer_for(vocab):
    """llguidance's LLTokenizer for `vocab` (made once, kept on the Vocab)."""
    tok = getattr(vocab, _CACHE_ATTR, None)
    if tok is None:
        import llguidance

        wrapped = llguidance.TokenizerWrapper(_VocabTokenizer(vocab, token_bytes(vocab)))
        eos = sorted(vocab.eog) or ([vocab.eos] if vocab.eos is not None else [])
        tok = llguidance.LLTokenizer(wrapped, n_vocab=vocab.n_vocab, eos_token=eos)
        setattr(vocab, _CACHE_ATTR, tok)
    return tok
