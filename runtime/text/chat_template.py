"""The model's Jinja chat template, rendered in an immutable sandbox with a time and size budget.

A GGUF file carries its chat template (`tokenizer.chat_template`) as Jinja source written by a
third party, so we treat it as untrusted code:

- jinja2's ImmutableSandboxedEnvironment refuses private attributes (`''.__class__`), calls to
  unsafe callables and every mutating method (`messages.append`); a refusal surfaces as one
  ChatTemplateError line, as do syntax errors and runtime errors of the template.
- Time: a template can loop without calling anything (`{% for i in range(10**5) %}{% for j in
  range(10**5) %}{% endfor %}{% endfor %}`), so a step counter is not enough if it only sees calls.
  We rewrite the parsed template so that every `for` iterates through a counting wrapper, and
  also count each sandboxed call, attribute/item lookup, filter and output chunk. Every step checks
  a step budget and a wall-clock deadline, so a runaway template stops within a fraction of a
  second, in-process, with no thread left spinning and no tracing hooks.
- Size: the output is streamed and cut at `max_output` characters; operations that could build a
  huge value in one go (`'x' * n`, `**`, `%`-formatting, `join`, `replace`, str padding methods,
  filters with numeric width/count arguments, namespace assignments) are checked *before* they
  run against the same cap.

`ChatTemplate.from_gguf` falls back to ChatML when the file has no template (Gemma-3-270M, a base
model, has none).
"""

from __future__ import annotations

import contextvars
import functools
import json
import re
import time
from datetime import datetime
from pathlib import Path

from jinja2 import nodes
from jinja2.exceptions import SecurityError, TemplateError, TemplateSyntaxError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace

from kvchat.runtime.errors import ChatTemplateError

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

MAX_OUTPUT = 1_000_000  # characters of rendered prompt (and of any single value built on the way)
MAX_STEPS = 1_000_000  # loop iterations + calls + lookups + output chunks
TIME_LIMIT = 2.0  # seconds of wall-clock per render
_ITER_GLOBAL = "__kvchat_budgeted_iter__"
_WIDE_FORMAT = re.compile(r"\d{7,}")  # a %-format or {}-format width/precision of a million or more


class _TemplateAbort(Exception):
    """Raised inside rendering when a budget runs out (turned into ChatTemplateError outside)."""


class _TemplateRaised(Exception):
    """raise_exception(message) called by the template itself."""


class _Budget:
    """Steps, deadline and size cap of one render."""

    def __init__(self, max_steps: int, time_limit: float, max_size: int):
        self.steps_left = max_steps
        self.deadline = time.monotonic() + time_limit
        self.time_limit = time_limit
        self.max_steps = max_steps
        self.max_size = max_size

    def step(self) -> None:
        self.steps_left -= 1
        if self.steps_left < 0:
            raise _TemplateAbort(f"it ran more than {self.max_steps} steps (an endless or huge loop?)")
        if time.monotonic() > self.deadline:
            raise _TemplateAbort(f"it ran longer than {self.time_limit:g} s")

    def size(self, n: int, what: str) -> None:
        if n > self.max_size:
            raise _TemplateAbort(f"{what} would make a value of ~{n} characters (limit {self.max_size})")


_BUDGET: contextvars.ContextVar[_Budget] = contextvars.ContextVar("chat_template_budget")


def _budget() -> _Budget:
    b = _BUDGET.get(None)
    if b is None:  # rendering outside ChatTemplate.render (should not happen): still bounded
        b = _Budget(MAX_STEPS, TIME_LIMIT, MAX_OUTPUT)
        _BUDGET.set(b)
    return b


def _budgeted_iter(iterable):
    """Each iteration of a template `for` loop costs one step."""
    b = _budget()
    for item in iterable:
        b.step()
        yield item


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _seq_len(x) -> int:
    return len(x) if isinstance(x, (str, list, tuple)) else 0


class _BudgetNamespace(Namespace):
    """`namespace()` whose attributes (the only state a loop can grow) are size-checked."""

    def __setitem__(self, name, value):
        if isinstance(value, (str, list, tuple)):
            _budget().size(len(value), "a namespace assignment")
        super().__setitem__(name, value)


class _SandboxEnv(ImmutableSandboxedEnvironment):
    """The immutable sandbox plus the step/size hooks described in the module docstring."""

    intercepted_binops = frozenset({"+", "*", "**", "%"})

    def _parse(self, source, name, filename):
        tree = super()._parse(source, name, filename)
        for loop in list(tree.find_all(nodes.For)):
            loop.iter = nodes.Call(
                nodes.Name(_ITER_GLOBAL, "load", lineno=loop.lineno), [loop.iter], [], None, None, lineno=loop.lineno
            )
        return tree

    def call_binop(self, context, operator, left, right):
        b = _budget()
        b.step()
        if operator == "*":
            if _is_int(left) and _is_int(right):
                b.size((left.bit_length() + right.bit_length()) // 3, "multiplying")
            elif _is_int(right) or _is_int(left):
                seq, n = (left, right) if _is_int(right) else (right, left)
                b.size(_seq_len(seq) * max(n, 0), "repeating a sequence")
        elif operator == "**":
            if _is_int(left) and _is_int(right) and abs(left) > 1:
                b.size(left.bit_length() * max(right, 0) // 3, "a power")
        elif operator == "+":
            b.size(_seq_len(left) + _seq_len(right), "concatenating")
        elif operator == "%" and isinstance(left, str):
            if _WIDE_FORMAT.search(left):
                b.size(10**7, "a %-format width")
        return super().call_binop(context, operator, left, right)

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's signature)
        b = _budget()
        b.step()
        owner = getattr(__obj, "__self__", None)
        name = getattr(__obj, "__name__", "")
        if isinstance(owner, str):
            _check_str_method(b, owner, name, args)
        return super().call(__context, __obj, *args, **kwargs)

    def getattr(self, obj, attribute):
        _budget().step()
        return super().getattr(obj, attribute)

    def wrap_str_format(self, value):
        """str.format / format_map: refuse a million-wide field before it is allocated."""
        wrapped = super().wrap_str_format(value)
        if wrapped is not None and _WIDE_FORMAT.search(value.__self__):
            _budget().size(10**7, "a format width")
        return wrapped

    def unsafe_undefined(self, obj, attribute):
        """Refuse outright (the default returns an Undefined that only fails when used)."""
        raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")

    def getitem(self, obj, argument):
        _budget().step()
        return super().getitem(obj, argument)


def _check_str_method(b: _Budget, s: str, name: str, args) -> None:
    """Refuse str methods whose result would exceed the size cap, before they allocate it."""
    if name in ("center", "ljust", "rjust", "zfill") and args and _is_int(args[0]):
        b.size(args[0], f"str.{name}")
    elif name == "expandtabs":
        b.size(len(s) * (args[0] if args and _is_int(args[0]) else 8), "str.expandtabs")
    elif name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        _check_replace(b, s, args[0], args[1])
    elif name == "join" and args:
        _check_join(b, s, args[0])
    elif name in ("format", "format_map") and _WIDE_FORMAT.search(s):
        b.size(10**7, "a format width")


def _check_replace(b: _Budget, s: str, old: str, new: str) -> None:
    count = s.count(old) if old else len(s) + 1
    b.size(len(s) + count * max(len(new) - len(old), 0), "replace")


def _check_join(b: _Budget, sep: str, seq) -> None:
    if isinstance(seq, (list, tuple)):
        b.size(len(sep) * len(seq) + sum(_seq_len(x) for x in seq), "join")


def _guard_filter(name, f):
    """Wrap a filter: one step per call, and no numeric argument (width, count…) above the cap."""
    n_injected = 1 if getattr(f, "jinja_pass_arg", None) is not None else 0

    @functools.wraps(f)
    def guarded(*args, **kwargs):
        b = _budget()
        b.step()
        value = args[n_injected] if len(args) > n_injected else None
        extra = list(args[n_injected + 1 :]) + list(kwargs.values())
        for a in extra:
            if _is_int(a):
                b.size(abs(a), f"the '{name}' filter's argument")
        if name == "join" and extra and isinstance(extra[0], str):
            _check_join(b, extra[0], list(value) if isinstance(value, (list, tuple)) else [])
        elif name == "replace" and len(extra) >= 2 and isinstance(value, str):
            _check_replace(b, value, str(extra[0]), str(extra[1]))
        elif name == "indent" and isinstance(value, str) and extra and isinstance(extra[0], str):
            b.size(len(value) + (value.count("\n") + 1) * len(extra[0]), "indent")
        elif name == "format" and isinstance(value, str) and _WIDE_FORMAT.search(value):
            b.size(10**7, "a format width")
        return f(*args, **kwargs)

    return guarded


def _raise_exception(message="the template raised an error"):
    raise _TemplateRaised(str(message))


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(str(fmt)[:200])


def _tojson(value, indent=None, separators=None, sort_keys=False, ensure_ascii=False):
    """Like transformers' tojson: plain JSON, no HTML escaping, non-ASCII kept."""
    return json.dumps(value, indent=indent, separators=separators, sort_keys=sort_keys, ensure_ascii=ensure_ascii)


def _make_env() -> _SandboxEnv:
    env = _SandboxEnv(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"], autoescape=False)
    env.filters["tojson"] = _tojson
    env.filters = {name: _guard_filter(name, f) for name, f in env.filters.items()}
    env.globals.update(
        {
            "raise_exception": _raise_exception,
            "strftime_now": _strftime_now,
            "namespace": _BudgetNamespace,
            _ITER_GLOBAL: _budgeted_iter,
        }
    )
    return env


def _one_line(text: str, limit: int = 200) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


class ChatTemplate:
    """A compiled chat template: `render(messages, add_generation_prompt)` → prompt text."""

    def __init__(
        self,
        source: str,
        bos_token: str = "",
        eos_token: str = "",
        *,
        name: str = "chat template",
        max_output: int = MAX_OUTPUT,
        max_steps: int = MAX_STEPS,
        time_limit: float = TIME_LIMIT,
    ):
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.name = name
        self.max_output = max_output
        self.max_steps = max_steps
        self.time_limit = time_limit
        self.is_fallback = False
        self._env = _make_env()
        try:
            self._template = self._env.from_string(source)
        except TemplateSyntaxError as e:
            raise ChatTemplateError(f"{name}: syntax error at line {e.lineno}: {_one_line(e.message)}") from None
        except TemplateError as e:
            raise ChatTemplateError(f"{name}: cannot compile: {_one_line(e)}") from None

    @classmethod
    def from_gguf(cls, gf, vocab=None, **limits) -> "ChatTemplate":
        """The file's tokenizer.chat_template, or ChatML when it has none."""
        source = gf.metadata.get("tokenizer.chat_template")
        bos, eos = _special_texts(vocab)
        if not isinstance(source, str) or not source.strip():
            tpl = cls(CHATML_TEMPLATE, bos, eos, name="built-in ChatML template", **limits)
            tpl.is_fallback = True
            return tpl
        return cls(source, bos, eos, name=f"chat template of {Path(str(getattr(gf, 'path', 'model'))).name}", **limits)

    @classmethod
    def from_file(cls, path, vocab=None, **limits) -> "ChatTemplate":
        """A template from a file (--chat-template-file)."""
        p = Path(path)
        try:
            source = p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ChatTemplateError(
                f"chat template file {p}: cannot read: {getattr(e, 'strerror', None) or e}"
            ) from None
        bos, eos = _special_texts(vocab)
        return cls(source, bos, eos, name=f"chat template {p}", **limits)

    def render(self, messages, add_generation_prompt: bool = True, tools=None, **extra) -> str:
        """The prompt for `messages` (list of {"role", "content", ...} dicts)."""
        variables = dict(extra)
        variables.update(
            messages=_plain(messages),
            add_generation_prompt=bool(add_generation_prompt),
            bos_token=self.bos_token,
            eos_token=self.eos_token,
            tools=_plain(tools),
        )
        budget = _Budget(self.max_steps, self.time_limit, self.max_output)
        token = _BUDGET.set(budget)
        try:
            out, size = [], 0
            for chunk in self._template.generate(**variables):
                budget.step()
                size += len(chunk)
                if size > self.max_output:
                    raise _TemplateAbort(f"its output exceeds {self.max_output} characters")
                out.append(chunk)
            return "".join(out)
        except _TemplateRaised as e:
            raise ChatTemplateError(f"{self.name}: {_one_line(e)}") from None
        except _TemplateAbort as e:
            raise ChatTemplateError(f"{self.name}: stopped because {e}") from None
        except SecurityError as e:
            raise ChatTemplateError(f"{self.name}: refused, it tried to leave its sandbox: {_one_line(e)}") from None
        except TemplateError as e:
            raise ChatTemplateError(f"{self.name}: failed to render: {_one_line(e)}") from None
        except RecursionError:
            raise ChatTemplateError(f"{self.name}: stopped because it recursed too deeply") from None
        except MemoryError:
            raise ChatTemplateError(f"{self.name}: stopped because it ran out of memory") from None
        except Exception as e:  # a template error surfacing as a Python one (TypeError, KeyError...)
            raise ChatTemplateError(f"{self.name}: failed to render: {type(e).__name__}: {_one_line(e)}") from None
        finally:
            _BUDGET.reset(token)


def _special_texts(vocab) -> tuple[str, str]:
    """BOS/EOS token texts for the template variables ("" when the model has none)."""
    if vocab is None:
        return "", ""
    bos = vocab.token_text(vocab.bos) if vocab.bos is not None else ""
    eos = vocab.token_text(vocab.eos) if vocab.eos is not None else ""
    return bos, eos


def _plain(value):
    """A private copy of the caller's messages/tools (plain dicts, lists, scalars)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value
