"""Test doubles for the recurrent and hybrid memories: small HParams with recurrent layers, and
a stub model whose forward does to memory what a real recurrent layer does - reads each
sequence's conv and SSM state through mctx.get_r/get_s, runs the real conv and scan kernels,
writes the new states with cpy_r/cpy_s - and returns logits that depend on those states. Its
attention layers (hybrid) write K/V like memory_stubs.StubModel. It can fail on the Nth ubatch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvchat.kernels.conv import conv_with_state
from kvchat.kernels.ssm_scan import scan
from kvchat.runtime.context import Context
from kvchat.runtime.cparams import ContextParams
from kvchat.runtime.hparams import HParams
from kvchat.runtime.memory.hybrid import MemoryHybrid
from kvchat.runtime.memory.recurrent import MemoryRecurrent
from tests.helpers.memory_stubs import roped_k, v_rows

D_CONV, D_INNER, D_STATE = 4, 8, 4


@dataclass
class RecurrentHParams(HParams):
    recurrent_layers: list = field(default_factory=list)

    def is_recurrent(self, il: int) -> bool:
        return bool(self.recurrent_layers[il])

    def n_embd_r(self) -> int:
        return (D_CONV - 1) * D_INNER

    def n_embd_s(self) -> int:
        return D_STATE * D_INNER


def make_rhparams(recurrent_layers=(True, True), n_vocab=64) -> RecurrentHParams:
    """arch names the memory the Context creates first (mamba: recurrent, lfm2: hybrid)."""
    n_layer = len(recurrent_layers)
    return RecurrentHParams(
        arch="mamba" if all(recurrent_layers) else "lfm2",
        n_vocab=n_vocab,
        n_ctx_train=4096,
        n_embd=16,
        n_layer=n_layer,
        n_head=2,
        n_head_kv=1,
        n_embd_head_k=8,
        n_embd_head_v=8,
        n_ff=16,
        norm_eps=1e-6,
        rope_type="neox",
        n_rot=8,
        rope_freq_base=10000.0,
        rope_freq_scale=1.0,
        rope_freq_base_swa=10000.0,
        n_swa=0,
        swa_layers=[False] * n_layer,
        use_qk_norm=False,
        tied_output=True,
        recurrent_layers=list(recurrent_layers),
    )


def _layer_inputs(il, tokens):
    """Deterministic per-token conv inputs and scan parameters of layer il."""
    t = tokens.astype(np.float64)[..., None]
    j = np.arange(D_INNER, dtype=np.float64)
    x = np.sin(t * 0.37 + j * 0.11 + il).astype(np.float32)  # [.., D_INNER]
    dt = np.cos(t * 0.13 - j * 0.05 + il).astype(np.float32)
    n = np.arange(D_STATE, dtype=np.float64)
    B = np.sin(t * 0.21 + n * 0.3 - il).astype(np.float32)
    C = np.cos(t * 0.17 + n * 0.2 + il).astype(np.float32)
    return x, dt, B, C


W = (np.sin(np.arange(D_INNER * D_CONV).reshape(D_INNER, D_CONV) * 0.7)).astype(np.float32)
A = (-np.exp(np.sin(np.arange(D_INNER * D_STATE).reshape(D_INNER, D_STATE)))).astype(np.float32)


class RecurrentStubModel:
    """forward(ubatch, mctx) -> f32 [n_outputs, n_vocab]; fail_at = 1-based ubatch to fail."""

    def __init__(self, hp, fail_at=None):
        self.hparams = hp
        self.fail_at = fail_at
        self.n_calls = 0

    def forward(self, ub, mctx, min_macs=None):
        self.n_calls += 1
        hp = self.hparams
        recr = mctx.get_recr() if hasattr(mctx, "get_recr") else mctx
        attn = mctx.get_attn() if hasattr(mctx, "get_attn") else None
        n_rs, n_st = recr.get_n_rs(), ub.n_seq_tokens
        score = np.zeros(ub.n_tokens)
        for il in range(hp.n_layer):
            if not hp.is_recurrent(il):
                k, v = roped_k(hp, il, ub.token, ub.pos), v_rows(hp, il, ub.token)
                attn.cpy_k(il, k)
                attn.cpy_v(il, v)
                mask, _ = attn.kq_mask(il)
                score += np.isfinite(mask).sum(axis=1) * 0.01
                continue
            tok = ub.token.reshape(n_rs, n_st)
            x, dt, B, C = _layer_inputs(il, tok)
            conv = recr.get_r(il).reshape(n_rs, D_INNER, D_CONV - 1)
            y, new_conv = conv_with_state(conv, x, W)
            recr.cpy_r(il, new_conv.reshape(n_rs, -1))
            s0 = recr.get_s(il).reshape(n_rs, D_INNER, D_STATE)
            out, s1 = scan(s0, y, dt, A, B, C)
            recr.cpy_s(il, s1.reshape(n_rs, -1))
            score += out.reshape(ub.n_tokens, D_INNER).sum(axis=1)
        if self.fail_at is not None and self.n_calls == self.fail_at:
            raise RuntimeError("forced compute failure")
        o = np.asarray(ub.output, dtype=bool)
        v = np.arange(hp.n_vocab, dtype=np.float64)
        return np.cos(score[o, None] * 0.5 + v[None, :] * 0.03).astype(np.float32)


def make_rctx(hybrid=False, n_seq_max=1, n_ctx=256, n_ubatch=512, fail_at=None, unified=True):
    """A Context over the stub with a recurrent (or hybrid: layer 1 attention) memory."""
    hp = make_rhparams((True, False, True) if hybrid else (True, True))
    ctx = Context(
        RecurrentStubModel(hp, fail_at),
        ContextParams(n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ubatch, n_seq_max=n_seq_max, kv_unified=unified),
    )
    cp = ctx.cparams
    if hybrid:
        ctx.memory = MemoryHybrid(
            hp, cp.type_k, cp.type_v, cp.v_trans, cp.kv_unified, cp.n_ctx_seq, max(1, cp.n_seq_max), cp.n_seq_max
        )
    else:
        ctx.memory = MemoryRecurrent(hp, max(1, cp.n_seq_max), cp.n_seq_max)
    return ctx


def recr_of(mem):
    return mem.mem_recr if hasattr(mem, "mem_recr") else mem


def snapshot(mem):
    """Every byte of recurrent metadata and data (and the KV part of a hybrid)."""
    r = recr_of(mem)
    c = r.cells
    out = [c.pos.copy(), c.src.copy(), c.tail.copy(), c.seq.copy(), r.head]
    out += [r.r_l[il].copy() for il in r.layers] + [r.s_l[il].copy() for il in r.layers]
    if hasattr(mem, "mem_attn"):
        kv = mem.mem_attn  # the KV cache promises the rows of occupied cells (docs/memory.md)
        empty = kv.cells[0].pos < 0
        out += [kv.cells[0].pos.copy(), kv.cells[0].seq.copy(), kv.heads[0]]
        for l in kv.layers:
            k, v = l.k.copy(), l.v.copy()
            k[0, empty] = 0
            if not kv.v_trans:
                v[0, empty] = 0
            out += [k, v]
    return out


def assert_same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        if isinstance(x, np.ndarray):
            np.testing.assert_array_equal(x, y)
        else:
            assert x == y
