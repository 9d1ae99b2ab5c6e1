"""`kvchat chat` on the tiny hybrid (lfm2) and recurrent (mamba) models in a pseudo-terminal:
/regen and /undo come back to the state checkpointed before the answer (the same greedy answer
again, no prompt re-decoded for /regen), /save, exit and --session resume the recurrent and
KV state, and a full context on a recurrent memory stops with one line."""

import pytest

from tests.helpers.pty_chat import Chat, answer_of, decoded_prompt_tokens

pytest.importorskip("pexpect")


@pytest.fixture
def tiny_chat(reference_dir, tmp_path):
    chats = []

    def make(name, *args):
        c = Chat(reference_dir / "tiny" / f"{name}.gguf", tmp_path, *args)
        chats.append(c)
        return c

    yield make
    for c in chats:
        c.close()


def test_hybrid_chat_regen_undo_save_exit_resume(tiny_chat, tmp_path):
    session = tmp_path / "hybrid.kvs"
    chat = tiny_chat("lfm2_s1", "-n", "12")
    first = answer_of(chat.say("Hello there, who are you?"))
    assert first.strip()
    n_after_first = chat.ctx_used
    second = answer_of(chat.say("Tell me more about it."))
    assert second.strip() and chat.ctx_used > n_after_first
    n_after_second = chat.ctx_used

    # /regen restores the checkpoint taken before the answer: same greedy answer, nothing re-decoded
    again = answer_of(chat.say("/regen"))
    assert again == second
    assert decoded_prompt_tokens(chat.say("/stats")) == 0
    assert chat.ctx_used == n_after_second

    # /undo drops the exchange; asking again gives the same answer from the restored state
    chat.say("/undo")
    assert chat.ctx_used <= n_after_first
    assert answer_of(chat.say("Tell me more about it.")) == second
    assert chat.ctx_used == n_after_second

    kv = chat.say("/kv")
    assert "recurrent states: 1/1 cells used" in kv and "KV cache attn" in kv
    mem = chat.say("/mem")
    assert "recurrent states" in mem and "bytes per sequence" in mem

    out = chat.say(f"/save {session}")
    assert f"to {session}" in out and session.exists()
    n_saved = chat.ctx_used
    assert chat.exit() == 0

    resumed = tiny_chat("lfm2_s1", "-n", "12", "--session", str(session))
    assert resumed.ctx_used == n_saved
    out = resumed.say("And then?")
    assert answer_of(out).strip()
    assert 0 < decoded_prompt_tokens(resumed.say("/stats")) <= 20  # only the new turn
    assert resumed.exit() == 0


@pytest.mark.parametrize("name", ["mamba_s1", "lfm2_s1"])
def test_a_full_context_on_a_recurrent_memory_stops_with_one_line(tiny_chat, name):
    chat = tiny_chat(name, "-n", "400", "--ignore-eos")
    out = chat.say("Write a very long story about a lighthouse keeper.")
    lines = [l for l in out.splitlines() if "context full" in l]
    assert len(lines) == 1, out
    assert "recurrent state cannot drop old tokens: answer stopped" in lines[0]
    assert chat.ctx_used == 256
    chat.say("/clear")
    assert chat.ctx_used == 0
    assert chat.exit() == 0
