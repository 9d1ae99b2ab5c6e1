"""The conversation engine on the tiny recurrent (mamba) and hybrid (qwen35) models: /regen and
/undo go back to the state checkpointed before the answer / the prompt - the same greedy answer
again, only the tokens after the checkpoint decoded - and a session's state resumes."""

import pytest

from kvchat.runtime.chat.conversation import Conversation, ConversationConfig
from kvchat.runtime.context import Context
from kvchat.runtime.cparams import ContextParams
from kvchat.runtime.model import Model
from kvchat.runtime.sampling import Sampler, SamplingParams
from kvchat.runtime.text.chat_template import ChatTemplate


@pytest.fixture(scope="module", params=["mamba_s1", "qwen35_s1"])
def model(request, reference_dir):
    m = Model.load(reference_dir / "tiny" / f"{request.param}.gguf")
    yield m
    m.close()


def conversation(model):
    ctx = Context(model, ContextParams(n_ctx=512, n_batch=512, n_ubatch=512))
    return Conversation(
        ctx,
        model.vocab,
        ChatTemplate.from_gguf(model.gguf, model.vocab),
        Sampler(SamplingParams(temp=0.0, seed=1)),
        ConversationConfig(n_predict=10),
    )


def test_regen_restores_the_checkpoint_and_gives_the_same_answer_without_decoding(model):
    conv = conversation(model)
    conv.ask("Hello there.")
    conv.ask("Tell me more.")
    answer, n_cached = conv.messages[-1]["content"], conv.n_cached
    s = conv.regenerate()
    assert s.n_prompt == 0 and conv.messages[-1]["content"] == answer
    assert conv.n_cached == n_cached
    assert conv.ctx.memory.seq_pos_max(0) == n_cached - 1


def test_undo_then_the_same_question_gives_the_same_answer_decoding_only_the_new_turn(model):
    conv = conversation(model)
    conv.ask("Hello there.")
    n_first = conv.n_cached
    conv.ask("Tell me more.")
    answer = conv.messages[-1]["content"]
    conv.undo()
    assert conv.n_cached <= n_first and conv.n_cached > 0  # back to a checkpoint, not to zero
    s = conv.ask("Tell me more.")
    assert conv.messages[-1]["content"] == answer
    assert s.n_prompt < n_first + 12  # the new turn (and the checkpoint's gap), not the whole chat


def test_session_state_round_trips_into_a_fresh_context(model):
    conv = conversation(model)
    conv.ask("Hello there.")
    saved = conv.session_state()
    conv.ask("Tell me more.")
    want = conv.messages[-1]["content"]
    fresh = conversation(model)
    fresh.restore(saved["messages"], saved["tokens"], saved["n_dropped"], saved["n_keep"], saved["state"])
    s = fresh.ask("Tell me more.")
    assert fresh.messages[-1]["content"] == want
    assert 0 < s.n_prompt < 20
