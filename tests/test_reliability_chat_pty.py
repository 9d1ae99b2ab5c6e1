"""`kvchat chat` in a pseudo-terminal on a tiny random model, pushed the way a hurried user does:
locked sessions, /save over the wrong file, /load under --session, double Ctrl-C, odd bytes."""

import os
import re
import time

import pytest

from tests.helpers.gguf_factory import write_tiny_model
from tests.helpers.pty_chat import ACCEPTED, READY, Chat, chats_on, flat


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("m") / "tiny.gguf")


@pytest.fixture
def chat(tiny, tmp_path):
    yield from chats_on(tiny, tmp_path, cwd=tmp_path)


def session_users(path):
    from kvchat.cli.session.session import read_session

    return [m["content"] for m in read_session(path).messages if m["role"] == "user"]


# ---- sessions --------------------------------------------------------------------------------------


def test_chat_on_a_session_held_by_another_process_is_refused(chat, tmp_path):
    from kvchat.cli.session.file import SessionLock

    s = tmp_path / "s.kvs"
    with SessionLock(s):
        c = chat("--session", str(s), ready=False)
        out = flat(c.rest())
    assert f"error: session file {s} is in use by process {os.getpid()}" in out
    assert c.child.exitstatus == 1 and "Traceback" not in out


def test_save_over_a_text_file_is_refused_unless_forced(chat, tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("precious")
    c = chat("-n", "2")
    c.say("hello")
    out = flat(c.say(f"/save {notes}"))
    assert "is not a kvchat session file: not overwriting it" in out
    assert notes.read_text() == "precious"
    out = c.say(f"/save! {notes}")
    assert "saved 2 messages" in out
    assert session_users(notes) == ["hello"]
    assert c.exit() == 0


def test_load_under_session_moves_autosave_and_leaves_the_session_file_alone(chat, tmp_path):
    s, other = tmp_path / "s.kvs", tmp_path / "other.kvs"
    c = chat("-n", "2")
    c.say("the other conversation")
    c.say(f"/save {other}")
    assert c.exit() == 0
    c = chat("-n", "2", "--session", str(s))
    c.say("my own conversation")
    before = s.read_bytes()
    out = flat(c.say(f"/load {other}"))
    assert f"autosave now goes to {other} ({s} is left as it was)" in out
    c.say("continuing the other one")
    assert c.exit() == 0
    assert s.read_bytes() == before and session_users(s) == ["my own conversation"]
    assert session_users(other) == ["the other conversation", "continuing the other one"]


def test_load_of_a_file_another_process_holds_is_refused(chat, tmp_path):
    from kvchat.cli.session.file import SessionLock

    s, other = tmp_path / "s.kvs", tmp_path / "other.kvs"
    c = chat("-n", "2")
    c.say("x")
    c.say(f"/save {other}")
    assert c.exit() == 0
    c = chat("-n", "2", "--session", str(s))
    c.say("mine")
    with SessionLock(other):
        out = flat(c.say(f"/load {other}"))
    assert f"session file {other} is in use by process {os.getpid()}" in out
    assert c.ctx_used > 0
    c.say("still mine")
    assert c.exit() == 0
    assert session_users(s) == ["mine", "still mine"]


def test_save_path_with_spaces_is_quoted_like_set(chat, tmp_path):
    c = chat("-n", "2")
    c.say("hello")
    target = tmp_path / "my talks" / "first talk.kvs"
    target.parent.mkdir()
    out = flat(c.say(f'/save "{target}"'))
    assert f"to {target}" in out
    assert session_users(target) == ["hello"]
    out = flat(c.say(f"/load '{target}'"))
    assert "loaded" in out
    out = flat(c.say('/save "unterminated'))
    assert "quote a file name with spaces" in out
    assert c.exit() == 0


@pytest.mark.parametrize("sys_args", [(), ("-sys", "Be brief.")])
def test_clear_with_session_empties_the_file_too(chat, tmp_path, sys_args):
    s = tmp_path / "s.kvs"
    c = chat("-n", "2", "--session", str(s), *sys_args)
    c.say("remember this")
    assert session_users(s) == ["remember this"]
    out = flat(c.say("/clear"))
    assert f"{s} emptied" in out
    assert session_users(s) == []
    assert c.exit() == 0
    assert session_users(s) == []  # leaving does not bring it back
    c = chat("-n", "2", "--session", str(s))
    assert c.ctx_used == 0


def test_double_ctrl_c_stops_the_answer_and_does_not_quit(chat, tmp_path):
    c = chat("-n", "400", "--ignore-eos")
    c.child.sendline("write a lot")
    c.wait(ACCEPTED)
    time.sleep(0.5)
    c.child.send("\x03")
    c.child.send("\x03")  # the impatient second press
    out = c.wait(READY)
    time.sleep(0.3)
    c.child.send("\x03")  # and one more on the empty prompt
    out += c.wait(r"Ctrl-D or /exit leaves the chat")
    assert c.child.isalive()
    assert "decode aborted" not in out and "Traceback" not in out
    kv = flat(c.say("/kv"))
    assert re.search(r"(\d+)/256 cells used", kv)
    c.say("/stats")
    assert c.exit() == 0


def test_typed_escape_sequences_and_invalid_bytes_do_not_break_the_line_editor(chat, tmp_path):
    c = chat("-n", "2")
    out = c.say("hello \x1b[0m world")
    assert "Unhandled exception" not in out and "Press ENTER" not in out
    os.write(c.child.child_fd, b"caf\xe9 \xff ok\r")  # bytes a terminal passes on as typed
    c.wait(ACCEPTED)
    out = c.wait(READY)
    assert "Traceback" not in out and "Unhandled exception" not in out
    saved = tmp_path / "t.kvs"
    c.say(f"/save {saved}")
    assert c.exit() == 0
    users = session_users(saved)
    assert users[0] == "hello \x1b[0m world"
    assert users[1] == "caf\ufffd \ufffd ok"


def test_damaged_model_in_the_chat_is_one_line_and_exit_1(tmp_path):
    import gguf
    import numpy as np

    path = write_tiny_model(tmp_path / "damaged.gguf")
    reader = gguf.GGUFReader(path, "r+")
    for t in reader.tensors:
        if t.name == "output_norm.weight":
            t.data[:] = np.nan
    del reader
    c = Chat(path, tmp_path, "-n", "2", cwd=tmp_path)
    try:
        c.child.sendline("hello")
        out = flat(c.rest())
    finally:
        c.close()
    assert "error: damaged.gguf: the model produced NaN logits: its weights are damaged" in out
    assert "Traceback" not in out and c.child.exitstatus == 1


def test_unusable_cache_dir_keeps_the_chat_working(chat, tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    c = chat("-n", "2", env={"KVCHAT_CACHE": str(not_a_dir)})
    out = c.say("hello")
    assert "Traceback" not in out
    assert c.exit() == 0
