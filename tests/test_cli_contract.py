"""The CLI contract of `kvchat run` / `kvchat chat` on a tiny ChatML model (no real model needed):
stdout carries only the answer, errors are one line with a clear exit code, sessions resume
without re-processing, Ctrl-C stops an answer. Most calls run `cli.app.main` in this process
(the kernels are compiled once); the ones about pipes, signals and --session files (locked
for the life of the process that uses them) run a real process.
The same behaviour on SmolLM2, with llama.cpp's answers, is tests/test_cli_run.py."""
import io
import os
import signal
import subprocess
import sys
import time
from contextlib import redirect_stderr, redirect_stdout
from types import SimpleNamespace

import numpy as np
import pytest

from tests.conftest import ROOT

TIMEOUT = 600


def kvchat(*args, input=None, env=None):
    """`kvchat ARGS` in this process: (returncode, stdout, stderr); stdin is `input` (not a tty)."""
    from cli.app import main
    out, err = io.StringIO(), io.StringIO()
    old_stdin, old_env = sys.stdin, dict(os.environ)
    sys.stdin = io.StringIO(input or "")
    os.environ.update(env or {})
    code = 0
    try:
        with redirect_stdout(out), redirect_stderr(err):
            main([str(a) for a in args])
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.stdin = old_stdin
        os.environ.clear()
        os.environ.update(old_env)
    return SimpleNamespace(returncode=code, stdout=out.getvalue(), stderr=err.getvalue())


def kvchat_process(*args, input=None, env=None):
    cmd = [sys.executable, "-c", "from cli.app import main; main()", *map(str, args)]
    e = dict(os.environ, PYTHONPATH=str(ROOT), **(env or {}))
    return subprocess.run(cmd, input=input, capture_output=True, text=True, timeout=TIMEOUT, cwd=ROOT, env=e)


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCHAT_CACHE", str(tmp_path / "cache"))


def greedy_text(model_path, prompt_ids, n):
    """What the engine itself answers, greedily: the reference the CLI must print."""
    from runtime.context import Context
    from runtime.cparams import ContextParams
    from runtime.generate import generate
    from runtime.model import Model
    from runtime.text.vocab import StreamDecoder
    m = Model.load(model_path)
    ctx = Context(m, ContextParams(n_ctx=256))
    dec = StreamDecoder(m.vocab)
    text = "".join(dec.feed(s.token) for s in generate(ctx, lambda x: int(np.argmax(x)), prompt=prompt_ids,
                                                       max_tokens=n))
    return text + dec.flush()


def test_raw_answer_is_exactly_the_engines_greedy_continuation(tiny_chat):
    from runtime.model import Model
    ids = Model.load(tiny_chat).vocab.tokenize("hello world", add_special=True)
    r = kvchat("run", "-m", tiny_chat, "--raw", "--temp", "0", "-n", "12", "-c", "256", "-p", "hello world")
    assert r.returncode == 0, r.stderr
    assert r.stdout == greedy_text(tiny_chat, ids, 12) + "\n"
    assert len(r.stdout.strip()) > 0


def test_stdout_is_only_the_answer_and_timings_go_to_stderr(tiny_chat, tmp_path):
    prompt_file = tmp_path / "q.txt"
    prompt_file.write_text("Name a colour.", encoding="utf-8")
    r = kvchat_process("run", "-m", tiny_chat, "--temp", "0", "-n", "6", "-c", "256", "-f", prompt_file,
                       "--show-timings", "--verbose-prompt")
    assert r.returncode == 0, r.stderr
    assert "t/s" not in r.stdout and "->" not in r.stdout
    assert "[ Prompt: " in r.stderr and " t/s | Generation: " in r.stderr and " t/s ]" in r.stderr
    assert "'<|im_start|>'" in r.stderr  # --verbose-prompt lists the prompt tokens
    r2 = kvchat("run", "-m", tiny_chat, "--temp", "0", "-n", "6", "-c", "256", input="Name a colour.")
    assert r2.returncode == 0 and r2.stdout == r.stdout and len(r.stdout.strip()) > 0


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


def test_corrupt_session_at_startup_exits_1_and_leaves_file(tiny_chat, tmp_path):
    bad = tmp_path / "bad.kvs"
    bad.write_bytes(b"KVCHATSS" + b"\x01\x00\x00\x00" + b"garbage" * 10)
    before = bad.read_bytes()
    r = kvchat_process("chat", "-m", tiny_chat, "-c", "256", "--session", bad, input="hello\n")
    assert r.returncode == 1, r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith(f"error: {bad}: ")
    assert bad.read_bytes() == before


def test_run_with_session_continues_the_conversation(tiny_chat, tmp_path):
    from cli.session import decode_session
    sess = tmp_path / "s.kvs"
    r1 = kvchat_process("run", "-m", tiny_chat, "-c", "512", "--temp", "0", "-n", "12", "--session", sess,
                "-p", "My name is Ada.")
    assert r1.returncode == 0, r1.stderr
    first = decode_session(sess.read_bytes())
    assert [m["role"] for m in first.messages] == ["user", "assistant"]
    assert first.messages[1]["content"].strip() == r1.stdout.strip()
    r2 = kvchat_process("run", "-m", tiny_chat, "-c", "512", "--temp", "0", "-n", "12", "--session", sess,
                "-p", "What is my name?")
    assert r2.returncode == 0, r2.stderr
    assert f"resumed {sess}: {len(first.tokens)} tokens in the cache" in " ".join(r2.stderr.split())
    second = decode_session(sess.read_bytes())
    assert [m["content"] for m in second.messages[:2]] == [m["content"] for m in first.messages]
    assert second.messages[2]["content"] == "What is my name?"
    assert second.tokens[:len(first.tokens)] == first.tokens  # the cached prefix was kept


def test_run_session_that_is_a_directory_is_refused(tiny_chat, tmp_path):
    r = kvchat("run", "-m", tiny_chat, "-c", "256", "-n", "4", "--session", tmp_path, "-p", "hi")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("error: ")


def test_piped_chat_answers_each_line_and_refuses_bad_set_values(tiny_chat):
    r = kvchat("chat", "-m", tiny_chat, "-c", "256", "--temp", "0", "-n", "5",
               input="hello\n/set top-k -5\n/set temp nan\n/set n-predict 3\nagain\n/stats\n/exit\n")
    assert r.returncode == 0, r.stderr
    assert "error: /set top-k: must be >= 0 (got -5)" in r.stderr
    assert "error: /set temp: must be a finite number (got nan)" in r.stderr
    assert "n-predict = 3" in r.stderr and "answer cut at -n 3 tokens" in r.stderr
    assert "answer cut at -n 5 tokens" in r.stderr


def test_ctrl_c_stops_a_run_with_exit_130_and_keeps_what_was_said(tiny_chat):
    """--ignore-eos with a context that shifts forever: only Ctrl-C ends it."""
    cmd = [sys.executable, "-c", "from cli.app import main; main()", "run", "-m", str(tiny_chat), "-c", "256",
           "-n", "-1", "--ignore-eos", "-p", "go on"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
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
