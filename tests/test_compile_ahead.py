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


def _pack_kinds(cache) -> set:
    """The packing kinds in the one weight pack under KVCHAT_CACHE `cache` (runtime/weights/cache.py)."""
    from kvchat.runtime.weights.cache import _read_table

    (pack,) = (cache / "packed").glob("*.kvpack")
    with open(pack, "rb") as f:
        table = _read_table(f, pack.stat().st_size)
    return {e["kind"] for e in table["tensors"].values()}


def test_run_shows_the_progress_on_stderr_and_only_the_answer_on_stdout(tiny_chat, tmp_path):
    """On a Q5_0 + Q8_0 copy of the tiny chat model: the first run holds the Q5_0 rows as Q8_0
    (kernels/stand_in.py) and answers byte for byte as the next run, which holds them natively."""
    from kvchat.kernels.ggml_types import GGMLType
    from tests.helpers.gguf_factory import quantized_copy

    layers = quantized_copy(tiny_chat, tmp_path / "q5.gguf", GGMLType.Q5_0, only=lambda n: n.startswith("blk."))
    model = quantized_copy(layers, tmp_path / "mixed.gguf", GGMLType.Q8_0)
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "numba"), KVCHAT_CACHE=str(tmp_path / "cache"))
    env["KVCHAT_WEIGHT_CACHE"] = "1"  # the packs show how the rows were held
    cmd = [sys.executable, "-c", "from kvchat.cli.app import main; main()", "run", "-m", str(model)]
    cmd += ["-p", "Hello", "-n", "8", "--temp", "0", "--no-prompt-cache"]
    cold = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=COMPILE_TIMEOUT)
    assert cold.returncode == 0, cold.stderr
    steps = [tuple(map(int, m)) for m in re.findall(PROGRESS, cold.stderr)]
    assert steps and steps[-1][0] == steps[-1][1] > 0  # counted up to every planned kernel
    assert [d for d, _ in steps] == sorted(d for d, _ in steps)
    assert _pack_kinds(tmp_path / "cache") == {"int", "int:Q8_0"}  # Q8_0 rows as they are, Q5_0 ones held as Q8_0
    warm = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert warm.returncode == 0 and not re.search(PROGRESS, warm.stderr)
    assert cold.stdout == warm.stdout and warm.stdout.strip()
    assert _pack_kinds(tmp_path / "cache") == {"int"}  # the native Q5_0 kernels were planned last
