"""The chat's first run: its prompt at once, the model loading on a thread behind it.

On a first run (numba's cache cold, compile workers started: cli/chat/setup.KernelsBehind) the
load itself compiles kernels (the weights' repack) and takes seconds, so the chat does not wait
for it before its prompt: the user types the first message while the model loads and the
workers compile; sending it waits for the load (a progress line, Ctrl-C returns to the prompt
with nothing sent), then the chat starts as usual with that message as its first input, waiting
for the kernels it still lacks (Engine.kernels_ready). What the load would have printed on
stderr (a notice, a warning) is printed when it is done, not over the line being typed.
"""

from __future__ import annotations

import io
import sys
import threading

from kvchat.cli.chat.setup import FIRST_RUN, sigint_raises

EXIT_COMMANDS = {"/exit", "/quit", "/q"}


class LoadBehind:
    """open_engine running on a daemon thread; `wait` joins it (the engine, or its error)."""

    def __init__(self, load):
        """load(renderer) -> Engine, with a renderer whose stderr is kept for later."""
        from rich.console import Console

        from kvchat.cli.chat.render import Renderer

        self._err = io.StringIO()
        self._renderer = Renderer(out=io.StringIO(), err=Console(file=self._err, force_terminal=False))
        self._done = threading.Event()
        self.engine = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(load,), daemon=True, name="model-load")
        self._thread.start()

    def _run(self, load) -> None:
        try:
            self.engine = load(self._renderer)
        except BaseException as e:  # handed to the main thread by wait()
            self._error = e
        finally:
            self._done.set()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, renderer, name: str):
        """The engine once loaded (the load's error raised here); a progress line meanwhile.
        Ctrl-C raises KeyboardInterrupt and leaves the load running (a later call waits again)."""
        if not self._done.is_set():
            with renderer.progress(f"loading {name} ({FIRST_RUN})"), sigint_raises():
                while not self._done.wait(0.1):
                    pass
        held = self._err.getvalue()
        if held:
            sys.stderr.write(held)
            self._err.seek(0)
            self._err.truncate()
        if self._error is not None:
            raise self._error
        return self.engine


class Toolbar:
    """The prompt's bottom line, switched from the loading one to the chat's own (Repl.toolbar)."""

    def __init__(self, text: str):
        self.show = lambda: text

    def __call__(self) -> str:
        return self.show()


def first_message(loading: LoadBehind, renderer, name: str, toolbar: Toolbar, session_factory=None):
    """Read messages until one is sent and the model has loaded: (text, prompt session or None);
    (None, session) when the user leaves first (Ctrl-D, /exit). Ctrl-C while waiting for the
    load: nothing is sent, the prompt comes back."""
    from kvchat.cli.chat.repl import line_reader, read_message

    read_line, session = line_reader(session_factory, None, renderer, toolbar)
    while True:
        text = read_message(read_line, renderer)
        if text is None or text.strip().lower() in EXIT_COMMANDS:
            return None, session
        if not text.strip():
            continue
        try:
            loading.wait(renderer, name)
        except KeyboardInterrupt:
            renderer.notice("interrupted: the model is still loading, nothing was sent")
            continue
        return text, session
