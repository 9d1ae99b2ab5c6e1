"""One answer's tokens on their way out: which token comes next, and which text it belongs to.

`AnswerStream` sits between the sampler and the text of one answer (a chat turn, or one
sequence of `run -np`). Per token it
- lets the thinking budget force the end-of-thinking marker (runtime/text/reasoning.py), or
- samples, with the grammar's mask (runtime/grammar/) while the answer proper is being written:
  a grammar never applies inside a thinking span, and at the start of an answer that may still
  open one, the start marker is allowed beside the grammar's tokens;
then sorts the token into thinking, answer or markup and decodes the first two into their own
streams (answer text leading whitespace after a thinking span dropped, as templates write
"</think>\\n\\n"). `content` / `reasoning` are the texts; `is_last()` ends the answer as soon as
the grammar can only end.
"""

from __future__ import annotations

import numpy as np

from kvchat.runtime.text.reasoning import ANSWER, MARKUP, THINK


class AnswerStream:
    def __init__(self, vocab, matcher=None, parser=None, on_text=None, on_thinking=None, decoder=None):
        if decoder is None:
            from kvchat.runtime.text.detokenize import StreamDecoder as decoder
        self.vocab = vocab
        self.matcher = matcher
        self.parser = parser
        self.on_text = on_text or (lambda s: None)
        self.on_thinking = on_thinking or (lambda s: None)
        self._answer_dec = decoder(vocab)
        self._think_dec = decoder(vocab)
        self.answer: list[str] = []
        self.thinking: list[str] = []
        self.n_thinking = 0  # tokens inside thinking spans
        self._kind = ANSWER  # of the token chosen last
        self._lead = True  # no answer text yet
        self._after_span = False  # markers were seen: leading answer whitespace is theirs

    # ---- choosing the token ------------------------------------------------------------------

    def choose(self, sampler, logits: np.ndarray, history) -> int:
        """The next token: forced by the budget, or drawn (under the grammar in the answer)."""
        p = self.parser
        forced = p.forced() if p is not None else None
        if forced is not None:
            token = int(forced)
        else:
            grammar = self.matcher is not None and (p is None or p.in_answer)
            allowed = None
            if grammar:
                allowed = self.matcher.allowed()
                opener = p.may_open if p is not None else None
                if opener is not None:
                    allowed = allowed.copy()
                    allowed[opener] = True
            token = sampler.sample(logits, history, allowed=allowed)
            if grammar and not (p is not None and token == p.may_open):
                self.matcher.accept(token)
        if p is not None:
            piece = self.vocab.token_to_piece(token, True).decode("utf-8", errors="replace")
            self._kind = p.feed(token, piece)
            self._after_span |= self._kind == MARKUP
        return token

    def is_last(self) -> bool:
        """The grammar is complete and only an end token could follow."""
        return (
            self.matcher is not None
            and self.matcher.done
            and (self.parser is None or self.parser.in_answer or self.parser.state == "answer")
        )

    # ---- the text ----------------------------------------------------------------------------

    def emit(self, token: int) -> None:
        """Decode a yielded token into its stream (markup shows nowhere)."""
        if self._kind == THINK:
            self.n_thinking += 1
            piece = self._think_dec.feed(token)
            if piece:
                if not self.thinking:
                    piece = piece.lstrip("\n")
                if piece:
                    self.thinking.append(piece)
                    self.on_thinking(piece)
        elif self._kind == ANSWER:
            piece = self._answer_dec.feed(token)
            if piece and self._lead and self._after_span:
                piece = piece.lstrip()
            if piece:
                self._lead = False
                self.answer.append(piece)
                self.on_text(piece)

    def finish(self) -> None:
        for dec, out, cb in ((self._think_dec, self.thinking, self.on_thinking), (self._answer_dec, self.answer, None)):
            tail = dec.flush()
            if tail:
                out.append(tail)
                (cb or self.on_text)(tail)

    @property
    def content(self) -> str:
        return "".join(self.answer)

    @property
    def reasoning(self) -> str:
        return "".join(self.thinking).strip()
