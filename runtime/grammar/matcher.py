"""One grammar, many answers: a `Constraint` (compiled grammar + the vocabulary's tokenizer) makes
a `GrammarMatcher` per answered sequence, which says which tokens may come next and follows the
tokens actually sampled.

The mask is llguidance's bitmask (one bit per token id, computed in Rust without the GIL) unpacked
to a bool row; the sampler applies it after the repetition penalty and before top-k
(runtime/sampling.py), so a greedy or seeded run with a grammar is as reproducible as one without.
An answer ends when the model ends its turn where the grammar is satisfied (the end-of-generation
tokens are allowed exactly then), or as soon as the grammar can only end (`done`): no decode is
spent on an end token the grammar forces anyway, and no whitespace can run on after a closed JSON
document.
"""

from __future__ import annotations

import time

import numpy as np

from kvchat.runtime.errors import GrammarError, KvchatError


class GrammarMatcher:
    """The grammar's state for one answer. `seconds`: time spent computing masks and following
    tokens (the cost a grammar adds per token; docs/performance.md)."""

    def __init__(self, tokenizer, grammar: str, n_vocab: int, origin: str = "grammar"):
        import llguidance

        self.origin = origin
        self.n_vocab = int(n_vocab)
        self._m = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if self._m.is_error():
            raise GrammarError(f"{origin}: {self._m.get_error()}")
        self.n_tokens = 0
        self.seconds = 0.0

    def allowed(self) -> np.ndarray:
        """bool [n_vocab]: the tokens the grammar allows next (end tokens when it is satisfied)."""
        t0 = time.perf_counter()
        bits = np.frombuffer(self._m.compute_bitmask(), dtype=np.uint8)  # [ceil(n/32)*4] u8
        if self._m.is_error():
            raise KvchatError(f"{self.origin}: the grammar failed: {self._m.get_error()}")
        row = np.unpackbits(bits, count=self.n_vocab, bitorder="little").view(np.bool_)  # [n_vocab]
        self.seconds += time.perf_counter() - t0
        return row

    def accept(self, token: int) -> None:
        """Follow a sampled token (one the mask allowed)."""
        t0 = time.perf_counter()
        ok = self._m.consume_token(int(token))
        self.seconds += time.perf_counter() - t0
        if not ok:
            raise KvchatError(f"{self.origin}: token {token} does not fit the grammar: {self._m.get_error()}")
        self.n_tokens += 1

    @property
    def done(self) -> bool:
        """The grammar can only end here (no token but an end token would fit)."""
        return self._m.is_stopped()

    @property
    def accepting(self) -> bool:
        """What was sampled so far is a complete match."""
        return self._m.is_accepting()


class Constraint:
    """A grammar spec compiled for one vocabulary; `matcher()` starts an answer under it."""

    def __init__(self, spec, vocab):
        from kvchat.runtime.grammar.tokenizer import lltokenizer_for

        self.spec = spec
        self.grammar = spec.compile()
        self.vocab = vocab
        self.tokenizer = lltokenizer_for(vocab)

    def matcher(self) -> GrammarMatcher:
        return GrammarMatcher(self.tokenizer, self.grammar, self.vocab.n_vocab, self.spec.origin)
