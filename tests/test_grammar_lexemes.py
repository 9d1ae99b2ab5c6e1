"""GBNF character runs as single lexemes (runtime/grammar/lexemes.py): which runs are rewritten,
which are left alone because llguidance's greedy lexer would then accept other strings, and that
a rewritten grammar is the same grammar: the same next-byte masks, accepting and stopped states
after every byte string up to a length (explored exhaustively), the same token masks over a real
vocabulary, and the same answers greedy and seeded."""

import json

import numpy as np
import pytest

from kvchat.runtime.grammar import lexemes
from kvchat.runtime.grammar.lexemes import first_bytes, gbnf_to_lark_with_runs
from tests.helpers.cli_inproc import kvchat

TEXT = "root ::= [a-zA-Z0-9 ,.;:!?'\"()-]+"  # benchmarks/grammar_cost.py's permissive class
ENGLISH = 'root ::= en-char+ ([ \\t\\n] en-char+)*\nen-char ::= letter | punct\nletter ::= [a-zA-Z]\npunct ::= [,."\']'

REWRITTEN = {
    TEXT: "start: /[a-zA-Z0-9 ,.;:!?'\"()-]+/",
    'root ::= "A:" [a-z ]* "."': 'start: "A:" /[a-z ]+/? "."',
    'root ::= ([a-z]+ ",")* [0-9]*': 'start: (/[a-z]+/ ",")* /[0-9]+/?',
    'root ::= [^"]+ "\\""': 'start: /[^"]+/ "\\""',
    'root ::= "<" [a-zé]* ">" | [0-9]+': 'start: "<" /[a-zé]+/? ">"\n     | /[0-9]+/',
    # llama.cpp's grammars/english.gbnf's shape: a TERMINAL of one character, run again in a group
    ENGLISH: "start: KVCHAT_RUN_0 (/[ \\t\\n]/ KVCHAT_RUN_0)*\nEN_CHAR: LETTER\n     | PUNCT\n"
    "LETTER: /[a-zA-Z]/\nPUNCT: /[,.\"']/\nKVCHAT_RUN_0: EN_CHAR+",
    'root ::= ("a" | "s" | [0-9])+ "." ("x" | "\\n")*': 'start: KVCHAT_RUN_0 "." KVCHAT_RUN_1?\n'
    'KVCHAT_RUN_0: (("a" | "s" | /[0-9]/))+\nKVCHAT_RUN_1: (("x" | "\\n"))+',
}
LEFT_ALONE = [
    'root ::= [a-z]+ "s"',  # "s" could go on the run: the greedy lexeme would eat it
    'root ::= [a-z]+ "1" | "ab" "c2"',  # "ab" starts where the run does: lexemes compete
    'root ::= "(" root ")" | [a-z]+',  # the root is referred to: what follows it is not the end
    'root ::= "x" .*',  # "x" is one of `.`'s characters
    'root ::= [a-z]+ "-" [a-z]{2}',  # a bounded class of the same characters
    'root ::= ([a-z]+)* "."',  # a run repeated again is followed by itself
    'root ::= ("a" [0-9]+)? [0-9]*',  # after the optional group's run, maybe the other one
    'root ::= ("a" | [0-9])+ "a"',  # one character of the run's alternatives follows it
    'root ::= ("<" [a-z]+) "s"',  # as the first, the group's end passed on to what follows it
]


def plain_lark(gbnf):
    from llguidance.gbnf_to_lark import gbnf_to_lark

    return gbnf_to_lark(gbnf)


@pytest.mark.parametrize("gbnf", sorted(REWRITTEN))
def test_runs_become_lexemes(gbnf):
    assert gbnf_to_lark_with_runs(gbnf) == "%llguidance {}\n\n" + REWRITTEN[gbnf] + "\n"
    assert gbnf_to_lark_with_runs(gbnf) != plain_lark(gbnf)


@pytest.mark.parametrize("gbnf", LEFT_ALONE)
def test_runs_left_alone_when_the_lexer_would_choose_differently(gbnf):
    assert gbnf_to_lark_with_runs(gbnf) == plain_lark(gbnf)


def test_lark_passes_as_it_is_and_first_bytes():
    lark = 'start: /[a-z]/+ "s"\n'
    assert gbnf_to_lark_with_runs(lark) == lark
    assert first_bytes('%llguidance {}\nstart: "é" | /[0-9]/?\n') == (frozenset(b"0123456789") | {0xC3}, True)


# ---- the same grammar: every byte string up to a length ----------------------------------------

ALPHABET = [ord(c) for c in 'as1, ."<>-A(:'] + [0xC3, 0xA9, 0xA8]  # é = C3 A9, è = C3 A8


def walk(lark_a, lark_b, depth):
    """Feed both grammars every byte string over ALPHABET they take, up to `depth` bytes; return
    how many strings were compared (asserting equal masks and states after each)."""
    import llguidance

    tok = lexemes._byte_tokenizer()
    a, b = (llguidance.LLMatcher(tok, g, log_level=0) for g in (lark_a, lark_b))
    seen = 0

    def state(m):
        return m.compute_bitmask(), m.is_accepting(), m.is_stopped()

    def go(d):
        nonlocal seen
        sa = state(a)
        assert sa == state(b)
        seen += 1
        if d == depth:
            return
        bits = np.unpackbits(np.frombuffer(sa[0], dtype=np.uint8), bitorder="little")
        for byte in ALPHABET:
            if bits[byte]:
                assert a.consume_token(byte) and b.consume_token(byte)
                go(d + 1)
                a.rollback(1)
                b.rollback(1)

    go(0)
    return seen


@pytest.mark.parametrize("gbnf", sorted(REWRITTEN))
def test_rewritten_grammar_takes_the_same_strings(gbnf):
    permissive = "[^" in gbnf or gbnf in (TEXT, ENGLISH)  # most of ALPHABET at every byte: 4 deep is ~20k strings
    seen = walk(plain_lark(gbnf), gbnf_to_lark_with_runs(gbnf), depth=4 if permissive else 7)
    assert seen > 100  # the walk went deep into the runs


# ---- the same answers --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_vocab(tiny_chat):
    from kvchat.runtime.gguf.file import GGUFFile
    from kvchat.runtime.text.vocab import Vocab

    return Vocab.from_gguf(GGUFFile(tiny_chat))


def test_token_masks_equal_along_a_random_walk(tiny_vocab, monkeypatch):
    from kvchat.runtime.grammar.matcher import Constraint
    from kvchat.runtime.grammar.spec import GrammarSpec

    spec = GrammarSpec("gbnf", 'root ::= "<" [a-z ]* ">" [0-9]*', "g")
    fast = Constraint(spec, tiny_vocab)
    monkeypatch.setattr(lexemes, "_rewrite", lambda text: None)
    plain = Constraint(spec, tiny_vocab)
    assert fast.grammar != plain.grammar
    rng = np.random.default_rng(7)
    for _ in range(5):
        a, b = fast.matcher(), plain.matcher()
        for _ in range(40):
            ma, mb = a.allowed(), b.allowed()
            assert np.array_equal(ma, mb) and a.accepting == b.accepting and a.done == b.done
            if a.done:
                break
            ok = np.nonzero(ma)[0]
            t = int(rng.choice(ok[~np.isin(ok, list(tiny_vocab.eog))]))
            a.accept(t)
            b.accept(t)


@pytest.mark.parametrize(
    "sampling", [("--temp", "0"), ("--temp", "0.8"), ("--temp", "0.8", "--top-k", "0", "--top-p", "0.9")]
)
def test_same_answers_with_and_without_the_rewrite(tiny_chat, monkeypatch, sampling):
    args = ("run", "-m", tiny_chat, "--grammar", TEXT, "-p", "Say it.", "-n", "40", "--jsonl", "-s", "3", *sampling)
    fast = kvchat(*args)
    monkeypatch.setattr(lexemes, "_rewrite", lambda text: None)
    plain = kvchat(*args)
    assert fast.returncode == plain.returncode == 0, fast.stderr + plain.stderr
    a, b = json.loads(fast.stdout), json.loads(plain.stdout)
    assert a["n_gen"] == 40 and a["text"]
    assert a == b
