"""`kvchat run -np N` and `kvchat run --prompts-file F -np N` through the CLI: answers on stdout in
input order (numbered or --jsonl), each equal to what `kvchat run` alone prints; progress lines
on stderr; bad requests reported in their own line; one-line errors for impossible setups."""

import json

import pytest
from typer.testing import CliRunner

from kvchat.cli.app import app
from tests.helpers.gguf_factory import write_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(
        tmp_path_factory.mktemp("cli_par") / "q.gguf",
        arch="qwen3",
        n_layer=2,
        n_embd=128,
        n_head=4,
        n_head_kv=2,
        n_ff=96,
    )


def run(*args, ok=True):
    r = CliRunner().invoke(app, ["run", *map(str, args)])
    if ok:
        assert r.exit_code == 0, (r.output, r.exception)
    return r


def jsonl(r):
    return [json.loads(l) for l in r.stdout.splitlines() if l.startswith("{")]


def test_np_jsonl_answers_equal_single_runs_with_seed_s_plus_i(tiny):
    r = run("-m", tiny, "-p", "hello there", "-np", "3", "-n", "6", "--temp", "0.9", "-s", "70", "--jsonl", "-c", "512")
    rows = jsonl(r)
    assert [x["index"] for x in rows] == [0, 1, 2] and [x["seed"] for x in rows] == [70, 71, 72]
    for x in rows:
        solo = run("-m", tiny, "-p", "hello there", "-n", "6", "--temp", "0.9", "-s", x["seed"], "-c", "512")
        assert solo.stdout == x["text"] + "\n"
        assert x["n_gen"] == 6 and x["stop"] == "limit" and x["n_prompt"] > 2
    assert "prompt" in r.stderr and "(decoded once)" in r.stderr


def test_np_numbered_blocks_without_jsonl(tiny):
    r = run("-m", tiny, "-p", "hi", "-np", "2", "-n", "3", "--temp", "0", "-s", "5", "-c", "512")
    assert r.stdout.startswith("sequence 0 (seed 5):\n") and "\nsequence 1 (seed 6):\n" in r.stdout


def test_prompts_file_results_in_input_order_with_a_bad_line_reported(tiny, tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text(
        "\n".join(
            [
                json.dumps({"prompt": "first question"}),
                "{not json",
                json.dumps({"messages": [{"role": "user", "content": "second question"}]}),
                json.dumps({"prompt": "word " * 400}),
                json.dumps({"prompt": "third"}),
            ]
        )
        + "\n"
    )
    r = run("-m", tiny, "--prompts-file", f, "-np", "2", "-n", "4", "--temp", "0", "-s", "1", "--jsonl", "-c", "512")
    rows = jsonl(r)
    assert [x["index"] for x in rows] == [0, 1, 2, 3, 4]
    assert "not JSON" in rows[1]["error"] and rows[1]["stop"] == "error"
    assert "holds at most 512" in rows[3]["error"]
    for i, text in ((0, "first question"), (2, "second question"), (4, "third")):
        solo = run("-m", tiny, "-p", text, "-n", "4", "--temp", "0", "-s", str(1 + i), "-c", "512")
        assert solo.stdout == rows[i]["text"] + "\n"
    err = r.stderr
    assert err.count("Client ") == 5 and "failed: " in err
    assert "Total prompt tokens:" in err and "Total gen tokens:" in err and "Cache misses:" in err
    assert "system tokens = " in err


def test_prompts_txt_one_per_line_numbered(tiny, tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("alpha\n\nbeta\ngamma\n")
    r = run("-m", tiny, "--prompts-file", f, "-np", "2", "-n", "2", "--temp", "0", "-s", "0", "-c", "512")
    heads = [l for l in r.stdout.splitlines() if l.startswith("request ")]
    assert heads == ["request 0 (seed 0):", "request 1 (seed 1):", "request 2 (seed 2):"]


def test_a_context_too_small_for_n_sequences_is_one_line(tiny):
    r = run("-m", tiny, "-p", "word " * 200, "-np", "4", "-c", "256", ok=False)
    msg = str(r.exception)
    assert r.exit_code != 0 and "\n" not in msg
    assert "sequences need at least" in msg and "the context has 256 cells; raise -c or lower -np" in msg


def test_prompt_and_prompts_file_together_is_refused(tiny, tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("x\n")
    r = run("-m", tiny, "-p", "hi", "--prompts-file", f, ok=False)
    assert "not both" in str(r.exception)
