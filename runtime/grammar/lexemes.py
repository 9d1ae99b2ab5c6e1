"""GBNF character runs as single lexemes: `[a-z ,.]+` handed to llguidance as one lexeme
`/[a-z ,.]+/` instead of a grammar-level repetition of one-character lexemes, where that cannot
change a single accepted string or token mask.

Why: llguidance's `gbnf_to_lark` makes a rule a lexeme (a TERMINAL) only when its whole body is
terminal and it is not the root; a run inside the root (or any rule with non-terminal parts)
stays a repetition in the grammar, so every character is a lexeme of its own and llguidance's
Earley parser runs at every byte of the vocabulary's trie while it computes a mask: 3.0 ms a token
on SmolLM2's 49k vocabulary for `root ::= [a-zA-Z0-9 ,.;:!?'"()-]+`, 23 % of its tg
(docs/performance.md). As one lexeme the mask comes from the lexer alone (~0.02 ms).

When it is the same grammar. llguidance's lexer is greedy: a lexeme goes on while the next byte
can extend it, and the other lexemes that started at the same byte are dropped then (even in
the grammar as converted: `[a-z]+ "1" | "ab" "c2"` refuses "abd1"). A run of one-character
lexemes and one long lexeme therefore behave alike exactly when no choice between "the run goes
on" and "something else starts" is ever made on the same byte. A run is an unbounded repetition
(`+`, `*`) of one character X: a class, `.`, a one-character literal, alternatives of these, or
a TERMINAL rule of one character (llama.cpp's english.gbnf: `en-char+`). Checked on the grammar
as a whole, with FIRST byte sets computed by llguidance itself over a 256-byte vocabulary (so its
own class and UTF-8 semantics decide):
  (a) every lexeme of the grammar that can start with a byte an X can start with is a run of
      that same X, so all of them become the one lexeme `X+`;
  (b) nothing that can follow each run (the rest of its sequence, a group repeated around it,
      and so on outwards while all that can be empty) can start with such a byte; where
      everything after it can be empty, only the end of a root no rule refers to may follow.
Then at every byte both grammars go the same way, accept the same strings and give the same
masks; anything else is left as `gbnf_to_lark` wrote it (and so is any grammar this module fails
on: it only ever changes speed). tests/test_grammar_lexemes.py compares the masks byte string by
byte string and token by token (test_grammar_smollm2.py on SmolLM2's vocabulary); english.gbnf's
masks on SmolLM2: 5.6 -> 0.84 ms a token.
"""

from __future__ import annotations

import re

_BYTE_TOKENIZER = None
_BYTE_EOS = 255  # b"\xff" is never UTF-8: that slot holds the end token


class _Bytes:
    """A vocabulary of the 255 single bytes 0x00-0xfe plus an end token: a matcher's mask over it
    is the set of bytes a grammar's text can start with."""

    tokens = [bytes([i]) for i in range(_BYTE_EOS)] + [b"\xff<end>"]
    eos_token_id = _BYTE_EOS
    bos_token_id = None
    special_token_ids = [_BYTE_EOS]

    def __call__(self, text):
        return list(text if isinstance(text, bytes) else text.encode("utf-8"))


def _byte_tokenizer():
    global _BYTE_TOKENIZER
    if _BYTE_TOKENIZER is None:
        import llguidance

        _BYTE_TOKENIZER = llguidance.LLTokenizer(
            llguidance.TokenizerWrapper(_Bytes()), n_vocab=_BYTE_EOS + 1, slices=[]
        )
    return _BYTE_TOKENIZER


def first_bytes(lark: str) -> tuple[frozenset[int], bool]:
    """(the bytes a text of grammar `lark` can start with, whether it can be empty)."""
    import llguidance
    import numpy as np

    m = llguidance.LLMatcher(_byte_tokenizer(), lark, log_level=0)
    if m.is_error():
        raise ValueError(m.get_error())
    bits = np.unpackbits(np.frombuffer(m.compute_bitmask(), dtype=np.uint8), bitorder="little")
    return frozenset(int(b) for b in np.nonzero(bits[:_BYTE_EOS])[0]), bool(bits[_BYTE_EOS])


def gbnf_to_lark_with_runs(text: str) -> str:
    """llguidance's Lark text for GBNF `text`, with the character runs that can be single
    lexemes made so (module docstring). Errors are gbnf_to_lark's own."""
    from llguidance.gbnf_to_lark import any_to_lark, is_lark_syntax

    plain = any_to_lark(text)  # raises on a bad grammar, with line and position
    if is_lark_syntax(text):
        return plain
    try:
        return _rewrite(text) or plain
    except Exception:  # an llguidance whose converter's insides differ: the plain grammar
        return plain


# ---- the rewrite, on gbnf_to_lark's own syntax tree -----------------------------------------


def _rewrite(text: str) -> str | None:
    from llguidance import gbnf_to_lark as g

    rules = g.GrammarParser().parse(text)
    g.resolve(rules)
    start = rules["start"]
    root_is_referenced = any(
        isinstance(n, g.RuleRefNode) and n.target is start for r in rules.values() for n in _walk(r.alternatives)
    )
    # every lexeme of the grammar with the chain of (parent, index) above it, innermost last
    lexemes = []
    for r in rules.values():
        if not r.rule_is_terminal:
            _collect(g, r.alternatives, [(r, -1)], lexemes)
    firsts = {}

    def first_of(node):
        key = str(node)
        if key not in firsts:
            firsts[key] = first_bytes(_lark(rules, start, node))
        return firsts[key]

    runs = {}  # the repeated character's text -> its runs
    for node, chain in lexemes:
        if _is_run(g, node):
            runs.setdefault(str(node.node), []).append((node, chain))
    chosen = []
    for key, occurrences in runs.items():
        x = first_of(occurrences[0][0].node)[0]
        if not x:
            continue
        others = [n.node if _is_run(g, n) else n for n, _ in lexemes if not (_is_run(g, n) and str(n.node) == key)]
        if any(first_of(n)[0] & x for n in others):
            continue
        if all(_follow_is_clear(g, chain, x, start, root_is_referenced, first_of) for _, chain in occurrences):
            chosen.extend(occurrences)
    if not chosen:
        return None
    names = {}
    for node, chain in chosen:
        atom = node.node
        if isinstance(atom, g.RegexNode):
            lexeme = g.RegexNode(f"{atom.rx}+")
        else:  # a new TERMINAL rule `KVCHAT_RUN_n: atom+`, one per repeated character
            key = str(atom)
            if key not in names:
                names[key] = rule = g.RuleNode(f"KVCHAT_RUN_{len(names)}", g.RepetitionNode(atom, 1, None), "", True)
                rule.order = len(rules) + len(names)
                rules[rule.name] = rule
            lexeme = g.RuleRefNode(names[key].name, names[key])
        new = lexeme if node.min_times >= 1 else g.RepetitionNode(lexeme, 0, 1)
        parent, i = chain[-1]
        if isinstance(parent, g.SequenceNode):
            parent.nodes[i] = new
        elif isinstance(parent, g.AlternativeNode):
            parent.alternatives[i] = new
        elif isinstance(parent, g.RepetitionNode):
            parent.node = new
        else:
            parent.alternatives = new
    return _lark(rules, start, None)


def _walk(node):
    yield node
    for c in node.children():
        yield from _walk(c)


def _collect(g, node, chain, out):
    """The lexemes under `node` (in a non-terminal rule): runs, literals, classes and references
    to TERMINAL rules, each with its chain of parents; a run is not looked into."""
    if _is_run(g, node) or isinstance(node, (g.LiteralNode, g.RegexNode)):
        out.append((node, chain))
    elif isinstance(node, g.RuleRefNode):
        if node.target is not None and node.target.rule_is_terminal:
            out.append((node, chain))
    elif isinstance(node, g.SequenceNode):
        for j, c in enumerate(node.nodes):
            _collect(g, c, chain + [(node, j)], out)
    elif isinstance(node, g.AlternativeNode):
        for j, c in enumerate(node.alternatives):
            _collect(g, c, chain + [(node, j)], out)
    elif isinstance(node, g.RepetitionNode):
        _collect(g, node.node, chain + [(node, 0)], out)


_ESCAPE = re.compile(r"\\([nrt\"\\\[\]/]|x[0-9a-fA-F]{2})")


def _one_char(g, node, depth=0) -> bool:
    """Does `node` match exactly one character: a class, `.`, a one-character literal, or
    alternatives of these (also through TERMINAL rules)."""
    if depth > 20:
        return False
    if isinstance(node, g.RegexNode):
        return node.rx.startswith("[") or node.rx == "."
    if isinstance(node, g.LiteralNode):
        v = node.value
        return (len(v) == 1 and v != "\\") or _ESCAPE.fullmatch(v) is not None
    if isinstance(node, g.RuleRefNode):
        t = node.target
        return t is not None and t.rule_is_terminal and _one_char(g, t.alternatives, depth + 1)
    if isinstance(node, g.AlternativeNode):
        return all(_one_char(g, a, depth + 1) for a in node.alternatives)
    return False


def _is_run(g, node) -> bool:
    """An unbounded repetition (`*`, `+`) of one character."""
    return (
        isinstance(node, g.RepetitionNode)
        and node.max_times is None
        and node.min_times in (0, 1)
        and _one_char(g, node.node)
    )


def _follow_is_clear(g, chain, x, start, root_is_referenced, first_of) -> bool:
    """Nothing that can follow the run (inner parents first: the rest of its sequence, the
    repeated group it is in, ...) can start with a byte in `x`; if all of that can be empty, only
    the end of a root that no rule refers to may follow."""
    for parent, i in reversed(chain):
        if isinstance(parent, g.SequenceNode):
            rest = parent.nodes[i + 1 :]
            if rest:
                follow, can_be_empty = first_of(g.SequenceNode(list(rest)))
                if follow & x:
                    return False
                if not can_be_empty:
                    return True
        elif isinstance(parent, g.RepetitionNode):
            if parent.max_times is None or parent.max_times > 1:  # the group again may follow
                if first_of(parent.node)[0] & x:
                    return False
        elif not isinstance(parent, g.AlternativeNode):  # the rule
            return parent is start and not root_is_referenced
    return False


def _lark(rules, start, body) -> str:
    """The grammar as Lark text; with `body`, a grammar whose root is `body` (the original root
    kept under another name for rules that refer to it)."""
    lines = ["%llguidance {}", ""]
    saved = start.name
    try:
        if body is not None:
            start.name = "kvchat_first_of_root"
            lines.append(f"start: {body}")
        for r in sorted(rules.values(), key=lambda r: r.order):
            lines.append(str(r))
    finally:
        start.name = saved
    return "\n".join(lines) + "\n"
