"""The CLI contract of `kvchat run` / `kvchat chat` on a tiny ChatML model (no real model needed):
stdout carries only the answer, errors are one line with a clear exit code, sessions resume
without re-processing, Ctrl-C stops an answer. Most calls run `kvchat.cli.app.main` in this process
(tests/helpers/cli_inproc.py: the kernels are compiled once); the one about a signal runs a real process.
tests/test_cli_run.py holds the contract tests that run on both this model and SmolLM2 (the
`any_model` ones: stdout-only answers, corrupt and resumed sessions) and SmolLM2's agreement
with llama.cpp's answers."""

import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import ROOT
from tests.helpers.cli_inproc import kvchat

TIMEOUT = 600


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCHAT_CACHE", str(tmp_path / "cache"))


def greedy_text(model_path, prompt_ids, n):
    """What the engine itself answers, greedily: the reference the CLI must print."""
    from kvchat.runtime.context import Context
    from kvchat.runtime.cparams import ContextParams
    from kvchat.runtime.generate import generate
    from kvchat.runtime.model import Model
    from kvchat.runtime.text.detokenize import StreamDecoder

    m = Model.load(model_path)
    ctx = Context(m, ContextParams(n_ctx=256))
    dec = StreamDecoder(m.vocab)
    text = "".join(
        dec.feed(s.token) for s in generate(ctx, lambda x: int(np.argmax(x)), prompt=prompt_ids, max_tokens=n)
    )
    return text + dec.flush()


def test_raw_answer_is_exactly_the_engines_greedy_continuation(tiny_chat):
    from kvchat.runtime.model import Model

    ids = Model.load(tiny_chat).vocab.tokenize("hello world", add_special=True)
    r = kvchat("run", "-m", tiny_chat, "--raw", "--temp", "0", "-n", "12", "-c", "256", "-p", "hello world")
    assert r.returncode == 0, r.stderr
    assert r.stdout == greedy_text(tiny_chat, ids, 12) + "\n"
    assert len(r.stdout.strip()) > 0


def test_seeded_sampling_is_reproducible_and_the_seed_matters(tiny_chat):
    args = ("run", "-m", tiny_chat, "--temp", "1.0", "-n", "16", "-c", "256", "-p", "Tell me a joke.")
    a, b, c = kvchat(*args, "-s", "1234"), kvchat(*args, "-s", "1234"), kvchat(*args, "-s", "99")
    assert a.returncode == b.returncode == c.returncode == 0
    assert a.stdout == b.stdout and a.stdout.strip() and c.stdout != a.stdout


def test_prompt_longer_than_context_is_refused(tiny_chat):
    r = kvchat("run", "-m", tiny_chat, "-c", "256", "-n", "4", "-p", "word " * 400)
    assert r.returncode == 1 and r.stdout == ""
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: the prompt needs ") and "context of 256 tokens" in last
    assert last.endswith("; shorten it or raise -c") and "Traceback" not in r.stderr


def test_no_prompt_and_bad_flags_are_one_line_errors(tiny_chat, tmp_path):
    r = kvchat("run", "-m", tiny_chat, "-f", tmp_path / "missing.txt")
    assert r.returncode == 1 and r.stderr.strip().startswith("error: cannot read prompt file")
    r = kvchat("run", "-m", tiny_chat, "-ctk", "q7_0", "-p", "hi", "-c", "256")
    assert r.returncode == 1 and "invalid cache type 'q7_0'" in r.stderr and "Traceback" not in r.stderr
    r = kvchat("run", "-m", tiny_chat, "-ctv", "q8_0", "-fa", "off", "-p", "hi", "-c", "256")
    assert r.returncode == 1 and "Flash Attention" in r.stderr and "Traceback" not in r.stderr
    r = kvchat("run", "-m", tmp_path / "nothing.gguf", "-p", "hi")
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1


def test_run_session_that_is_a_directory_is_refused(tiny_chat, tmp_path):
    r = kvchat("run", "-m", tiny_chat, "-c", "256", "-n", "4", "--session", tmp_path, "-p", "hi")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("error: ")


def test_piped_chat_answers_each_line_and_refuses_bad_set_values(tiny_chat):
    r = kvchat(
        "chat",
        "-m",
        tiny_chat,
        "-c",
        "256",
        "--temp",
        "0",
        "-n",
        "5",
        input="hello\n/set top-k -5\n/set temp nan\n/set n-predict 3\nagain\n/stats\n/exit\n",
    )
    assert r.returncode == 0, r.stderr
    assert "error: /set top-k: must be >= 0 (got -5)" in r.stderr
    assert "error: /set temp: must be a finite number (got nan)" in r.stderr
    assert "n-predict = 3" in r.stderr and "answer cut at -n 3 tokens" in r.stderr
    assert "answer cut at -n 5 tokens" in r.stderr


def test_ctrl_c_stops_a_run_with_exit_130_and_keeps_what_was_said(tiny_chat):
    """--ignore-eos with a context that shifts forever: only Ctrl-C ends it."""
    cmd = [
        sys.executable,
        "-c",
        "from kvchat.cli.app import main; main()",
        "run",
        "-m",
        str(tiny_chat),
        "-c",
        "256",
        "-n",
        "-1",
        "--ignore-eos",
        "-p",
        "go on",
    ]
    p = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT))
    )
    try:
        first = p.stdout.read(20)  # some of the answer has streamed
        assert len(first) == 20
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=TIMEOUT)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 130, err
    assert b"Traceback" not in err and len(first + out) >= 20


def test_help_lists_every_shared_flag_with_its_range(tiny_chat):
    r = kvchat("run", "--help", env={"COLUMNS": "200"})
    assert r.returncode == 0
    for text in ("--top-k", "[x>=0]", "--top-p", "[0.0<=x<=1.0]", "--seed", "-1 = random", "-ctk"):
        assert text in r.stdout, text
