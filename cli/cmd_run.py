"""`kvchat run`: answer one prompt (-p, -f or stdin) and exit; only the answer goes to stdout.

With --session FILE it resumes the saved conversation (only the new prompt is decoded) and saves
the extended one. Exit code 130 when Ctrl-C stopped the answer or the prompt evaluation.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from cli.chat_setup import (apply_saved_sampling, hold_session_lock, make_conversation, open_engine,
                            should_resume, sigint_sets)
from cli.options import ChatSettings, with_settings
from cli.render import Renderer
from runtime.conversation import Interrupted, StopReason
from runtime.errors import KvchatError
from runtime.text.utf8 import decode_bytes, read_stream


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


def register(app: typer.Typer) -> None:
    @app.command("run")
    @with_settings
    def run(prompt: Annotated[Optional[str], typer.Option("-p", "--prompt", help="the prompt text",
                                                          rich_help_panel="Input")] = None,
            file: Annotated[Optional[Path], typer.Option("-f", "--file", help="read the prompt from FILE",
                                                         rich_help_panel="Input")] = None,
            raw: Annotated[bool, typer.Option("--raw", help="plain completion: no chat template",
                                              rich_help_panel="Input")] = False,
            parallel: Annotated[int, typer.Option("-np", "--parallel", min=1, rich_help_panel="Parallel",
                                                  help="N answers of the prompt (seeds S..S+N-1), or N "
                                                       "prompts of --prompts-file at a time")] = 1,
            prompts_file: Annotated[Optional[Path], typer.Option(
                "--prompts-file", rich_help_panel="Parallel",
                help="answer every prompt of FILE (one per line, or .jsonl with prompt/messages)")] = None,
            jsonl: Annotated[bool, typer.Option("--jsonl", rich_help_panel="Parallel",
                                                help="one JSON object per answer on stdout")] = False,
            kv_unified: Annotated[bool, typer.Option("-kvu/-no-kvu", "--kv-unified/--no-kv-unified",
                                                     rich_help_panel="Parallel",
                                                     help="one cell pool for all sequences (else one "
                                                          "stream of n_ctx/N cells each)")] = True,
            prompt_cache: Annotated[Optional[Path], typer.Option(
                "--prompt-cache", rich_help_panel="Prompt cache", show_default="<cache dir>/prompt-cache",
                help="directory of the persistent prefix cache")] = None,
            no_prompt_cache: Annotated[bool, typer.Option("--no-prompt-cache", rich_help_panel="Prompt cache",
                                                          help="neither read nor write the prefix cache")] = False,
            prompt_cache_max: Annotated[int, typer.Option("--prompt-cache-max", min=1, rich_help_panel="Prompt cache",
                                                          help="size limit of the prefix cache in MiB "
                                                               "(least recently used entries go first)")] = 2048,
            settings: ChatSettings = None):
        """Answer one prompt (-p, -f or stdin) and exit; only the answer goes to stdout."""
        import threading
        from cli import run_parallel
        if prompts_file is not None and (prompt is not None or file is not None):
            raise KvchatError("give either --prompts-file or a prompt (-p / -f), not both")
        if (parallel > 1 or prompts_file is not None or jsonl) and settings.session is not None:
            raise KvchatError("--session works with one answer; drop -np / --prompts-file / --jsonl")
        text = read_prompt(prompt, file) if prompts_file is None else None
        lock = hold_session_lock(settings.session)  # noqa: F841 (held until the process ends)
        renderer = Renderer(markdown=settings.markdown)
        stop = threading.Event()
        renderer.on_out_lost = stop.set  # nobody reads the answer any more: stop generating it
        engine = open_engine(settings, renderer, stop,
                             n_seq_max=run_parallel.n_seq_max_for(parallel, prompts_file),
                             kv_unified=kv_unified)
        raw = raw or not engine.has_template
        conv = make_conversation(engine, settings, renderer, stop, raw=raw)
        if prompts_file is not None or parallel > 1 or jsonl:
            with sigint_sets(stop):
                if prompts_file is not None:
                    run_parallel.run_prompts_file(engine, conv, settings, prompts_file, parallel,
                                                  jsonl, stop, renderer)
                else:
                    run_parallel.run_alternatives(engine, conv, settings, text, parallel, jsonl,
                                                  stop, renderer)
            return
        if should_resume(settings, renderer):
            # a follow-up in a saved conversation: SessionError -> exit 1, file untouched
            from cli.session import load_conversation
            data = load_conversation(settings.session, conv, engine.identity, engine.cache,
                                     engine.vocab.n_vocab)
            apply_saved_sampling(conv, data.sampling, settings)
            renderer.notice(f"resumed {settings.session}: {conv.n_cached} tokens in the cache")
        renderer.begin_answer()
        try:
            with sigint_sets(stop):
                if not no_prompt_cache:
                    from cli import run_prompt_cache
                    run_prompt_cache.warm(engine, conv, text, prompt_cache, prompt_cache_max, renderer)
                stats = conv.ask(text, on_text=renderer.piece)
        except Interrupted:  # Ctrl-C while the prompt was being evaluated
            renderer.end_answer()
            renderer.notice("interrupted")
            raise typer.Exit(130)
        renderer.end_answer()
        if settings.session is not None:
            from cli.session import save_conversation
            save_conversation(settings.session, conv, engine.identity, engine.cache,
                              force=settings.force)
        if settings.show_timings:
            renderer.timings(stats)
        if renderer.out_lost:
            saved = f"; the conversation is saved in {settings.session}" if settings.session else ""
            raise KvchatError(f"stdout is closed, so the answer could not be printed in full{saved}")
        if stats.stop == StopReason.INTERRUPTED:
            raise typer.Exit(130)
