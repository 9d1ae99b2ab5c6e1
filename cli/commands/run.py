"""`kvchat run`: answer one prompt (-p, -f or stdin) and exit; only the answer goes to stdout.

With --session FILE it resumes the saved conversation (only the new prompt is decoded) and saves
the extended one. Exit code 130 when Ctrl-C stopped the answer or the prompt evaluation.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

from kvchat.cli.chat.render import Renderer
from kvchat.cli.chat.setup import (
    apply_saved_sampling,
    hold_session_lock,
    make_conversation,
    open_engine,
    should_resume,
    sigint_sets,
)
from kvchat.cli.options import ChatSettings, Option
from kvchat.runtime.chat.conversation import Interrupted, StopReason
from kvchat.runtime.errors import KvchatError
from kvchat.runtime.text.utf8 import decode_bytes, read_stream

INPUT, PARALLEL, PROMPT_CACHE = "Input", "Parallel", "Prompt cache"

# run's own flags (the shared ones are cli/options.py's OPTIONS); typer's `min` is in `extra` so
# that a refusal keeps typer's wording
RUN_OPTIONS = [
    Option("prompt", Optional[str], ("-p", "--prompt"), "the prompt text", INPUT),
    Option("file", Optional[Path], ("-f", "--file"), "read the prompt from FILE", INPUT),
    Option("raw", bool, ("--raw",), "plain completion: no chat template", INPUT, default=False),
    Option(
        "show_reasoning",
        bool,
        ("--show-reasoning",),
        "a thinking model's thinking goes to stderr (stdout gets only the answer)",
        "Reasoning",
        default=False,
    ),
    Option(
        "parallel",
        int,
        ("-np", "--parallel"),
        "N answers of the prompt (seeds S..S+N-1), or N prompts of --prompts-file at a time",
        PARALLEL,
        extra={"min": 1},
        default=1,
    ),
    Option(
        "prompts_file",
        Optional[Path],
        ("--prompts-file",),
        "answer every prompt of FILE (one per line, or .jsonl with prompt/messages)",
        PARALLEL,
    ),
    Option("jsonl", bool, ("--jsonl",), "one JSON object per answer on stdout", PARALLEL, default=False),
    Option(
        "kv_unified",
        bool,
        ("-kvu/-no-kvu", "--kv-unified/--no-kv-unified"),
        "one cell pool for all sequences (else one stream of n_ctx/N cells each)",
        PARALLEL,
        default=True,
    ),
    Option(
        "prompt_cache",
        Optional[Path],
        ("--prompt-cache",),
        "directory of the persistent prefix cache",
        PROMPT_CACHE,
        extra={"show_default": "<cache dir>/prompt-cache"},
    ),
    Option(
        "no_prompt_cache",
        bool,
        ("--no-prompt-cache",),
        "neither read nor write the prefix cache",
        PROMPT_CACHE,
        default=False,
    ),
    Option(
        "prompt_cache_max",
        int,
        ("--prompt-cache-max",),
        "size limit of the prefix cache in MiB (least recently used entries go first)",
        PROMPT_CACHE,
        extra={"min": 1},
        default=2048,
    ),
]


def read_prompt(prompt: str | None, file: Path | None) -> str:
    if prompt is not None and file is not None:
        raise KvchatError("give the prompt with -p or -f, not both")
    if prompt is not None:
        return prompt
    if file is not None:
        try:
            return decode_bytes(Path(file).read_bytes())  # bytes that are not UTF-8 -> U+FFFD
        except OSError as e:
            raise KvchatError(f"cannot read prompt file {file}: {e.strerror or e}") from None
    if sys.stdin is None or sys.stdin.isatty():
        raise KvchatError("no prompt: give -p TEXT, -f FILE, or pipe it on stdin")
    return read_stream(sys.stdin)


def register(app) -> None:
    """`run` on the typer app: RUN_OPTIONS, then the shared flags (cli/options.py)."""
    import inspect

    from kvchat.cli.option_params import parameter, with_settings

    def run(settings: ChatSettings = None, **own):
        """Answer one prompt (-p, -f or stdin) and exit; only the answer goes to stdout."""
        return run_command(settings, **own)

    run.__signature__ = inspect.Signature(
        [parameter(o) for o in RUN_OPTIONS] + [inspect.Parameter("settings", inspect.Parameter.KEYWORD_ONLY)]
    )
    app.command("run")(with_settings(run))


def run_command(
    settings: ChatSettings,
    *,
    prompt,
    file,
    raw,
    show_reasoning=False,
    parallel,
    prompts_file,
    jsonl,
    kv_unified,
    prompt_cache,
    no_prompt_cache,
    prompt_cache_max,
):
    """The command itself, from converted flags (typer's, or cli/fast_args.py's for a plain line)."""
    import threading

    from kvchat.cli.commands import run_parallel

    if prompts_file is not None and (prompt is not None or file is not None):
        raise KvchatError("give either --prompts-file or a prompt (-p / -f), not both")
    if (parallel > 1 or prompts_file is not None) and (settings.spec_type or settings.model_draft):
        raise KvchatError("speculative decoding works with one answer; drop -np / --prompts-file or the draft flags")
    if (parallel > 1 or prompts_file is not None or jsonl) and settings.session is not None:
        raise KvchatError("--session works with one answer; drop -np / --prompts-file / --jsonl")
    text = read_prompt(prompt, file) if prompts_file is None else None
    spec = settings.grammar_spec()  # a bad schema or grammar: exit 2 before the model loads
    lock = hold_session_lock(settings.session)  # noqa: F841 (held until the process ends)
    renderer = Renderer(markdown=settings.markdown)
    stop = threading.Event()
    renderer.on_out_lost = stop.set  # nobody reads the answer any more: stop generating it
    engine = open_engine(
        settings,
        renderer,
        stop,
        n_seq_max=run_parallel.n_seq_max_for(parallel, prompts_file),
        kv_unified=kv_unified,
        skip_cached_warm_up=True,
    )
    raw = raw or not engine.has_template
    conv = make_conversation(engine, settings, renderer, stop, raw=raw, grammar=spec)
    if show_reasoning:
        from kvchat.cli.chat.thinking import ThinkingView

        renderer.thinking_view = ThinkingView(renderer, stream=sys.stderr)
        conv.on_thinking = renderer.thinking
    if prompts_file is not None or parallel > 1 or jsonl:
        with sigint_sets(stop):
            if prompts_file is not None:
                run_parallel.run_prompts_file(engine, conv, settings, prompts_file, parallel, jsonl, stop, renderer)
            else:
                run_parallel.run_alternatives(engine, conv, settings, text, parallel, jsonl, stop, renderer)
        engine.kernels_finished(renderer)
        return
    if should_resume(settings, renderer):
        # a follow-up in a saved conversation: SessionError -> exit 1, file untouched
        from kvchat.cli.session.session import load_conversation

        data = load_conversation(settings.session, conv, engine.identity, engine.cache, engine.vocab.n_vocab)
        apply_saved_sampling(conv, data.sampling, settings)
        from kvchat.cli.session.session import apply_saved_reasoning

        apply_saved_reasoning([conv], data.extra, settings)
        renderer.notice(f"resumed {settings.session}: {conv.n_cached} tokens in the cache")
    renderer.begin_answer()
    try:
        with sigint_sets(stop):
            if not no_prompt_cache:
                from kvchat.cli.commands import run_prompt_cache

                run_prompt_cache.warm(engine, conv, text, prompt_cache, prompt_cache_max, renderer)
            stats = conv.ask(text, on_text=renderer.piece)
    except Interrupted:  # Ctrl-C while the prompt was being evaluated
        renderer.end_answer()
        renderer.notice("interrupted")
        raise SystemExit(130)
    renderer.end_answer()
    if settings.session is not None:
        from kvchat.cli.session.session import save_conversation

        save_conversation(settings.session, conv, engine.identity, engine.cache, force=settings.force)
    if not renderer.out_lost and stats.stop != StopReason.INTERRUPTED:
        engine.kernels_finished(renderer)  # a first run: the parallel twins, so the next run is warm
    if settings.show_timings:
        renderer.timings(stats)
    if renderer.out_lost:
        saved = f"; the conversation is saved in {settings.session}" if settings.session else ""
        raise KvchatError(f"stdout is closed, so the answer could not be printed in full{saved}")
    if stats.stop == StopReason.INTERRUPTED:
        raise SystemExit(130)
