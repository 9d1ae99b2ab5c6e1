"""Every flag kvchat's commands share, declared once, named as llama.cpp names them.

`OPTIONS` is the one table: per flag its `ChatSettings` field, type, spellings, help, --help panel,
the range check, and — for what can change mid-chat — where `/set` applies it. From it:
- `with_settings(...)` (cli/option_params.py) appends the flags to a typer command (all of them
  for chat/run; a subset such as `CACHE_FLAGS` with other defaults for bench, perplexity,
  logprobs) and hands the command one `ChatSettings` instead of thirty arguments;
- the REPL's `/set` (names, parsing, listing) and the `/set` line of `/help` (cli/chat/repl.py).
A value is refused by the same check whether it comes from a flag (usage error, exit 2) or from
`/set` (an error line, the chat goes on): `check_value(option, value)` (the checks themselves:
cli/option_checks.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from enum import Enum
from pathlib import Path
from typing import Any, Callable, Optional

from kvchat.cli.option_checks import above, at_least, one_of, seed_value, spec_type_value, within
from kvchat.runtime.errors import KvchatError
from kvchat.runtime.sampling import SamplingParams
from kvchat.runtime.speculative.speculator import DRAFT_MAX, DRAFT_P_MIN

PANEL_MODEL = "Model"
PANEL_CONTEXT = "Context and KV cache"
PANEL_SAMPLING = "Sampling"
PANEL_CHAT = "Conversation"
PANEL_OUTPUT = "Output"
PANEL_SPEC = "Speculative decoding"
PANEL_FORMAT = "Structured output"
PANEL_REASONING = "Reasoning"


class FlashAttn(str, Enum):
    on = "on"
    off = "off"
    auto = "auto"


@dataclass
class ChatSettings:
    """Everything the shared flags set; the defaults are the flags' defaults."""

    model: Optional[str] = None
    hf_repo: Optional[str] = None
    ctx_size: int = 4096
    batch_size: int = 2048
    ubatch_size: int = 512
    n_predict: int = -1
    cache_type_k: str = "f16"
    cache_type_v: str = "f16"
    flash_attn: str = "auto"
    swa_full: bool = False
    threads: Optional[int] = None
    exact: bool = False
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
    force: bool = False
    show_timings: bool = False
    verbose_prompt: bool = False
    markdown: bool = False
    model_draft: Optional[str] = None
    spec_type: Optional[str] = None
    draft_max: int = DRAFT_MAX
    draft_min: int = 0
    draft_p_min: float = DRAFT_P_MIN
    json_schema: Optional[str] = None
    json_schema_file: Optional[Path] = None
    grammar: Optional[str] = None
    grammar_file: Optional[Path] = None
    json: bool = False
    reasoning: str = "auto"
    reasoning_budget: int = -1
    reasoning_effort: Optional[str] = None

    def grammar_spec(self):
        """The runtime.grammar GrammarSpec the format flags ask for (None: free text), compiled
        and checked: GrammarError (exit 2) before any model loads."""
        from kvchat.runtime.grammar.spec import spec_from_flags

        return spec_from_flags(self.json_schema, self.json_schema_file, self.grammar, self.grammar_file, self.json)

    def sampling(self) -> SamplingParams:
        return SamplingParams(
            temp=self.temp,
            top_k=self.top_k,
            top_p=self.top_p,
            min_p=self.min_p,
            repeat_penalty=self.repeat_penalty,
            repeat_last_n=self.repeat_last_n,
            seed=self.seed,
        )

    def context_params(self, **override):
        """The runtime's ContextParams from the context / cache flags."""
        from kvchat.runtime.cparams import ContextParams

        values = dict(
            n_ctx=self.ctx_size,
            n_batch=self.batch_size,
            n_ubatch=self.ubatch_size,
            type_k=self.cache_type_k,
            type_v=self.cache_type_v,
            flash_attn=self.flash_attn,
            swa_full=self.swa_full,
            n_threads=self.threads,
        )
        return ContextParams(**(values | override))


# ---- the table ------------------------------------------------------------------------------------

SAMPLING, CONVERSATION, OUTPUT, CACHE = "sampling", "conversation", "output", "cache"


@dataclass(frozen=True)
class Option:
    name: str  # the ChatSettings field
    type: Any  # the annotation typer sees
    flags: tuple  # spellings, llama.cpp's first
    help: str
    panel: str
    check: Optional[Callable] = None  # value -> value, ValueError("must be ...")
    live: Optional[str] = None  # what /set changes mid-chat: SAMPLING, CONVERSATION, OUTPUT, CACHE
    extra: dict = field(default_factory=dict)  # more typer.Option keywords
    default: Any = None  # set from ChatSettings below (with_settings may override)

    @property
    def key(self) -> str:
        """The /set name: the long flag without its dashes (`--top-k` -> `top-k`)."""
        long = next(f for f in self.flags if f.startswith("--"))
        return long.split("/")[0][2:]

    @property
    def value_type(self):
        t = self.type
        return {Optional[int]: int, Optional[str]: str, Optional[Path]: Path}.get(t, t)


MODEL_HELP = (
    "model: smollm2 or gemma3 (fetched on first use), hf:owner/repo[:QUANT], ollama:NAME[:TAG] "
    "(used in place from Ollama's store) or a .gguf path"
)
HF_HELP = (
    "GGUF model from the Hugging Face hub, owner/repo[:QUANT] (QUANT default Q4_K_M); downloaded "
    "once, then run offline from the cache"
)

OPTIONS = [
    Option("model", Optional[str], ("-m", "--model"), MODEL_HELP, PANEL_MODEL, extra={"show_default": "smollm2"}),
    Option("hf_repo", Optional[str], ("-hf", "-hfr", "--hf-repo"), HF_HELP, PANEL_MODEL),
    Option(
        "chat_template_file",
        Optional[Path],
        ("--chat-template-file",),
        "Jinja chat template to use instead of the model's",
        PANEL_MODEL,
    ),
    Option(
        "threads",
        Optional[int],
        ("-t", "--threads"),
        "CPU threads for the kernels",
        PANEL_MODEL,
        at_least(1),
        extra={"show_default": "all cores"},
    ),
    Option(
        "exact",
        bool,
        ("--exact",),
        "compute as llama.cpp's CPU build does, float op for float op where kvchat can "
        "(KVCHAT_GGML_ORDER=1: SmolLM2's and Gemma-3's prompt logits bit-identical to llama.cpp's); slower prompts",
        PANEL_MODEL,
    ),
    Option(
        "ctx_size",
        int,
        ("-c", "--ctx-size"),
        "context size in tokens (0 = the model's training length; padded up to 256)",
        PANEL_CONTEXT,
        at_least(0),
    ),
    Option("batch_size", int, ("-b", "--batch-size"), "most tokens per decode call", PANEL_CONTEXT, at_least(1)),
    Option("ubatch_size", int, ("-ub", "--ubatch-size"), "most tokens per forward pass", PANEL_CONTEXT, at_least(1)),
    Option(
        "cache_type_k",
        str,
        ("-ctk", "--cache-type-k"),
        "K cache type: f32, f16, bf16, q8_0, q4_0, q4_1, iq4_nl, q5_0, q5_1",
        PANEL_CONTEXT,
        live=CACHE,
    ),
    Option(
        "cache_type_v",
        str,
        ("-ctv", "--cache-type-v"),
        "V cache type (quantized types need flash attention)",
        PANEL_CONTEXT,
        live=CACHE,
    ),
    Option(
        "flash_attn",
        FlashAttn,
        ("-fa", "--flash-attn"),
        "flash attention",
        PANEL_CONTEXT,
        extra={"case_sensitive": False},
    ),
    Option(
        "swa_full",
        bool,
        ("--swa-full",),
        "full-size cache for sliding-window layers (lets iSWA models context-shift)",
        PANEL_CONTEXT,
    ),
    Option(
        "keep",
        Optional[int],
        ("--keep",),
        "tokens kept at the start when the context shifts (-1 = the whole first prompt)",
        PANEL_CONTEXT,
        at_least(-1),
        CONVERSATION,
        {"show_default": "the system prompt"},
    ),
    Option(
        "context_shift",
        bool,
        ("--context-shift/--no-context-shift",),
        "when the context is full: drop half of the older tokens and go on (or stop the answer)",
        PANEL_CONTEXT,
        live=CONVERSATION,
    ),
    Option(
        "n_predict",
        int,
        ("-n", "--n-predict"),
        "most tokens per answer (-1 = until end of turn)",
        PANEL_SAMPLING,
        at_least(-1),
        CONVERSATION,
    ),
    Option("temp", float, ("--temp",), "temperature (0 = greedy)", PANEL_SAMPLING, at_least(0.0), SAMPLING),
    Option(
        "top_k", int, ("--top-k",), "keep the k most likely tokens (0 = off)", PANEL_SAMPLING, at_least(0), SAMPLING
    ),
    Option(
        "top_p",
        float,
        ("--top-p",),
        "nucleus: smallest set with this probability mass (1 = off)",
        PANEL_SAMPLING,
        within(0.0, 1.0),
        SAMPLING,
    ),
    Option(
        "min_p",
        float,
        ("--min-p",),
        "drop tokens below this fraction of the best one (0 = off)",
        PANEL_SAMPLING,
        within(0.0, 1.0),
        SAMPLING,
    ),
    Option(
        "repeat_penalty",
        float,
        ("--repeat-penalty",),
        "penalty for recently seen tokens (1 = off)",
        PANEL_SAMPLING,
        above(0.0),
        SAMPLING,
    ),
    Option(
        "repeat_last_n",
        int,
        ("--repeat-last-n",),
        "how many recent tokens the penalty looks at (0 = off, -1 = context)",
        PANEL_SAMPLING,
        at_least(-1),
        SAMPLING,
    ),
    Option(
        "seed",
        Optional[int],
        ("-s", "--seed"),
        "random seed (-1 = random)",
        PANEL_SAMPLING,
        seed_value,
        SAMPLING,
        {"show_default": "random"},
    ),
    Option(
        "ignore_eos",
        bool,
        ("--ignore-eos",),
        "keep generating past end-of-turn tokens",
        PANEL_SAMPLING,
        live=CONVERSATION,
    ),
    Option(
        "system_prompt",
        Optional[str],
        ("-sys", "--system-prompt"),
        "system prompt",
        PANEL_CHAT,
        extra={"show_default": "the model's default, if any"},
    ),
    Option(
        "session",
        Optional[Path],
        ("--session",),
        "resume from FILE if it exists, save to it after every turn",
        PANEL_CHAT,
    ),
    Option(
        "force", bool, ("--force",), "let /save and --session replace a file that is not a kvchat session", PANEL_CHAT
    ),
    Option(
        "show_timings",
        bool,
        ("--show-timings",),
        "print prompt and generation speeds after each answer",
        PANEL_OUTPUT,
        live=OUTPUT,
    ),
    Option("verbose_prompt", bool, ("--verbose-prompt",), "print the prompt tokens before decoding them", PANEL_OUTPUT),
    Option(
        "markdown",
        bool,
        ("--markdown",),
        "render the answer as Markdown when it is complete",
        PANEL_OUTPUT,
        live=OUTPUT,
    ),
    Option(
        "model_draft",
        Optional[str],
        ("-md", "--model-draft"),
        "draft model for speculative decoding (same vocabulary; named as -m)",
        PANEL_SPEC,
    ),
    Option(
        "spec_type",
        Optional[str],
        ("--spec-type",),
        "draft source: draft (the -md model), ngram (lookups in the prompt and answer), "
        "self:TYPE (a TYPE copy of the model's weights, e.g. self:q4_0)",
        PANEL_SPEC,
        spec_type_value,
        extra={"show_default": "draft with -md, else off"},
    ),
    Option(
        "draft_max",
        int,
        ("--draft-max", "--spec-draft-n-max"),
        "most draft tokens per verify batch (fewer when drafts are rejected)",
        PANEL_SPEC,
        within(1, 32),
    ),
    Option(
        "draft_min",
        int,
        ("--draft-min", "--spec-draft-n-min"),
        "fewest draft tokens worth a verify batch (below: plain steps)",
        PANEL_SPEC,
        at_least(0),
    ),
    Option(
        "draft_p_min",
        float,
        ("--draft-p-min", "--spec-draft-p-min"),
        "a draft model stops at a token it gives less probability than this (0: never)",
        PANEL_SPEC,
        within(0.0, 1.0),
    ),
    Option(
        "json_schema",
        Optional[str],
        ("-j", "--json-schema"),
        "the answer is one JSON document valid against this JSON schema",
        PANEL_FORMAT,
    ),
    Option("json_schema_file", Optional[Path], ("--json-schema-file",), "the JSON schema from FILE", PANEL_FORMAT),
    Option(
        "grammar",
        Optional[str],
        ("--grammar",),
        "the answer follows this GBNF grammar (llama.cpp's format; Lark too)",
        PANEL_FORMAT,
    ),
    Option("grammar_file", Optional[Path], ("--grammar-file",), "the GBNF grammar from FILE", PANEL_FORMAT),
    Option("json", bool, ("--json",), "the answer is one JSON object (any)", PANEL_FORMAT),
    Option(
        "reasoning",
        str,
        ("--reasoning",),
        "thinking models: think before answering (auto = the chat template's default)",
        PANEL_REASONING,
        one_of("on", "off", "auto"),
        CONVERSATION,
    ),
    Option(
        "reasoning_budget",
        int,
        ("--reasoning-budget",),
        "most thinking tokens per answer, then the end of thinking is forced (-1 = no limit, 0 = no thinking)",
        PANEL_REASONING,
        at_least(-1),
        CONVERSATION,
    ),
    Option(
        "reasoning_effort",
        Optional[str],
        ("--reasoning-effort",),
        "how hard gpt-oss-style templates think",
        PANEL_REASONING,
        one_of("low", "medium", "high"),
        CONVERSATION,
        {"show_default": "the template's"},
    ),
]
OPTIONS = [replace(o, default=getattr(ChatSettings(), o.name)) for o in OPTIONS]
BY_NAME = {o.name: o for o in OPTIONS}
LIVE = [o for o in OPTIONS if o.live]  # what /set can change, in --help order
LIVE_BY_KEY = {o.key: o for o in LIVE}
assert set(BY_NAME) == {f.name for f in fields(ChatSettings)}

# the flags of a command that makes a Context of its own (perplexity, logprobs; bench without -c);
# add "swa_full" where the command passes it on
CACHE_FLAGS = (
    "model",
    "hf_repo",
    "threads",
    "exact",
    "ctx_size",
    "batch_size",
    "ubatch_size",
    "cache_type_k",
    "cache_type_v",
    "flash_attn",
)


def check_value(option: Option, value):
    """The option's range check (ValueError with the reason); returns the normalised value."""
    return option.check(value) if option.check is not None else value


def parse_bool(text: str) -> bool:
    v = text.strip().lower()
    if v in ("on", "true", "1", "yes"):
        return True
    if v in ("off", "false", "0", "no"):
        return False
    raise ValueError(f"expected on or off, got '{text}'")


def parse_value(option: Option, text: str):
    """A /set value: parsed as the flag's type, then range-checked like the flag."""
    t = option.value_type
    if t is bool:
        value = parse_bool(text)
    elif t is int:
        try:
            value = int(text)
        except ValueError:
            raise ValueError(f"expected a whole number, got '{text}'") from None
    elif t is float:
        try:
            value = float(text)
        except ValueError:
            raise ValueError(f"expected a number, got '{text}'") from None
    else:
        value = t(text)
    return check_value(option, value)


def use_ggml_order() -> None:
    """--exact: every op in llama.cpp's float order (kernels/qlayout.py reads KVCHAT_GGML_ORDER when
    the kernels load, which a command does after its flags are parsed)."""
    import os
    import sys

    os.environ["KVCHAT_GGML_ORDER"] = "1"
    loaded = sys.modules.get("kvchat.kernels.qlayout")
    if loaded is not None and loaded.GGML_ORDER_PARTS != loaded.GGML_ORDER_ALL:  # only in a long-lived process
        raise KvchatError("--exact: the kernels are already loaded in this process; give KVCHAT_GGML_ORDER=1 instead")


def settings_from(values: dict, fixed: dict | None = None) -> ChatSettings:
    """ChatSettings from the shared flags' converted values (`fixed`: a command's own defaults
    for flags it does not take): -fa's choice as its text, `-hf X` as `-m hf:X`."""
    values = dict(values)
    if values.get("exact"):
        use_ggml_order()
    if isinstance(values.get("flash_attn"), FlashAttn):
        values["flash_attn"] = values["flash_attn"].value
    if values.get("hf_repo") is not None:  # -hf X is -m hf:X, for every command taking both
        if values.get("model") is not None:
            raise KvchatError(f"give -m {values['model']} or -hf {values['hf_repo']}, not both")
        values["model"] = "hf:" + values["hf_repo"]
    return ChatSettings(**((fixed or {}) | values))
