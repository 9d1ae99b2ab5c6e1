"""What a grammar costs per generated token, next to the token itself (docs/performance.md).

Usage: python benchmarks/grammar_cost.py [MODEL] [-n 128] [--rounds 3]
Answers the same prompt greedily with -n N tokens, alternately free and under a grammar that
never ends on its own (any text of letters, digits, spaces and punctuation, so every round makes
N tokens) — compiled as kvchat compiles it (the character run as one llguidance lexeme,
runtime/grammar/lexemes.py) and as llguidance's gbnf_to_lark alone writes it ("plain") — and a
JSON schema run (which ends when the object closes). Per round it prints the
time per generated token (wall and CPU of the whole answer loop: sampling, masking, decoding)
and the grammar's own time per token (llguidance's mask, its unpacking, following the token:
GrammarMatcher.seconds), then medians. The mask's share of tg is matcher time / free time.
"""

import argparse
import os
import statistics
import sys
import time

if not os.environ.get("PYTHONPATH"):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PROMPT = "Write a long story about a lighthouse keeper."
TEXT_GRAMMAR = 'root ::= [a-zA-Z0-9 ,.;:!?\'"()-]+'
PERSON = '{"type":"object","properties":{"name":{"type":"string"},"age":{"type":"integer"}},"required":["name","age"]}'


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "model", nargs="?", default=os.path.expanduser("~/.cache/kvchat/models/SmolLM2-135M-Instruct.Q4_1.gguf")
    )
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    from kvchat.runtime.chat.conversation import Conversation, ConversationConfig
    from kvchat.runtime.context import Context
    from kvchat.runtime.cparams import ContextParams
    from kvchat.runtime.grammar.matcher import Constraint
    from kvchat.runtime.grammar.spec import GrammarSpec
    from kvchat.runtime.model import Model
    from kvchat.runtime.sampling import Sampler, SamplingParams
    from kvchat.runtime.text.chat_template import ChatTemplate

    model = Model.load(args.model)
    ctx = Context(model, ContextParams(n_ctx=1024))
    tpl = ChatTemplate.from_gguf(model.gguf, model.vocab)
    t0 = time.perf_counter()
    text = Constraint(GrammarSpec("gbnf", TEXT_GRAMMAR, "text"), model.vocab)
    t_tok = time.perf_counter() - t0
    from kvchat.runtime.grammar import lexemes

    rewrite, lexemes._rewrite = lexemes._rewrite, lambda text: None
    plain = Constraint(GrammarSpec("gbnf", TEXT_GRAMMAR, "text"), model.vocab)
    lexemes._rewrite = rewrite
    assert plain.grammar != text.grammar
    person = Constraint(GrammarSpec("json_schema", PERSON, "person"), model.vocab)
    print(f"llguidance tokenizer for {model.vocab.n_vocab} tokens: {t_tok:.2f} s (once per run)")

    def answer(constraint, n):
        conv = Conversation(ctx, model.vocab, tpl, Sampler(SamplingParams(temp=0.0)), ConversationConfig(n_predict=n))
        conv.constraint = constraint
        c0 = time.process_time()
        stats = conv.ask(PROMPT)
        cpu = time.process_time() - c0
        ctx.memory.clear(True)
        m = conv.matcher.seconds if conv.matcher is not None else 0.0
        return stats.n_gen, stats.t_gen / stats.n_gen, m / stats.n_gen, conv.messages[-1]["content"], cpu

    answer(None, 8)  # warm
    rows = {"free": [], "grammar": [], "plain": [], "json": []}
    answers = {}
    order = (("free", None), ("grammar", text), ("plain", plain), ("json", person))
    for r in range(args.rounds):
        for name, c in order if r % 2 == 0 else order[::-1]:
            n, per_tok, mask, content, _ = answer(c, args.n)
            rows[name].append((per_tok, mask))
            answers.setdefault(name, set()).add(content)
            print(f"round {r} {name:8s} n={n:4d}  {per_tok * 1e3:7.2f} ms/token  grammar {mask * 1e3:6.3f} ms/token")
            if name == "json":
                print(f"   json answer: {content}")
    print(
        "the class grammar's answers with and without the lexeme rewrite identical:",
        answers["grammar"] == answers["plain"],
    )
    free = statistics.median(p for p, _ in rows["free"])
    for name in ("grammar", "plain", "json"):
        tok = statistics.median(p for p, _ in rows[name])
        mask = statistics.median(m for _, m in rows[name])
        print(
            f"median {name}: {tok * 1e3:.2f} ms/token vs free {free * 1e3:.2f} ms/token "
            f"({tok / free:.3f}x); grammar alone {mask * 1e3:.3f} ms/token = {mask / free * 100:.1f} % of free tg"
        )


if __name__ == "__main__":
    main()
