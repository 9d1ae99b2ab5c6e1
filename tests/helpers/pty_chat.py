"""The pty driver of the chat tests: one `kvchat chat` process in a pseudo-terminal, driven as a
user would (-c 256, greedy).

The terminal side answers prompt_toolkit's cursor-position requests like a real terminal does
(without that it cannot know its height and hides the bottom toolbar). The toolbar
("ctx N/256 · f16/f16") appearing again is the sign the chat waits for input.
"""

import os
import re
import sys

import pytest

from tests.conftest import ROOT

pexpect = pytest.importorskip("pexpect")

TIMEOUT = 600  # generous: numba compiles on the first run, and the machine may be shared
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b[()][A-Za-z0-9]|\x1b[=>]|\x08|\r")
READY = r"ctx (\d+)/256 · f16/f16"
ACCEPTED = r"\x1b\[\?2004l"  # prompt_toolkit leaves the input line: what follows is the chat's output


def plain(text: str) -> str:
    return ANSI.sub("", text)


def flat(text: str) -> str:
    """Whitespace collapsed: rich wraps long lines at the terminal width."""
    return " ".join(text.split())


class Chat:
    """One `kvchat chat -m MODEL -c 256 --temp 0 ARGS` process in a pty, run in `cwd` (the repo by
    default); env entries are added to the environment; ready=False does not wait for the prompt.
    The terminal is 200 columns wide so that a message naming a pytest tmp path (longer under
    pytest-xdist's workers) stays on one line for the tests' substring checks."""

    def __init__(self, model, tmp_path, *args, env=None, ready=True, cwd=ROOT):
        e = dict(
            os.environ,
            TERM="xterm",
            PYTHONPATH=str(ROOT),
            KVCHAT_CACHE=str(tmp_path / "cache"),
            COLUMNS="200",
            LINES="50",
        )
        e.pop("PROMPT_TOOLKIT_NO_CPR", None)
        e.pop("KVCHAT_DEBUG", None)
        e.update(env or {})
        self.child = pexpect.spawn(
            sys.executable,
            [
                "-c",
                "from kvchat.cli.app import main; main()",
                "chat",
                "-m",
                str(model),
                "-c",
                "256",
                "--temp",
                "0",
                *args,
            ],
            env=e,
            encoding="utf-8",
            codec_errors="replace",
            timeout=TIMEOUT,
            dimensions=(50, 200),
            cwd=str(cwd),
        )
        self.ctx_used = None
        if ready:
            self.wait(READY)

    def wait(self, pattern) -> str:
        """Output up to `pattern` (ANSI stripped), answering cursor-position requests meanwhile."""
        seen = []
        while True:
            i = self.child.expect([pattern, r"\x1b\[6n"])
            seen.append(self.child.before)
            if i == 0:
                if pattern == READY:
                    self.ctx_used = int(self.child.match.group(1))
                return plain("".join(seen) + self.child.after)
            self.child.send("\x1b[50;1R")  # answer the cursor-position request as a terminal does

    def say(self, text) -> str:
        """Send a line; return what the chat printed in reply, until it is ready again."""
        self.child.sendline(text)
        self.wait(ACCEPTED)
        return self.wait(READY)

    def exit(self) -> int:
        self.child.sendline("/exit")
        self.child.expect(pexpect.EOF)
        self.child.close()
        return self.child.exitstatus

    def rest(self) -> str:
        """Everything until the process ends (ANSI stripped), and close it."""
        out = []
        while True:
            i = self.child.expect([pexpect.EOF, r"\x1b\[6n"])
            out.append(self.child.before)
            if i == 0:
                break
            self.child.send("\x1b[50;1R")
        self.child.close()
        return plain("".join(out))

    def close(self):
        if self.child.isalive():
            self.child.terminate(force=True)


def answer_of(output: str) -> str:
    """The answer part of a reply (before the next prompt and its toolbar)."""
    return output.split("ctx ")[0]


def decoded_prompt_tokens(stats_output: str) -> int:
    m = re.search(r"prompt tokens decoded\s+(\d+)", stats_output)
    assert m, stats_output
    return int(m.group(1))


def chats_on(model, tmp_path, **kw):
    """A factory of Chat processes on `model`, all closed afterwards (for `yield from` fixtures)."""
    chats = []

    def make(*args, **more):
        c = Chat(model, tmp_path, *args, **kw, **more)
        chats.append(c)
        return c

    yield make
    for c in chats:
        c.close()
