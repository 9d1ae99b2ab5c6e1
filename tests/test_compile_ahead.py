"""Chat while compiling (kvchat.runtime.startup.compile_ahead): from an empty numba cache the chat shows
its prompt while worker processes compile, the first answer waits for them with a progress line,
Ctrl-C during that wait returns to the prompt with nothing changed, and the answer is the one a
warm chat gives; `kvchat run` shows the same progress on stderr and only the answer on stdout.

Each test starts from a new NUMBA_CACHE_DIR, so each compiles every kernel of the tiny model:
slow (minutes on a busy machine), hence few."""

import os
import re
import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT
from tests.helpers.pty_chat import ACCEPTED, READY, Chat, answer_of

pytestmark = pytest.mark.slow

PROGRESS = r"kernels (\d+)/(\d+)"
COMPILE_TIMEOUT = 2400  # every kernel of the tiny model: ~4 min idle, 15 at load 22 on 2 cores


def after_progress(text: str) -> str:
    """What follows the last progress frame (the spinner's frames precede the answer)."""
    frames = list(re.finditer(PROGRESS, text))
    return text[frames[-1].end() :] if frames else text


def test_the_chat_takes_input_while_compiling_and_answers_as_a_warm_chat(tiny_chat, tmp_path):
    env = {"NUMBA_CACHE_DIR": str(tmp_path / "numba")}
    cold = Chat(tiny_chat, tmp_path, "-n", "8", env=env)  # the prompt is up: the workers are compiling
    cold.child.timeout = COMPILE_TIMEOUT
    cold.child.sendline("Hello there")
    cold.wait(ACCEPTED)
    seen = cold.wait(PROGRESS)  # the first answer waits for the workers and says how far they are
    assert "compiling kernels" in seen
    time.sleep(1)  # as a user would: not within the millisecond the input line closes
    cold.child.sendintr()  # Ctrl-C during the wait
    out = cold.wait(READY)
    assert "interrupted" in out
    assert cold.ctx_used == 0  # nothing was decoded or kept
    reply = cold.say("Hello there")
    answer = answer_of(after_progress(reply)).strip()
    assert answer
    assert cold.ctx_used > 0
    assert cold.exit() == 0

    warm = Chat(tiny_chat, tmp_path, "-n", "8", env=env)
    warm_reply = warm.say("Hello there")
    assert not re.search(PROGRESS, warm_reply)  # warm: nothing to wait for
    assert answer_of(warm_reply).strip() == answer
    assert warm.ctx_used == cold.ctx_used
    assert warm.exit() == 0


def test_run_shows_the_progress_on_stderr_and_only_the_answer_on_stdout(tiny_chat, tmp_path):
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "numba"), KVCHAT_CACHE=str(tmp_path / "cache"))
    cmd = [sys.executable, "-c", "from kvchat.cli.app import main; main()", "run", "-m", str(tiny_chat)]
    cmd += ["-p", "Hello", "-n", "8", "--temp", "0", "--no-prompt-cache"]
    cold = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=COMPILE_TIMEOUT)
    assert cold.returncode == 0, cold.stderr
    steps = [tuple(map(int, m)) for m in re.findall(PROGRESS, cold.stderr)]
    assert steps and steps[-1][0] == steps[-1][1] > 0  # counted up to every planned kernel
    assert [d for d, _ in steps] == sorted(d for d, _ in steps)
    warm = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert warm.returncode == 0 and not re.search(PROGRESS, warm.stderr)
    assert cold.stdout == warm.stdout and warm.stdout.strip()
