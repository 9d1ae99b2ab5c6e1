"""`kvchat chat`, the interactive default: the REPL (cli/repl.py) on a Conversation."""
from __future__ import annotations

import typer

from cli.chat_setup import make_conversation, open_engine, should_resume
from cli.options import ChatSettings, with_settings
from cli.render import Renderer


def register(app: typer.Typer) -> None:
    @app.command("chat")
    @with_settings
    def chat(settings: ChatSettings = None):
        """Chat with a model in the terminal (the default command). /help inside lists commands."""
        import atexit
        import threading
        from cli.repl import Repl
        from cli.session_file import AutosaveTarget
        target = AutosaveTarget(settings.session)  # locked for the process's life (or refused)
        atexit.register(target.release)
        renderer = Renderer(markdown=settings.markdown)
        stop = threading.Event()
        engine = open_engine(settings, renderer, stop)
        conv = make_conversation(engine, settings, renderer, stop)
        repl = Repl(engine, conv, settings, renderer, target=target)
        if should_resume(settings, renderer):
            repl.resume(settings.session)  # SessionError → exit 1, file untouched
        repl.run()
