"""`kvchat chat` in a pseudo-terminal on the tiny ChatML model: the REPL's contract without a real
model — incremental turns, /regen, /save and /load (refusals leave the chat intact), resume with
--session, Ctrl-C during an answer, context shift and its absence, /set checks. What the answers
say is SmolLM2's business (tests/test_cli_chat_pty.py); here only what the chat does with them."""

import re

import pytest

from tests.helpers.pty_chat import ACCEPTED, READY, chats_on, decoded_prompt_tokens

pexpect = pytest.importorskip("pexpect")


@pytest.fixture
def chat_factory(tiny_chat, tmp_path):
    yield from chats_on(tiny_chat, tmp_path)


def test_turns_regen_sessions_and_refused_loads(chat_factory, tmp_path):
    from kvchat.cli.session.session import decode_session, encode_session, read_session

    chat = chat_factory("-n", "12")
    chat.say("My name is Zoltan.")
    first = chat.ctx_used
    assert first > 12
    chat.say("What is my name?")
    # only the new turn was decoded: the cache grew by at least what was decoded
    assert 0 < decoded_prompt_tokens(chat.say("/stats")) <= chat.ctx_used - first
    before = chat.ctx_used
    chat.say("/regen")
    assert decoded_prompt_tokens(chat.say("/stats")) == 0 and chat.ctx_used == before

    good = tmp_path / "good.kvs"
    out = chat.say(f"/save {good}")
    assert f"to {good}" in out and good.exists()
    used = chat.ctx_used
    corrupt = tmp_path / "corrupt.kvs"
    blob = bytearray(good.read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    corrupt.write_bytes(bytes(blob))
    assert "corrupted" in chat.say(f"/load {corrupt}")
    data = decode_session(good.read_bytes())
    data.cache["type_k"] = "q8_0"
    other = tmp_path / "other.kvs"
    other.write_bytes(encode_session(data))
    out = chat.say(f"/load {other}")
    assert "saved with type_k=q8_0" in out and "-ctk" in out
    assert "does not exist" in chat.say(f"/load {tmp_path / 'missing.kvs'}")
    assert chat.ctx_used == used  # every refusal left the live chat as it was
    out = chat.say("/set top-p 5")
    assert "error: /set top-p: must be within 0.0..1.0 (got 5.0)" in out
    assert chat.exit() == 0

    resumed = chat_factory("-n", "12", "--session", str(good))
    assert resumed.ctx_used == used  # the cache is back, nothing re-processed
    resumed.say("Say my name once more.")
    assert 0 < decoded_prompt_tokens(resumed.say("/stats")) <= resumed.ctx_used - used
    assert resumed.exit() == 0
    saved = read_session(good)
    assert saved.messages[-2]["content"] == "Say my name once more."


def test_ctrl_c_context_shift_and_its_absence(chat_factory):
    # The turns whose assertions depend on the cache's size follow an answer bounded by -n, not by
    # a timed Ctrl-C: 260 tokens pass -c 256 once (a shift makes room) and end at the same cache
    # size on every machine, so whether the next turn shifts again is fixed too.
    chat = chat_factory("-n", "260", "--ignore-eos")
    out = chat.say("Tell me everything.")
    assert re.search(r"context full: dropped \d+ tokens after the first \d+", out)  # shifted, went on
    assert 0 < chat.ctx_used <= 256
    stats = chat.say("/stats")
    assert int(re.search(r"(\d+) in total", stats).group(1)) >= 256  # up to -c 256 and past it:
    assert int(re.search(r"(\d+) dropped", stats).group(1)) > 0  # a shift made room
    chat.say("/set n-predict 8")
    before = chat.ctx_used
    assert before + 48 < 256  # room for the next turn (about 36 tokens) without another shift
    chat.say("And then?")
    assert 0 < decoded_prompt_tokens(chat.say("/stats")) <= chat.ctx_used - before  # cache consistent
    assert f"{chat.ctx_used}/256 cells used" in chat.say("/kv")

    # Ctrl-C during an answer that already shifted: where it lands is timing, so only what holds
    # wherever it lands is asserted (the partial answer kept, the cache consistent with the chat).
    chat.say("/set n-predict -1")
    chat.child.sendline("Tell me more.")
    chat.wait(ACCEPTED)
    chat.wait(r"context full: dropped \d+ tokens after the first \d+")  # shifted, still going
    chat.child.send("\x03")
    out = chat.wait(READY)
    assert "stopped (the partial answer is kept)" in out
    assert 0 < chat.ctx_used <= 256
    assert f"{chat.ctx_used}/256 cells used" in chat.say("/kv")

    chat.say("/clear")  # the context-shift-off turns start from an empty cache: their sizes are fixed
    chat.say("/set context-shift off")
    chat.say("/set n-predict 400")
    out = chat.say("More, please.")
    assert "context shift is off: answer stopped" in out and chat.ctx_used == 256
    out = chat.say("And then?")
    assert "error: the prompt needs" in out and "context of 256 tokens" in out and "/clear" in out
    assert chat.ctx_used == 256  # refused: nothing changed
    chat.say("/clear")
    assert chat.ctx_used == 0
    assert chat.exit() == 0
