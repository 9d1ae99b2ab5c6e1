"""Terminal output: streamed answers, notices, timings, memory tables and the KV cell map.

Answers go to `out` (stdout) as raw text, flushed per piece, so pipes and terminals see tokens
as they are produced; everything else (notices, timings, tables, spinners) goes to `err`
(stderr) through rich, so `kvchat run ... > answer.txt` captures only the answer. rich is
imported when something is first shown on stderr (a spinner, a notice): a `kvchat run` whose
stderr is not a terminal and that has nothing to say never imports it (~0.05 s of a start).
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.console import Console
    from rich.live import Live
    from rich.text import Text

MIB = 1024.0 * 1024.0


def timings_line(stats) -> str:
    """llama.cpp's one-line speed summary (with the drafts accepted when speculating)."""
    spec = ""
    if getattr(stats, "n_drafted", 0):
        spec = f" | Drafts: {stats.n_accepted}/{stats.n_drafted} accepted"
    return f"[ Prompt: {stats.prompt_tps:.1f} t/s | Generation: {stats.gen_tps:.1f} t/s{spec} ]"


class Renderer:
    def __init__(self, out=None, err: Console | None = None, markdown: bool = False):
        self.out = out or sys.stdout
        self._err = err
        self.markdown = markdown
        self._live: Live | None = None
        self._text: list[str] = []
        self._open_line = False
        # stdout closed (`>&-`) or its reader gone (`| head -c 10`): the answer cannot be shown.
        # Writing stops, `on_out_lost` is told once (run stops generating), the caller says so.
        self.out_lost = self.out is None
        self.on_out_lost = None
        self.thinking_view = None  # cli/chat/thinking.py's ThinkingView when thinking is shown

    @property
    def err(self) -> Console:
        """The stderr console (made, and rich imported, on first use)."""
        if self._err is None:
            from rich.console import Console

            self._err = Console(stderr=True, highlight=False)
        return self._err

    @err.setter
    def err(self, console: Console) -> None:
        self._err = console

    @property
    def err_console(self):
        """A stand-in for `err` to hand on (model download messages): makes it when used."""
        return _LazyConsole(self)

    def _err_is_terminal(self) -> bool:
        """rich's Console.is_terminal for the default stderr console, without making it when
        the answer is plain: not a tty and none of the variables rich reads to force one."""
        if self._err is None and "TTY_COMPATIBLE" not in os.environ and "FORCE_COLOR" not in os.environ:
            try:
                if not sys.stderr.isatty():
                    return False
            except (AttributeError, ValueError):
                return False
        return self.err.is_terminal

    def _write(self, text: str) -> None:
        if self.out_lost:
            return
        try:
            self.out.write(text)
            self.out.flush()
        except (BrokenPipeError, ValueError, OSError, AttributeError):
            self._lose_out()

    def _lose_out(self) -> None:
        self.out_lost = True
        try:  # the interpreter's final flush of stdout would fail again, with a traceback
            import os

            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
        except (OSError, ValueError, AttributeError):
            pass
        if self.on_out_lost is not None:
            self.on_out_lost()

    # ---- the answer -------------------------------------------------------------------------

    def begin_answer(self) -> None:
        self._text = []
        self._open_line = False

    def thinking(self, text: str) -> None:
        """A piece of the model's thinking (shown apart from the answer, or not at all)."""
        if text and self.thinking_view is not None:
            self.thinking_view.piece(text)

    def _end_thinking(self) -> None:
        if self.thinking_view is not None and self.thinking_view.active:
            self.thinking_view.end()

    def piece(self, text: str) -> None:
        if not text:
            return
        self._end_thinking()
        self._text.append(text)
        if self.out_lost or (self.markdown and not self._out_is_tty()):
            return  # a pipe gets the rendered Markdown once, at the end
        if self.markdown:
            from rich.console import Console
            from rich.live import Live
            from rich.text import Text

            if self._live is None:
                self._live = Live(
                    Text(""),
                    console=Console(file=self.out, highlight=False),
                    auto_refresh=False,
                    vertical_overflow="visible",
                )
                self._live.start()
            self._live.update(Text("".join(self._text)), refresh=True)
        else:
            self._write(text)
            self._open_line = not text.endswith("\n")

    def _out_is_tty(self) -> bool:
        try:
            return self.out.isatty()
        except (AttributeError, ValueError):
            return False

    def end_answer(self) -> None:
        """Finish the answer line (and render Markdown); nothing at all if nothing was streamed."""
        self._end_thinking()
        text = "".join(self._text)
        self._text = []
        if (not text and self._live is None) or self.out_lost:
            return
        if self._live is not None:
            from rich.markdown import Markdown  # markdown-it + pygments: only with --markdown

            self._live.update(Markdown(text), refresh=True)
            self._live.stop()
            self._live = None
        elif self.markdown:  # not a terminal: nothing was streamed; print the rendering
            try:
                from rich.console import Console
                from rich.markdown import Markdown

                Console(file=self.out, highlight=False).print(Markdown(text))
            except (BrokenPipeError, ValueError, OSError):
                self._lose_out()
        else:
            self._write("\n")
        self._open_line = False  # a notice after the answer (the rest of a first run's compile) adds no blank line

    # ---- diagnostics ------------------------------------------------------------------------

    def _break_line(self) -> None:
        """A notice in the middle of a streamed answer starts on a line of its own."""
        if getattr(self, "_open_line", False):
            self._write("\n")
            self._open_line = False

    def notice(self, text: str) -> None:
        """One dim line (context shifts, stops, saves)."""
        from rich.text import Text

        self._break_line()
        self.err.print(Text(text, style="dim"))

    def warn(self, text: str) -> None:
        from rich.text import Text

        self.err.print(Text(text, style="yellow"))

    def error(self, text: str) -> None:
        from rich.text import Text

        self.err.print(Text(f"error: {text}", style="bold red"))

    def timings(self, stats) -> None:
        from rich.text import Text

        self.err.print(Text(timings_line(stats), style="dim"))

    @contextlib.contextmanager
    def spinner(self, text: str):
        """A spinner on stderr while something slow happens (model load, kernel compilation)."""
        if self._err_is_terminal():
            with self.err.status(text, spinner="dots"):
                yield
        else:
            yield

    @contextlib.contextmanager
    def progress(self, text: str):
        """A spinner (terminal) or plain lines (a pipe, a log file) on stderr; yields show(line):
        the spinner, shown as `text` from the start, becomes `text line`; on a pipe each new
        line is printed as `text line` (nothing before the first). None changes nothing."""
        shown = [None]
        if self._err_is_terminal():
            with self.err.status(text, spinner="dots") as status:

                def show(line):
                    if line is not None and line != shown[0]:
                        shown[0] = line
                        status.update(f"{text} {line}")

                yield show
            return

        from rich.text import Text

        def show(line):
            if line is not None and line != shown[0]:
                shown[0] = line
                self._break_line()  # one unwrapped line each: a log or a pipe reader sees `text line` whole
                self.err.print(Text(f"{text} {line}", style="dim"), soft_wrap=True)

        yield show

    def verbose_prompt(self, vocab, ids) -> None:
        from rich.text import Text

        self.err.print(Text(f"prompt: {len(ids)} new tokens", style="dim"))
        for t in ids:
            piece = vocab.token_to_piece(int(t), True).decode("utf-8", errors="replace")
            self.err.print(Text(f"{int(t):6d} -> {piece!r}", style="dim"))

    # ---- tables -----------------------------------------------------------------------------

    def stats(self, conv) -> None:
        from rich.table import Table

        s = conv.last_stats
        t = Table(title="last turn", show_header=False, box=None, pad_edge=False)
        t.add_row("prompt tokens decoded", str(s.n_prompt), f"{s.t_prompt * 1000:.0f} ms", f"{s.prompt_tps:.1f} t/s")
        t.add_row("answer tokens", str(s.n_gen), f"{s.t_gen * 1000:.0f} ms", f"{s.gen_tps:.1f} t/s")
        if s.n_drafted or getattr(conv, "speculative", None) is not None:
            t.add_row(
                "drafts accepted",
                f"{s.n_accepted}/{s.n_drafted}",
                f"{100 * s.acceptance:.0f} %",
                f"{s.n_verify} verify batches",
            )
        t.add_row("stopped by", s.stop or "-", "", "")
        t.add_row("dropped by context shift", str(s.n_shifted), "", "")
        t.add_row(
            "context", f"{conv.n_cached}/{conv.n_ctx}", f"{len(conv.tokens)} in total", f"{conv.n_dropped} dropped"
        )
        t.add_row("messages", str(len(conv.messages)), "", "")
        self.err.print(t)

    def memory(self, breakdown: dict, weights_bytes: int | None = None) -> None:
        """/mem: weights, KV caches (per layer kind and type), outputs."""
        from rich.table import Table

        t = Table(title="memory", box=None, pad_edge=False)
        t.add_column("buffer")
        t.add_column("detail")
        t.add_column("MiB", justify="right")
        if weights_bytes is not None:
            t.add_row("weights", "mmap of the GGUF (quantized blocks)", f"{weights_bytes / MIB:.2f}")
        for name, mem in kv_breakdowns(breakdown.get("memory", breakdown)):
            detail = (
                f"{mem.get('kv_size', '?')} cells × {mem.get('n_layer', '?')} layers, "
                f"K {mem.get('type_k', '?')} {mem.get('k_bytes', 0) / MIB:.2f} MiB, "
                f"V {mem.get('type_v', '?')} {mem.get('v_bytes', 0) / MIB:.2f} MiB"
            )
            t.add_row(
                f"KV cache{(' (' + name + ')') if name else ''}", detail, f"{mem.get('total_bytes', 0) / MIB:.2f}"
            )
        for name, rec in recurrent_breakdowns(breakdown.get("memory", breakdown)):
            detail = (
                f"{rec['mem_size']} cells × {rec['n_layer']} layers, "
                f"R {rec['type_r']} {rec['r_bytes'] / MIB:.2f} MiB, S {rec['type_s']} "
                f"{rec['s_bytes'] / MIB:.2f} MiB ({(rec['r_bytes'] + rec['s_bytes']) // max(1, rec['mem_size']):,} "
                f"bytes per sequence)"
            )
            t.add_row(
                f"recurrent states{(' (' + name + ')') if name else ''}", detail, f"{rec['total_bytes'] / MIB:.2f}"
            )
        if "output_bytes" in breakdown:
            t.add_row("compute: logits", "output buffer", f"{breakdown['output_bytes'] / MIB:.2f}")
        total = breakdown.get("total_bytes", 0) + (weights_bytes or 0)
        t.add_row("total", "", f"{total / MIB:.2f}")
        self.err.print(t)

    def kv_map(self, memory, seq_names=None, max_cells: int = 512) -> None:
        """/kv: every cell of each cache — sequence and position, empty cells, the head."""
        from rich.text import Text

        for cache in memory.kv_caches():
            name = cache.name
            for strm, cells in enumerate(cache.cells):
                size = int(cells.pos.shape[0])
                head = cache.heads[strm] if hasattr(cache, "heads") else -1
                used = int((cells.pos >= 0).sum())
                shown = size
                if size > max_cells:
                    last = int(cells.used_max_p1()) if hasattr(cells, "used_max_p1") else size
                    shown = min(size, max(64, (max(last, head + 1) + 63) // 64 * 64))
                title = f"KV cache{(' ' + name) if name else ''}, stream {strm}: {used}/{size} cells used, head {head}"
                self.err.print(Text(title, style="bold"))
                self.err.print(kv_grid(cells.pos[:shown], cells.seq[:shown], head))
                if shown < size:
                    self.err.print(Text(f"… {size - shown} more cells, all empty", style="dim"))
        for rec in recurrent_memories(memory):
            c = rec.cells
            used = int(c.seq.any(axis=1).sum())
            per_cell = 4 * (rec.n_embd_r + rec.n_embd_s) * len(rec.layers)
            self.err.print(
                Text(
                    f"recurrent states: {used}/{rec.size} cells used, {per_cell:,} bytes "
                    f"of state per cell ({len(rec.layers)} layers)",
                    style="bold",
                )
            )
            self.err.print(kv_grid(c.pos, c.seq, -1))
        self.err.print(Text("cell = s<seq>:<pos> · '····' empty · reverse = head", style="dim"))


class _LazyConsole:
    """Renderer.err_console: every attribute is the renderer's stderr console's."""

    def __init__(self, renderer: Renderer):
        self._renderer = renderer

    def __getattr__(self, name):
        return getattr(self._renderer.err, name)

    # `with console:` (rich's Live, i.e. the download bars) looks these up on the type, past __getattr__
    def __enter__(self):
        return self._renderer.err.__enter__()

    def __exit__(self, *exc):
        return self._renderer.err.__exit__(*exc)


SEQ_STYLES = ["cyan", "green", "magenta", "yellow", "blue", "red"]


def kv_grid(pos, seq, head: int, per_row: int = 8) -> Text:
    """pos i32 [n], seq bool [n, n_seq_max] → rows of cells like `s0:12`."""
    from rich.text import Text

    out = Text()
    n = int(pos.shape[0])
    for i in range(n):
        if i % per_row == 0:
            if i:
                out.append("\n")
            out.append(f"{i:5d} ", style="dim")
        p = int(pos[i])
        if p < 0:
            label, style = "  ····  ", "dim"
        else:
            seqs = [int(s) for s in seq[i].nonzero()[0]]
            who = ",".join(str(s) for s in seqs) or "-"
            label = f"s{who}:{p}".center(8)[:8]
            style = SEQ_STYLES[seqs[0] % len(SEQ_STYLES)] if seqs else "white"
        if i == head:
            style += " reverse"
        out.append(label, style=style)
        out.append(" ")
    return out


def recurrent_memories(memory):
    """The recurrent memory of a memory: itself, or the one a hybrid holds (else none)."""
    if hasattr(memory, "cells") and hasattr(memory, "n_embd_s"):
        return [memory]
    return [v for v in vars(memory).values() if hasattr(v, "cells") and hasattr(v, "n_embd_s")]


def recurrent_breakdowns(mem: dict):
    """(name, dict) of the recurrent parts of a memory breakdown (flat or nested in a hybrid)."""
    if "r_bytes" in mem:
        return [("", mem)]
    return [("", v) for v in mem.values() if isinstance(v, dict) and "r_bytes" in v]


def kv_breakdowns(mem: dict):
    """(name, per-cache dict) pairs from a memory breakdown (flat, or nested for iSWA)."""
    nested = [(k, v) for k, v in mem.items() if isinstance(v, dict) and "k_bytes" in v]
    if nested:
        return nested
    return [("", mem)] if "k_bytes" in mem else []
