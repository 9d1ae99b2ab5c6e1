"""The speculative-decoding flags of `run` (and `bench --spec`) on tiny models: the answer with
drafts is the plain answer, byte for byte; what cannot work is one line and exit 1 or 2."""

import pytest

from tests.helpers.cli_inproc import kvchat as kvchat_call


def kvchat(*args):
    """(returncode, stdout, stderr) of an in-process `kvchat ARGS`."""
    r = kvchat_call(*args)
    return r.returncode, r.stdout, r.stderr


@pytest.fixture(scope="module")
def dense(reference_dir):
    return reference_dir / "tiny" / "llama3rope_s1.gguf"


@pytest.fixture(scope="module")
def other_vocab(tiny_model):
    return tiny_model("llama")  # tests/gguf_factory's vocabulary, not SmolLM2's


ARGS = ["-p", "one two three one two three one two three", "-n", "48", "--temp", "0", "--raw", "--ignore-eos"]


@pytest.mark.parametrize(
    "spec",
    # --draft-p-min 0: a random-weight model is never sure of a token; the drafting is under test
    [
        ["--spec-type", "ngram"],
        ["--spec-type", "self:q4_0", "--draft-max", "4", "--draft-p-min", "0"],
        ["-md", "SELF", "--spec-draft-p-min", "0"],
    ],
)
def test_run_with_drafts_prints_the_plain_answer(dense, spec):
    spec = [str(dense) if a == "SELF" else a for a in spec]  # the model as its own draft
    rc, plain, err = kvchat("run", "-m", dense, *ARGS)
    assert rc == 0, err
    rc, out, err = kvchat("run", "-m", dense, *ARGS, *spec, "--show-timings")
    assert rc == 0, err
    assert out == plain and len(out) > 20
    if "ngram" not in spec:  # a model draft always proposes; lookups may find no match
        assert "Drafts:" in err


def test_a_draft_model_of_another_vocabulary_is_refused_in_one_line(dense, other_vocab):
    rc, out, err = kvchat("run", "-m", dense, *ARGS, "-md", other_vocab)
    assert rc == 1 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "not the target's vocabulary" in lines[0], err


@pytest.mark.parametrize(
    "flags, code, words",
    [
        (["--spec-type", "lookahead"], 2, "draft, ngram or self:TYPE"),
        (["--spec-type", "self:q3_k"], 1, "unknown draft type"),
        (["--spec-type", "draft"], 1, "needs a draft model"),
        (["--spec-type", "ngram", "-md", "x.gguf"], 1, "-md is the draft model of --spec-type draft"),
        (["--draft-max", "0", "--spec-type", "ngram"], 2, "within 1..32"),
        (["--draft-min", "17", "--spec-type", "ngram"], 1, "draft-min"),  # above the default --draft-max 16
    ],
)
def test_impossible_speculative_flags(dense, flags, code, words):
    rc, out, err = kvchat("run", "-m", dense, *ARGS, *flags)
    assert rc == code and out == ""
    assert words in err, err


def test_bench_spec_reports_the_speed_up_and_equal_answers(dense):
    rc, out, err = kvchat("bench", "-m", dense, "--spec", "ngram", "-n", "32", "-r", "1", "-c", "256")
    assert rc == 0, err
    head, rule, row = out.strip().splitlines()
    assert head.startswith("| spec |") and row.startswith("| ngram |")
    assert row.split("|")[6].strip().endswith("x")
