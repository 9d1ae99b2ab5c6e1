"""The interactive chat loop: prompt_toolkit input, streamed answers, slash commands.

Input: persistent history (KVCHAT_CACHE/history), Alt-Enter for a new line, or a block between
lines of triple quotes. Ctrl-C while typing clears the line, on an empty line it leaves (as do
Ctrl-D and /exit). Ctrl-C while an answer streams stops it at the next token: the partial answer
stays in the conversation and the cache holds exactly what was decoded.
"""
from __future__ import annotations

import difflib
import os
import shlex
import sys
from pathlib import Path

from cli.chat_setup import apply_saved_sampling, sigint_sets
from cli.options import CONVERSATION, LIVE, LIVE_BY_KEY, OUTPUT, SAMPLING, parse_value
from cli.wording import error_text, stop_text
from runtime.generate import Interrupted
from runtime.errors import KvchatError
from runtime.sampling import Sampler, SamplingParams

TRIPLE = '"""'

COMMANDS = {
    "/help": "this list",
    "/exit": "leave (also /quit, Ctrl-D, Ctrl-C on an empty line)",
    "/clear": "new conversation: messages and cache emptied (the system prompt stays)",
    "/regen": "drop the last answer and sample a new one (no prompt re-evaluation)",
    "/undo": "drop the last exchange (your message and its answer)",
    "/system": "/system TEXT sets the system prompt; /system alone shows it; /system - removes it",
    "/set": f"/set PARAM VALUE ({', '.join(o.key for o in LIVE)}); /set alone lists",
    "/save": "/save FILE: save the conversation and its cache state",
    "/load": "/load FILE: resume a saved conversation (no tokens re-processed)",
    "/stats": "tokens and speeds of the last turn, context use",
    "/mem": "memory: weights, KV cache per layer kind and type, outputs",
    "/kv": "map of the KV cache cells: sequence and position of each cell, empty cells, head",
}
ALIASES = {"/quit": "/exit", "/q": "/exit", "/?": "/help"}

def history_path() -> Path:
    from cli.models import cache_dir
    return cache_dir() / "history"


def _read_stdin_line(prompt: str) -> str:
    line = sys.stdin.readline()
    if not line:
        raise EOFError
    return line.rstrip("\n")


class Repl:
    def __init__(self, engine, conv, settings, renderer, session_factory=None):
        self.engine = engine
        self.conv = conv
        self.settings = settings
        self.r = renderer
        self._session_factory = session_factory
        self._prompt = None
        self.running = True

    # ---- input ------------------------------------------------------------------------------

    def toolbar(self) -> str:
        c = self.engine.cache
        shift = "" if self.conv.config.context_shift else " · no shift"
        return (f" ctx {self.conv.n_cached}/{self.conv.n_ctx} · {c['type_k']}/{c['type_v']}"
                f"{shift} · {self.engine.identity['file']} · /help ")

    def _make_prompt(self):
        from prompt_toolkit import PromptSession
        from prompt_toolkit.history import FileHistory, InMemoryHistory
        from prompt_toolkit.key_binding import KeyBindings

        kb = KeyBindings()

        @kb.add("escape", "enter")  # Alt-Enter: a new line inside the message
        def _newline(event):
            event.current_buffer.insert_text("\n")

        @kb.add("c-c")
        def _ctrl_c(event):
            buf = event.current_buffer
            if buf.text:
                buf.reset()
            else:
                event.app.exit(exception=EOFError())

        try:
            path = history_path()
            path.parent.mkdir(parents=True, exist_ok=True)
            history = FileHistory(str(path))
        except OSError:
            history = InMemoryHistory()
        return PromptSession(history=history, key_bindings=kb, bottom_toolbar=self.toolbar,
                             enable_history_search=False)

    def read(self) -> str | None:
        """One message (None at end of input). A line starting with \"\"\" opens a block."""
        if self._session_factory is not None:
            read_line = self._session_factory
        elif not sys.stdin.isatty():  # piped input: one message per line, no line editor
            read_line = _read_stdin_line
        else:
            if self._prompt is None:
                self._prompt = self._make_prompt()
            read_line = self._prompt.prompt
        try:
            line = read_line("> ")
        except EOFError:
            return None
        if not line.lstrip().startswith(TRIPLE):
            return line
        body = line.lstrip()[len(TRIPLE):]
        if body.rstrip().endswith(TRIPLE) and body.strip():
            return body.rstrip()[:-len(TRIPLE)]
        lines = [body] if body else []
        while True:
            try:
                more = read_line("... ")
            except EOFError:
                return "\n".join(lines)
            if more.rstrip().endswith(TRIPLE):
                lines.append(more.rstrip()[:-len(TRIPLE)])
                return "\n".join(x for x in lines).rstrip("\n") if lines else ""
            lines.append(more)

    # ---- loop -------------------------------------------------------------------------------

    def banner(self) -> None:
        e, c = self.engine, self.engine.cache
        fa = "on" if c["flash_attn"] else "off"
        self.r.notice(f"kvchat · {e.identity['file']} · ctx {self.conv.n_ctx} · K {c['type_k']} "
                      f"V {c['type_v']} · flash-attn {fa} · seed {self.conv.sampler.seed}")
        self.r.notice('/help for commands · Alt-Enter or """ for several lines · Ctrl-C stops an answer')

    def run(self) -> None:
        self.banner()
        while self.running:
            text = self.read()
            if text is None:
                break
            if not text.strip():
                continue
            try:
                if text.startswith("/"):
                    self.command(text)
                else:
                    self.turn(lambda on_text: self.conv.ask(text, on_text=on_text))
            except KvchatError as e:  # SessionError included: the conversation is unchanged
                self.r.error(error_text(e, in_chat=True))
            except KeyboardInterrupt:  # a second Ctrl-C, or one during a slash command
                self.conv.repair()
                self.r.notice("interrupted")
        self.autosave()

    def turn(self, start) -> None:
        """Run one answer (ask or regen) with Ctrl-C stopping it; report, autosave."""
        self.r.begin_answer()
        try:
            with sigint_sets(self.conv.stop_event):
                stats = start(self.r.piece)
        except Interrupted:
            self.r.end_answer()
            self.r.notice("stopped while reading the prompt: nothing was answered")
            return
        except BaseException:
            self.r.end_answer()
            raise
        self.r.end_answer()
        line = stop_text(stats, self.conv.config.n_predict)
        if line:
            self.r.notice(line)
        if self.settings.show_timings:
            self.r.timings(stats)
        self.autosave()

    def autosave(self) -> None:
        path = self.settings.session
        if path is None or not self.conv.messages:
            return
        from cli.session import save_conversation
        try:
            save_conversation(path, self.conv, self.engine.identity, self.engine.cache)
        except KvchatError as e:
            self.r.error(str(e))

    def resume(self, path) -> None:
        """Load a session at startup; SessionError propagates (the program exits, file untouched)."""
        from cli.session import load_conversation
        data = load_conversation(path, self.conv, self.engine.identity, self.engine.cache,
                                 self.engine.vocab.n_vocab)
        apply_saved_sampling(self.conv, data.sampling, self.settings)
        self.r.notice(f"resumed {path}: {self.conv.n_cached} tokens in the cache, "
                      f"{len(self.conv.messages)} messages (nothing re-processed)")

    # ---- slash commands ---------------------------------------------------------------------

    def command(self, text: str) -> None:
        name, _, arg = text.strip().partition(" ")
        name = ALIASES.get(name.lower(), name.lower())
        arg = arg.strip()
        handler = getattr(self, "cmd_" + name[1:], None) if name in COMMANDS else None
        if handler is None:
            close = difflib.get_close_matches(name, list(COMMANDS) + list(ALIASES), n=1)
            hint = f" — did you mean {close[0]}?" if close else ""
            self.r.warn(f"unknown command {name}{hint} (/help lists the commands)")
            return
        handler(arg)

    def cmd_help(self, arg: str) -> None:
        from rich.table import Table
        t = Table(show_header=False, box=None, pad_edge=False)
        for name, what in COMMANDS.items():
            t.add_row(name, what)
        self.r.err.print(t)

    def cmd_exit(self, arg: str) -> None:
        self.running = False

    def cmd_clear(self, arg: str) -> None:
        self.conv.clear()
        self.r.notice("new conversation (cache emptied)")

    def cmd_regen(self, arg: str) -> None:
        self.turn(lambda on_text: self.conv.regenerate(on_text=on_text))

    def cmd_undo(self, arg: str) -> None:
        n = self.conv.undo()
        self.r.notice(f"removed the last exchange ({n} messages); ctx {self.conv.n_cached}/{self.conv.n_ctx}")

    def cmd_system(self, arg: str) -> None:
        if not arg:
            self.r.notice(f"system prompt: {self.conv.system_prompt!r}" if self.conv.system_prompt
                          else "no system prompt (the template's default applies, if it has one)")
            return
        self.conv.set_system(None if arg == "-" else arg)
        self.r.notice("system prompt removed" if arg == "-" else "system prompt set (applies from the next turn)")

    def cmd_set(self, arg: str) -> None:
        """/set PARAM VALUE: the flags marked live in cli/options.py, checked as the flags are."""
        if not arg:
            self.r.notice(" · ".join(f"{o.key} {self._current(o)}" for o in LIVE))
            return
        try:
            key, value = shlex.split(arg)
        except ValueError:
            raise KvchatError("usage: /set PARAM VALUE (/set alone lists the parameters)") from None
        key = key.lower().replace("_", "-")
        option = LIVE_BY_KEY.get(key)
        if option is None:
            close = difflib.get_close_matches(key, list(LIVE_BY_KEY), n=1)
            hint = f" — did you mean {close[0]}?" if close else ""
            raise KvchatError(f"unknown parameter '{key}'{hint}")
        try:
            self._apply(option, parse_value(option, value))
        except ValueError as e:
            raise KvchatError(f"/set {key}: {e}") from None
        self.r.notice(f"{key} = {value}")

    def _current(self, option):
        conv = self.conv
        if option.live == SAMPLING:
            return conv.sampler.seed if option.name == "seed" else getattr(conv.sampler.params, option.name)
        if option.live == CONVERSATION:
            return getattr(conv.config, option.name)
        return getattr(self.r, option.name, getattr(self.settings, option.name))

    def _apply(self, option, value) -> None:
        conv = self.conv
        if option.live == SAMPLING:
            p = conv.sampler.params
            sampler = Sampler(SamplingParams.from_dict(p.to_dict() | {option.name: value}))
            if option.name != "seed":  # the random stream goes on; /set seed restarts it
                sampler.rng, sampler.seed = conv.sampler.rng, conv.sampler.seed
                sampler.params.seed = p.seed
            conv.sampler = sampler
        elif option.live == CONVERSATION:
            setattr(conv.config, option.name, value)
        elif option.live == OUTPUT:
            setattr(self.settings, option.name, value)
            if hasattr(self.r, option.name):
                setattr(self.r, option.name, value)

    def cmd_save(self, arg: str) -> None:
        if not arg:
            raise KvchatError("usage: /save FILE")
        from cli.session import save_conversation
        path = Path(os.path.expanduser(arg))
        size = save_conversation(path, self.conv, self.engine.identity, self.engine.cache)
        self.r.notice(f"saved {len(self.conv.messages)} messages, {self.conv.n_cached} cached tokens "
                      f"to {path} ({size / 1024:.0f} KiB)")

    def cmd_load(self, arg: str) -> None:
        if not arg:
            raise KvchatError("usage: /load FILE")
        from cli.session import load_conversation
        path = Path(os.path.expanduser(arg))
        data = load_conversation(path, self.conv, self.engine.identity, self.engine.cache,
                                 self.engine.vocab.n_vocab)
        apply_saved_sampling(self.conv, data.sampling, None)
        self.r.notice(f"loaded {path}: {len(self.conv.messages)} messages, {self.conv.n_cached} "
                      "cached tokens (nothing re-processed)")

    def cmd_stats(self, arg: str) -> None:
        self.r.stats(self.conv)

    def cmd_mem(self, arg: str) -> None:
        model = self.engine.model
        self.r.memory(self.engine.ctx.memory_breakdown(), getattr(model, "size_bytes", None))

    def cmd_kv(self, arg: str) -> None:
        self.r.kv_map(self.engine.ctx.memory)
