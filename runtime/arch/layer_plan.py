"""Per-layer plans of the decoder forwards: what a layer's attention and FFN need, worked out
once per model and context size, so that a generated token's per-layer Python is a few calls.

A one-token decode runs ~30 layers, and each layer's work outside the matmuls is small (a few
hundred to a few thousand values per step), so the Python around it — looking up optional
weights, widths, RoPE constants, the memory context's eight per-layer accessors — was a
large share of a token (docs/performance.md, "Lean decode step"). A `LayerPlan` holds the
layer's weights by role (None where the file has none) and its constants in the types the
kernels take; `attention_step` and `ffn_step` run a layer with it: the QKV matmul, one launch
for QK-norm + RoPE + the K/V cache write (kernels/qkv_store.py), attention through
`attention_checked`, and the FFN. The kernels and their order are those of the unplanned steps
(runtime/arch/blocks.py), so the logits are bit-identical.
"""

from __future__ import annotations

import numpy as np

from kvchat.kernels.act import geglu, glu_fused, swiglu
from kvchat.kernels.attention import attention_checked, round_q_to_vec_dot_type
from kvchat.kernels.ggml_types import GGMLType
from kvchat.kernels.qkv_store import prepare_qkv_store
from kvchat.kernels.rope import _ONE, prepare_qkv_planned, rope_plan
from kvchat.runtime.memory.attn_rotation import rotate

_Q_AS_IS = (int(GGMLType.F32), int(GGMLType.F16))  # K types whose K·Q takes Q in f32 (blocks.round_q_like_ggml)


class LayerPlan:
    """One decoder layer's weights by role and its attention constants (see the module)."""

    __slots__ = (
        "il",
        "L",
        "wqkv",
        "bqkv",
        "wq",
        "wk",
        "wv",
        "qa",
        "qb",
        "wo",
        "bo",
        "n_head",
        "n_head_kv",
        "head_dim",
        "rope",
        "rope_args",
        "q_norm",
        "k_norm",
        "neox",
        "eps",
        "kq_scale",
        "softcap",
        "w_gate_up",
        "w_gate",
        "w_up",
        "b_gate",
        "b_up",
        "w_down",
        "b_down",
        "n_ff",
    )

    def __init__(self, model, il: int, L, n_ctx_seq: int):
        hp = model.hparams
        g = L.__dict__.get
        self.il, self.L = il, L
        self.wqkv, self.bqkv, self.wq, self.wk, self.wv = g("wqkv"), g("bqkv"), g("wq"), g("wk"), g("wv")
        self.wo, self.bo = g("wo"), g("bo")
        self.n_head, self.n_head_kv, self.head_dim = int(hp.n_head), int(hp.n_head_kv), int(hp.n_embd_head_k)
        self.qa = self.head_dim * self.n_head  # Q | K | V column boundaries of a fused QKV product
        self.qb = self.qa + int(hp.n_embd_k_gqa(il))
        self.rope = rope_plan(**hp.rope_args(il, n_ctx_seq))
        self.q_norm, self.k_norm = g("q_norm"), g("k_norm")
        self.neox = hp.rope_type == "neox"
        self.eps = float(hp.norm_eps)
        has_norm = self.q_norm is not None
        # prepare_qkv_store's constants, in its kernel's argument order
        self.rope_args = (
            self.q_norm if has_norm else _ONE,
            self.k_norm if has_norm else _ONE,
            has_norm,
            np.float64(self.eps),
            *self.rope,
            bool(self.neox),
        )
        self.kq_scale = np.float32(hp.kq_scale)
        self.softcap = np.float32(hp.attn_logit_softcap)
        self.w_gate_up, self.w_gate, self.w_up = g("w_gate_up"), g("w_gate"), g("w_up")
        self.b_gate, self.b_up, self.w_down, self.b_down = g("b_gate"), g("b_up"), g("w_down"), g("b_down")
        self.n_ff = int(hp.n_ff)


def layer_plan(model, il: int, n_ctx_seq: int) -> LayerPlan:
    """The LayerPlan of layer il for a context of n_ctx_seq cells per sequence (LongRoPE picks
    its factors by it), built on first use and kept on the model, so a generated token does not
    redo its constants for every layer."""
    plans = model.__dict__.setdefault("_layer_plan", {})
    key = (il, n_ctx_seq)
    p = plans.get(key)
    if p is None:
        p = plans[key] = LayerPlan(model, il, model.weights.layers[il], n_ctx_seq)
    return p


def layer_plans(model, n_ctx_seq: int) -> list:
    """layer_plan of every layer, as one list kept on the model (a forward looks it up once)."""
    lists = model.__dict__.setdefault("_layer_plans", {})
    p = lists.get(n_ctx_seq)
    if p is None:
        p = lists[n_ctx_seq] = [layer_plan(model, il, n_ctx_seq) for il in range(len(model.weights.layers))]
    return p


def qkv_of(p: LayerPlan, h: np.ndarray):
    """Q, K, V rows of h ([n, n_embd] f32) -> three [n, width] f32 arrays (column views of the
    fused product when the layer has a fused QKV matrix), biases added."""
    if p.wqkv is not None:
        qkv = p.wqkv.matmul(h)  # [n, q + k + v] f32
        if p.bqkv is not None:
            qkv += p.bqkv
        return qkv[:, : p.qa], qkv[:, p.qa : p.qb], qkv[:, p.qb :]
    q, k, v = p.wq.matmul(h), p.wk.matmul(h), p.wv.matmul(h)
    if p.bqkv is not None:
        q += p.bqkv[: p.qa]
        k += p.bqkv[p.qa : p.qb]
        v += p.bqkv[p.qb :]
    return q, k, v


def attention_step(
    p: LayerPlan, h: np.ndarray, pos: np.ndarray, mctx, n_threads: int, kq_scale: np.float32 | None = None
) -> np.ndarray:
    """Self-attention of layer p.il for the ubatch (before the output projection): h [n, n_embd]
    f32, pos i32 [n] -> [n, n_head * head_dim_v] f32; kq_scale: the layer's (hparams) when None."""
    q_in, k_in, v_in = qkv_of(p, h)
    io = mctx.attn_io(p.il)  # AttnIO
    store = io.store
    if store is not None:  # plain K/V rows: QK-norm, RoPE and the cache write in one launch
        q = prepare_qkv_store(q_in, k_in, v_in, pos, p.rope_args, p.n_head, p.n_head_kv, p.head_dim, store)
        return attend_io(p, q, io, n_threads, kq_scale)
    q, k, v = prepare_qkv_planned(
        q_in, k_in, v_in, p.n_head, p.n_head_kv, p.head_dim, pos, p.rope, p.neox, p.q_norm, p.k_norm, p.eps
    )
    return store_and_attend(p, q, k, v, mctx, io, n_threads, kq_scale)


def store_and_attend(p: LayerPlan, q, k, v, mctx, io, n_threads: int, kq_scale=None) -> np.ndarray:
    """Attention of roped q [n, n_head, dk] after storing k [n, n_head_kv, dk] and v
    [n, n_embd_v_gqa] through the memory context (cpy_k / cpy_v), with the K/V rotation of a
    quantized cache (runtime/memory/attn_rotation.py) when io asks for it; [n, n_head * dv]."""
    n = q.shape[0]
    rot_k, rot_v = io.rot_k, io.rot_v
    if rot_k:
        q, k = rotate(q, rot_k), rotate(k, rot_k)
    if rot_v:
        v = rotate(v, rot_v)
    mctx.cpy_k(p.il, k.reshape(n, -1))
    mctx.cpy_v(p.il, v)
    return attend_io(p, q, io, n_threads, kq_scale)


def attend_io(p: LayerPlan, q, io, n_threads: int, kq_scale=None) -> np.ndarray:
    """Attention of q [n, n_head, dk] f32 over the layer's cache views in io (mctx.attn_io),
    K/V of this ubatch already stored; [n, n_head * dv] f32 (rotated back for a rotated V)."""
    type_k = io.type_k
    if type_k not in _Q_AS_IS:  # Q in K's vec-dot type, as ggml (blocks.round_q_like_ggml)
        q = round_q_to_vec_dot_type(q, type_k)
    if not q.flags.c_contiguous:
        q = np.ascontiguousarray(q)
    out = attention_checked(
        q,
        io.k,
        type_k,
        io.v,
        io.type_v,
        io.mask,
        io.tok_stream,
        io.start,
        p.n_head_kv,
        p.kq_scale if kq_scale is None else kq_scale,
        p.softcap,
        io.flash,
        n_threads,
    )
    return rotate(out, io.rot_v) if io.rot_v else out  # [n, n_head * dv]


def output_step(p: LayerPlan, attn: np.ndarray) -> np.ndarray:
    """Output projection (+ bias): [n, n_head * dv] -> [n, n_embd] f32."""
    out = p.wo.matmul(attn)
    if p.bo is not None:
        out += p.bo
    return out


def ffn_step(p: LayerPlan, h: np.ndarray, use_gelu: bool) -> np.ndarray:
    """The layer's gated FFN (gated_ffn) on h [n, n_embd] -> [n, n_embd] f32."""
    return gated_ffn(h, p.n_ff, use_gelu, p.w_gate_up, p.w_gate, p.w_up, p.b_gate, p.b_up, p.w_down, p.b_down)


def gated_ffn(h, n_ff, use_gelu, w_gate_up, w_gate, w_up, b_gate, b_up, w_down, b_down):
    """down(act(gate(h)) * up(h)), act GELU (gemma; as ggml's CPU computes it, through its f16
    table: kernels/gelu_table.py) or SiLU. w_gate_up: a fused gate+up matrix or None (then w_gate
    and w_up); biases None where the file has none. h [n, n_embd] f32 -> [n, n_embd] f32."""
    if w_gate_up is not None:
        a = glu_fused(w_gate_up.matmul(h), n_ff, use_gelu)
    else:
        g, u = w_gate.matmul(h), w_up.matmul(h)
        if b_gate is not None:
            g += b_gate
        if b_up is not None:
            u += b_up
        a = geglu(g, u) if use_gelu else swiglu(g, u)
    out = w_down.matmul(a)
    if b_down is not None:
        out += b_down
    return out
