"""`kvchat run`'s persistent prefix cache (runtime/serving/prompt_cache.py): before the answer, restore the
longest cached prefix of the rendered prompt and decode the rest block by block, saving new
blocks; the Conversation then decodes only the final tokens. One line on stderr says what was
reused (`prompt cache: reused 1920/2010 tokens`)."""

from __future__ import annotations

import sys
from pathlib import Path

DEFAULT_MAX_MIB = 2048


def _line(text: str) -> None:
    print(text, file=sys.stderr, flush=True)  # one unwrapped line (scripts grep these)


def default_dir() -> Path:
    from kvchat.cli.sources.models import cache_dir

    return cache_dir() / "prompt-cache"


def warm(engine, conv, text: str, directory: Path | None, max_mib: int, renderer) -> None:
    """Fill conv's sequence from the cache (and the cache from this prompt) before conv.ask."""
    from kvchat.runtime.serving.prompt_cache import PromptCache, prefill
    from kvchat.runtime.serving.prompt_keys import BLOCK, cache_salt, cacheable, file_sha256

    ctx = engine.ctx
    if conv.n_cached or not cacheable(ctx.memory):
        return
    desired = conv.render(conv.messages + [{"role": "user", "content": text}])
    if len(desired) <= BLOCK or len(desired) + 1 > ctx.n_ctx:
        return  # nothing to cache, or too long: conv.ask words the refusal
    directory = Path(directory) if directory is not None else default_dir()
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        _line(f"prompt cache: cannot use {directory}: {e.strerror or e} (continuing without)")
        return
    sha = file_sha256(engine.model.path, directory)
    cache = PromptCache(directory, max_mib << 20, cache_salt(sha, ctx.cparams, ctx.memory), warn=_line)
    n_reused, n_mem = prefill(ctx, conv.seq_id, desired, cache)
    conv.tokens = list(desired[:n_mem])  # the mirror of what the sequence now holds
    print(f"prompt cache: reused {n_reused}/{len(desired)} tokens", file=sys.stderr, flush=True)
