"""The flags `kvchat chat` and `kvchat run` share, named as llama.cpp names them.

Each flag is declared once in OPTIONS (name, type, default, spellings, help, --help panel). The
decorator `with_settings` appends them to a command's signature, so typer sees ordinary
parameters, and hands the command one `ChatSettings` object instead of thirty arguments.
"""
from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, fields
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

from runtime.sampling import SamplingParams

PANEL_MODEL = "Model"
PANEL_CONTEXT = "Context and KV cache"
PANEL_SAMPLING = "Sampling"
PANEL_CHAT = "Conversation"
PANEL_OUTPUT = "Output"


class FlashAttn(str, Enum):
    on = "on"
    off = "off"
    auto = "auto"


@dataclass
class ChatSettings:
    """Everything the shared flags set; the defaults are the flags' defaults."""
    model: Optional[str] = None
    ctx_size: int = 4096
    batch_size: int = 2048
    ubatch_size: int = 512
    n_predict: int = -1
    cache_type_k: str = "f16"
    cache_type_v: str = "f16"
    flash_attn: str = "auto"
    swa_full: bool = False
    threads: Optional[int] = None
    keep: Optional[int] = None
    context_shift: bool = True
    temp: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    seed: Optional[int] = None
    ignore_eos: bool = False
    system_prompt: Optional[str] = None
    chat_template_file: Optional[Path] = None
    session: Optional[Path] = None
    show_timings: bool = False
    verbose_prompt: bool = False
    markdown: bool = False

    def sampling(self) -> SamplingParams:
        return SamplingParams(temp=self.temp, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p,
                              repeat_penalty=self.repeat_penalty,
                              repeat_last_n=self.repeat_last_n, seed=self.seed)


_D = ChatSettings()

# (field, type, spellings, help, panel, extra typer.Option kwargs)
OPTIONS = [
    ("model", Optional[str], ("-m", "--model"),
     "model: a short name (smollm2, gemma3; fetched on first use) or a .gguf path",
     PANEL_MODEL, {"show_default": "smollm2"}),
    ("chat_template_file", Optional[Path], ("--chat-template-file",),
     "Jinja chat template to use instead of the model's", PANEL_MODEL, {}),
    ("threads", Optional[int], ("-t", "--threads"),
     "CPU threads for the kernels", PANEL_MODEL, {"min": 1, "show_default": "all cores"}),
    ("ctx_size", int, ("-c", "--ctx-size"),
     "context size in tokens (0 = the model's training length; padded up to 256)", PANEL_CONTEXT,
     {"min": 0}),
    ("batch_size", int, ("-b", "--batch-size"), "most tokens per decode call", PANEL_CONTEXT, {"min": 1}),
    ("ubatch_size", int, ("-ub", "--ubatch-size"), "most tokens per forward pass", PANEL_CONTEXT,
     {"min": 1}),
    ("cache_type_k", str, ("-ctk", "--cache-type-k"),
     "K cache type: f32, f16, bf16, q8_0, q4_0, q4_1, iq4_nl, q5_0, q5_1", PANEL_CONTEXT, {}),
    ("cache_type_v", str, ("-ctv", "--cache-type-v"),
     "V cache type (quantized types need flash attention)", PANEL_CONTEXT, {}),
    ("flash_attn", FlashAttn, ("-fa", "--flash-attn"), "flash attention", PANEL_CONTEXT,
     {"case_sensitive": False}),
    ("swa_full", bool, ("--swa-full",),
     "full-size cache for sliding-window layers (lets iSWA models context-shift)", PANEL_CONTEXT, {}),
    ("keep", Optional[int], ("--keep",),
     "tokens kept at the start when the context shifts (-1 = the whole first prompt)",
     PANEL_CONTEXT, {"min": -1, "show_default": "the system prompt"}),
    ("context_shift", bool, ("--context-shift/--no-context-shift",),
     "when the context is full: drop half of the older tokens and go on (or stop the answer)",
     PANEL_CONTEXT, {}),
    ("n_predict", int, ("-n", "--n-predict"), "most tokens per answer (-1 = until end of turn)",
     PANEL_SAMPLING, {"min": -1}),
    ("temp", float, ("--temp",), "temperature (0 = greedy)", PANEL_SAMPLING, {"min": 0.0}),
    ("top_k", int, ("--top-k",), "keep the k most likely tokens (0 = off)", PANEL_SAMPLING, {"min": 0}),
    ("top_p", float, ("--top-p",), "nucleus: smallest set with this probability mass (1 = off)",
     PANEL_SAMPLING, {"min": 0.0, "max": 1.0}),
    ("min_p", float, ("--min-p",), "drop tokens below this fraction of the best one (0 = off)",
     PANEL_SAMPLING, {"min": 0.0, "max": 1.0}),
    ("repeat_penalty", float, ("--repeat-penalty",), "penalty for recently seen tokens (1 = off)",
     PANEL_SAMPLING, {"min": 0.0}),
    ("repeat_last_n", int, ("--repeat-last-n",), "how many recent tokens the penalty looks at "
     "(0 = off, -1 = context)", PANEL_SAMPLING, {"min": -1}),
    ("seed", Optional[int], ("-s", "--seed"), "random seed", PANEL_SAMPLING,
     {"min": 0, "show_default": "random"}),
    ("ignore_eos", bool, ("--ignore-eos",), "keep generating past end-of-turn tokens", PANEL_SAMPLING, {}),
    ("system_prompt", Optional[str], ("-sys", "--system-prompt"),
     "system prompt", PANEL_CHAT, {"show_default": "the model's default, if any"}),
    ("session", Optional[Path], ("--session",),
     "resume from FILE if it exists, save to it after every turn", PANEL_CHAT, {}),
    ("show_timings", bool, ("--show-timings",), "print prompt and generation speeds after each answer",
     PANEL_OUTPUT, {}),
    ("verbose_prompt", bool, ("--verbose-prompt",), "print the prompt tokens before decoding them",
     PANEL_OUTPUT, {}),
    ("markdown", bool, ("--markdown",), "render the answer as Markdown when it is complete",
     PANEL_OUTPUT, {}),
]

assert {o[0] for o in OPTIONS} == {f.name for f in fields(ChatSettings)}


def _parameter(name, typ, decls, help_, panel, extra) -> inspect.Parameter:
    default = getattr(_D, name)
    if typ is FlashAttn:
        default = FlashAttn(default)
    extra = {"show_default": default is not None, **extra}
    option = typer.Option(*decls, help=help_, rich_help_panel=panel, **extra)
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default,
                             annotation=Annotated[typ, option])


def with_settings(func):
    """Give a typer command every shared flag; it receives them as `settings: ChatSettings`."""
    own = [p for p in inspect.signature(func, eval_str=True).parameters.values() if p.name != "settings"]
    shared = [_parameter(*o) for o in OPTIONS]
    names = [o[0] for o in OPTIONS]

    @functools.wraps(func)
    def command(**kwargs):
        values = {n: kwargs.pop(n) for n in names}
        if isinstance(values["flash_attn"], FlashAttn):
            values["flash_attn"] = values["flash_attn"].value
        return func(settings=ChatSettings(**values), **kwargs)

    del command.__wrapped__  # typer must see the new signature, not the wrapped one
    params = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own] + shared
    command.__signature__ = inspect.Signature(params)
    command.__annotations__ = {p.name: p.annotation for p in params}
    return command
