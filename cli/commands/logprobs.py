"""`kvchat logprobs -m MODEL -f FILE [--top N] [--parse-special] [-c -b -ub -ctk -ctv -fa -t]`:
score a text, printing the model's next-token distribution after every token as JSON.

    {"tokens": [ids...], "positions": [{"top": [[id, logprob], ...]}, ...]}

positions[i] is the distribution of token i+1 given tokens 0..i (natural-log softmax over the
whole vocabulary, the N most likely first), the layout of the `logits[*]` entries of llama.cpp's
reference files (shared/reference/tiny). The text is tokenized with the model's add-special
rule (BOS when the model adds one); --parse-special turns texts like <|im_start|> into their
special tokens. The tokens are decoded in -b pieces (one sequence, all logits), so the whole
text must fit the context (-c; 0 = the model's training length).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import typer

from kvchat.cli.option_params import with_settings
from kvchat.cli.options import CACHE_FLAGS, ChatSettings
from kvchat.runtime.errors import KvchatError

FLAGS = CACHE_FLAGS + ("swa_full",)


def top_logprobs(logits: np.ndarray, top: int) -> list[list[list]]:
    """Rows of logits f32 [n, n_vocab] -> per row the `top` (id, log-softmax) pairs, most likely
    first (ties by id). Computed in float64."""
    x = logits.astype(np.float64)  # [n, n_vocab]
    m = x.max(axis=1, keepdims=True)
    lp = x - (m + np.log(np.exp(x - m).sum(axis=1, keepdims=True)))
    k = min(top, x.shape[1])
    out = []
    for row in lp:
        ids = np.argpartition(-row, k - 1)[:k] if k < row.size else np.arange(row.size)
        ids = ids[np.lexsort((ids, -row[ids]))]
        out.append([[int(i), float(row[i])] for i in ids])
    return out


def score_tokens(ctx, tokens: list[int], top: int) -> list[list[list]]:
    """Decode `tokens` from position 0 of sequence 0 in n_batch pieces with every logit
    (kvchat.runtime.generate.decode_tokens), and return top_logprobs of each position."""
    from kvchat.runtime.generate import decode_tokens

    positions = []
    decode_tokens(ctx, tokens, 0, 0, logits="all", on_logits=lambda i, rows: positions.extend(top_logprobs(rows, top)))
    return positions


def logprobs_json(tokens: list[int], positions: list) -> str:
    return json.dumps({"tokens": [int(t) for t in tokens], "positions": [{"top": t} for t in positions]})


def run_logprobs(settings: ChatSettings, file: Path, top: int, parse_special: bool) -> str:
    from kvchat.cli.sources.models import resolve_model
    from kvchat.runtime.context import Context
    from kvchat.runtime.model import Model

    if not file.is_file():
        raise KvchatError(f"text file '{file}' not found; give an existing file with -f")
    try:
        text = file.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise KvchatError(f"'{file}' is not UTF-8 text ({e.reason} at byte {e.start}); give a UTF-8 file")
    model = Model.load(resolve_model(settings.model))
    try:
        tokens = model.vocab.tokenize(text, add_special=True, parse_special=parse_special)
        if not tokens:
            raise KvchatError(f"'{file}' tokenizes to no tokens; give a non-empty text")
        ctx = Context(model, settings.context_params())
        if len(tokens) > ctx.n_ctx_seq:
            raise KvchatError(
                f"the text is {len(tokens)} tokens, more than the context of "
                f"{ctx.n_ctx_seq}; give -c {len(tokens)} or more"
            )
        return logprobs_json(tokens, score_tokens(ctx, tokens, top))
    finally:
        model.close()


def register(app: typer.Typer) -> None:
    @app.command("logprobs")
    @with_settings(names=FLAGS)
    def logprobs(
        file: Path = typer.Option(..., "-f", "--file", help="text file to score"),
        top: int = typer.Option(10, "--top", min=1, help="most likely tokens listed per position"),
        parse_special: bool = typer.Option(
            False, "--parse-special", help="turn texts like <|im_start|> into their special tokens"
        ),
        settings: ChatSettings = None,
    ):
        """Print the next-token log-probabilities after every token of a text, as JSON."""
        sys.stdout.write(run_logprobs(settings, file, top, parse_special) + "\n")
