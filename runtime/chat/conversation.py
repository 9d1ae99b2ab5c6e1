"""A conversation on top of one sequence of a Context: messages in, generated answers out.

Two lists describe the state. `messages` is the chat as the user sees it. `tokens` is that chat
as tokens *as if nothing had ever been dropped* (runtime/chat/cache.py: the mirror of
the sequence's cache and its edits, the base class).

Each turn renders the messages through the chat template, compares the result with `tokens`,
keeps the common prefix (`seq_rm` of the rest) and decodes only what is new — so a follow-up
costs its own tokens, and /undo, /system or a re-tokenized answer cost only from the first
difference on. A memory that refuses a partial removal (a recurrent state has no per-position
cells: `seq_rm` returns False) goes back to the latest checkpoint at or before the cut
(runtime/chat/checkpoints.py) and decodes from there - or, without one, is cleared and the prompt
decoded whole. When the cache is full, the overflow policy applies: with context shift, keep the
first n_keep tokens, drop half of the rest (`seq_rm` + `seq_add` with a negative delta) and go
on; without it (or when the memory cannot drop tokens), stop the answer. A prompt that cannot
fit at all is refused with both numbers.

The answer loop is `kvchat.runtime.generate.generate`. What happens is reported as data — a StopReason
in the turn's stats, ContextShifted / ContextFull events to `notify` — and cli/ words it.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import numpy as np

from kvchat.runtime.chat.answer import AnswerStream
from kvchat.runtime.chat.cache import CachedSequence
from kvchat.runtime.chat.checkpoints import SeqCheckpoints
from kvchat.runtime.chat.events import ContextFull, ContextShifted, FullCause, PromptTooLong, TurnStats
from kvchat.runtime.chat.refit import common_prefix, refit, refit_plan
from kvchat.runtime.errors import KvchatError, SessionError
from kvchat.runtime.generate import DecodeError, Interrupted, StopReason, generate
from kvchat.runtime.text.reasoning import ReasoningParser, template_switches
from kvchat.runtime.text.utf8 import clean_text

__all__ = [
    "Conversation",
    "ConversationConfig",
    "TurnStats",
    "StopReason",
    "Interrupted",
    "DecodeError",
    "PromptTooLong",
    "ContextShifted",
    "ContextFull",
    "FullCause",
    "common_prefix",
]


@dataclass
class ConversationConfig:
    n_predict: int = -1  # most answer tokens (-1: until end of turn)
    context_shift: bool = True
    keep: int | None = None  # None: the system prompt; -1: the whole first prompt
    ignore_eos: bool = False
    raw: bool = False  # plain completion: no template, the prompt is the text
    system_prompt: str | None = None
    reasoning: str = "auto"  # on | off | auto (the template's default)
    reasoning_budget: int = -1  # most thinking tokens per answer (-1: no limit, 0: none)
    reasoning_effort: str | None = None  # low | medium | high (gpt-oss's templates)


class Conversation(CachedSequence):
    """Messages, the token mirror of the cache, the overflow policy, and the generation loop.

    ctx: a Context (decode, get_logits_ith, memory, n_ctx, cparams.n_batch).
    vocab: a Vocab; template: a ChatTemplate or None (raw mode); sampler: kvchat.runtime.sampling.Sampler.
    notify(event): ContextShifted / ContextFull as they happen (cli/wording.py words them).
    batch_factory(tokens, pos0, seq, all_logits=False) and stream_decoder(vocab) are for tests.
    """

    def __init__(
        self,
        ctx,
        vocab,
        template,
        sampler,
        config: ConversationConfig | None = None,
        seq_id: int = 0,
        notify=None,
        batch_factory=None,
        stream_decoder=None,
        stop_event: threading.Event | None = None,
    ):
        self.ctx = ctx
        self.vocab = vocab
        self.template = template
        self.sampler = sampler
        self.config = config or ConversationConfig()
        self.seq_id = seq_id
        self.notify = notify or (lambda event: None)
        self._batch = batch_factory  # None: kvchat.runtime.batch.Batch.one_seq
        if stream_decoder is None:
            from kvchat.runtime.text.detokenize import StreamDecoder as stream_decoder
        self._stream_decoder = stream_decoder
        # set from a signal handler: stop at the next token (and, via the Context's abort
        # callback, inside a long prompt evaluation)
        self.stop_event = stop_event or threading.Event()
        self.messages: list[dict] = []
        if self.config.system_prompt:
            self.messages.append({"role": "system", "content": self.config.system_prompt})
        self.tokens: list[int] = []
        self.n_dropped = 0
        self.n_keep_shift = 0
        self.logits: np.ndarray | None = None  # f32 [n_vocab] after the last decoded token
        self._regen = None  # (index in tokens where the last answer starts, logits there, n_dropped)
        self._first_prompt_len = 0
        # states to rewind to when the memory cannot cut a sequence (recurrent / hybrid)
        self.checkpoints = SeqCheckpoints(ctx, seq_id)
        self._n_keep_cache = None  # (system text, n_keep)
        self.last_stats = TurnStats()
        self.on_prompt = None  # called with the token ids about to be decoded (--verbose-prompt)
        self.speculative = None  # a Speculator (runtime/speculative/): answers verify its drafts
        # structured output: a runtime.grammar Constraint every answer must match (None: free text)
        self.constraint = None
        self.matcher = None  # the current answer's GrammarMatcher
        self.stream = None  # the current answer's AnswerStream
        self.on_thinking = None  # called with thinking text as it streams (None: not shown)
        from kvchat.runtime.text.reasoning import detect

        # the vocabulary's thinking markers (None: a model that does not think)
        self.reasoning_format = detect(vocab) if hasattr(vocab, "token_to_id") else None
        eog = sorted(int(t) for t in getattr(vocab, "eog", ()) or ())
        self._eog_ids = np.asarray(eog, dtype=np.int64)

    # ---- views -------------------------------------------------------------------------------

    @property
    def system_prompt(self) -> str | None:
        if self.messages and self.messages[0]["role"] == "system":
            return self.messages[0]["content"]
        return None

    # ---- templates → tokens ------------------------------------------------------------------

    def tokenize_prompt(self, text: str) -> list[int]:
        """Template output → ids, parsing special tokens, without doubling a BOS the text has."""
        ids = list(self.vocab.tokenize(text, add_special=True, parse_special=not self.config.raw))
        bos = getattr(self.vocab, "bos", None)
        if len(ids) >= 2 and bos is not None and ids[0] == bos and ids[1] == bos:
            ids = ids[1:]
        return ids

    def render(self, messages, add_generation_prompt: bool = True) -> list[int]:
        if self.config.raw or self.template is None:
            return self.tokenize_prompt("".join(m["content"] for m in messages if m["role"] != "system"))
        return self.tokenize_prompt(self.render_text(messages, add_generation_prompt))

    def render_text(self, messages, add_generation_prompt: bool = True) -> str:
        """The template's text for `messages` with the reasoning switches the config asks for:
        enable_thinking (on/off; auto passes nothing: the template's default) and
        reasoning_effort; an answer's thinking is also given as "thinking" (gpt-oss's name)."""
        cfg = self.config
        extra = {}
        if cfg.reasoning in ("on", "off"):
            extra["enable_thinking"] = cfg.reasoning == "on"
        if cfg.reasoning_effort:
            extra["reasoning_effort"] = cfg.reasoning_effort
        msgs = [m | {"thinking": m["reasoning_content"]} if m.get("reasoning_content") else m for m in messages]
        return self.template.render(msgs, add_generation_prompt=add_generation_prompt, **extra)

    def _switches(self) -> dict:
        return template_switches(getattr(self.template, "source", None))

    def n_keep(self) -> int:
        """How many leading tokens a context shift keeps.

        Default: everything the template puts before the first user's words (the system prompt,
        the model's default one included), found as the common prefix of two renderings that
        differ only in that first user message. -1: the whole first prompt.
        """
        keep = self.config.keep
        if keep is not None and keep >= 0:
            return keep
        if keep == -1:
            return self._first_prompt_len
        if self.config.raw or self.template is None:
            bos = getattr(self.vocab, "bos", None)
            return 1 if self.tokens and self.tokens[0] == bos and getattr(self.vocab, "add_bos", False) else 0
        system = self.system_prompt
        if self._n_keep_cache is None or self._n_keep_cache[0] != system:
            head = [m for m in self.messages[:1] if m["role"] == "system"]
            a = self.render(head + [{"role": "user", "content": "A"}])
            b = self.render(head + [{"role": "user", "content": "Z"}])
            self._n_keep_cache = (system, common_prefix(a, b))
        return self._n_keep_cache[1]

    def prefill(self, desired: list[int]) -> int:
        """Make the cache hold `desired` (full-list indices), decoding only what differs.

        Returns the number of tokens decoded. Raises PromptTooLong before touching anything
        when the new tokens cannot fit.
        """
        if not desired:
            raise KvchatError("the prompt is empty")
        p = common_prefix(self.tokens, desired)
        if p >= len(desired):
            p = len(desired) - 1  # re-decode the last token: its logits start the answer
        if self.n_dropped and p < self.n_keep_shift + self.n_dropped:
            base = min(p, self.n_keep_shift)  # what survives a rebuild
        else:
            base = p - self.n_dropped
        n_new = len(desired) - p
        shift = self._can_shift()
        keep = min(self.n_keep(), base) if shift else base
        if shift and n_new + keep > self.n_ctx:
            plan = refit_plan(self, desired)
            if plan is not None:
                return refit(self, desired, *plan)
        if n_new + keep > self.n_ctx or (not shift and base + n_new > self.n_ctx):
            raise PromptTooLong(n_new, self.n_ctx - keep, self.n_ctx)
        p = self._rewind(p)
        n_new = len(desired) - p
        if self.on_prompt is not None:
            self.on_prompt(desired[p:])
        if self.n_cached + n_new > self.n_ctx:
            self.last_stats.n_shifted += self.context_shift(n_new)
        self._decode(desired[p:])
        return n_new

    # ---- turns -------------------------------------------------------------------------------

    def ask(self, text: str, on_text=None) -> TurnStats:
        """Add a user message, evaluate the prompt, stream the answer. Returns the turn's stats.

        On Interrupted during the prompt the message is withdrawn; on PromptTooLong nothing changed.
        """
        if not text.strip():
            raise KvchatError("the prompt is empty: give some text")
        self.stop_event.clear()
        self.messages.append({"role": "user", "content": clean_text(text)})
        try:
            desired = self.render(self.messages)
            stats = self.last_stats = TurnStats()
            t0 = time.perf_counter()
            if not any(m["role"] == "assistant" for m in self.messages):
                self._first_prompt_len = len(desired)
            self.checkpoints.take(self.n_cached)  # where /undo comes back to
            stats.n_prompt = self.prefill(desired)
            stats.t_prompt = time.perf_counter() - t0
            self.checkpoints.take(self.n_cached)  # where /regen comes back to
        except BaseException:
            self.messages.pop()
            raise
        self._regen = (len(self.tokens), self.logits.copy(), self.n_dropped)
        return self._answer(stats, on_text)

    def regenerate(self, on_text=None) -> TurnStats:
        """Drop the last answer and sample a new one from the same prompt (no prompt re-decode
        when the prompt's logits are still at hand; else only its last token is re-decoded)."""
        if not self.messages or self.messages[-1]["role"] != "assistant":
            raise KvchatError("nothing to regenerate: there is no answer yet")
        self.stop_event.clear()
        self.messages.pop()
        stats = self.last_stats = TurnStats()
        regen, self._regen = self._regen, None
        if (
            regen is not None
            and regen[2] == self.n_dropped
            and (
                self._remove_from(regen[0] - self.n_dropped)
                or self.checkpoints.restore(regen[0] - self.n_dropped) == regen[0] - self.n_dropped
            )
        ):
            start, logits, _ = regen
            self.tokens = self.tokens[:start]
            self.logits = logits.copy()
            self._regen = regen
        else:
            t0 = time.perf_counter()
            stats.n_prompt = self.prefill(self.render(self.messages))
            stats.t_prompt = time.perf_counter() - t0
            self.checkpoints.take(self.n_cached)
            self._regen = (len(self.tokens), self.logits.copy(), self.n_dropped)
        return self._answer(stats, on_text)

    def _answer(self, stats: TurnStats, on_text) -> TurnStats:
        """Generate the answer from self.logits; the message holds whatever was streamed (its
        thinking under "reasoning_content", where templates look for it)."""
        cfg = self.config
        self.matcher = self.constraint.matcher() if self.constraint is not None else None
        parser = self.reasoning_parser()
        self.stream = stream = AnswerStream(
            self.vocab, self.matcher, parser, on_text, self.on_thinking, self._stream_decoder
        )
        kw = {"is_last": stream.is_last} if self.matcher is not None else {}
        run = generate
        if self.speculative is not None and self.matcher is None and parser is None:
            # drafts are verified against the plain sampler: not with a grammar or a thinking parser
            from kvchat.runtime.speculative.generate import generate_speculative

            run, kw = generate_speculative, {"speculator": self.speculative, "history": list(self.tokens)}
        gen = run(
            self.ctx,
            self._sample,
            **kw,
            logits=self.logits,
            pos0=self.n_cached,
            seq=self.seq_id,
            max_tokens=cfg.n_predict,
            is_eog=None if cfg.ignore_eos else self.vocab.is_eog,
            stop_event=self.stop_event,
            make_room=self._make_room,
            on_decoded=self._decoded,
            batch_factory=self._batch,
        )
        try:
            for step in gen:
                stats.n_gen += 1
                stream.emit(step.token)
        finally:
            stream.finish()
            stats.t_gen = gen.seconds
            stats.n_gen_decoded = gen.n_decoded
            stats.n_thinking = stream.n_thinking
            stats.stop = gen.stop or ""
            spec = getattr(gen, "stats", None)
            if spec is not None:
                stats.n_drafted, stats.n_accepted, stats.n_verify = spec.n_drafted, spec.n_accepted, spec.n_verify
            message = {"role": "assistant", "content": stream.content}
            if stream.reasoning:
                message["reasoning_content"] = stream.reasoning
            self.messages.append(message)
        return stats

    def reasoning_parser(self, prompt=None):
        """A ReasoningParser for an answer to `prompt` (default: this conversation's tokens);
        None in raw mode or for a model without thinking markers."""
        if self.config.raw or self.template is None or self.reasoning_format is None:
            return None
        cfg = self.config
        budget = cfg.reasoning_budget
        if cfg.reasoning == "off" and not self._switches()["enable_thinking"]:
            budget = 0  # the template cannot turn thinking off: end any span at once
        prompt = self.tokens if prompt is None else prompt
        return ReasoningParser(self.reasoning_format, prompt[-4096:], budget, allow_start=cfg.reasoning != "off")

    def _sample(self, logits: np.ndarray) -> int:
        """The next token (budget, grammar, sampler), end-of-turn tokens masked under --ignore-eos."""
        if self.config.ignore_eos and self._eog_ids.size:
            logits = logits.copy()
            logits[self._eog_ids[self._eog_ids < logits.shape[0]]] = -np.inf
        return self.stream.choose(self.sampler, logits, self._recent(self.sampler.params.repeat_last_n))

    def _decoded(self, token: int, logits: np.ndarray) -> None:
        self.tokens.append(int(token))
        self.logits = logits

    def _make_room(self, pos: int, n: int) -> int | None:
        """The overflow policy while answering: shift the context when allowed, else stop."""
        if self.n_cached + n <= self.n_ctx:
            return self.n_cached
        if not self._can_shift():
            cause = (
                FullCause.SHIFT_OFF
                if not self.config.context_shift
                else FullCause.RECURRENT
                if self.checkpoints.needed
                else FullCause.CANNOT_SHIFT
            )
            self.notify(ContextFull(self.n_cached, self.n_ctx, cause))
            return None
        self.last_stats.n_shifted += self.context_shift(n)
        if self.n_cached + n <= self.n_ctx:
            return self.n_cached
        self.notify(ContextFull(self.n_cached, self.n_ctx, FullCause.KEEP_ALL))
        return None

    # ---- editing the conversation --------------------------------------------------------------

    def _sync_to_messages(self) -> None:
        """Remove from the cache whatever no longer matches the messages (used after edits)."""
        if len(self.messages) <= (1 if self.system_prompt is not None else 0):
            self.clear(keep_system=True)
            return
        self._rewind(common_prefix(self.tokens, self.render(self.messages, add_generation_prompt=False)))

    def undo(self) -> int:
        """Drop the last exchange (user message and its answer). Returns messages removed."""
        idx = max((i for i, m in enumerate(self.messages) if m["role"] == "user"), default=None)
        if idx is None:
            raise KvchatError("nothing to undo")
        removed = len(self.messages) - idx
        del self.messages[idx:]
        self._sync_to_messages()
        return removed

    def clear(self, keep_system: bool = True) -> None:
        """A new conversation: messages (but the system prompt) and the sequence's cache emptied."""
        self._forget_all()
        self.messages = [m for m in self.messages[:1] if keep_system and m["role"] == "system"]
        self._first_prompt_len = 0

    def set_system(self, text: str | None) -> None:
        """Replace the system prompt; the cache is fixed lazily at the next turn (prefix compare)."""
        if self.system_prompt is not None:
            self.messages.pop(0)
        if text:
            self.messages.insert(0, {"role": "system", "content": clean_text(text)})
        self._n_keep_cache = None

    # ---- sessions ----------------------------------------------------------------------------

    def session_state(self) -> dict:
        """What a session file needs from the conversation (besides identity and config)."""
        return {
            "messages": [dict(m) for m in self.messages],
            "tokens": list(self.tokens),
            "n_dropped": self.n_dropped,
            "n_keep": self.n_keep_shift,
            "state": self.ctx.state_seq_get_data(self.seq_id),
        }

    def restore(self, messages, tokens, n_dropped: int, n_keep: int, state: bytes) -> None:
        """Replace the conversation with a validated session; on refusal nothing changes."""
        before = self.ctx.state_seq_get_data(self.seq_id)
        consumed = self.ctx.state_seq_set_data(state, self.seq_id)
        n_cached = len(tokens) - n_dropped
        ok = consumed == len(state) and (n_cached == 0 or self.ctx.memory.seq_pos_max(self.seq_id) == n_cached - 1)
        if not ok:
            if self.ctx.state_seq_set_data(before, self.seq_id) != len(before) and before:
                raise KvchatError("the memory state was refused and the previous one could not be put back; use /clear")
            raise SessionError(
                "the saved memory state does not fit this context (refused; the conversation is unchanged)"
            )
        self.messages = [dict(m) for m in messages]
        self.tokens = [int(t) for t in tokens]
        self.n_dropped = int(n_dropped)
        self.n_keep_shift = int(n_keep) if n_dropped else 0
        self.logits = None
        self._regen = None
        self._n_keep_cache = None
        self._first_prompt_len = 0
        self.checkpoints.clear()
