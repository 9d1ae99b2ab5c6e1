"""The chat's first run reads its first message while the model loads on a thread
(cli/chat/load_behind.py); the cold chat end to end is tests/test_compile_ahead.py."""

import io
import threading

import pytest

from kvchat.cli.chat.load_behind import LoadBehind, Toolbar, first_message
from kvchat.cli.chat.render import Renderer
from kvchat.runtime.errors import KvchatError


def _renderer():
    from rich.console import Console

    err = io.StringIO()
    return Renderer(out=io.StringIO(), err=Console(file=err, force_terminal=False)), err


def test_the_first_message_is_typed_while_the_model_is_still_loading(capsys):
    gate = threading.Event()

    def load(quiet):
        quiet.warn("n_ctx rounded up to 256")  # held while the user types
        assert gate.wait(10)
        return "ENGINE"

    loading = LoadBehind(load)
    seen = []

    def typed(prompt):
        seen.append((prompt, loading.done))
        gate.set()  # the load ends only after the prompt was up
        return "Hello there"

    renderer, _ = _renderer()
    text, session = first_message(loading, renderer, "m.gguf", Toolbar("x"), session_factory=typed)
    assert (text, session, loading.engine) == ("Hello there", None, "ENGINE")
    assert seen == [("> ", False)]
    assert "n_ctx rounded up to 256" in capsys.readouterr().err  # printed once the load was done


def test_leaving_before_the_first_message_does_not_wait_for_the_load():
    gate = threading.Event()
    loading = LoadBehind(lambda quiet: gate.wait(10))
    renderer, _ = _renderer()
    lines = iter(["", "   ", "/exit"])
    text, _ = first_message(loading, renderer, "m.gguf", Toolbar("x"), session_factory=lambda p: next(lines))
    assert text is None and not loading.done  # blank lines are skipped; /exit leaves at once
    gate.set()

    def eof(prompt):
        raise EOFError

    assert first_message(LoadBehind(lambda q: 1), renderer, "m.gguf", Toolbar("x"), session_factory=eof)[0] is None


def test_a_load_that_fails_raises_its_error_when_the_first_message_is_sent():
    def load(quiet):
        raise KvchatError("m.gguf: not a GGUF file")

    loading = LoadBehind(load)
    renderer, _ = _renderer()
    with pytest.raises(KvchatError, match="not a GGUF file"):
        first_message(loading, renderer, "m.gguf", Toolbar("x"), session_factory=lambda p: "hi")


def test_the_toolbar_switches_from_the_loading_line_to_the_chats_own():
    bar = Toolbar(" ctx 0/256 · f16/f16 · m.gguf · loading ")
    assert bar() == " ctx 0/256 · f16/f16 · m.gguf · loading "
    bar.show = lambda: " ctx 12/256 · f16/f16 · m.gguf · /help "
    assert bar() == " ctx 12/256 · f16/f16 · m.gguf · /help "
