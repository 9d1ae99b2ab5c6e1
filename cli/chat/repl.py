"""The interactive chat loop: prompt_toolkit input, streamed answers, slash commands.

Input: persistent history (KVCHAT_CACHE/history, the newest 1000 entries), Alt-Enter for a new
line, or a block between lines of triple quotes. Ctrl-C while typing clears the line; on an empty
line it only says how to leave (Ctrl-D or /exit): a Ctrl-C pressed twice to stop an answer must
not end the chat. Ctrl-C while an answer streams stops it at the next token: the partial answer
stays in the conversation and the cache holds exactly what was decoded.

With --session the chat saves after every turn to its target file, locked for the process's
life; /load of another file moves the target there (and says so), so the --session file is never
overwritten by a conversation it did not hold. /clear empties the file too.
"""

from __future__ import annotations

import difflib
import os
import shlex
import sys
from pathlib import Path

from kvchat.cli.chat.setup import apply_saved_sampling, sigint_sets
from kvchat.cli.options import CACHE, CONVERSATION, LIVE, LIVE_BY_KEY, OUTPUT, SAMPLING, parse_value
from kvchat.cli.wording import error_text, stop_text
from kvchat.runtime.errors import KvchatError, ModelOutputError
from kvchat.runtime.generate import Interrupted
from kvchat.runtime.sampling import Sampler, SamplingParams

TRIPLE = '"""'

COMMANDS = {
    "/help": "this list",
    "/exit": "leave (also /quit, Ctrl-D)",
    "/clear": "new conversation: messages and cache emptied (the system prompt stays)",
    "/regen": "drop the last answer and sample a new one (no prompt re-evaluation)",
    "/undo": "drop the last exchange (your message and its answer)",
    "/system": "/system TEXT sets the system prompt; /system alone shows it; /system - removes it",
    "/set": f"/set PARAM VALUE ({', '.join(o.key for o in LIVE)}); /set format json|schema FILE|grammar FILE|off; "
    "/set alone lists",
    "/save": "/save FILE: save the conversation and its cache state (/save! FILE replaces a "
    "file that is not a session); quote names with spaces",
    "/load": "/load FILE: resume a saved conversation (no tokens re-processed); with --session, "
    "later turns are saved to FILE",
    "/stats": "tokens and speeds of the last turn, context use",
    "/mem": "memory: weights, KV cache per layer kind and type, outputs",
    "/kv": "map of the KV cache cells: sequence and position of each cell, empty cells, head",
}
from kvchat.cli.chat.branches import BRANCH_COMMANDS, BranchCommands  # noqa: E402
from kvchat.cli.chat.format_commands import FORMAT_COMMANDS, FormatCommands  # noqa: E402

COMMANDS.update(BRANCH_COMMANDS)
DECODING_COMMANDS = {"/alts", "/set", "/load"}  # may run kernels: wait for the compile workers
COMMANDS.update(FORMAT_COMMANDS)
ALIASES = {"/quit": "/exit", "/q": "/exit", "/?": "/help", "/save!": "/save"}
LEAVE_HINT = "(Ctrl-D or /exit leaves the chat)"


def file_argument(arg: str, command: str) -> Path:
    """The one FILE argument of /save or /load, quoted as a shell would ("my talk.kvs"), ~ expanded."""
    try:
        parts = shlex.split(arg)
    except ValueError as e:
        raise KvchatError(f"{command}: {e} (quote a file name with spaces: {command} \"my talk.kvs\")") from None
    if len(parts) != 1:
        what = "a file name" if not parts else "one file name (quote names with spaces)"
        raise KvchatError(f"usage: {command} FILE — give {what}")
    return Path(os.path.expanduser(parts[0]))


def history_path() -> Path:
    from kvchat.cli.sources.models import cache_dir

    return cache_dir() / "history"


def _read_stdin_line(prompt: str) -> str:
    from kvchat.runtime.text.utf8 import read_stream_line

    line = read_stream_line(sys.stdin)  # bad bytes -> U+FFFD, whatever the locale's error mode
    if not line:
        raise EOFError
    return line.rstrip("\n")


def make_prompt_session(renderer, toolbar):
    """The chat's line editor: persistent history, Alt-Enter for a new line, Ctrl-C clears the
    line (on an empty one it says how to leave), toolbar() the bottom line."""
    from prompt_toolkit import PromptSession
    from prompt_toolkit.application import run_in_terminal
    from prompt_toolkit.key_binding import KeyBindings

    from kvchat.cli.chat.history import open_history
    from kvchat.cli.chat.keys import safe_mouse_bindings

    kb = safe_mouse_bindings(KeyBindings())  # pasted "\x1b[0m" is text, not a broken mouse report

    @kb.add("escape", "enter")  # Alt-Enter: a new line inside the message
    def _newline(event):
        event.current_buffer.insert_text("\n")

    @kb.add("c-c")
    def _ctrl_c(event):
        buf = event.current_buffer
        if buf.text:
            buf.reset()
        else:  # never leave on Ctrl-C: the second of two pressed to stop an answer lands here
            run_in_terminal(lambda: renderer.notice(LEAVE_HINT))

    history = open_history(history_path())
    return PromptSession(history=history, key_bindings=kb, bottom_toolbar=toolbar, enable_history_search=False)


def line_reader(session_factory, session, renderer, toolbar):
    """(read_line(prompt), the prompt session or None): the test's session_factory when given,
    plain lines from a piped stdin (no line editor), else the line editor — `session` when one
    is already open, a new one otherwise."""
    if session_factory is not None:
        return session_factory, session
    if not sys.stdin.isatty():
        return _read_stdin_line, session
    session = session or make_prompt_session(renderer, toolbar)
    return session.prompt, session


def read_message(read_line, renderer) -> str | None:
    """One message through read_line(prompt) (None at end of input). A line starting with
    \"\"\" opens a block that a line ending with \"\"\" closes."""
    try:
        line = read_line("> ")
    except EOFError:
        return None
    except KeyboardInterrupt:  # Ctrl-C between the answer and the prompt: not a quit
        renderer.notice(LEAVE_HINT)
        return ""
    if not line.lstrip().startswith(TRIPLE):
        return line
    body = line.lstrip()[len(TRIPLE) :]
    if body.rstrip().endswith(TRIPLE) and body.strip():
        return body.rstrip()[: -len(TRIPLE)]
    lines = [body] if body else []
    while True:
        try:
            more = read_line("... ")
        except EOFError:
            return "\n".join(lines)
        if more.rstrip().endswith(TRIPLE):
            lines.append(more.rstrip()[: -len(TRIPLE)])
            return "\n".join(x for x in lines).rstrip("\n") if lines else ""
        lines.append(more)


class Repl(BranchCommands, FormatCommands):
    def __init__(self, engine, conv, settings, renderer, session_factory=None, target=None):
        from kvchat.cli.session.file import AutosaveTarget

        self.engine = engine
        self.target = target if target is not None else AutosaveTarget(None)
        self._bang = False
        from kvchat.runtime.chat.branches import BranchConversation, Branches, clone_conversation

        if not isinstance(conv, BranchConversation):  # (it refuses to shift shared cells)
            conv = clone_conversation(conv, conv.seq_id)
        self.conv = conv
        self.branches = Branches(conv)  # /branch, /alts: more sequences of the same cache
        self.settings = settings
        self.r = renderer
        self._session_factory = session_factory
        self._prompt = None
        self.running = True
        from kvchat.cli.chat.thinking import ThinkingView

        renderer.thinking_view = ThinkingView(
            renderer, show=False, count=lambda: self.conv.stream.n_thinking if self.conv.stream is not None else 0
        )

    # ---- input ------------------------------------------------------------------------------

    def toolbar(self) -> str:
        c = self.engine.cache
        shift = "" if self.conv.config.context_shift else " · no shift"
        branch = f" [{self.branches.current}]" if len(self.branches.items) > 1 else ""
        return (
            f"{branch} ctx {self.conv.n_cached}/{self.conv.n_ctx} · {c['type_k']}/{c['type_v']}"
            f"{shift} · {self.engine.identity['file']} · /help "
        )

    def read(self) -> str | None:
        """One message (None at end of input). A line starting with \"\"\" opens a block."""
        return read_message(self._line_reader(), self.r)

    def _line_reader(self):
        read_line, self._prompt = line_reader(self._session_factory, self._prompt, self.r, self.toolbar)
        return read_line

    def adopt_prompt(self, session) -> None:
        """Go on with the prompt session the chat read its first message with while loading
        (cli/chat/load_behind.py): the same line editor and history, this chat's toolbar."""
        self._prompt = session

    # ---- loop -------------------------------------------------------------------------------

    def banner(self) -> None:
        e, c = self.engine, self.engine.cache
        fa = "on" if c["flash_attn"] else "off"
        self.r.notice(
            f"kvchat · {e.identity['file']} · ctx {self.conv.n_ctx} · K {c['type_k']} "
            f"V {c['type_v']} · flash-attn {fa} · seed {self.conv.sampler.seed}"
        )
        self.r.notice('/help for commands · Alt-Enter or """ for several lines · Ctrl-C stops an answer')

    def run(self, first: str | None = None) -> None:
        """The loop; first: a message already read (typed while the model loaded), taken as
        the first input."""
        self.banner()
        while self.running:
            try:
                text, first = (self.read(), None) if first is None else (first, None)
            except KeyboardInterrupt:
                self.r.notice(LEAVE_HINT)
                continue
            if text is None:
                break
            if not text.strip():
                continue
            try:
                if text.startswith("/"):
                    self.command(text)
                else:
                    self.turn(lambda on_text: self.conv.ask(text, on_text=on_text))
            except ModelOutputError:  # damaged weights: every later turn would fail alike
                raise
            except KvchatError as e:  # SessionError included: the conversation is unchanged
                self.r.error(error_text(e, in_chat=True))
            except KeyboardInterrupt:  # a second Ctrl-C, or one during a slash command
                self.conv.repair()
                self.r.notice("interrupted")
            if self.r.out_lost:
                break
        self.autosave()
        if self.r.out_lost:
            saved = f"; the conversation is saved in {self.target.path}" if self.target.path else ""
            raise KvchatError(f"stdout is closed, so answers cannot be printed{saved}")

    def turn(self, start) -> None:
        """Run one answer (ask or regen) with Ctrl-C stopping it; report, autosave. Kernels still
        compiling behind the chat are waited for first (Ctrl-C there: nothing has changed)."""
        self.engine.kernels_ready(self.r)
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

    def autosave(self, even_empty: bool = False) -> None:
        """Save to the target (if any). An empty conversation is only written over an existing
        file when asked (/clear): starting and leaving a chat creates no file."""
        path = self.target.path
        if path is None or not (self.conv.messages or (even_empty and path.exists())):
            return
        from kvchat.cli.chat.branches import save_all

        try:
            save_all(path, self.branches, self.engine.identity, self.engine.cache, force=self.settings.force)
        except KvchatError as e:
            self.r.error(str(e))

    def resume(self, path) -> None:
        """Load a session at startup; SessionError propagates (the program exits, file untouched)."""
        from kvchat.cli.chat.branches import load_all

        data = load_all(path, self.branches, self.engine.identity, self.engine.cache, self.engine.vocab.n_vocab)
        self._follow()
        if "branches" not in (data.extra or {}):
            apply_saved_sampling(self.conv, data.sampling, self.settings)
        from kvchat.cli.session.session import apply_saved_reasoning

        apply_saved_reasoning(list(self.branches.items.values()), data.extra, self.settings)
        self.r.notice(
            f"resumed {path}: {self.conv.n_cached} tokens in the cache, "
            f"{len(self.conv.messages)} messages (nothing re-processed)"
        )

    # ---- slash commands ---------------------------------------------------------------------

    def command(self, text: str) -> None:
        name, _, arg = text.strip().partition(" ")
        self._bang = name.endswith("!")  # /save! FILE: forced
        name = ALIASES.get(name.lower(), name.lower())
        arg = arg.strip()
        handler = getattr(self, "cmd_" + name[1:], None) if name in COMMANDS else None
        if handler is None:
            close = difflib.get_close_matches(name, list(COMMANDS) + list(ALIASES), n=1)
            hint = f" — did you mean {close[0]}?" if close else ""
            self.r.warn(f"unknown command {name}{hint} (/help lists the commands)")
            return
        if name in DECODING_COMMANDS:
            self.engine.kernels_ready(self.r)
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
        self.autosave(even_empty=True)  # cleared means cleared, on disk too
        on_disk = f"; {self.target.path} emptied" if self.target.path is not None and self.target.path.exists() else ""
        self.r.notice(f"new conversation (cache emptied{on_disk})")

    def cmd_regen(self, arg: str) -> None:
        self.turn(lambda on_text: self.conv.regenerate(on_text=on_text))

    def cmd_undo(self, arg: str) -> None:
        n = self.conv.undo()
        self.r.notice(f"removed the last exchange ({n} messages); ctx {self.conv.n_cached}/{self.conv.n_ctx}")

    def cmd_system(self, arg: str) -> None:
        if not arg:
            self.r.notice(
                f"system prompt: {self.conv.system_prompt!r}"
                if self.conv.system_prompt
                else "no system prompt (the template's default applies, if it has one)"
            )
            return
        self.conv.set_system(None if arg == "-" else arg)
        self.r.notice("system prompt removed" if arg == "-" else "system prompt set (applies from the next turn)")

    def cmd_set(self, arg: str) -> None:
        """/set PARAM VALUE: the flags marked live in cli/options.py, checked as the flags are."""
        if not arg:
            fmt = self.conv.constraint.spec.describe() if self.conv.constraint is not None else "off"
            self.r.notice(" · ".join(f"{o.key} {self._current(o)}" for o in LIVE) + f" · format {fmt}")
            return
        if arg.split()[0].lower() == "format":
            return self._set_format(arg.split(None, 1)[1] if len(arg.split()) > 1 else "")
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
        if option.live == CACHE:
            return self.engine.ctx.params.type_k if option.name == "cache_type_k" else self.engine.ctx.params.type_v
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
        elif option.live == CACHE:
            self._convert_cache(option.name, value)
        elif option.live == OUTPUT:
            setattr(self.settings, option.name, value)
            if hasattr(self.r, option.name):
                setattr(self.r, option.name, value)

    def cmd_save(self, arg: str) -> None:
        path = file_argument(arg, "/save")
        from kvchat.cli.chat.branches import save_all
        from kvchat.cli.session.file import SessionLock

        force = self._bang or self.settings.force
        if self.target.is_target(path):
            size = save_all(path, self.branches, self.engine.identity, self.engine.cache, force=force)
        else:
            with SessionLock(path):  # not over a file another chat is using
                size = save_all(path, self.branches, self.engine.identity, self.engine.cache, force=force)
        self.r.notice(
            f"saved {len(self.conv.messages)} messages, {self.conv.n_cached} cached tokens "
            f"to {path} ({size / 1024:.0f} KiB)"
        )

    def cmd_load(self, arg: str) -> None:
        path = file_argument(arg, "/load")
        from kvchat.cli.chat.branches import load_all

        lock = self.target.claim(path)  # another process's file: refused before anything changes
        try:
            data = load_all(path, self.branches, self.engine.identity, self.engine.cache, self.engine.vocab.n_vocab)
            self._follow()
        except BaseException:
            if lock is not None:
                lock.release()
            raise
        if "branches" not in (data.extra or {}):
            apply_saved_sampling(self.conv, data.sampling, None)
        from kvchat.cli.session.session import apply_saved_reasoning

        apply_saved_reasoning(list(self.branches.items.values()), data.extra)
        self.r.notice(
            f"loaded {path}: {len(self.conv.messages)} messages, {self.conv.n_cached} "
            "cached tokens (nothing re-processed)"
        )
        if lock is not None:
            old = self.target.adopt(path, lock)
            self.r.notice(f"autosave now goes to {path} ({old} is left as it was)")

    def cmd_stats(self, arg: str) -> None:
        self.r.stats(self.conv)

    def _convert_cache(self, name: str, value: str) -> None:
        """/set cache-type-k|v: re-store the live cache in the new type (runtime/memory/kv_convert.py)."""
        from kvchat.cli.session.session import cache_config
        from kvchat.kernels.ggml_types import cache_type_by_name
        from kvchat.runtime.memory.interface import MemoryOpError
        from kvchat.runtime.memory.kv_convert import convert_context_cache_types

        ctx = self.engine.ctx
        value = cache_type_by_name(value).name  # ValueError "invalid cache type ..." -> one line
        tk, tv = (value, ctx.params.type_v) if name == "cache_type_k" else (ctx.params.type_k, value)
        try:
            convert_context_cache_types(ctx, tk, tv)
        except MemoryOpError as e:
            raise ValueError(str(e)) from None
        setattr(self.settings, name, value)
        self.engine.cache = cache_config(ctx.cparams)

    def cmd_mem(self, arg: str) -> None:
        model = self.engine.model
        self.r.memory(self.engine.ctx.memory_breakdown(), getattr(model, "size_bytes", None))
        from kvchat.runtime.eval.kv_sweep import kv_footprint

        ctx = self.engine.ctx
        per_tok, at_ctx = kv_footprint(model.hparams, ctx.params.type_k, ctx.params.type_v, ctx.n_ctx)
        self.r.notice(
            f"KV cache K {ctx.params.type_k} / V {ctx.params.type_v}: {per_tok:,} bytes per "
            f"token ({at_ctx / 2**20:.2f} MiB for a full {ctx.n_ctx}-token context)"
        )
