"""Thinking models: markers read from the vocabulary, the parser and the budget on token streams,
the templates' own switches (Qwen3's enable_thinking, gpt-oss's reasoning_effort) rendered as the
templates render them, and a thinking answer on a tiny model written with Qwen3's template."""

from pathlib import Path

import jinja2
import numpy as np
import pytest

from kvchat.runtime.text.reasoning import ANSWER, MARKUP, THINK, ReasoningParser, detect, template_switches
from tests.helpers.gguf_factory import CONTROL, USER_DEFINED, printable_token_ids, write_tiny_model

TEMPLATES = Path(__file__).parent / "data" / "templates"
QWEN3 = (TEMPLATES / "qwen3.jinja").read_text()
GPT_OSS = (TEMPLATES / "gpt-oss.jinja").read_text()
THINK_TOKENS = (("<think>", USER_DEFINED), ("</think>", USER_DEFINED))
HARMONY_TOKENS = tuple(
    (t, CONTROL) for t in ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>")
)


def vocab_of(path):
    from kvchat.runtime.gguf.file import GGUFFile
    from kvchat.runtime.text.vocab import Vocab

    return Vocab.from_gguf(GGUFFile(path))


# Qwen3's template with the generation prompt opening the thinking span, as the thinking-only
# releases (Qwen3-*-Thinking-2507) and DeepSeek-R1's distills do: the answer starts inside it
QWEN3_OPENED = QWEN3.replace("{{- '<|im_start|>assistant\\n' }}", "{{- '<|im_start|>assistant\\n<think>\\n' }}")


def tiny_thinker(path, template):
    """A tiny llama with `template` and <think>/</think> in its vocabulary, saying printable text
    and </think> (so its thinking can also end on its own)."""
    write_tiny_model(path, arch="llama", chat_template=template, added_tokens=THINK_TOKENS, n_ctx_train=4096)
    ids = printable_token_ids() + [vocab_of(path).token_to_id["</think>"]]
    return write_tiny_model(
        path, arch="llama", chat_template=template, added_tokens=THINK_TOKENS, n_ctx_train=4096, output_tokens=ids
    )


@pytest.fixture(scope="module")
def qwen3_model(tmp_path_factory):
    return tiny_thinker(tmp_path_factory.mktemp("qwen3") / "qwen3-think.gguf", QWEN3)


@pytest.fixture(scope="module")
def qwen3_vocab(qwen3_model):
    return vocab_of(qwen3_model)


@pytest.fixture(scope="module")
def harmony_vocab(tmp_path_factory):
    path = tmp_path_factory.mktemp("oss") / "oss.gguf"
    return vocab_of(write_tiny_model(path, arch="llama", chat_template=GPT_OSS, added_tokens=HARMONY_TOKENS))


def ids_of(vocab, text):
    return vocab.tokenize(text, add_special=False, parse_special=True)


def kinds(parser, vocab, ids):
    return [parser.feed(t, vocab.token_to_piece(t).decode()) for t in ids]


# ---- markers from the vocabulary ---------------------------------------------------------------


def test_detect_reads_the_vocabulary(qwen3_vocab, harmony_vocab, tiny_chat):
    f = detect(qwen3_vocab)
    assert (f.kind, f.start, f.end, f.close) == (
        "tags",
        qwen3_vocab.token_to_id["<think>"],
        qwen3_vocab.token_to_id["</think>"],
        (qwen3_vocab.token_to_id["</think>"],),
    )
    h = detect(harmony_vocab)
    assert h.kind == "channels"
    assert harmony_vocab.detokenize(h.close, special=True) == "<|end|><|start|>assistant<|channel|>final<|message|>"
    assert detect(vocab_of(tiny_chat)) is None  # ChatML alone: no thinking
    assert template_switches(QWEN3) == {"enable_thinking": True, "reasoning_effort": False}
    assert template_switches(GPT_OSS) == {"enable_thinking": False, "reasoning_effort": True}


# ---- the parser and the budget on token streams ------------------------------------------------


def test_tags_stream_sorted_into_thinking_and_answer(qwen3_vocab):
    v = qwen3_vocab
    p = ReasoningParser(detect(v), prompt=ids_of(v, "<|im_start|>assistant\n"))
    assert p.state == "start" and p.may_open == v.token_to_id["<think>"] and p.in_answer
    stream = ids_of(v, "<think>hello the</think>\n\nhello")
    got = kinds(p, v, stream)
    n_think = len(ids_of(v, "hello the"))
    assert got == [MARKUP] + [THINK] * n_think + [MARKUP] + [ANSWER] * (len(stream) - n_think - 2)
    assert p.n_thinking == n_think and p.in_answer and p.forced() is None


def test_budget_forces_the_end_after_exactly_n_thinking_tokens(qwen3_vocab):
    v = qwen3_vocab
    end = v.token_to_id["</think>"]
    for budget in (0, 1, 3):
        p = ReasoningParser(detect(v), prompt=ids_of(v, "<|im_start|>assistant\n"), budget=budget)
        p.feed(v.token_to_id["<think>"])
        n = 0
        while p.forced() is None:
            assert p.feed(ids_of(v, "a")[0], "a") == THINK
            n += 1
        assert n == budget and p.forced() == end
        assert p.feed(end) == MARKUP and p.n_forced == 1 and p.in_answer
    p = ReasoningParser(detect(v), prompt=[], budget=0)
    assert p.may_open is None  # budget 0: thinking never opens under a grammar


def test_where_the_template_left_off(qwen3_vocab):
    v = qwen3_vocab
    opened = ReasoningParser(detect(v), prompt=ids_of(v, "<|im_start|>assistant\n<think>\n"))
    assert opened.thinking and not opened.in_answer  # DeepSeek-R1-style: the prompt opened it
    closed = ReasoningParser(detect(v), prompt=ids_of(v, "<|im_start|>assistant\n<think>\n\n</think>\n\n"))
    assert closed.state == "answer" and closed.may_open is None  # Qwen3 with enable_thinking=false
    history = ids_of(v, "<think>x</think>old<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert ReasoningParser(detect(v), prompt=history).state == "start"  # an old closed span


def test_channels_stream(harmony_vocab):
    v = harmony_vocab
    p = ReasoningParser(detect(v), prompt=ids_of(v, "<|start|>assistant"))
    text = "<|channel|>analysis<|message|>hello the<|end|><|start|>assistant<|channel|>final<|message|>hello"
    stream = ids_of(v, text)
    got = kinds(p, v, stream)
    shown = {k: v.detokenize([t for t, k2 in zip(stream, got) if k2 == k]) for k in (THINK, ANSWER)}
    assert shown == {THINK: "hello the", ANSWER: "hello"}
    p = ReasoningParser(detect(v), prompt=[], budget=2)
    for t in ids_of(v, "<|channel|>analysis<|message|>ab"):
        p.feed(t, v.token_to_piece(t).decode())
    assert p.n_thinking == 2
    forced = []
    while p.forced() is not None:
        forced.append(p.forced())
        p.feed(forced[-1], v.token_to_piece(forced[-1]).decode())
    assert v.detokenize(forced, special=True) == "<|end|><|start|>assistant<|channel|>final<|message|>"
    assert p.in_answer and p.channel == "final"


# ---- templates: the switches as the templates themselves render them ----------------------------


def reference_render(source, messages, **kw):
    """The template rendered as transformers renders it (plain jinja2, trim/lstrip blocks)."""
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = lambda m: (_ for _ in ()).throw(ValueError(m))
    env.globals["strftime_now"] = lambda f: "2026-12-03"
    return env.from_string(source).render(messages=messages, add_generation_prompt=True, **kw)


def templated(path, **config):
    """A Conversation that only renders (no Context): the file's vocabulary and template."""
    from kvchat.runtime.chat.conversation import Conversation, ConversationConfig
    from kvchat.runtime.gguf.file import GGUFFile
    from kvchat.runtime.sampling import Sampler
    from kvchat.runtime.text.chat_template import ChatTemplate
    from kvchat.runtime.text.vocab import Vocab

    gf = GGUFFile(path)
    vocab = Vocab.from_gguf(gf)
    return Conversation(None, vocab, ChatTemplate.from_gguf(gf, vocab), Sampler(), ConversationConfig(**config))


def conversation(path, **config):
    from kvchat.runtime.chat.conversation import Conversation, ConversationConfig
    from kvchat.runtime.context import Context
    from kvchat.runtime.cparams import ContextParams
    from kvchat.runtime.model import Model
    from kvchat.runtime.sampling import Sampler, SamplingParams
    from kvchat.runtime.text.chat_template import ChatTemplate

    model = Model.load(path)
    ctx = Context(model, ContextParams(n_ctx=512, n_batch=64, n_ubatch=64))
    tpl = ChatTemplate.from_gguf(model.gguf, model.vocab)
    return Conversation(ctx, model.vocab, tpl, Sampler(SamplingParams(temp=0.8, seed=3)), ConversationConfig(**config))


def test_reasoning_off_renders_byte_equal_to_the_template(qwen3_model):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why is the sky blue?"}]
    off = templated(qwen3_model, reasoning="off")
    assert off.render_text(msgs) == reference_render(QWEN3, msgs, enable_thinking=False)
    assert off.render_text(msgs).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    on = templated(qwen3_model, reasoning="on")
    assert on.render_text(msgs) == reference_render(QWEN3, msgs, enable_thinking=True)
    auto = templated(qwen3_model)
    assert auto.render_text(msgs) == reference_render(QWEN3, msgs)
    assert auto.render_text(msgs).endswith("<|im_start|>assistant\n")


def test_reasoning_effort_reaches_gpt_oss_template(tmp_path):
    path = write_tiny_model(tmp_path / "oss.gguf", arch="llama", chat_template=GPT_OSS, added_tokens=HARMONY_TOKENS)
    msgs = [{"role": "user", "content": "hi"}]
    conv = templated(path, reasoning_effort="high")
    text = conv.render_text(msgs)
    assert "Reasoning: high" in text and text.endswith("<|start|>assistant")
    assert "Reasoning: medium" in templated(path).render_text(msgs)  # the template's default
    # an answer's thinking goes to the template as "thinking" (gpt-oss's field) for the last turn
    done = msgs + [{"role": "assistant", "content": "hello", "reasoning_content": "pondering"}]
    tail = conv.render_text(done, add_generation_prompt=False)
    assert tail.endswith(
        "<|channel|>analysis<|message|>pondering<|end|><|start|>assistant<|channel|>final<|message|>hello<|return|>"
    )


# ---- a thinking answer on the tiny Qwen3-template model -----------------------------------------


def test_answer_thinks_apart_and_the_next_turn_reuses_the_cache(tmp_path):
    from kvchat.runtime.chat.refit import common_prefix

    path = tiny_thinker(tmp_path / "opened.gguf", QWEN3_OPENED)
    assert QWEN3_OPENED != QWEN3
    conv = conversation(path, n_predict=60, reasoning_budget=10)
    v = conv.vocab
    end = v.token_to_id["</think>"]
    shown_think, shown_answer = [], []
    conv.on_thinking = shown_think.append
    stats = conv.ask("Why?", on_text=shown_answer.append)
    prompt_len = len(conv.tokens) - stats.n_gen_decoded
    gen = conv.tokens[prompt_len:]
    assert conv.tokens[prompt_len - 2 : prompt_len] == ids_of(v, "<think>\n")  # the template opened it
    k = gen.index(end)  # ended by the model, or forced at the budget
    assert stats.n_thinking == k <= 10
    answer = conv.messages[-1]
    assert answer["reasoning_content"] == v.detokenize(gen[:k]).strip() == "".join(shown_think).strip()
    assert answer["content"] == "".join(shown_answer)
    assert answer["content"].startswith(v.detokenize(gen[k + 1 :]).lstrip())  # (+ the last, undecoded token)
    # second turn: Qwen3's template drops the old thinking, so the cache is reused up to the
    # first token that differs (the start of that answer) and only the rest is decoded
    before = list(conv.tokens)
    desired = conv.render(conv.messages + [{"role": "user", "content": "And?"}])
    stats2 = conv.ask("And?")
    keep = common_prefix(before, desired)
    assert stats2.n_prompt == len(desired) - keep
    assert keep == prompt_len - 2  # everything before "<think>\n" of the first answer


# ---- the answer stream: budget and grammar around the thinking span ------------------------------


class ScriptedSampler:
    """Gives the scripted tokens in order, skipping (and recording) those the mask refuses, and
    records the mask it was handed each time."""

    def __init__(self, script):
        self.script = list(script)
        self.masks = []
        self.refused = []

    def sample(self, logits, history=None, allowed=None):
        self.masks.append(None if allowed is None else np.asarray(allowed).copy())
        while allowed is not None and not allowed[self.script[0]]:
            self.refused.append(self.script.pop(0))
        return self.script.pop(0)


def test_grammar_starts_after_the_thinking_span(qwen3_vocab):
    from kvchat.runtime.chat.answer import AnswerStream
    from kvchat.runtime.grammar.matcher import Constraint
    from kvchat.runtime.grammar.spec import GrammarSpec

    v = qwen3_vocab
    think, end = v.token_to_id["<think>"], v.token_to_id["</think>"]
    matcher = Constraint(GrammarSpec("gbnf", 'root ::= "yes" | "no"', "--grammar"), v).matcher()
    parser = ReasoningParser(detect(v), prompt=ids_of(v, "<|im_start|>assistant\n"), budget=3)
    shown = {"think": [], "answer": []}
    stream = AnswerStream(v, matcher, parser, shown["answer"].append, shown["think"].append)
    words = ids_of(v, "hello the")  # 3 tokens of thinking: none of them fits the grammar
    assert len(words) == 3
    sampler = ScriptedSampler([think] + words + ids_of(v, "\n\nno"))
    logits = np.zeros(v.n_vocab, dtype=np.float32)
    out = []
    while not stream.is_last():
        out.append(stream.choose(sampler, logits, []))
        stream.emit(out[-1])
    # first token: the grammar's first letters and the opener; inside thinking no mask at all
    first = set(np.nonzero(sampler.masks[0])[0])
    assert first == {think} | {ids_of(v, "y")[0], ids_of(v, "n")[0]}
    assert sampler.masks[1:4] == [None, None, None]
    # the budget of 3 forced </think> (no draw), then the grammar applied ("\n\n" was not allowed)
    assert out[:5] == [think] + words + [end]
    assert sampler.refused == ids_of(v, "\n\n")  # after the span the grammar's mask applies
    assert len(sampler.masks) == 4 + 2 and out[5:] == ids_of(v, "no")
    assert "".join(shown["think"]).strip() == "hello the" and stream.reasoning == "hello the"
    assert stream.content in ("yes", "no") and stream.content == "".join(shown["answer"])
