"""The persistent prefix cache (runtime/serving/prompt_cache.py) on tiny models: a second process-like
run restores the longest cached prefix and decodes only the rest, with the same cells, rows and
logits as the first; iSWA caches come back exact; corrupt or foreign entries are ignored with
one warning and deleted; the directory never exceeds its size limit."""

import numpy as np
import pytest

from kvchat.runtime.context import Context
from kvchat.runtime.cparams import ContextParams
from kvchat.runtime.generate import decode_tokens
from kvchat.runtime.model import Model
from kvchat.runtime.serving.prompt_cache import PromptCache, prefill
from kvchat.runtime.serving.prompt_keys import BLOCK, cache_salt
from tests.helpers.gguf_factory import write_tiny_model


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return Model.load(write_tiny_model(tmp_path_factory.mktemp("pc") / "l.gguf", arch="llama", n_ctx_train=2048))


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    return Model.load(
        write_tiny_model(tmp_path_factory.mktemp("pc") / "g.gguf", arch="gemma3", n_swa=16, n_ctx_train=2048)
    )


def tokens(n, seed=0, n_vocab=200):
    return [int(t) for t in np.random.default_rng(seed).integers(3, n_vocab, n)]


def run(model, ids, cache, n_gen=8, **cp):
    """A fresh context: cached prefill, then the rest and a greedy continuation.
    Returns (n_reused, prompt tokens decoded, logits of every generated step, ctx)."""
    ctx = Context(model, ContextParams(n_ctx=1024, **cp))
    n_reused, n_mem = prefill(ctx, 0, ids, cache) if cache is not None else (0, 0)
    lg = decode_tokens(ctx, ids[n_mem:], n_mem, 0)
    out = [lg]
    for i in range(n_gen):
        lg = decode_tokens(ctx, [int(np.argmax(lg))], len(ids) + i, 0)
        out.append(lg)
    return n_reused, len(ids) - n_reused, np.array(out), ctx


def make_cache(tmp_path, ctx_model, max_bytes=1 << 30, warn=None, **cp):
    ctx = Context(ctx_model, ContextParams(n_ctx=1024, **cp))
    return PromptCache(tmp_path / "pc", max_bytes, cache_salt("m" * 64, ctx.cparams, ctx.memory), warn)


def test_second_run_restores_the_prefix_and_gives_the_same_logits_and_cells(llama, tmp_path):
    ids = tokens(700)
    plain = run(llama, ids, None)
    cache = make_cache(tmp_path, llama)
    first = run(llama, ids, cache)
    assert first[0] == 0 and cache.n_written == (700 - 1) // BLOCK
    second = run(llama, ids, make_cache(tmp_path, llama))
    assert second[0] == 5 * BLOCK and second[1] == 700 - 5 * BLOCK  # 60 of 700 decoded
    np.testing.assert_array_equal(first[2], plain[2])
    np.testing.assert_array_equal(second[2], first[2])
    a, b = first[3].memory, second[3].memory
    np.testing.assert_array_equal(a.cells[0].pos, b.cells[0].pos)
    for la, lb in zip(a.layers, b.layers):
        np.testing.assert_array_equal(la.k, lb.k)
        np.testing.assert_array_equal(la.v, lb.v)


def test_a_shared_head_is_reused_and_a_different_tail_is_decoded(llama, tmp_path):
    head = tokens(300, seed=1)
    run(llama, head + tokens(200, seed=2), make_cache(tmp_path, llama))
    n_reused, n_dec, lg, _ = run(llama, head + tokens(150, seed=3), make_cache(tmp_path, llama))
    assert n_reused == 2 * BLOCK and n_dec == 450 - 2 * BLOCK
    np.testing.assert_array_equal(lg, run(llama, head + tokens(150, seed=3), None)[2])


@pytest.mark.parametrize("swa_full", [False, True])
def test_iswa_prefix_is_restored_exactly(gemma, tmp_path, swa_full):
    ids = tokens(600, seed=4)
    first = run(gemma, ids, make_cache(tmp_path, gemma, swa_full=swa_full), swa_full=swa_full)
    second = run(gemma, ids, make_cache(tmp_path, gemma, swa_full=swa_full), swa_full=swa_full)
    assert second[0] == 4 * BLOCK
    np.testing.assert_array_equal(second[2], first[2])
    for ca, cb in (
        (first[3].memory.kv_base, second[3].memory.kv_base),
        (first[3].memory.kv_swa, second[3].memory.kv_swa),
    ):
        # every cell a later token can still attend is the same cell with the same rows (the
        # first run's SWA cache also holds masked leftovers, which nothing reads)
        pa, pb = ca.cells[0].pos, cb.cells[0].pos
        lo = ca.seq_pos_max(0) + 1 - ca.n_swa if ca.n_swa else 0
        seen = np.flatnonzero(pa >= lo)
        assert seen.size >= min(ca.n_swa or 10**9, 608) and np.array_equal(seen, np.flatnonzero(pb >= lo))
        np.testing.assert_array_equal(pa[seen], pb[seen])
        for la, lb in zip(ca.layers, cb.layers):
            np.testing.assert_array_equal(la.k[0, seen], lb.k[0, seen])
        assert ca.heads == cb.heads


def test_another_configuration_does_not_see_the_entries(llama, tmp_path):
    ids = tokens(400, seed=5)
    run(llama, ids, make_cache(tmp_path, llama))
    q8 = make_cache(tmp_path, llama, type_k="bf16")
    assert run(llama, ids, q8, type_k="bf16")[0] == 0


@pytest.mark.parametrize("damage", ["truncate", "flip", "foreign"])
def test_a_damaged_entry_is_ignored_with_one_warning_and_deleted(llama, tmp_path, damage):
    ids = tokens(500, seed=6)
    run(llama, ids, make_cache(tmp_path, llama))
    from kvchat.runtime.serving.prompt_keys import block_keys

    keys = block_keys(make_cache(tmp_path, llama).salt, ids, 3)
    victim = tmp_path / "pc" / f"{keys[1]}.kvpc"
    blob = victim.read_bytes()
    if damage == "truncate":
        victim.write_bytes(blob[: len(blob) // 2])
    elif damage == "flip":
        victim.write_bytes(blob[:100] + bytes([blob[100] ^ 1]) + blob[101:])
    else:  # the file of block 2 put under block 1's name
        victim.write_bytes((tmp_path / "pc" / f"{keys[2]}.kvpc").read_bytes())
    warnings = []
    n_reused, _, lg, _ = run(llama, ids, make_cache(tmp_path, llama, warn=warnings.append))
    assert n_reused == BLOCK  # block 0 still good; the restore stopped before the bad one
    assert len(warnings) == 1 and warnings[0].startswith("prompt cache: ignoring ")
    assert warnings[0].endswith("; deleted")
    np.testing.assert_array_equal(lg, run(llama, ids, None)[2])
    assert victim.exists()  # rewritten by this run's prefill
    assert run(llama, ids, make_cache(tmp_path, llama))[0] == 3 * BLOCK


def test_the_directory_never_exceeds_its_limit_and_evicts_least_recently_used(llama, tmp_path):
    probe = make_cache(tmp_path, llama)
    run(llama, tokens(300, seed=7), probe)
    one = probe.total_bytes() // 2  # bytes of one block entry
    limit = 5 * one + one // 2
    sizes = []
    for seed in range(8, 12):
        c = make_cache(tmp_path, llama, max_bytes=limit)
        run(llama, tokens(300, seed=seed), c)
        sizes.append(c.total_bytes())
    assert max(sizes) <= limit
    last = make_cache(tmp_path, llama, max_bytes=limit)
    assert run(llama, tokens(300, seed=11), last)[0] == 2 * BLOCK  # the newest prompt survived
    assert run(llama, tokens(300, seed=8), make_cache(tmp_path, llama, max_bytes=limit))[0] == 0
    tiny = make_cache(tmp_path / "t", llama, max_bytes=one // 2)
    run(llama, tokens(300, seed=12), tiny)
    assert tiny.total_bytes() == 0  # a block bigger than the whole budget is not written
