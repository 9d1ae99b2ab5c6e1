"""`kvchat run`, `tokenize` and `session show` on bad bytes, damaged models, impossible sizes and
locked sessions, on a tiny random model: one line and a clear exit code each, never a traceback,
never a lost turn. Most calls run in this process (tests/helpers/cli_inproc.py); a session held by
another process, concurrent runs, closed or vanishing stdout and the start-up locale need real
processes."""

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import ROOT
from tests.helpers import cli_inproc as inproc
from tests.helpers.gguf_factory import write_tiny_model

TIMEOUT = 600  # the first run compiles the kernels


def kvchat(*args, input=None, env=None, cwd=None):
    """In this process; stdout / stderr as bytes; env=STRICT gives stdin a strict text layer."""
    strict = env is STRICT
    return inproc.kvchat(
        *args,
        input=input,
        env=None if strict else env,
        cwd=cwd,
        text=False,
        stdin_errors="strict" if strict else "surrogateescape",
    )


def kvchat_process(*args, input=None, env=None, cwd=None):
    """As a process of its own."""
    cmd = [
        sys.executable,
        "-c",
        "from kvchat.cli.app import main; main()",
        *(a if isinstance(a, bytes) else os.fsencode(str(a)) for a in args),
    ]
    e = dict(os.environ, PYTHONPATH=str(ROOT), **(env or {}))
    e.pop("KVCHAT_DEBUG", None)
    return subprocess.run(cmd, input=input, capture_output=True, timeout=TIMEOUT, cwd=cwd or ROOT, env=e)


def err_lines(r) -> list[str]:
    return [line for line in r.stderr.decode("utf-8", "replace").splitlines() if line.strip()]


def assert_no_traceback(r):
    text = r.stderr.decode("utf-8", "replace")
    assert "Traceback" not in text and "Error:" not in text.replace("error:", ""), text


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("m") / "tiny.gguf")


@pytest.fixture(scope="module", params=["F32", "Q8_0", "Q4_1"])
def nan_model(tmp_path_factory, request):
    """A model whose output_norm is NaN, with float weights or integer-path ones (q8_0 / q8_1
    activations: integers cannot hold a NaN, kernels/quant_act.py keeps it in the block scale)."""
    import gguf

    from kvchat.kernels.ggml_types import GGMLType

    wt = GGMLType[request.param]
    path = write_tiny_model(tmp_path_factory.mktemp("nan") / "damaged.gguf", weight_type=wt)
    reader = gguf.GGUFReader(path, "r+")
    for t in reader.tensors:
        if t.name == "output_norm.weight":
            t.data[:] = np.nan
    del reader
    return path


RUN = ("run", "-c", "256", "-n", "4", "--temp", "0")
STRICT = {"PYTHONIOENCODING": "utf-8:strict"}  # a locale whose stdin refuses bad bytes


# ---- invalid UTF-8 -----------------------------------------------------------------------------------


def test_invalid_utf8_prompt_argument_is_replaced_and_answered(tiny, tmp_path):
    from kvchat.cli.session.session import read_session

    session = tmp_path / "s.kvs"
    r = kvchat(*RUN, "-m", tiny, "--session", session, "-p", b"caf\xe9 \xff\xfe ok")
    assert r.returncode == 0, r.stderr
    assert_no_traceback(r)
    assert read_session(session).messages[0]["content"] == "caf\ufffd \ufffd\ufffd ok"


def test_invalid_utf8_on_stdin_is_replaced_and_answered(tiny, tmp_path):
    from kvchat.cli.session.session import read_session

    session = tmp_path / "s.kvs"
    r = kvchat(*RUN, "-m", tiny, "--session", session, input=b"ab\xc3(\x80cd")
    assert r.returncode == 0, r.stderr
    assert read_session(session).messages[0]["content"] == "ab\ufffd(\ufffdcd"


def test_tokenize_replaces_each_invalid_byte_like_llama_cpp(tiny):
    from kvchat.runtime.gguf.file import GGUFFile
    from kvchat.runtime.text.vocab import Vocab

    with GGUFFile(tiny) as gf:
        vocab = Vocab.from_gguf(gf)
    expected = vocab.tokenize("x\ufffd\ufffdy", add_special=False)
    r = kvchat("tokenize", "-m", tiny, "--no-bos", b"x\xe2\x82y")  # a cut 3-byte char: 2 bytes, 2 U+FFFD
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == expected
    r = kvchat("tokenize", "-m", tiny, "--no-bos", "-", input=b"x\xe2\x82y")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == expected


# ---- damaged models, impossible sizes ----------------------------------------------------------------


def test_nan_logits_are_one_line_and_exit_1(nan_model, tmp_path):
    session = tmp_path / "s.kvs"
    r = kvchat(*RUN, "-m", nan_model, "-p", "hello", "--session", session)
    assert r.returncode == 1
    (line,) = err_lines(r)
    assert re.fullmatch(
        r"error: damaged\.gguf: the model produced NaN logits: its weights are damaged \(re-download or "
        r"re-convert the model file\) \(logits for position (\d+)\)",
        line,
    ), line
    assert int(line.rsplit(" ", 1)[1][:-1]) > 1  # after the templated prompt: the first answer token's
    assert r.stdout.strip() == b""
    assert not session.exists()  # nothing saved as if it were an answer


def test_context_too_large_for_the_machine_is_refused_up_front(tiny):
    from kvchat.runtime.cparams import available_memory

    r = kvchat(*RUN, "-m", tiny, "-c", "1000000000", "-p", "hello")
    assert r.returncode == 1
    (line,) = err_lines(r)
    assert line.startswith("error: -c 1000000000 needs 238.4 GiB of KV cache (f16/f16)")
    fit = int(line.split("the largest -c that fits is ")[1].split()[0])
    # 2 layers x (32 K + 32 V) f16 values = 256 bytes per token; MemAvailable moves meanwhile
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert fit % 256 == 0 and 0 < fit * 256 <= total and available_memory() <= total


def test_training_context_warning_is_printed_once_and_engine_logs_stay_hidden(tiny):
    r = kvchat(*RUN, "-m", tiny, "-c", "1024", "-p", "hello")
    assert r.returncode == 0, r.stderr
    lines = err_lines(r)
    assert sum("possible training context overflow" in line for line in lines) == 1
    assert lines == ["n_ctx_seq (1024) > n_ctx_train (512) -- possible training context overflow"]


def test_refused_memory_state_prints_only_the_real_error(tiny, tmp_path):
    from kvchat.cli.session.session import decode_session, encode_session

    session = tmp_path / "s.kvs"
    assert kvchat(*RUN, "-m", tiny, "--session", session, "-p", "hello").returncode == 0
    data = decode_session(session.read_bytes())
    data.state = b"\x05" + data.state[1:]  # a state of another shape, digest recomputed
    session.write_bytes(encode_session(data))
    before = session.read_bytes()
    r = kvchat(*RUN, "-m", tiny, "--session", session, "-p", "again")
    assert r.returncode == 1
    (line,) = err_lines(r)  # no "error loading sequence state: ..." log line before it
    assert line.startswith("error: ") and "memory state" in line
    assert session.read_bytes() == before


# ---- locked sessions ---------------------------------------------------------------------------------


def test_run_on_a_session_another_process_holds_is_refused_naming_it(tiny, tmp_path):
    from kvchat.cli.session.file import SessionLock

    session = tmp_path / "s.kvs"
    assert kvchat(*RUN, "-m", tiny, "--session", session, "-p", "Seed").returncode == 0
    before = session.read_bytes()
    with SessionLock(session):
        r = kvchat_process(*RUN, "-m", tiny, "--session", session, "-p", "msg")
    assert r.returncode == 1
    assert err_lines(r) == [
        f"error: session file {session} is in use by process {os.getpid()}; wait for it to finish or use another file"
    ]
    assert session.read_bytes() == before


def test_concurrent_runs_never_report_a_turn_that_is_not_in_the_file(tiny, tmp_path):
    from kvchat.cli.session.session import read_session

    session = tmp_path / "s.kvs"
    assert kvchat(*RUN, "-m", tiny, "--session", session, "-p", "Seed").returncode == 0
    cmd = [
        sys.executable,
        "-c",
        "from kvchat.cli.app import main; main()",
        *RUN,
        "-m",
        str(tiny),
        "--session",
        str(session),
    ]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    procs = [
        subprocess.Popen(cmd + ["-p", f"msg {i}"], env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for i in range(4)
    ]
    codes = [p.wait(timeout=TIMEOUT) for p in procs]
    users = [m["content"] for m in read_session(session).messages if m["role"] == "user"]
    ok = [f"msg {i}" for i, c in enumerate(codes) if c == 0]
    assert ok and set(users[1:]) == set(ok) and users[0] == "Seed"
    for p, c in zip(procs, codes):
        if c:
            assert b"is in use by process" in p.stderr.read()
    assert not (tmp_path / ".s.kvs.lock").exists()


# ---- kvchat session show -----------------------------------------------------------------------------


def test_session_show_prints_model_settings_and_messages(tiny, tmp_path):
    session = tmp_path / "s.kvs"
    assert kvchat(*RUN, "-m", tiny, "--session", session, "--seed", "5", "-p", "Hello there").returncode == 0
    r = kvchat("session", "show", session)
    assert r.returncode == 0, r.stderr
    out = r.stdout.decode()
    assert "model    tiny.gguf" in out and "-c 256 · K f16 V f16 · flash-attn on" in out
    assert "seed 5" in out and "user: Hello there" in out and "messages 2" in out
    r = kvchat("session", "show", "--json", session)
    info = json.loads(r.stdout)
    assert info["model"]["file"] == "tiny.gguf" and info["cache"]["n_ctx"] == 256
    assert info["sampling"]["seed"] == 5 and info["messages"][0] == {"role": "user", "content": "Hello there"}
    assert info["n_cached"] == len(info["tokens"]) and info["state_bytes"] > 0
    r = kvchat("session", "show", tiny)
    assert r.returncode == 1 and err_lines(r) == [f"error: {tiny}: not a kvchat session file (bad magic)"]


# ---- -n 0, empty prompts, closed stdout, unusable cache dirs -----------------------------------------


def test_n_predict_zero_generates_nothing(tiny, tmp_path):
    from kvchat.cli.session.session import read_session

    session = tmp_path / "s.kvs"
    r = kvchat("run", "-c", "256", "-n", "0", "-m", tiny, "--session", session, "-p", "hello")
    assert r.returncode == 0, r.stderr
    assert r.stdout == b""
    assert read_session(session).messages[-1] == {"role": "assistant", "content": ""}


@pytest.mark.parametrize("how", ["argv", "stdin", "spaces"])
def test_empty_prompt_is_refused_like_raw_mode(tiny, tmp_path, how):
    session = tmp_path / "s.kvs"
    if how == "argv":
        r = kvchat(*RUN, "-m", tiny, "--session", session, "-p", "")
    elif how == "stdin":
        r = kvchat(*RUN, "-m", tiny, "--session", session, input=b"")
    else:
        r = kvchat(*RUN, "-m", tiny, "--session", session, input=b"  \n\t\n")
    assert r.returncode == 1
    assert err_lines(r) == ["error: the prompt is empty: give some text"]
    assert not session.exists()
    raw = kvchat(*RUN, "-m", tiny, "--raw", "-p", "")
    assert raw.returncode == 1 and len(err_lines(raw)) == 1


def test_closed_stdout_is_one_line_and_the_turn_is_saved(tiny, tmp_path):
    from kvchat.cli.session.session import read_session

    session = tmp_path / "s.kvs"
    cmd = [
        sys.executable,
        "-c",
        "from kvchat.cli.app import main; main()",
        *RUN,
        "-m",
        str(tiny),
        "--session",
        str(session),
        "-p",
        "hello",
    ]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run(
        cmd,
        stdout=None,
        stderr=subprocess.PIPE,
        env=env,
        cwd=ROOT,
        timeout=TIMEOUT,
        pass_fds=(),
        stdin=subprocess.DEVNULL,
        preexec_fn=lambda: os.close(1),
    )
    assert r.returncode == 1
    assert err_lines(r) == [
        f"error: stdout is closed, so the answer could not be printed in full; the conversation is saved in {session}"
    ]
    assert read_session(session).messages[0]["content"] == "hello"


def test_reader_of_stdout_going_away_stops_the_answer_and_saves_it(tiny, tmp_path):
    from kvchat.cli.session.session import read_session

    session = tmp_path / "s.kvs"
    cmd = (
        f"{sys.executable} -c 'from kvchat.cli.app import main; main()' run -c 256 -n 200 --ignore-eos "
        f"--temp 0 -m {tiny} --session {session} -p hello | head -c 10 > /dev/null; "
        "echo rc=${PIPESTATUS[0]} >&2"
    )
    r = subprocess.run(
        ["bash", "-c", cmd], capture_output=True, env=dict(os.environ, PYTHONPATH=str(ROOT)), cwd=ROOT, timeout=TIMEOUT
    )
    lines = err_lines(r)
    assert lines == [
        f"error: stdout is closed, so the answer could not be printed in full; the conversation is saved in {session}",
        "rc=1",
    ]
    data = read_session(session)
    assert data.messages[0]["content"] == "hello" and data.messages[1]["role"] == "assistant"
    assert len(data.tokens) - data.n_dropped < 256  # stopped when the reader left, not at -n 200


@pytest.mark.parametrize("env", [{"KVCHAT_CACHE": "FILE"}, {"HOME": "/proc/1", "KVCHAT_CACHE": ""}])
def test_unusable_cache_directory_is_one_line(tiny, tmp_path, env):
    env = {k: (str(tiny) if v == "FILE" else v) for k, v in env.items()}
    r = kvchat(*RUN, "-m", "smollm2", "-p", "hello", env=env)
    assert r.returncode == 1
    (line,) = err_lines(r)
    assert line.startswith("error: cannot store SmolLM2-135M-Instruct.Q4_1.gguf in ")
    assert "must be a writable directory" in line
    r = kvchat(*RUN, "-m", tiny, "-p", "hello", env=env)  # a model path needs no cache: works
    assert r.returncode == 0, r.stderr


def test_invalid_utf8_in_strict_locale_stdin_file_and_piped_chat(tiny, tmp_path):
    """The first call is a real process started with the strict locale; the others emulate it
    in this process (a strict text layer over stdin, which is what the setting changes)."""
    from kvchat.cli.session.session import read_session

    s1, s2, s3 = tmp_path / "1.kvs", tmp_path / "2.kvs", tmp_path / "3.kvs"
    r = kvchat_process(*RUN, "-m", tiny, "--session", s1, input=b"ab\xffcd", env=STRICT)
    assert r.returncode == 0, r.stderr
    assert read_session(s1).messages[0]["content"] == "ab\ufffdcd"
    prompt = tmp_path / "p.txt"
    prompt.write_bytes(b"from \xc3 file")
    r = kvchat(*RUN, "-m", tiny, "--session", s2, "-f", prompt)
    assert r.returncode == 0, r.stderr
    assert read_session(s2).messages[0]["content"] == "from \ufffd file"
    r = kvchat(
        "chat", "-c", "256", "-n", "2", "-m", tiny, "--session", s3, input=b"piped \xfe line\n/exit\n", env=STRICT
    )
    assert r.returncode == 0, r.stderr
    assert_no_traceback(r)
    assert read_session(s3).messages[0]["content"] == "piped \ufffd line"
    r = kvchat("tokenize", "-m", tiny, "--no-bos", "-", input=b"x\xffy", env=STRICT)
    assert r.returncode == 0 and json.loads(r.stdout) == json.loads(
        kvchat("tokenize", "-m", tiny, "--no-bos", "x\ufffdy").stdout
    )


def test_session_on_a_text_file_is_refused_unless_forced(tiny, tmp_path):
    from kvchat.cli.session.session import read_session

    notes = tmp_path / "notes.txt"
    notes.write_text("precious")
    r = kvchat(*RUN, "-m", tiny, "--session", notes, "-p", "hello")
    assert r.returncode == 1 and err_lines(r) == [f"error: {notes}: not a kvchat session file (8 bytes)"]
    assert notes.read_text() == "precious"
    r = kvchat(*RUN, "-m", tiny, "--session", notes, "--force", "-p", "hello")
    assert r.returncode == 0, r.stderr
    assert "is not a kvchat session: starting a new conversation" in " ".join(r.stderr.decode().split())
    assert read_session(notes).messages[0]["content"] == "hello"
