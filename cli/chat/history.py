"""The chat's input history file, bounded: the newest MAX_ENTRIES inputs are kept.

prompt_toolkit's FileHistory appends forever; every start reads the whole file. This one keeps
the newest MAX_ENTRIES entries (and at most MAX_BYTES) when it loads, rewriting the file
atomically when it had grown past that, stores text that is not valid UTF-8 with U+FFFD, and
gives up quietly (history in memory only) when the file cannot be read or written — the chat
never fails over its history.
"""

from __future__ import annotations

import datetime
import os
import stat
from pathlib import Path

from prompt_toolkit.history import FileHistory, History, InMemoryHistory

from kvchat.runtime.text.utf8 import clean_text

MAX_ENTRIES = 1000
MAX_BYTES = 1 << 20


def _entry_text(entry: str) -> str:
    return f"\n# {datetime.datetime.now()}\n" + "".join(f"+{line}\n" for line in entry.split("\n"))


class BoundedFileHistory(FileHistory):
    def __init__(self, filename, max_entries: int = MAX_ENTRIES, max_bytes: int = MAX_BYTES):
        super().__init__(str(filename))
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._broken = False

    def load_history_strings(self):
        try:
            st = os.stat(self.filename)
        except FileNotFoundError:
            return []
        except OSError:
            self._broken = True
            return []
        if not stat.S_ISREG(st.st_mode):
            self._broken = True  # a directory, a FIFO...: do not touch it
            return []
        try:
            newest_first = list(super().load_history_strings())
        except OSError:
            self._broken = True
            return []
        kept = newest_first[: self.max_entries]
        while kept and sum(len(e) + 40 for e in kept) > self.max_bytes:
            kept.pop()
        if len(kept) < len(newest_first):
            self._rewrite(list(reversed(kept)))
        return kept

    def _rewrite(self, oldest_first: list[str]) -> None:
        from kvchat.runtime.memory.state import atomic_write

        try:
            atomic_write(self.filename, "".join(_entry_text(e) for e in oldest_first).encode("utf-8", "replace"))
        except OSError:
            self._broken = True

    def store_string(self, string: str) -> None:
        if self._broken:
            return
        try:
            with open(self.filename, "ab") as f:
                f.write(_entry_text(clean_text(string)).encode("utf-8", "replace"))
        except OSError:
            self._broken = True


def open_history(path: Path) -> History:
    """A bounded file history at `path`, or an in-memory one if its directory cannot be made."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return BoundedFileHistory(path)
    except OSError:
        return InMemoryHistory()
