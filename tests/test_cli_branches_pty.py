"""Branches and alternatives in `kvchat chat`, driven in a pty on a tiny model (fast lane):
/branch forks without decoding, the toolbar names the branch, /branches shows what is shared,
/drop frees only the branch's own cells, /alts N + /pick K keep one answer, and a session file
saves every branch and resumes them all (each continuing as it would have without the save)."""

import re

import pytest

from tests.helpers.gguf_factory import write_tiny_model
from tests.helpers.pty_chat import Chat, answer_of

pexpect = pytest.importorskip("pexpect")


@pytest.fixture
def chat_factory(tmp_path):
    model = write_tiny_model(
        tmp_path / "tiny.gguf", arch="qwen3", n_layer=2, n_embd=128, n_head=4, n_head_kv=2, n_ff=96
    )
    chats = []

    def make(*args):
        c = Chat(model, tmp_path, "-n", "6", *args)
        chats.append(c)
        return c

    yield make
    for c in chats:
        c.close()


def cells_of(kv_output: str, seq: int) -> int:
    return len(re.findall(rf"s{seq}:\d+", kv_output))


def test_branch_switch_branches_drop(chat_factory):
    chat = chat_factory()
    chat.say("hello there")
    n_main = chat.ctx_used
    out = chat.say("/branch alt")
    assert f"branch alt: forked at {n_main} tokens" in out and "[alt] ctx" in out
    assert chat.ctx_used == n_main  # nothing decoded: the cells are shared
    chat.say("a question on alt")
    n_alt = chat.ctx_used
    out = chat.say("/branches")
    assert re.search(r"\* alt\s+seq 1: \d+ tokens, 4 messages", out)
    assert re.search(rf"  main\s+seq 0: {n_main} tokens, 2 messages, shares \d+ cells", out)
    out = chat.say("/switch main")
    assert "on branch main: 2 messages" in out and chat.ctx_used == n_main
    kv = chat.say("/kv")
    own_alt = cells_of(kv, 1) - min(cells_of(kv, 0), cells_of(kv, 1))
    out = chat.say("/drop alt")
    m = re.search(r"dropped alt: (\d+) cells freed", out)
    assert m and int(m.group(1)) >= n_alt - n_main
    kv = chat.say("/kv")
    assert cells_of(kv, 1) == 0 and cells_of(kv, 0) == n_main
    assert "[alt]" not in kv and chat.exit() == 0
    assert own_alt >= 0


def test_alts_then_pick(chat_factory):
    chat = chat_factory("--temp", "0.9", "-s", "5")
    chat.say("tell me something")
    out = chat.say("/alts 3")
    assert "[1] (seed 6," in out and "[2] (seed 7," in out and "[3] (seed 8," in out
    assert "/pick 1..3 keeps one" in out
    assert "choose one of the alternatives first" in chat.say("/branch x")
    out = chat.say("/pick 2")
    assert "kept alternative 2" in out
    kv = chat.say("/kv")
    assert cells_of(kv, 1) == 0 and cells_of(kv, 2) == 0 and cells_of(kv, 0) == chat.ctx_used
    assert chat.exit() == 0


def test_a_session_saves_every_branch_and_resumes_them(chat_factory, tmp_path):
    session = tmp_path / "branches.kvs"
    chat = chat_factory()
    chat.say("first words")
    chat.say("/branch b")
    chat.say("words on b")
    out = chat.say(f"/save {session}")
    assert session.exists() and "saved" in out
    # what each branch says next without a save/resume
    want_b = answer_of(chat.say("and then on b"))
    chat.say("/switch main")
    want_main = answer_of(chat.say("and then on main"))
    chat.exit()

    again = chat_factory("--session", str(session))
    out = again.say("/branches")
    assert "* b " in out and "  main " in out
    assert answer_of(again.say("and then on b")) == want_b
    again.say("/switch main")
    assert answer_of(again.say("and then on main")) == want_main
    assert again.exit() == 0
