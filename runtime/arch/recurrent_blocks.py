"""Pieces shared by the recurrent and hybrid architectures (mamba, lfm2, qwen35): the memories
they create (llama_model::create_memory's recurrent and hybrid branches), the causal conv
through the recurrent memory context, small dense weights, element-wise helpers.

A recurrent layer works on ubatches of equal sequences: the ubatch's tokens are n_rs sequences
of n_seq_tokens each, sequence-major, and the memory context hands out one state per sequence
(RecurrentMemoryContext in runtime/memory/interface.py).
"""

from __future__ import annotations

import numpy as np

from kvchat.kernels.conv import conv_with_state
from kvchat.runtime.memory.hybrid import MemoryHybrid
from kvchat.runtime.memory.recurrent import MemoryRecurrent


def create_recurrent_memory(hparams, cparams) -> MemoryRecurrent:
    """One state cell per sequence: mem_size = max(1, n_seq_max)."""
    return MemoryRecurrent(hparams, max(1, cparams.n_seq_max), cparams.n_seq_max)


def create_hybrid_memory(hparams, cparams) -> MemoryHybrid:
    """KV cache (n_ctx_seq cells per stream) for the attention layers + recurrent states."""
    return MemoryHybrid(
        hparams,
        cparams.type_k,
        cparams.type_v,
        v_trans=cparams.v_trans,
        unified=cparams.kv_unified,
        kv_size=cparams.n_ctx_seq,
        rs_size=max(1, cparams.n_seq_max),
        n_seq_max=cparams.n_seq_max,
    )


ATTENTION_TENSORS = ("wq", "wk", "wv", "wo", "bq", "bk", "bv", "q_norm", "k_norm")


def without_attention(tensors: dict) -> dict:
    """A layer schema (Arch.layer_tensors) with its attention weights taken out: what a
    recurrent layer of a hybrid model keeps (norms, FFN) before adding its own."""
    return {k: v for k, v in tensors.items() if k not in ATTENTION_TENSORS}


def dense(L, name: str) -> np.ndarray:
    """A small 2-D weight of layer L (conv kernel, A) as f32 [rows, cols] (ggml ne {cols, rows}),
    converted once and kept on the layer."""
    key = "_dense_" + name
    a = getattr(L, key, None)
    if a is None:
        q = getattr(L, name)
        a = np.ascontiguousarray(q.get_rows(np.arange(q.m, dtype=np.int32)), dtype=np.float32)
        setattr(L, key, a)
    return a


def silu(x: np.ndarray) -> np.ndarray:
    """x * sigmoid(x), f32, element-wise."""
    x = np.asarray(x, dtype=np.float32)
    return (x / (np.float32(1.0) + np.exp(-x))).astype(np.float32)


def sigmoid(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32)
    return (np.float32(1.0) / (np.float32(1.0) + np.exp(-x))).astype(np.float32)


def softplus(x: np.ndarray) -> np.ndarray:
    """ggml's softplus: x above 20, else log1p(exp(x))."""
    x = np.asarray(x, dtype=np.float32)
    return np.where(x > 20, x, np.log1p(np.exp(np.minimum(x, 20)))).astype(np.float32)


def causal_conv(rctx, il: int, x: np.ndarray, w: np.ndarray, d_conv: int) -> np.ndarray:
    """Conv of x f32 [n_tokens, ch] with kernel w f32 [ch, d_conv], continuing each sequence
    from its conv state (read from and written back to the memory context)."""
    n_rs = rctx.get_n_rs()
    n_tokens, ch = x.shape
    state = rctx.get_r(il).reshape(n_rs, ch, d_conv - 1)
    y, new_state = conv_with_state(state, x.reshape(n_rs, n_tokens // n_rs, ch), w)
    rctx.cpy_r(il, new_state.reshape(n_rs, -1))
    return y.reshape(n_tokens, ch)


def l2_norm(x: np.ndarray, eps: float) -> np.ndarray:
    """L2 normalisation over the last axis as the llama.cpp of the references computes it:
    x / sqrt(sum x^2 + eps). (Newer ggml divides by max(||x||, eps); on the tiny Qwen3.5 that
    moves the log-probs by 1e-3, this form matches them to 2e-5.)"""
    ss = np.sum(x.astype(np.float64) ** 2, axis=-1, keepdims=True)
    return (x / np.sqrt(ss + eps)).astype(np.float32)


def rms_norm_last(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm over the last axis of any-shaped x (per head), times w."""
    ms = np.mean(x.astype(np.float64) ** 2, axis=-1, keepdims=True)
    return (x / np.sqrt(ms + eps) * w).astype(np.float32)
