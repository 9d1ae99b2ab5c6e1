"""Structured output (runtime/grammar/): specs refused with one line before a model loads, the
mask in the sampler's chain, matchers over a real GGUF vocabulary, and answers that follow the
grammar on the tiny chat model (one prompt, -np alternatives, per-request schemas)."""

import json

import numpy as np
import pytest

from kvchat.runtime.errors import GrammarError
from kvchat.runtime.grammar.spec import GrammarSpec, spec_from_flags
from kvchat.runtime.sampling import Sampler, SamplingParams
from tests.helpers.cli_inproc import kvchat


def run(*args):
    r = kvchat(*args)
    return r.returncode, r.stdout, r.stderr


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


def check_person(text: str) -> dict:
    """The answer is one JSON document valid against PERSON (a hand check: no jsonschema package)."""
    doc = json.loads(text)
    assert set(doc) == {"name", "age"}
    assert isinstance(doc["name"], str) and len(doc["name"]) <= 8
    assert type(doc["age"]) is int and 0 <= doc["age"] <= 150
    return doc


# ---- specs: what and where, before anything loads ---------------------------------------------


def test_schema_that_is_not_json_says_line_and_column():
    with pytest.raises(GrammarError, match=r"--json-schema: the JSON schema is not valid JSON: .* line 2 column 3"):
        spec_from_flags(json_schema='{"type": "object",\n  oops}')


def test_schema_errors_name_the_problem():
    with pytest.raises(GrammarError, match=r"--json-schema: bad JSON schema: Invalid type: objekt"):
        spec_from_flags(json_schema='{"type": "objekt"}')
    with pytest.raises(GrammarError, match=r"must be an object or a boolean, not list"):
        spec_from_flags(json_schema="[1]")
    with pytest.raises(GrammarError, match=r"Pointer '/nope' does not exist"):
        spec_from_flags(json_schema='{"properties": {"a": {"$ref": "#/nope"}}}')


def test_gbnf_errors_say_where():
    with pytest.raises(GrammarError, match=r"--grammar: bad GBNF grammar: .*Expected '\)' at line 1"):
        spec_from_flags(grammar='root ::= ("yes" | "no"')
    with pytest.raises(GrammarError, match=r"Rule 'foo' not found"):
        spec_from_flags(grammar="root ::= foo")


def test_one_format_at_a_time_and_files(tmp_path):
    with pytest.raises(GrammarError, match=r"give one of --json-schema, --json, not several"):
        spec_from_flags(json_schema="{}", any_json=True)
    with pytest.raises(GrammarError, match=r"--grammar-file .*missing.gbnf: cannot read"):
        spec_from_flags(grammar_file=tmp_path / "missing.gbnf")
    f = tmp_path / "p.json"
    f.write_text(json.dumps(PERSON))
    spec = spec_from_flags(json_schema_file=f)
    assert (spec.kind, spec.origin, json.loads(spec.text)) == ("json_schema", str(f), PERSON)
    assert spec_from_flags() is None
    assert spec_from_flags(any_json=True).text == '{"type": "object"}'


def test_bad_schema_exits_2_before_the_model_loads(tmp_path):
    """The model does not exist: had it been opened first, the error would be about the model."""
    rc, out, err = run("run", "-m", str(tmp_path / "none.gguf"), "-j", '{"type": 5}', "-p", "hi")
    assert (rc, out) == (2, "")
    assert err.count("\n") == 1 and err.startswith("error: --json-schema: bad JSON schema")
    rc, out, err = run("run", "-m", str(tmp_path / "none.gguf"), "--grammar", "root ::= [a-", "-p", "hi")
    assert (rc, out) == (2, "") and "bad GBNF grammar" in err and err.count("\n") == 1


# ---- the sampler: mask after the penalties, before top-k ---------------------------------------


def test_mask_applies_before_top_k_and_keeps_greedy_exact():
    logits = np.array([5.0, 4.0, 3.0, 2.5, 1.0], dtype=np.float32)
    allowed = np.array([False, False, True, True, False])
    greedy = Sampler(SamplingParams(temp=0.0, top_k=1))
    assert greedy.sample(logits) == 0
    assert greedy.sample(logits, allowed=allowed) == 2  # top-k=1 among the allowed, not before
    # the penalty runs first: token 2 seen recently falls below token 3
    pen = Sampler(SamplingParams(temp=0.0, repeat_penalty=2.0))
    assert pen.sample(logits, history=[2], allowed=allowed) == 3


def test_masked_sampling_is_seeded_and_never_leaves_the_mask():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal(300).astype(np.float32) * 3
    allowed = rng.random(300) < 0.1
    runs = []
    for _ in range(2):
        s = Sampler(SamplingParams(temp=1.5, top_k=0, top_p=1.0, min_p=0.0, seed=7))
        runs.append([s.sample(logits, allowed=allowed) for _ in range(200)])
    assert runs[0] == runs[1]
    assert all(allowed[t] for t in runs[0])
    assert len(set(runs[0])) > 5  # it does sample among them


def test_mask_without_finite_choice_is_one_line():
    from kvchat.runtime.errors import ModelOutputError

    logits = np.array([-np.inf, 1.0], dtype=np.float32)
    with pytest.raises(ModelOutputError, match="the grammar allows no token"):
        Sampler(SamplingParams(temp=0)).sample(logits, allowed=np.array([True, False]))


# ---- matchers on a real vocabulary ------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_vocab(tiny_chat):
    from kvchat.runtime.gguf.file import GGUFFile
    from kvchat.runtime.text.vocab import Vocab

    return Vocab.from_gguf(GGUFFile(tiny_chat))


def test_tokenizer_marks_special_tokens_and_ends(tiny_vocab):
    from kvchat.runtime.grammar.tokenizer import lltokenizer_for, token_bytes

    pieces = token_bytes(tiny_vocab)
    assert pieces[tiny_vocab.token_to_id["<|im_end|>"]] == b"\xff<|im_end|>"
    assert pieces[tiny_vocab.tokenize("a", add_special=False)[0]] == b"a"
    tok = lltokenizer_for(tiny_vocab)
    assert tok is lltokenizer_for(tiny_vocab)  # made once per vocabulary
    assert sorted(tok.eos_tokens) == sorted(tiny_vocab.eog)


def test_matcher_allows_exactly_the_grammar(tiny_vocab):
    from kvchat.runtime.grammar.matcher import Constraint

    c = Constraint(GrammarSpec("gbnf", 'root ::= ("yes" | "no")', "--grammar"), tiny_vocab)
    m = c.matcher()
    first = {tiny_vocab.token_to_piece(int(t)) for t in np.nonzero(m.allowed())[0]}
    assert first == {b"y", b"n"}  # the tiny vocabulary spells words byte by byte
    for t in tiny_vocab.tokenize("ye", add_special=False):
        assert m.allowed()[t]
        m.accept(t)
    assert not m.done and not m.accepting
    m.accept(tiny_vocab.tokenize("s", add_special=False)[0])
    assert m.done and m.accepting
    assert set(np.nonzero(m.allowed())[0]) == set(tiny_vocab.eog)  # only an end may follow
    assert c.matcher().n_tokens == 0  # a new answer starts afresh


# ---- answers on the tiny chat model -----------------------------------------------------------


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_yes_no_grammar_answers_exactly(tiny_chat, seed):
    rc, out, err = run(
        "run", "-m", tiny_chat, "--grammar", 'root ::= ("yes" | "no")', "-p", "Is it?", "-s", seed, "-n", "50"
    )
    assert rc == 0, err
    assert out in ("yes\n", "no\n")


def test_schema_answers_validate(tiny_chat):
    for seed in (1, 2):
        rc, out, err = run(
            "run", "-m", tiny_chat, "-j", json.dumps(PERSON), "-p", "A person.", "-s", seed, "--temp", "0.8"
        )
        assert rc == 0, err
        check_person(out)
    rc, out, err = run("run", "-m", tiny_chat, "--json", "-p", "x", "--temp", "0", "-n", "400")
    assert rc == 0, err
    assert isinstance(json.loads(out), dict) or out.startswith("{")  # -n may cut a long object


def test_alternatives_each_follow_the_grammar(tiny_chat):
    rc, out, err = run(
        "run", "-m", tiny_chat, "-j", json.dumps(PERSON), "-p", "A person.", "-np", "3", "-s", "5", "--jsonl"
    )
    assert rc == 0, err
    answers = [json.loads(line) for line in out.splitlines()]
    assert [a["seed"] for a in answers] == [5, 6, 7]
    for a in answers:
        assert a["stop"] == "eog"
        check_person(a["text"])


def test_prompts_file_requests_bring_their_own_schema(tiny_chat, tmp_path):
    colour = {"type": "object", "properties": {"c": {"enum": ["red", "blue"]}}, "required": ["c"]}
    f = tmp_path / "reqs.jsonl"
    f.write_text(
        "\n".join(
            [
                json.dumps({"prompt": "a person", "json_schema": PERSON}),
                json.dumps({"prompt": "a colour", "json_schema": colour}),
                json.dumps({"prompt": "yes or no"}),  # the command line's grammar
                json.dumps({"prompt": "bad", "json_schema": {"type": "objekt"}}),
            ]
        )
        + "\n"
    )
    rc, out, err = run(
        "run", "-m", tiny_chat, "--prompts-file", f, "-np", "4", "--grammar", 'root ::= "yes" | "no"', "--jsonl"
    )
    assert rc == 0, err
    a = [json.loads(line) for line in out.splitlines()]
    check_person(a[0]["text"])
    assert json.loads(a[1]["text"])["c"] in ("red", "blue")
    assert a[2]["text"] in ("yes", "no")
    assert a[3]["stop"] == "error" and a[3]["error"].startswith(f"{f}:4: json_schema: bad JSON schema: Invalid type")


# ---- the chat's /set format --------------------------------------------------------------------


def test_set_format_in_the_chat(tiny_vocab, tmp_path):
    from types import SimpleNamespace

    from kvchat.cli.chat.render import Renderer
    from kvchat.cli.chat.repl import Repl
    from kvchat.cli.options import ChatSettings
    from kvchat.runtime.errors import KvchatError
    from tests.test_conversation import make

    conv, _, _ = make()
    r = Repl(engine=SimpleNamespace(vocab=tiny_vocab), conv=conv, settings=ChatSettings(), renderer=Renderer())
    r.cmd_set("format json")
    assert r.conv.constraint.spec.text == '{"type": "object"}'
    good, bad = tmp_path / "p.json", tmp_path / "bad.json"
    good.write_text(json.dumps(PERSON))
    bad.write_text('{"type": "objekt"}')
    r.cmd_set(f"format schema {good}")
    assert json.loads(r.conv.constraint.spec.text) == PERSON
    with pytest.raises(KvchatError, match=r"/set format: .*bad.json: bad JSON schema: Invalid type: objekt"):
        r.cmd_set(f"format schema {bad}")
    assert json.loads(r.conv.constraint.spec.text) == PERSON  # a refused file changes nothing
    with pytest.raises(KvchatError, match="usage: /set format json"):
        r.cmd_set("format yaml")
    r.cmd_set("format off")
    assert r.conv.constraint is None


@pytest.mark.parametrize("top_k", [0, 1, 5, 40, 59, 60, 61, 300])
def test_masked_top_k_from_the_whole_row_picks_what_the_gathered_allowed_ids_do(top_k):
    """Sampler.candidates takes a top-k of at most the allowed count from the whole row with the
    others at -inf: the same ids and probabilities as top-k over the gathered allowed ids
    (ties between equal logits included), whatever the count against k."""
    from kvchat.runtime.sampling import min_p, softmax, temperature, top_p
    from kvchat.runtime.sampling import top_k as top_k_step

    rng = np.random.default_rng(top_k)
    logits = np.round(rng.standard_normal(300) * 2, 1).astype(np.float32)  # many exact ties
    logits[rng.random(300) < 0.05] = -np.inf  # --ignore-eos style impossible tokens
    allowed = rng.random(300) < 0.3  # ~90 allowed, ~85 finite
    ok = np.flatnonzero(allowed & np.isfinite(logits)).astype(np.int64)
    for k in (top_k, ok.size, ok.size + 1):  # below, at and above the allowed count
        for params in (
            SamplingParams(temp=0.0, top_k=k),
            SamplingParams(temp=0.9, top_k=k, top_p=0.9, seed=3),
            SamplingParams(temp=0.9, top_k=k, top_p=1.0, min_p=0.0, seed=3),  # nothing after top-k cuts
        ):
            ids, probs = Sampler(params).candidates(logits, None, allowed)
            ref_ids, lg = top_k_step(ok, logits[ok].astype(np.float64), k)
            ref_ids, lg = top_p(ref_ids, lg, params.top_p)
            ref_ids, lg = min_p(ref_ids, lg, params.min_p)
            ref_ids, lg = temperature(ref_ids, lg, params.temp)
            assert np.array_equal(ids, ref_ids) and np.array_equal(probs, softmax(lg))
    before = logits.copy()
    runs = [[Sampler(SamplingParams(temp=1.2, top_k=top_k, seed=9)).sample(logits, None, allowed)] for _ in range(2)]
    assert runs[0] == runs[1] and allowed[runs[0][0]]
    assert np.array_equal(logits, before)  # the mask went into the sampler's own copy
