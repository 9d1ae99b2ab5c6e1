"""How a thinking model's thinking is shown, apart from its answer.

Chat on a terminal: a dim "thinking" header, the thinking streaming dim under it (the last few
lines, in a transient rich Live region), and when the answer starts the region collapses to one
dim line ("thought for 123 tokens, 4.2 s · /think shows it"); with /think on, the whole thinking
stays on screen, dim. A chat whose stdout is not a terminal prints the collapsed line, or the
whole thinking when shown, as plain text. `kvchat run` keeps thinking off stdout: with
--show-reasoning it streams to stderr, otherwise nowhere.
"""

from __future__ import annotations

import time


class ThinkingView:
    """Shows one answer's thinking at a time (begin → piece* → end)."""

    def __init__(self, renderer, show: bool = False, stream=None, count=None):
        self.r = renderer
        self.count = count or (lambda: 0)  # thinking tokens of the current answer
        self.show = show  # /think: keep the whole thinking on screen
        self.stream = stream  # run --show-reasoning: a text stream (stderr) that gets it raw
        self._text: list[str] = []
        self._live = None
        self._t0 = 0.0
        self.active = False

    def _terminal(self) -> bool:
        return self.stream is None and self.r._out_is_tty() and not self.r.out_lost

    def piece(self, text: str) -> None:
        if not self.active:
            self.active, self._text, self._t0 = True, [], time.perf_counter()
            if self.stream is None:
                self._header()
        self._text.append(text)
        if self.stream is not None:
            self.stream.write(text)
            self.stream.flush()
        elif self._live is not None:
            self._live.update(self._tail(), refresh=True)

    def _header(self) -> None:
        if not self._terminal():
            return
        from rich.console import Console
        from rich.live import Live

        self._console = Console(file=self.r.out, highlight=False)
        self._live = Live(self._tail(), console=self._console, auto_refresh=False, transient=True)
        self._live.start()

    def _tail(self):
        """The header and the last lines of the thinking, within the terminal's height."""
        from rich.console import Group
        from rich.text import Text

        height = max(3, (getattr(getattr(self, "_console", None), "height", 24) or 24) - 4)
        lines = "".join(self._text).splitlines()[-height:]
        return Group(Text("thinking…", style="dim bold"), Text("\n".join(lines), style="dim italic"))

    def end(self) -> None:
        """Thinking is over (the answer starts, or the turn ended)."""
        if not self.active:
            return
        n_tokens = self.count()
        self.active = False
        text = "".join(self._text).strip()
        seconds = time.perf_counter() - self._t0
        if self.stream is not None:
            self.stream.write("\n")
            self.stream.flush()
            return
        summary = f"thought for {n_tokens} tokens, {seconds:.1f} s"
        if self._live is not None:
            self._live.stop()  # transient: the streaming region disappears
            self._live = None
            from rich.text import Text

            if self.show:
                self._console.print(Text("thinking", style="dim bold"))
                self._console.print(Text(text, style="dim italic"))
                self._console.print(Text(f"({summary})", style="dim"))
            else:
                self._console.print(Text(f"▸ {summary} · /think shows it", style="dim"))
            return
        if self.show:
            self.r._write(f"[thinking]\n{text}\n[/thinking]\n")
        else:
            self.r._write(f"({summary})\n")
