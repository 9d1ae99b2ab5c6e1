"""The long-context retrieval probe (`kv-sweep --needle`): does a cache type lose a fact?

A needle sentence ("The secret number of the archive is 73915.") is placed at several depths
of a filler text (the sweep's own text, from its start), and the prompt ends with a question
whose answer repeats it. Each cache configuration decodes the same prompts; we teacher-force
the answer and report its log-probability (sum over its tokens) and whether greedy decoding
would produce it (every answer token is the argmax). The f16/f16 row says what the model can
do at that length at all; the other rows say what the cache type takes away.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np

from kvchat.runtime.errors import KvchatError
from kvchat.runtime.eval.perplexity import chunk_outputs, make_context

NEEDLE = " The secret number of the archive is {code}. Remember it."
QUESTION = "\n\nQuestion: What is the secret number of the archive?\nAnswer: The secret number of the archive is"
ANSWER = " {code}"
DEPTHS = (0.1, 0.5, 0.9)


@dataclass
class NeedleCase:
    length: int  # prompt tokens
    depth: float  # where the needle starts, as a fraction of the filler
    prompt: np.ndarray  # i64 [length]
    answer: np.ndarray  # i64 [n_answer]


@dataclass
class NeedleResult:
    label: str
    cases: list = field(default_factory=list)  # dicts: length, depth, logprob, correct

    def accuracy(self, length: Optional[int] = None) -> float:
        sel = [c for c in self.cases if length is None or c["length"] == length]
        return sum(c["correct"] for c in sel) / len(sel) if sel else float("nan")

    def mean_logprob(self, length: Optional[int] = None) -> float:
        sel = [c["logprob"] for c in self.cases if length is None or c["length"] == length]
        return float(np.mean(sel)) if sel else float("nan")


def needle_cases(model, filler_tokens, lengths, depths=DEPTHS, code: str = "73915") -> list[NeedleCase]:
    """One prompt per (length, depth): [BOS] filler[:a] needle filler[a:b] question, `length` tokens."""
    tok = model.vocab.tokenize
    needle = tok(NEEDLE.format(code=code), add_special=False, parse_special=False)
    question = tok(QUESTION, add_special=False, parse_special=False)
    answer = np.asarray(tok(ANSWER.format(code=code), add_special=False, parse_special=False), dtype=np.int64)
    bos = [model.vocab.bos] if model.vocab.add_bos else []
    filler = list(filler_tokens)
    if filler and bos and filler[0] == bos[0]:
        filler = filler[1:]
    cases = []
    for n in lengths:
        n_fill = n - len(bos) - len(needle) - len(question)
        if n_fill < 16:
            raise KvchatError(
                f"--needle-len {n}: too short for the needle and question ({len(needle) + len(question)} tokens)"
            )
        if n_fill > len(filler):
            raise KvchatError(
                f"--needle-len {n}: the text has only {len(filler)} filler tokens; "
                f"give a longer -f text or a smaller length"
            )
        for d in depths:
            a = int(round(d * n_fill))
            prompt = bos + filler[:a] + needle + filler[a:n_fill] + question
            cases.append(NeedleCase(n, d, np.asarray(prompt, dtype=np.int64), answer))
    return cases


def score_case(ctx, case: NeedleCase) -> dict:
    """Teacher-forced answer: sum of its log-probs and whether each token is the argmax."""
    toks = np.concatenate([case.prompt, case.answer])
    first = case.prompt.shape[0] - 1
    logprob, correct = 0.0, True
    for pos, logits in chunk_outputs(ctx, toks, first):
        for r, p in enumerate(pos.tolist()):
            x = logits[r].astype(np.float64)
            m = x.max()
            lse = m + np.log(np.exp(x - m).sum())
            target = int(toks[p + 1])
            logprob += float(x[target] - lse)
            correct &= int(np.argmax(logits[r])) == target
    return dict(length=int(case.prompt.shape[0]), depth=case.depth, logprob=logprob, correct=bool(correct))


def run_needle(
    model,
    configs,
    cases: list[NeedleCase],
    n_threads: Optional[int] = None,
    flash_attn: str = "on",
    on_step: Optional[Callable[[str], None]] = None,
) -> list[NeedleResult]:
    """configs: SweepConfig-like (type_k, type_v, rotation, label); the reference goes first."""
    out = []
    n_ctx = max(c.prompt.shape[0] + c.answer.shape[0] for c in cases)
    for cfg in configs:
        ctx = make_context(model, n_ctx, 512, 512, cfg.type_k, cfg.type_v, flash_attn, n_threads, cfg.rotation)
        res = NeedleResult(cfg.label)
        for case in cases:
            res.cases.append(score_case(ctx, case))
            if on_step:
                on_step(f"needle {cfg.label} {case.prompt.shape[0]} @ {case.depth:.0%}")
        out.append(res)
        ctx = None
    return out


def default_lengths(model, n_text_tokens: int) -> list[int]:
    """Haystack lengths the model can use: powers of two from 512 up to a quarter of its
    training context (small models lose retrieval well before it), capped at 2048 and by the
    text."""
    n_train = int(getattr(model.hparams, "n_ctx_train", 0) or 2048)
    top = min(2048, max(512, n_train // 4), n_text_tokens - 64)
    out, n = [], 512
    while n <= top:
        out.append(n)
        n *= 2
    if not out:
        raise KvchatError(f"the text has {n_text_tokens} tokens; --needle needs at least 576 (or give --needle-len)")
    return out


def render_needle(rows: list[dict], console) -> None:
    """One line per configuration: per haystack length, hits / cases and mean answer log-prob."""
    from rich.table import Table

    lengths = sorted({r["length"] for r in rows})
    t = Table(title="needle: the secret number asked for at the end (teacher-forced answer)", header_style="bold")
    t.add_column("K/V")
    for n in lengths:
        t.add_column(f"{n} tokens: found", justify="right")
        t.add_column("log p(answer)", justify="right")
    seen = []
    for r in rows:
        key = (r["type_k"], r["type_v"], r["rot"])
        if key not in seen:
            seen.append(key)
    for key in seen:
        cells = [f"{key[0]}/{key[1]}" + ("" if key[2] == "auto" else " rot off")]
        for n in lengths:
            sel = [r for r in rows if (r["type_k"], r["type_v"], r["rot"]) == key and r["length"] == n]
            cells += [f"{sum(r['correct'] for r in sel)}/{len(sel)}", f"{np.mean([r['logprob'] for r in sel]):.3f}"]
        t.add_row(*cells)
    console.print(t)
    console.print(
        "found = every answer token is the greedy choice; depths "
        + ", ".join(f"{d:.0%}" for d in sorted({r['depth'] for r in rows}))
    )
