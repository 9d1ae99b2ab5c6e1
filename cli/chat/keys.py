"""Key bindings that keep the chat's line editor alive on odd input.

prompt_toolkit reads `ESC [ ... m` / `ESC [ ... M` as a terminal mouse report. Text a user types
or pastes can look like that (`hello \\x1b[0m world`: an ANSI colour reset copied from a log);
prompt_toolkit's mouse handler then fails to parse it, prints "Unhandled exception in event
loop" and waits for Enter. `safe_mouse_bindings` wraps that handler: a report that does not
parse is inserted as the text it was, and the chat goes on.
"""

from __future__ import annotations

from prompt_toolkit.key_binding import KeyBindings
from prompt_toolkit.key_binding.bindings.mouse import load_mouse_bindings
from prompt_toolkit.keys import Keys


def _default_mouse_handler():
    for b in load_mouse_bindings().bindings:
        if b.keys == (Keys.Vt100MouseEvent,):
            return b.handler
    return None


def safe_mouse_bindings(kb: KeyBindings | None = None) -> KeyBindings:
    """Add (to `kb`, or a new KeyBindings) a Vt100 mouse handler that never raises."""
    kb = kb or KeyBindings()
    default = _default_mouse_handler()

    @kb.add(Keys.Vt100MouseEvent)
    def _mouse(event):
        if default is not None:
            try:
                return default(event)
            except (ValueError, KeyError, IndexError, TypeError):
                pass
        event.current_buffer.insert_text(event.data)  # not a mouse report: it was typed text
        return None

    return kb
