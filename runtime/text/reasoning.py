"""Thinking models: where a model's thinking starts and ends, read from its vocabulary.

Two families, recognised by the marker tokens the vocabulary holds (never by one model's text):
- tag pairs (`<think>` … `</think>` of Qwen3, SmolLM3, DeepSeek-R1 distills; Command-R's
  `<|START_THINKING|>` … `<|END_THINKING|>`; Seed-OSS's `<seed:think>` …): a start token opens a
  thinking span, an end token closes it, what follows is the answer;
- gpt-oss's "harmony" channels: `<|start|>assistant<|channel|>analysis<|message|>` … `<|end|>`
  is thinking, `<|channel|>final<|message|>` … the answer; headers and markers are neither.

`ReasoningParser` follows one answer's tokens and says of each whether it is thinking, answer or
markup; it also says which token the sampler must produce next when the thinking budget is spent
(`forced()`): the end marker (or, for channels, the marker run that opens the final message), as
llama.cpp's reasoning budget does. Where the template left off matters: a prompt that ends inside
an open `<think>` (DeepSeek-R1's templates) starts in thinking; one that closed an empty span for
`enable_thinking=false` (Qwen3's) starts in the answer, with no thinking left to open.
"""

from __future__ import annotations

from dataclasses import dataclass

# (start, end) texts of thinking spans; the first pair whose both texts are single tokens wins
TAG_PAIRS = (
    ("<think>", "</think>"),
    ("<|START_THINKING|>", "<|END_THINKING|>"),
    ("<seed:think>", "</seed:think>"),
    ("<|begin_of_thought|>", "<|end_of_thought|>"),
)
HARMONY = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>")
HARMONY_FINAL = "<|end|><|start|>assistant<|channel|>final<|message|>"
CLOSED_NEAR_END = 8  # a prompt whose last end marker is this close to its end closed the span itself

THINK, ANSWER, MARKUP = "think", "answer", "markup"


@dataclass(frozen=True)
class ReasoningFormat:
    """How one vocabulary marks thinking. kind "tags": `start`/`end` are the marker ids;
    kind "channels": `channel`, `message`, `end_msg`, `start_msg` ids. `close` is the token run
    the budget forces to end thinking."""

    kind: str
    start: int = -1
    end: int = -1
    channel: int = -1
    message: int = -1
    end_msg: int = -1
    start_msg: int = -1
    close: tuple = ()
    names: tuple = ()  # the marker texts, for messages


def detect(vocab) -> ReasoningFormat | None:
    """The thinking markers of this vocabulary, or None when it has none."""
    ids = vocab.token_to_id
    if all(ids.get(t) is not None for t in HARMONY):
        close = tuple(vocab.tokenize(HARMONY_FINAL, add_special=False, parse_special=True))
        return ReasoningFormat(
            "channels",
            channel=ids.get("<|channel|>"),
            message=ids.get("<|message|>"),
            end_msg=ids.get("<|end|>"),
            start_msg=ids.get("<|start|>"),
            close=close,
            names=("<|channel|>analysis<|message|>", "<|end|>"),
        )
    for start, end in TAG_PAIRS:
        a, b = ids.get(start), ids.get(end)
        if a is not None and b is not None:
            return ReasoningFormat("tags", start=a, end=b, close=(b,), names=(start, end))
    return None


def template_switches(source: str | None) -> dict:
    """Which reasoning variables a chat template reads: {"enable_thinking": bool,
    "reasoning_effort": bool} (a template that never names one ignores it)."""
    s = source or ""
    return {"enable_thinking": "enable_thinking" in s, "reasoning_effort": "reasoning_effort" in s}


class ReasoningParser:
    """One answer's tokens sorted into thinking / answer / markup (module docstring).

    prompt: the prompt's tokens (where the template left off); budget: most thinking tokens
    (-1: no limit; 0: none); allow_start: whether thinking may still open (False when the user
    turned it off and the template could not)."""

    def __init__(self, fmt: ReasoningFormat, prompt=(), budget: int = -1, allow_start: bool = True):
        self.fmt = fmt
        self.budget = int(budget)
        self.n_thinking = 0  # thinking tokens so far (markers not counted)
        self.n_forced = 0  # tokens the budget forced
        self._queue: list[int] = []  # forced tokens still to come
        self.channel = ""
        self._header = False
        self.allow_start = allow_start
        if fmt.kind == "tags":
            self.state = self._tags_initial(list(prompt))
        else:
            self.state = "header"  # templates end the prompt with "<|start|>assistant"
            self._header = True

    # ---- where the prompt left off -----------------------------------------------------------

    def _tags_initial(self, prompt: list[int]) -> str:
        f = self.fmt
        last_start = max((i for i, t in enumerate(prompt) if t == f.start), default=-1)
        last_end = max((i for i, t in enumerate(prompt) if t == f.end), default=-1)
        if last_start > last_end:
            return "think"  # the template opened the span: the model thinks first
        if last_end > last_start and last_end >= len(prompt) - CLOSED_NEAR_END:
            return "answer"  # the template closed an empty span itself (thinking off)
        return "start"

    # ---- queries -----------------------------------------------------------------------------

    @property
    def thinking(self) -> bool:
        """Inside a thinking span now."""
        return self.state == "think" or (self.state == "body" and self.channel == "analysis")

    @property
    def in_answer(self) -> bool:
        """The next token belongs to the answer (a grammar applies to it)."""
        if self.fmt.kind == "tags":
            return self.state in ("start", "answer") and not self._queue
        return self.state == "body" and self.channel != "analysis" and not self._queue

    @property
    def may_open(self) -> int | None:
        """The start marker the answer may still begin with (tags, before any answer text)."""
        if self.fmt.kind == "tags" and self.state == "start" and self.allow_start and self.budget != 0:
            return self.fmt.start
        return None

    def forced(self) -> int | None:
        """The token the sampler must give next (the budget is spent), or None."""
        if self._queue:
            return self._queue[0]
        if self.thinking and 0 <= self.budget <= self.n_thinking:
            self._queue = list(self.fmt.close)
            return self._queue[0] if self._queue else None
        return None

    # ---- following the tokens ----------------------------------------------------------------

    def feed(self, token: int, text: str = "") -> str:
        """The kind of `token` (THINK, ANSWER or MARKUP); `text` is its piece (channel names)."""
        token = int(token)
        if self._queue and self._queue[0] == token:
            self._queue.pop(0)
            self.n_forced += 1
        elif self._queue:
            self._queue = []  # something else came (should not happen): forget the rest
        if self.fmt.kind == "tags":
            return self._feed_tags(token, text)
        return self._feed_channels(token, text)

    def _feed_tags(self, token: int, text: str) -> str:
        f = self.fmt
        if self.state == "think":
            if token == f.end:
                self.state = "answer"
                return MARKUP
            self.n_thinking += 1
            return THINK
        if self.state == "start":
            if token == f.start and self.allow_start:
                self.state = "think"
                return MARKUP
            if text.strip():
                self.state = "answer"
        return ANSWER

    def _feed_channels(self, token: int, text: str) -> str:
        f = self.fmt
        if token == f.start_msg:
            self.state, self.channel = "header", ""
            return MARKUP
        if token == f.channel:
            self.state, self.channel = "channel", ""
            return MARKUP
        if token == f.message:
            self.state = "body"
            self.channel = self.channel.strip().split(" ")[0] if self.channel.strip() else "final"
            return MARKUP
        if token == f.end_msg:
            self.state = "between"
            return MARKUP
        if self.state == "channel":
            self.channel += text
            return MARKUP
        if self.state in ("header", "between"):
            return MARKUP
        if self.channel == "analysis":
            self.n_thinking += 1
            return THINK
        return ANSWER
