"""`kvchat bench --spec TYPE`: the speed-up of speculative decoding on one prompt, side by side.

Greedy generation of up to -n tokens from a chat prompt (--prompt-file: its text as the user's
message, through the model's chat template), plain and speculative alternately for -r rounds
on one Context (the sequence cleared between runs), only the generation timed — the draft's
prefill of the prompt included, as llama-speculative-simple times it. Both answers must be the
same tokens (greedy speculative decoding is exact): a difference is reported as an error.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import numpy as np

from kvchat.runtime.errors import KvchatError

DEFAULT_PROMPT = "Write a Python function that returns the n-th Fibonacci number, with a docstring and tests."


def prompt_tokens(model, prompt_file: Path | None, raw: bool = False) -> list[int]:
    from kvchat.runtime.text.chat_template import ChatTemplate

    if prompt_file is None:
        text = DEFAULT_PROMPT
    else:
        try:
            text = Path(prompt_file).read_text(encoding="utf-8", errors="replace")
        except OSError as e:
            raise KvchatError(f"cannot read prompt file {prompt_file}: {e.strerror or e}") from None
    if raw:  # a base model's continuation, as llama-speculative-simple -f takes it
        rendered = text
    else:
        rendered = ChatTemplate.from_gguf(model.gguf, model.vocab).render([{"role": "user", "content": text}])
    ids = list(model.vocab.tokenize(rendered, add_special=True, parse_special=True))
    bos = model.vocab.bos
    if len(ids) >= 2 and ids[0] == bos and ids[1] == bos:
        ids = ids[1:]
    return ids


def one_run(ctx, prompt, n_gen, speculator):
    """(tokens, seconds of generation) of one greedy answer; the sequence is cleared first."""
    from kvchat.runtime.generate import decode_tokens, generate
    from kvchat.runtime.speculative.generate import generate_speculative

    ctx.memory.clear(True)
    logits = decode_tokens(ctx, prompt, 0, 0)
    if speculator is not None:
        speculator.source.close()  # the draft starts from nothing too
    vocab = ctx.model.vocab
    kw = dict(logits=logits, pos0=len(prompt), max_tokens=n_gen, is_eog=vocab.is_eog)
    greedy = lambda row: int(np.argmax(row))  # noqa: E731
    if speculator is None:
        gen = generate(ctx, greedy, **kw)
    else:
        gen = generate_speculative(ctx, greedy, speculator, history=prompt, **kw)
    t0 = time.perf_counter()
    toks = [s.token for s in gen]
    return toks, time.perf_counter() - t0, gen


def bench_spec(
    ctx, settings, kind: str, prompt_file, n_gen: int, reps: int, as_json: bool, draft_path, raw_prompt: bool = False
) -> None:
    from kvchat.runtime.speculative import make_speculator

    prompt = prompt_tokens(ctx.model, prompt_file, raw_prompt)
    if len(prompt) + n_gen + settings.draft_max + 2 > ctx.n_ctx:
        raise KvchatError(f"the prompt ({len(prompt)} tokens) and -n {n_gen} do not fit in -c {ctx.n_ctx}")
    spec = make_speculator(
        ctx,
        kind,
        draft_path=draft_path,
        draft_max=settings.draft_max,
        draft_min=settings.draft_min,
        draft_p_min=settings.draft_p_min,
    )
    print(f"bench: spec {kind}, prompt {len(prompt)} tokens, warm-up ...", file=sys.stderr)
    one_run(ctx, prompt, min(n_gen, 16), None)
    one_run(ctx, prompt, min(n_gen, 16), spec)
    plain_ts, spec_ts, acc = [], [], []
    ref = None
    for r in range(reps):
        for variant in ("plain", "spec") if r % 2 == 0 else ("spec", "plain"):
            toks, secs, gen = one_run(ctx, prompt, n_gen, spec if variant == "spec" else None)
            if ref is None:
                ref = toks
            elif toks != ref:
                raise KvchatError(f"speculative and plain greedy answers differ ({variant}, round {r + 1}): a bug")
            (spec_ts if variant == "spec" else plain_ts).append(len(toks) / secs)
            if variant == "spec":
                acc.append((gen.stats.n_accepted, gen.stats.n_drafted, gen.stats.n_verify))
    a, d, v = acc[-1]
    row = dict(
        spec_type=kind,
        n_prompt=len(prompt),
        n_gen=len(ref),
        plain_ts=statistics.mean(plain_ts),
        spec_ts=statistics.mean(spec_ts),
        speedup=statistics.mean(spec_ts) / statistics.mean(plain_ts),
        samples_plain=plain_ts,
        samples_spec=spec_ts,
        drafted=d,
        accepted=a,
        verify_batches=v,
    )
    if as_json:
        import json

        print(json.dumps([row], indent=2))
        return
    print("| spec | prompt | tokens | plain t/s | spec t/s | speed-up | accepted / drafted | verify batches |")
    print("| ---- | -----: | -----: | --------: | -------: | -------: | -----------------: | -------------: |")
    print(
        f"| {kind} | {row['n_prompt']} | {row['n_gen']} | {row['plain_ts']:.2f} | {row['spec_ts']:.2f} | "
        f"{row['speedup']:.2f}x | {a} / {d} ({100 * a / max(1, d):.0f} %) | {v} |"
    )
