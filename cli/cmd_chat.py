"""`kvchat chat`, the interactive default: the REPL (cli/repl.py) on a Conversation."""
from __future__ import annotations

import typer

from cli.chat_setup import hold_session_lock, make_conversation, open_engine
from cli.options import ChatSettings, with_settings
from cli.render import Renderer


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
