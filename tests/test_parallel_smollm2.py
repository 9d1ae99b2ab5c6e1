"""Many sequences on the real SmolLM2 (agreement checks; the fast tests are tests/test_parallel.py).

A sequence's logits are the same bits as a solo run's whatever shares the batch and the cache:
with one stream per sequence it occupies a solo run's cells; in the unified cache (the default)
attention reads its interleaved cells through a position view (runtime/memory/kv_view.py,
docs/parallel.md). So greedy and sampled answers equal `kvchat run --seed S+i` byte for byte,
in both layouts (issue #24: before the view, 6 of 8 unified `--prompts-file` answers did)."""

import json
from os.path import commonprefix

import pytest

from tests.test_cli_run import kvchat

pytestmark = pytest.mark.real_model
PROMPT = "Write a haiku about the sea."


def texts(r):
    assert r.returncode == 0, r.stderr
    return [json.loads(l)["text"] for l in r.stdout.splitlines() if l.startswith("{")]


def test_four_greedy_alternatives_equal_the_single_answer(smollm2_path):
    alts = texts(
        kvchat(
            "run",
            "-m",
            smollm2_path,
            "-p",
            PROMPT,
            "-np",
            "4",
            "--temp",
            "0",
            "-n",
            "40",
            "-c",
            "1024",
            "--no-kv-unified",
            "--jsonl",
        )
    )
    solo = kvchat("run", "-m", smollm2_path, "-p", PROMPT, "--temp", "0", "-n", "40", "-c", "1024")
    assert solo.returncode == 0, solo.stderr
    assert alts == [solo.stdout[:-1]] * 4 and len(alts[0]) > 40
    unified = texts(
        kvchat("run", "-m", smollm2_path, "-p", PROMPT, "-np", "4", "--temp", "0", "-n", "40", "-c", "1024", "--jsonl")
    )
    assert unified == [solo.stdout[:-1]] * 4


def test_sampled_alternatives_equal_runs_with_seed_s_plus_i_with_a_stream_per_sequence(smollm2_path):
    p = "Tell me a short story about a robot."
    alts = texts(
        kvchat(
            "run",
            "-m",
            smollm2_path,
            "-p",
            p,
            "-np",
            "4",
            "--temp",
            "0.8",
            "-s",
            "100",
            "-n",
            "48",
            "-c",
            "2048",
            "--no-kv-unified",
            "--jsonl",
        )
    )
    for i, a in enumerate(alts):
        solo = kvchat("run", "-m", smollm2_path, "-p", p, "--temp", "0.8", "-s", str(100 + i), "-n", "48", "-c", "2048")
        assert solo.stdout == a + "\n", i
    assert len(set(alts)) == 4


def test_sixteen_prompts_on_four_sequences_give_the_solo_greedy_answers(smollm2_path):
    from kvchat.runtime.chat.conversation import Conversation, ConversationConfig
    from kvchat.runtime.context import Context
    from kvchat.runtime.cparams import ContextParams
    from kvchat.runtime.model import Model
    from kvchat.runtime.sampling import Sampler, SamplingParams
    from kvchat.runtime.serving.parallel import ParallelRunner, Request
    from kvchat.runtime.text.chat_template import ChatTemplate

    model = Model.load(smollm2_path)
    template = ChatTemplate.from_gguf(model.gguf, model.vocab)
    topics = [
        "the sea",
        "a robot",
        "coffee",
        "winter",
        "a city",
        "the moon",
        "cats",
        "music",
        "rain",
        "a library",
        "trains",
        "mountains",
        "bread",
        "a clock",
        "friendship",
        "fire",
    ]
    prompts = [f"In one sentence, what is {t}?" for t in topics]

    def conv(ctx, n_predict=24):
        return Conversation(
            ctx,
            model.vocab,
            template,
            Sampler(SamplingParams(temp=0.0, seed=0)),
            ConversationConfig(n_predict=n_predict),
        )

    solo = []
    for p in prompts:
        c = conv(Context(model, ContextParams(n_ctx=512)))
        c.ask(p)
        solo.append(c.messages[-1]["content"])
    ctx = Context(model, ContextParams(n_ctx=2048, n_seq_max=5, kv_unified=False))  # exact: module docstring
    c = conv(ctx)
    reqs = [Request(i, c.render([{"role": "user", "content": p}]), seed=i) for i, p in enumerate(prompts)]
    shared = list(commonprefix([r.ids for r in reqs]))
    runner = ParallelRunner(ctx, model.vocab, SamplingParams(temp=0.0), 4, n_predict=24)
    results = runner.run(reqs, shared_prefix=shared)
    assert len(shared) > 20  # SmolLM2's default system prompt, decoded once
    assert [r.text for r in results] == solo


def test_a_prompts_file_at_np_4_gives_the_solo_answers_with_default_flags(smollm2_path, tmp_path):
    topics = ["the sea", "a robot", "coffee", "winter", "a city", "the moon", "cats", "music"]
    prompts = [f"In one sentence, what is {t}?" for t in topics]
    f = tmp_path / "prompts.txt"
    f.write_text("\n".join(prompts) + "\n")
    par = texts(
        kvchat("run", "-m", smollm2_path, "--prompts-file", str(f), "-np", "4", "--temp", "0", "-n", "16", "--jsonl")
    )
    solo = []
    for p in prompts:
        r = kvchat("run", "-m", smollm2_path, "-p", p, "--temp", "0", "-n", "16")
        assert r.returncode == 0, r.stderr
        solo.append(r.stdout[:-1])
    assert par == solo
