"""A kv-sweep run beside the two-pass route it must equal: the tests of dense and MoE models
assert the same pairs (each with its own bounds)."""

from __future__ import annotations

from kvchat.runtime.eval.kld import LogitsFile
from kvchat.runtime.eval.kv_sweep import run_sweep
from kvchat.runtime.eval.perplexity import compute_perplexity


def sweep_and_two_pass(model, tokens, configs, n_chunks: int, tmp_path):
    """(reference row, [(sweep row, two-pass KLD stats)]): run_sweep over `configs` (n_ctx 64,
    n_batch 24), and per config the two-pass route — a base logits file written by
    compute_perplexity, then compute_perplexity with the config's cache types against it."""
    ref_row, rows = run_sweep(model, tokens, configs, 64, n_chunks=n_chunks, n_batch=24)
    base = tmp_path / "base.kld"
    compute_perplexity(model, tokens, n_ctx=64, n_batch=64, n_chunks=n_chunks, base_out=base)
    lf = LogitsFile(base)
    pairs = []
    for row in rows:
        c = row.config
        two = compute_perplexity(
            model, None, n_chunks=n_chunks, type_k=c.type_k, type_v=c.type_v, rotation=c.rotation, kl_base=lf
        ).kld
        pairs.append((row, two))
    return ref_row, pairs
