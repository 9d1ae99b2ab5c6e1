"""`kvchat chat`, the interactive default: the REPL (cli/chat/repl.py) on a Conversation."""

from __future__ import annotations

from pathlib import Path  # noqa: F401 (typer resolves the annotations)
from typing import Annotated

import typer

from kvchat.cli.chat.render import Renderer
from kvchat.cli.chat.setup import make_conversation, open_engine, should_resume, start_engine
from kvchat.cli.option_params import with_settings
from kvchat.cli.options import ChatSettings


def register(app: typer.Typer) -> None:
    @app.command("chat")
    @with_settings
    def chat(
        parallel: Annotated[
            int,
            typer.Option(
                "-np",
                "--parallel",
                min=0,
                max=64,
                rich_help_panel="Branches",
                help="sequences in the cache: branches plus /alts answers (n_seq_max; 0 = auto: "
                "4 for a KV cache, 1 for recurrent models)",
            ),
        ] = 0,
        kv_unified: Annotated[
            bool,
            typer.Option(
                "-kvu/-no-kvu",
                "--kv-unified/--no-kv-unified",
                rich_help_panel="Branches",
                help="one cell pool for every branch (shared cells), or one stream of n_ctx/N cells each (copies)",
            ),
        ] = True,
        settings: ChatSettings = None,
    ):
        """Chat with a model in the terminal (the default command). /help inside lists commands."""
        import atexit
        import threading

        from kvchat.cli.chat.repl import Repl
        from kvchat.cli.session.file import AutosaveTarget

        spec = settings.grammar_spec()  # a bad schema or grammar: exit 2 before the model loads
        target = AutosaveTarget(settings.session)  # locked for the process's life (or refused)
        atexit.register(target.release)
        renderer = Renderer(markdown=settings.markdown)
        stop = threading.Event()
        start = start_engine(settings, renderer, n_seq_max=parallel, kv_unified=kv_unified)
        resume = should_resume(settings, renderer)

        def load(shown_by: Renderer):
            return open_engine(
                settings, shown_by, stop, n_seq_max=parallel, kv_unified=kv_unified, compile_behind=True, start=start
            )

        first, session, toolbar = None, None, None
        if start.behind is not None and not resume:  # a first run: the prompt now, the load behind it
            from kvchat.cli.chat.load_behind import LoadBehind, Toolbar, first_message

            loading = LoadBehind(load)
            name = start.path.name
            renderer.notice(f"first run: {name} loads and kernels compile behind the prompt; type your message")
            kv = f"{settings.cache_type_k}/{settings.cache_type_v}"
            toolbar = Toolbar(f" ctx 0/{settings.ctx_size or '…'} · {kv} · {name} · loading ")
            first, session = first_message(loading, renderer, name, toolbar)
            if first is None:  # left before the model was needed
                start.behind.close()
                return
            engine = loading.engine
        else:
            engine = load(renderer)
        conv = make_conversation(engine, settings, renderer, stop, grammar=spec)
        conv.on_thinking = renderer.thinking
        repl = Repl(engine, conv, settings, renderer, target=target)
        if session is not None:
            toolbar.show = repl.toolbar
            repl.adopt_prompt(session)
        if resume:
            repl.resume(settings.session)  # SessionError → exit 1, file untouched
        try:
            repl.run(first)
        finally:
            if engine.compiling is not None and engine.compiling.waited:
                engine.kernels_finished(renderer)  # the parallel twins, so the next chat starts warm
            elif engine.compiling is not None:  # left before the kernels were needed
                engine.compiling.close()
