"""`kvchat chat` (the interactive default) and `kvchat run` (one-shot), on one shared setup.

Setup = resolve the model name, load it, make a Context from the flags, warm the kernels up
(numba compiles them on first use; the spinner says so), pick the chat template and build a
Conversation. `run` then answers one prompt, streaming only the answer to stdout.
"""
from __future__ import annotations

import signal
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Optional

import typer

from cli.options import ChatSettings, with_settings
from cli.render import Renderer
from cli.wording import event_text
from runtime.conversation import Conversation, ConversationConfig, Interrupted, StopReason
from runtime.errors import KvchatError
from runtime.sampling import Sampler, SamplingParams


@dataclass
class Engine:
    model: object
    ctx: object
    template: object          # ChatTemplate, or None when the model has none and none was given
    has_template: bool        # the model (or --chat-template-file) provides one
    identity: dict            # session.model_identity
    cache: dict               # session.cache_config

    @property
    def vocab(self):
        return self.model.vocab


def open_engine(settings: ChatSettings, renderer: Renderer, stop_event, n_seq_max: int = 1,
                kv_unified: bool = True) -> Engine:
    """Model + Context + template from the flags; KvchatError (one line) for bad input."""
    from cli.models import resolve_model
    from cli.session import cache_config, model_identity
    from runtime.text.chat_template import ChatTemplate
    from runtime.context import Context
    from runtime.cparams import ContextParams
    from runtime.model import Model

    path = resolve_model(settings.model, renderer.err)
    with renderer.spinner(f"loading {Path(path).name}"):
        model = Model.load(path)
    params = ContextParams(n_ctx=settings.ctx_size, n_batch=settings.batch_size,
                           n_ubatch=settings.ubatch_size, type_k=settings.cache_type_k,
                           type_v=settings.cache_type_v, flash_attn=settings.flash_attn,
                           swa_full=settings.swa_full, n_threads=settings.threads,
                           n_seq_max=n_seq_max, kv_unified=kv_unified)
    ctx = Context(model, params, abort_callback=stop_event.is_set)
    for w in getattr(ctx.cparams, "warnings", []):
        renderer.warn(w)
    with renderer.spinner("compiling kernels (first use only; cached afterwards)"):
        from runtime.generate import warm_up
        bos = getattr(model.vocab, "bos", None)
        warm_up(ctx, bos if bos is not None and bos >= 0 else 0)
    if settings.chat_template_file is not None:
        template, has = ChatTemplate.from_file(settings.chat_template_file, model.vocab), True
    else:
        has = isinstance(model.gguf.get("tokenizer.chat_template"), str)
        template = ChatTemplate.from_gguf(model.gguf, model.vocab)
    identity = model_identity(path, getattr(model.gguf, "data_offset", None))
    return Engine(model, ctx, template, has, identity, cache_config(ctx.cparams))


def make_conversation(engine: Engine, settings: ChatSettings, renderer: Renderer, stop_event,
                      raw: bool = False) -> Conversation:
    config = ConversationConfig(n_predict=settings.n_predict, context_shift=settings.context_shift,
                                keep=settings.keep, ignore_eos=settings.ignore_eos, raw=raw,
                                system_prompt=None if raw else settings.system_prompt)
    try:
        sampler = Sampler(settings.sampling())
    except ValueError as e:
        raise KvchatError(str(e)) from None
    conv = Conversation(engine.ctx, engine.vocab, None if raw else engine.template, sampler, config,
                        notify=lambda event: renderer.notice(event_text(event)),
                        stop_event=stop_event)
    if settings.verbose_prompt:
        conv.on_prompt = lambda ids: renderer.verbose_prompt(engine.vocab, ids)
    return conv


@contextmanager
def sigint_sets(event):
    """While generating, Ctrl-C sets `event` (stop at the next token) instead of raising."""
    if not hasattr(signal, "SIGINT"):
        yield
        return
    previous = signal.getsignal(signal.SIGINT)

    def handler(signum, frame):
        if event.is_set():  # a second Ctrl-C while stopping: give up the normal way
            raise KeyboardInterrupt
        event.set()

    try:
        signal.signal(signal.SIGINT, handler)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def read_prompt(prompt: str | None, file: Path | None) -> str:
    if prompt is not None and file is not None:
        raise KvchatError("give the prompt with -p or -f, not both")
    if prompt is not None:
        return prompt
    if file is not None:
        try:
            return Path(file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise KvchatError(f"cannot read prompt file {file}: {getattr(e, 'strerror', None) or e}") from None
    if sys.stdin is None or sys.stdin.isatty():
        raise KvchatError("no prompt: give -p TEXT, -f FILE, or pipe it on stdin")
    return sys.stdin.read()


def apply_saved_sampling(conv: Conversation, saved: dict, settings: ChatSettings | None) -> None:
    """Sampling settings from a session, except those given explicitly on the command line."""
    defaults = ChatSettings()
    merged = conv.sampler.params.to_dict()
    for key, value in SamplingParams.from_dict(saved).to_dict().items():
        if settings is None or getattr(settings, key) == getattr(defaults, key):
            merged[key] = value
    try:
        conv.sampler = Sampler(SamplingParams.from_dict(merged))
    except ValueError as e:
        raise KvchatError(f"session sampling settings: {e}") from None


def hold_session_lock(path):
    """Lock a --session file for this process's life (None without one); SessionError naming
    the process that holds it, so two processes never save over each other's turns."""
    if path is None:
        return None
    import atexit
    from cli.session_file import SessionLock
    lock = SessionLock(path).acquire()
    atexit.register(lock.release)  # removes the lock file; the kernel drops the lock anyway
    return lock


def register(app: typer.Typer) -> None:
    @app.command("chat")
    @with_settings
    def chat(settings: ChatSettings = None):
        """Chat with a model in the terminal (the default command). /help inside lists commands."""
        from cli.repl import Repl
        import threading
        lock = hold_session_lock(settings.session)  # noqa: F841 (held until the process ends)
        renderer = Renderer(markdown=settings.markdown)
        stop = threading.Event()
        engine = open_engine(settings, renderer, stop)
        conv = make_conversation(engine, settings, renderer, stop)
        repl = Repl(engine, conv, settings, renderer)
        if settings.session is not None and settings.session.exists():
            repl.resume(settings.session)  # SessionError → exit 1, file untouched
        repl.run()

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
        if settings.session is not None and settings.session.exists():
            # a follow-up in a saved conversation: SessionError -> exit 1, file untouched
            from cli.session import load_conversation
            data = load_conversation(settings.session, conv, engine.identity, engine.cache,
                                     engine.vocab.n_vocab)
            apply_saved_sampling(conv, data.sampling, settings)
            renderer.notice(f"resumed {settings.session}: {conv.n_cached} tokens in the cache")
        renderer.begin_answer()
        try:
            with sigint_sets(stop):
                stats = conv.ask(text, on_text=renderer.piece)
        except Interrupted:  # Ctrl-C while the prompt was being evaluated
            renderer.end_answer()
            renderer.notice("interrupted")
            raise typer.Exit(130)
        renderer.end_answer()
        if settings.session is not None:
            from cli.session import save_conversation
            save_conversation(settings.session, conv, engine.identity, engine.cache)
        if settings.show_timings:
            renderer.timings(stats)
        if stats.stop == StopReason.INTERRUPTED:
            raise typer.Exit(130)
