"""Structured output on SmolLM2 (real_model): issue #26's acceptance runs. One JSON document valid
against the schema, greedy and on 20 seeds at --temp 0.8; a GBNF yes/no grammar answers exactly
yes or no; -np 4 with per-request schemas."""

import json

import pytest

from tests.helpers.cli_inproc import kvchat

# Written in session 9 under a load that let none of these runs finish; all passed in session 13
# (5 passed in 82 s, tests/test_grammar_smollm2.py, load ~2).

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


def valid_person(text: str) -> bool:
    doc = json.loads(text)  # one document: trailing text would fail here
    return set(doc) == {"name", "age"} and isinstance(doc["name"], str) and type(doc["age"]) is int


def test_greedy_person(smollm2_path):
    r = kvchat("run", "-m", smollm2_path, "--temp", "0", "-j", json.dumps(PERSON), "-p", "Invent a person.")
    assert r.returncode == 0, r.stderr
    assert r.stdout.endswith("}\n") and valid_person(r.stdout)


def test_twenty_seeds_at_temp_0_8(smollm2_path):
    """-np 20 answers with seeds 100..119, each what `run -s 100+i` alone gives (docs/parallel.md)."""
    r = kvchat(
        "run", "-m", smollm2_path, "--temp", "0.8", "-s", "100", "-np", "20", "--jsonl", "-c", "4096",
        "-j", json.dumps(PERSON), "-p", "Invent a person.",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    answers = [json.loads(line) for line in r.stdout.splitlines()]
    assert [a["seed"] for a in answers] == list(range(100, 120))
    bad = [a for a in answers if a["stop"] != "eog" or not valid_person(a["text"])]
    assert not bad


@pytest.mark.parametrize("seed", [1, 2])
def test_yes_no_grammar(smollm2_path, seed):
    r = kvchat(
        "run", "-m", smollm2_path, "--grammar", 'root ::= ("yes" | "no")', "-s", str(seed),
        "-p", "Is the sea salty? Answer yes or no.",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout in ("yes\n", "no\n")


def test_four_requests_each_with_its_schema(smollm2_path, tmp_path):
    colour = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}}, "required": ["colour"]}
    nums = {"type": "array", "items": {"type": "integer"}, "minItems": 3, "maxItems": 3}
    f = tmp_path / "reqs.jsonl"
    f.write_text(
        "\n".join(
            json.dumps(x)
            for x in (
                {"prompt": "Invent a person.", "json_schema": PERSON},
                {"prompt": "Name a colour.", "json_schema": colour},
                {"prompt": "Three numbers.", "json_schema": nums},
                {"prompt": "Is water wet?"},
            )
        )
    )
    r = kvchat(
        "run", "-m", smollm2_path, "--temp", "0", "--prompts-file", f, "-np", "4", "--jsonl",
        "--grammar", 'root ::= "yes" | "no"',
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    a = [json.loads(line) for line in r.stdout.splitlines()]
    assert valid_person(a[0]["text"])
    assert json.loads(a[1]["text"])["colour"] in ("red", "green", "blue")
    n = json.loads(a[2]["text"])
    assert len(n) == 3 and all(type(x) is int for x in n)
    assert a[3]["text"] in ("yes", "no")


def test_character_run_masks_equal_on_smollm2_vocabulary(smollm2_path, monkeypatch):
    """Character runs as single lexemes (runtime/grammar/lexemes.py; the permissive class of
    benchmarks/grammar_cost.py among them) give llguidance's very masks over SmolLM2's 49152 tokens
    along a real text, and after it."""
    import numpy as np

    from kvchat.runtime.gguf.file import GGUFFile
    from kvchat.runtime.grammar import lexemes
    from kvchat.runtime.grammar.matcher import Constraint
    from kvchat.runtime.grammar.spec import GrammarSpec
    from kvchat.runtime.text.vocab import Vocab

    v = Vocab.from_gguf(GGUFFile(smollm2_path))
    specs = [
        GrammarSpec("gbnf", "root ::= [a-zA-Z0-9 ,.;:!?'\"()-]+", "text"),
        GrammarSpec("gbnf", 'root ::= "Story: " [a-zA-Z ,]* "." [0-9]*', "story"),
        # words of one-character TERMINALs between whitespace (llama.cpp's grammars/english.gbnf's shape)
        GrammarSpec("gbnf", 'root ::= ch+ ([ \\t\\n] ch+)*\nch ::= l | d\nl ::= [a-zA-Z.,]\nd ::= [0-9]', "words"),
    ]
    fast = [Constraint(s, v) for s in specs]
    monkeypatch.setattr(lexemes, "_rewrite", lambda text: None)
    plain = [Constraint(s, v) for s in specs]
    story = "Once upon a time, in a small village by the sea, there lived an old keeper named Tom.42"
    for f, p, text in zip(fast, plain, (story, "Story: " + story, story)):
        assert f.grammar != p.grammar
        a, b = f.matcher(), p.matcher()
        sizes = []
        for t in v.tokenize(text, add_special=False):
            ma, mb = a.allowed(), b.allowed()
            assert np.array_equal(ma, mb) and (a.accepting, a.done) == (b.accepting, b.done)
            sizes.append(int(ma.sum()))
            a.accept(t)
            b.accept(t)
        assert sorted(sizes)[len(sizes) // 2] > 1000  # permissive masks, mostly
        assert np.array_equal(a.allowed(), b.allowed()) and a.accepting == b.accepting
