"""The range checks of the shared flags (cli/options.py's table): value -> value (possibly
normalised), ValueError with the reason; each carries `.text`, the range as --help shows it. A
flag and `/set` refuse a value with the same check."""

from __future__ import annotations

import math
from typing import Callable


def at_least(lo, finite: bool = True) -> Callable:
    def check(v):
        if v is None:
            return v
        if finite and isinstance(v, float) and not math.isfinite(v):
            raise ValueError(f"must be a finite number (got {v})")
        if v < lo:
            raise ValueError(f"must be >= {lo} (got {v})")
        return v

    check.text = f"x>={lo}"
    return check


def within(lo, hi) -> Callable:
    def check(v):
        if v is None:
            return v
        if isinstance(v, float) and not math.isfinite(v):
            raise ValueError(f"must be a finite number within {lo}..{hi} (got {v})")
        if not lo <= v <= hi:
            raise ValueError(f"must be within {lo}..{hi} (got {v})")
        return v

    check.text = f"{lo}<=x<={hi}"
    return check


def above(lo) -> Callable:
    def check(v):
        if v is None:
            return v
        if isinstance(v, float) and not math.isfinite(v):
            raise ValueError(f"must be a finite number (got {v})")
        if v <= lo:
            raise ValueError(f"must be > {lo} (got {v})")
        return v

    check.text = f"x>{lo}"
    return check


def seed_value(v):
    """-1 means a random seed (llama.cpp's LLAMA_DEFAULT_SEED), as does leaving it out."""
    if v is None or v == -1:
        return None
    if not 0 <= v < 2**64:
        raise ValueError(f"must be -1 (random) or within 0..2^64-1 (got {v})")
    return v


seed_value.text = "-1 or 0<=x<2^64"


def spec_type_value(v):
    """draft, ngram or self:TYPE (the draft type is checked when the model is loaded)."""
    if v is None:
        return v
    text = v.strip().lower()
    if text in ("draft", "ngram") or (text.startswith("self:") and len(text) > 5):
        return text
    raise ValueError(f"must be draft, ngram or self:TYPE such as self:q4_0 (got {v!r})")


spec_type_value.text = "draft|ngram|self:TYPE"


def one_of(*choices) -> Callable:
    """A word among `choices` (lower-cased); None passes (the flag's default)."""

    def check(v):
        if v is None:
            return v
        word = str(v).strip().lower()
        if word not in choices:
            raise ValueError(f"must be one of {', '.join(choices)} (got {v!r})")
        return word

    check.text = "|".join(choices)
    return check
