"""Test doubles for the memory-system tests: small HParams, a stub model, cache snapshots.

The stub model's forward does what a real one does to memory - writes RoPE'd K and plain V
rows through mctx.cpy_k/cpy_v for every layer, reads the mask - and returns logits that depend
on what the mask lets it see, so tests can compare runs. It can be told to raise on the Nth
ubatch (a compute failure) to exercise the rollback.
"""

from __future__ import annotations

import numpy as np

from kvchat.kernels.quants import dequantize
from kvchat.kernels.rope import rope_inplace
from kvchat.runtime.hparams import HParams
from kvchat.runtime.memory.attn_rotation import rotate


def make_hparams(
    n_layer=2,
    n_head_kv=2,
    head_dim=32,
    n_vocab=64,
    n_ctx_train=4096,
    n_swa=0,
    swa_layers=None,
    rope_type="neox",
    arch="llama",
) -> HParams:
    if swa_layers is None:
        swa_layers = [False] * n_layer
    return HParams(
        arch=arch,
        n_vocab=n_vocab,
        n_ctx_train=n_ctx_train,
        n_embd=n_head_kv * head_dim * 2,
        n_layer=n_layer,
        n_head=n_head_kv * 2,
        n_head_kv=n_head_kv,
        n_embd_head_k=head_dim,
        n_embd_head_v=head_dim,
        n_ff=64,
        norm_eps=1e-6,
        rope_type=rope_type,
        n_rot=head_dim,
        rope_freq_base=10000.0,
        rope_freq_scale=1.0,
        rope_freq_base_swa=1000.0,
        n_swa=n_swa,
        swa_layers=list(swa_layers),
        use_qk_norm=False,
        tied_output=True,
    )


def raw_k(hp: HParams, il: int, tokens: np.ndarray) -> np.ndarray:
    """Un-rotated keys of tokens in layer il: f32 [n, n_head_kv, head_dim], deterministic."""
    n = tokens.shape[0]
    j = np.arange(hp.n_head_kv * hp.n_embd_head_k, dtype=np.float64)
    x = np.sin(tokens[:, None].astype(np.float64) * 0.37 + j[None, :] * 0.11 + il * 1.3)
    return x.astype(np.float32).reshape(n, hp.n_head_kv, hp.n_embd_head_k)


def roped_k(hp: HParams, il: int, tokens: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """Keys as the forward pass stores them: f32 [n, n_embd_k_gqa], rotated to pos."""
    k = raw_k(hp, il, tokens)
    base = hp.rope_freq_base_swa if hp.is_swa(il) else hp.rope_freq_base
    rope_inplace(k, pos.astype(np.int32), hp.n_rot, base, hp.rope_freq_scale, hp.rope_type == "neox")
    return k.reshape(tokens.shape[0], -1)


def v_rows(hp: HParams, il: int, tokens: np.ndarray) -> np.ndarray:
    j = np.arange(hp.n_embd_v_gqa(il), dtype=np.float64)
    return np.cos(tokens[:, None] * 0.21 + j[None, :] * 0.07 - il * 0.5).astype(np.float32)


class StubModel:
    """forward(ubatch, mctx) -> f32 [n_outputs, n_vocab]; fail_at = 1-based ubatch to fail."""

    def __init__(self, hp: HParams, fail_at: int | None = None):
        self.hparams = hp
        self.fail_at = fail_at
        self.n_calls = 0
        self.seen = []  # (n_tokens, n_kv) per call

    def forward(self, ub, mctx, min_macs=None) -> np.ndarray:
        self.n_calls += 1
        hp = self.hparams
        for il in range(hp.n_layer):
            rot_k, rot_v = mctx.get_rot(il)  # quantized caches store Hadamard-rotated rows
            k, v = roped_k(hp, il, ub.token, ub.pos), v_rows(hp, il, ub.token)
            mctx.cpy_k(il, rotate(k, rot_k) if rot_k else k)
            mctx.cpy_v(il, rotate(v, rot_v) if rot_v else v)
        if self.fail_at is not None and self.n_calls == self.fail_at:
            raise RuntimeError("forced compute failure")
        mask, _ = mctx.kq_mask(0)
        k, tk = mctx.get_k(0)
        self.seen.append((ub.n_tokens, mask.shape[1]))
        # logits depend on the visible keys: sum of the first K value of every visible cell
        k0 = dequantize(k[0, : mask.shape[1]], tk, hp.n_embd_k_gqa(0))[:, 0]  # [n_kv]
        vis = np.where(np.isfinite(mask), 1.0, 0.0)  # [n_tokens, n_kv]
        score = vis @ k0  # [n_tokens]
        cnt = vis.sum(axis=1)
        out = ub.output
        v = np.arange(hp.n_vocab, dtype=np.float64)
        logits = np.cos(score[out, None] + cnt[out, None] * 0.01 * v[None, :] + ub.token[out, None] * 0.001)
        return logits.astype(np.float32)


def cells_snapshot(kv) -> list:
    """Everything find_slot/apply may touch, per stream: pos, seq, shift, ext, head, seq ranges."""
    out = []
    for s, c in enumerate(kv.cells):
        seq_ranges = [(c.seq_pos_min(q), c.seq_pos_max(q)) for q in range(c.n_seq_max)]
        out.append(
            (
                c.pos.copy(),
                c.seq.copy(),
                c.shift.copy(),
                c.ext.copy(),
                kv.heads[s],
                c.get_used(),
                c.used_max_p1(),
                seq_ranges,
            )
        )
    return out


def assert_same_cells(a, b) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        for u, w in zip(x, y):
            if isinstance(u, np.ndarray):
                np.testing.assert_array_equal(u, w)
            else:
                assert u == w
