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
on" and "something else starts" is ever made on the same byte. For a character class X that
means, checked on the grammar as a whole (FIRST byte sets computed by llguidance itself over a
256-token byte vocabulary, so its own class and UTF-8 semantics decide):
  (a) every lexeme of the grammar that can start with a byte an X can start with is an unbounded
      run (`+` or `*`) of that same X, so all of them become the one lexeme `/X+/`;
  (b) in each run's sequence what follows cannot start with such a byte and cannot be empty, or
      the sequence is a top-level alternative of the root (which no rule refers to): only the
      end follows then.
Then at every byte both grammars go the same way, accept the same strings and give the same
masks; anything else is left as `gbnf_to_lark` wrote it (and so is any grammar this module fails
on: it only ever changes speed). tests/test_grammar_lexemes.py compares the masks token by token.
"""

from __future__ import annotations

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
    nonterminals = [r for r in rules.values() if not r.rule_is_terminal]
    root_is_referenced = any(
        isinstance(n, g.RuleRefNode) and n.target is start for r in rules.values() for n in _walk(r.alternatives)
    )
    top_level = set()  # the root's top-level alternatives (only the end follows them)
    if not root_is_referenced:
        body = start.alternatives
        top_level = {id(a) for a in (body.alternatives if isinstance(body, g.AlternativeNode) else [body])}

    # every lexeme of the grammar: (node, parent, index): parent is the sequence, alternatives
    # or rule holding it (a rule: index -1)
    lexemes = []
    for r in nonterminals:
        _collect(g, r.alternatives, r, -1, lexemes)
    firsts = {}

    def first_of(node):
        key = str(node)
        if key not in firsts:
            firsts[key] = first_bytes(_lark(rules, start, node))[0]
        return firsts[key]

    runs = {}  # class text -> its runs [(node, parent, index)]
    for node, parent, i in lexemes:
        if _is_run(g, node):
            runs.setdefault(node.node.rx, []).append((node, parent, i))
    chosen = []
    for rx, occurrences in runs.items():
        x = first_of(occurrences[0][0].node)
        if not x:
            continue
        clash = any(
            first_of(node.node if _is_run(g, node) else node) & x
            for node, _, _ in lexemes
            if not (_is_run(g, node) and node.node.rx == rx)
        )
        if clash:
            continue
        if all(_follow_is_clear(g, rules, start, node, parent, i, x, top_level) for node, parent, i in occurrences):
            chosen.extend(occurrences)
    if not chosen:
        return None
    for node, parent, i in chosen:
        lexeme = g.RegexNode(f"{node.node.rx}+")
        new = lexeme if node.min_times >= 1 else g.RepetitionNode(lexeme, 0, 1)
        if isinstance(parent, g.SequenceNode):
            parent.nodes[i] = new
        elif isinstance(parent, g.AlternativeNode):
            parent.alternatives[i] = new
        else:
            parent.alternatives = new
    return _lark(rules, start, None)


def _walk(node):
    yield node
    for c in node.children():
        yield from _walk(c)


def _collect(g, node, parent, i, out):
    """The lexemes under `node` (in a non-terminal rule): runs, literals, classes and references
    to TERMINAL rules, each with where it stands; a run is not looked into."""
    if _is_run(g, node) or isinstance(node, (g.LiteralNode, g.RegexNode)):
        out.append((node, parent, i))
    elif isinstance(node, g.RuleRefNode):
        if node.target is not None and node.target.rule_is_terminal:
            out.append((node, parent, i))
    elif isinstance(node, g.SequenceNode):
        for j, c in enumerate(node.nodes):
            _collect(g, c, node, j, out)
    elif isinstance(node, g.AlternativeNode):
        for j, c in enumerate(node.alternatives):
            _collect(g, c, node, j, out)
    else:  # other repetitions: their child stands in no sequence of ours
        for c in node.children():
            _collect(g, c, node, -1, out)


def _is_run(g, node) -> bool:
    """An unbounded repetition (`*`, `+`) of one character class or `.`."""
    return (
        isinstance(node, g.RepetitionNode)
        and node.max_times is None
        and node.min_times in (0, 1)
        and isinstance(node.node, g.RegexNode)
        and (node.node.rx.startswith("[") or node.node.rx == ".")
    )


def _follow_is_clear(g, rules, start, node, parent, i, x, top_level) -> bool:
    """What follows the run `node` cannot start with a byte in `x`, and cannot be empty unless
    only the end of the root follows (the run, or its sequence, is a top-level alternative)."""
    if isinstance(parent, g.SequenceNode):
        rest, holder = parent.nodes[i + 1 :], parent
    elif isinstance(parent, g.RepetitionNode):
        return False  # a run repeated again: what follows it is itself
    else:  # the run alone is a rule's body or one of its alternatives
        rest, holder = [], node
    if not rest:
        return id(holder) in top_level
    follow, can_be_empty = first_bytes(_lark(rules, start, g.SequenceNode(list(rest))))
    if follow & x:
        return False
    return not can_be_empty or id(holder) in top_level


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
