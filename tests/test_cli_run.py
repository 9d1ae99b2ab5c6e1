"""`kvchat run` on SmolLM2 and on the tiny ChatML model, run in this process (tests/helpers/cli_inproc.py):
stdout carries only the answer, errors are one line."""

import json

import numpy as np
import pytest

from tests.helpers.cli_inproc import kvchat

# tests that take smollm2_path are marked real_model by tests/conftest.py; --help and usage
# errors need no model and run in the fast lane
CHAT_PROMPT = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n<|im_start|>user\nWhat is a KV cache in a transformer?<|im_end|>\n"
    "<|im_start|>assistant\n"
)


@pytest.fixture(
    params=[
        pytest.param("tiny_chat", id="tiny"),
        pytest.param("smollm2_path", id="smollm2", marks=pytest.mark.real_model),
    ]
)
def any_model(request):
    """The contract tests that hold for any chat model: on the tiny ChatML model (fast lane) and
    on SmolLM2."""
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="module")
def greedy(reference_dir):
    return json.loads((reference_dir / "greedy.json").read_text())


def smollm2_reference(greedy, prompt, kv_type="f16"):
    """The greedy.json entry of SmolLM2 for this prompt and cache type (its ids fit its
    49152-token vocabulary)."""
    return next(g for g in greedy if g["prompt"] == prompt and g["kv_type"] == kv_type and max(g["ids"]) < 49152)


def prefix_text(smollm2_path, ids):
    from kvchat.runtime.gguf.file import GGUFFile
    from kvchat.runtime.text.vocab import Vocab

    gf = GGUFFile(smollm2_path)
    try:
        return Vocab.from_gguf(gf).detokenize(ids)
    finally:
        gf.close()


# llama.cpp's 1st-2nd log-prob margin at each of the first 10 tokens of its f16 greedy chat
# answer (greedy.json), with the reference's settings (flash on, one ubatch): measured here with
# llama.cpp 11434 built from the sdist through llama.h (all logits of prompt + answer in one
# llama_decode). Tokens 2, 5, 7-10 are near-ties that llama.cpp's own runs decide differently.
F16_PATH_MARGINS = [1.13, 0.01, 2.95, 3.19, 0.03, 1.20, 0.27, 0.48, 0.49, 0.41]


def test_greedy_chat_answer_matches_llama_cpp(smollm2_path, greedy):
    """The template adds SmolLM2's default system prompt, giving greedy.json's chat prompt.

    llama.cpp's own greedy answers fork at the second token, where its margin is 0.01: its f16
    reference run says "A transformer is ...", its q8_0-cache run "A KV (Kinematic ...", its
    flash-off run "A KV cache in a transformer ...", and we "A KV cache is ..." (ggml's 8-bit
    activation rounding lets any last-bit difference flip near-ties; tests/test_forward_logits.py).
    So the true checks are: the answer's first token is llama.cpp's; the CLI's answer is the
    engine's greedy decode of that prompt; and along llama.cpp's own f16 answer (teacher-forced)
    our top-1 is llama.cpp's at every token where its margin exceeds 0.55."""
    from kvchat.runtime.context import Context
    from kvchat.runtime.cparams import ContextParams
    from kvchat.runtime.generate import decode_tokens
    from kvchat.runtime.model import Model

    r = kvchat(
        "run", "-m", smollm2_path, "--temp", "0", "-n", "24", "-c", "256", "-p", "What is a KV cache in a transformer?"
    )
    assert r.returncode == 0, r.stderr
    path = smollm2_reference(greedy, CHAT_PROMPT, "f16")["ids"]
    assert r.stdout.startswith(prefix_text(smollm2_path, path[:1]))

    model = Model.load(smollm2_path)
    prompt = model.vocab.tokenize(CHAT_PROMPT, add_special=True, parse_special=True)
    ctx = Context(model, ContextParams(n_ctx=256))
    logits = decode_tokens(ctx, prompt, 0)
    ours = []
    for _ in range(24):  # the engine's own greedy answer, token by token as the CLI decodes it
        ours.append(int(np.argmax(logits)))
        if model.vocab.is_eog(ours[-1]):
            break
        logits = decode_tokens(ctx, [ours[-1]], len(prompt) + len(ours) - 1)
    assert r.stdout.rstrip("\n") == model.vocab.detokenize([t for t in ours if not model.vocab.is_eog(t)])

    forced = Context(model, ContextParams(n_ctx=256))
    rows = decode_tokens(forced, list(prompt) + path[:9], 0, logits="all")  # [n, n_vocab]
    n = len(prompt)
    for i, margin in enumerate(F16_PATH_MARGINS):
        if margin > 0.55:
            assert int(np.argmax(rows[n - 1 + i])) == path[i], (i, margin)


def test_raw_completion_matches_llama_cpp(smollm2_path, greedy):
    ref = smollm2_reference(greedy, "Once upon a time")
    r = kvchat("run", "-m", smollm2_path, "--raw", "--temp", "0", "-n", "4", "-c", "256", "-p", "Once upon a time")
    assert r.returncode == 0, r.stderr
    # no template: the text continues the prompt itself (", the city of")
    assert r.stdout == prefix_text(smollm2_path, ref["ids"][:4]) + "\n"


def test_stdout_is_only_the_answer_and_timings_go_to_stderr(any_model, tmp_path):
    smollm2_path = any_model
    prompt_file = tmp_path / "q.txt"
    prompt_file.write_text("Name a colour.", encoding="utf-8")
    r = kvchat(
        "run",
        "-m",
        smollm2_path,
        "--temp",
        "0",
        "-n",
        "6",
        "-c",
        "256",
        "-f",
        prompt_file,
        "--show-timings",
        "--verbose-prompt",
    )
    assert r.returncode == 0, r.stderr
    assert "t/s" not in r.stdout and "Prompt:" not in r.stdout and "->" not in r.stdout
    assert "[ Prompt: " in r.stderr and " t/s | Generation: " in r.stderr and " t/s ]" in r.stderr
    assert "'<|im_start|>'" in r.stderr  # --verbose-prompt lists the prompt tokens
    # the same prompt on stdin gives the same (greedy) answer
    r2 = kvchat("run", "-m", smollm2_path, "--temp", "0", "-n", "6", "-c", "256", input="Name a colour.")
    assert r2.returncode == 0 and r2.stdout == r.stdout
    assert len(r.stdout.strip()) > 0


def test_seeded_sampling_is_reproducible(smollm2_path):
    args = ("run", "-m", smollm2_path, "--temp", "1.0", "-s", "1234", "-n", "8", "-c", "256", "-p", "Tell me a joke.")
    a, b = kvchat(*args), kvchat(*args)
    assert a.returncode == 0 and b.returncode == 0
    assert a.stdout == b.stdout and a.stdout.strip()


def test_prompt_longer_than_context_is_refused(smollm2_path):
    long = "word " * 400
    r = kvchat("run", "-m", smollm2_path, "-c", "256", "-n", "4", "-p", long)
    assert r.returncode == 1
    assert r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert lines[-1].startswith("error: the prompt needs ") and "context of 256 tokens" in lines[-1]
    assert "Traceback" not in r.stderr


def test_no_prompt_and_bad_flags_are_one_line_errors(smollm2_path, tmp_path):
    r = kvchat("run", "-m", smollm2_path, "-f", tmp_path / "missing.txt")
    assert r.returncode == 1 and r.stderr.strip().startswith("error: cannot read prompt file")
    r = kvchat("run", "-m", smollm2_path, "-ctk", "q7_0", "-p", "hi", "-c", "256")
    assert r.returncode == 1 and "invalid cache type 'q7_0'" in r.stderr and "Traceback" not in r.stderr
    r = kvchat("run", "-m", smollm2_path, "-ctv", "q8_0", "-fa", "off", "-p", "hi", "-c", "256")
    assert r.returncode == 1 and "Flash Attention" in r.stderr and "Traceback" not in r.stderr


def test_help_groups_flags_with_defaults():
    r = kvchat("run", "--help", env={"COLUMNS": "160"})
    assert r.returncode == 0
    out = r.stdout
    for panel in ("Model", "Context and KV cache", "Sampling", "Conversation", "Output", "Input"):
        assert panel in out
    for flag in (
        "--ctx-size",
        "-ctk",
        "--cache-type-v",
        "-fa",
        "--swa-full",
        "--keep",
        "--no-context-shift",
        "--temp",
        "--top-k",
        "--top-p",
        "--min-p",
        "--repeat-penalty",
        "--repeat-last-n",
        "--seed",
        "-sys",
        "--chat-template-file",
        "--threads",
        "--ignore-eos",
        "--session",
        "--show-timings",
        "--verbose-prompt",
        "--markdown",
        "-ub",
        "--batch-size",
        "--n-predict",
        "--raw",
        "--prompt",
        "--file",
    ):
        assert flag in out, flag
    for default in ("4096", "0.8", "0.95", "0.05", "40", "64", "f16", "auto"):
        assert default in out


def test_corrupt_session_at_startup_exits_1_and_leaves_file(any_model, tmp_path):
    smollm2_path = any_model
    bad = tmp_path / "bad.kvs"
    bad.write_bytes(b"KVCHATSS" + b"\x01\x00\x00\x00" + b"garbage" * 10)
    before = bad.read_bytes()
    r = kvchat("chat", "-m", smollm2_path, "-c", "256", "--session", bad, input="hello\n")
    assert r.returncode == 1
    assert r.stderr.strip().splitlines()[-1].startswith(f"error: {bad}: ")
    assert bad.read_bytes() == before


def test_run_with_session_continues_the_conversation(any_model, tmp_path):
    """`kvchat run --session F` saves after the answer and resumes on the next call: the
    follow-up sees the first exchange and only its own new tokens are decoded."""
    smollm2_path = any_model
    from kvchat.cli.session.session import decode_session

    sess = tmp_path / "s.kvs"
    r1 = kvchat(
        "run", "-m", smollm2_path, "-c", "512", "--temp", "0", "-n", "12", "--session", sess, "-p", "My name is Ada."
    )
    assert r1.returncode == 0, r1.stderr
    first = decode_session(sess.read_bytes())
    assert [m["role"] for m in first.messages] == ["user", "assistant"]
    assert first.messages[1]["content"].strip() == r1.stdout.strip()
    r2 = kvchat(
        "run",
        "-m",
        smollm2_path,
        "-c",
        "512",
        "--temp",
        "0",
        "-n",
        "12",
        "--session",
        sess,
        "--show-timings",
        "-p",
        "What is my name?",
    )
    assert r2.returncode == 0, r2.stderr
    assert f"resumed {sess}: {len(first.tokens)} tokens in the cache" in " ".join(r2.stderr.split())
    second = decode_session(sess.read_bytes())
    assert [m["content"] for m in second.messages[:2]] == [m["content"] for m in first.messages]
    assert second.messages[2]["content"] == "What is my name?"
    assert second.tokens[: len(first.tokens)] == first.tokens  # the cached prefix was kept


def test_run_session_that_is_a_directory_is_refused(smollm2_path, tmp_path):
    r = kvchat("run", "-m", smollm2_path, "-c", "256", "-n", "4", "--session", tmp_path, "-p", "hi")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("error: ")


def test_usage_errors_are_one_line_with_a_hint():
    """Unknown options, bad values and missing arguments: one `error:` line, exit 2, no box."""
    for args, needle in (
        (["run", "-p", "hi", "--temp", "-1"], "'--temp'"),
        (["info", "--bogus"], "No such option: --bogus"),
        (["frobnicate"], "No such command 'frobnicate'"),
        (["pull"], "Missing argument"),
    ):
        r = kvchat(*args)
        assert r.returncode == 2, (args, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], (args, r.stderr)
        assert "--help" in lines[0]
