"""The one decoder layer loop of every architecture, run from per-layer plans worked out once per
model and context size, so that a generated token's per-layer Python is a few calls.

An architecture declares its layers as data (`Arch.layer_spec(hp, il) -> LayerSpec`): the mixer
(attention, gated attention, a short conv, a delta net, a selective scan), whether the mixer's
output goes through the attention output projection, the norm kind ("pre": RMSNorm before the
mixer and the FFN; "sandwich": also after each, before the residual add: gemma), the weight of
the norm before the FFN, the FFN (SwiGLU, GeGLU, none) and the residual multiplier (granite);
and its ends (`Arch.model_spec(hp) -> ModelSpec`): the embedding scale, the final logit
soft-cap and the logit scale. `forward` is the loop all of them run (llm_build_llama's shape):

    h = attn_norm_0(embed(tokens) * embed_scale)
    per layer: cur = mixer(h); [last layer: only the output rows go on]; cur = wo·cur + bo;
               x += rs · post_mix_norm(cur);  h = ffn_norm(x)
               x += rs · post_ffn_norm(ffn(h));  h = attn_norm_next(x)   (output_norm after the last)
    logits = softcap(head · h) / logit_scale

Each residual add runs fused with the norm that follows it (kernels/fused_norm.py: the same
arithmetic in one launch, so the logits are those of the unfused adds and norms bit for bit).

A one-token decode runs ~30 layers, and each layer's work outside the matmuls is small (a few
hundred to a few thousand values per step), so the Python around it — looking up optional
weights, widths, RoPE constants, the memory context's per-layer accessors — was a large share
of a token (docs/performance.md, "Lean decode step"). A `LayerPlan` holds the layer's weights by
role (None where the file has none), its declared kinds and its constants in the types the
kernels take; `attention_step` and `ffn_step` run a layer with it: the QKV matmul, one launch
for QK-norm + RoPE + the K/V cache write (kernels/qkv_store.py), attention through
`attention_checked` (mctx.attn_io: an AttnIO), and the FFN.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, NamedTuple

import numba
import numpy as np

from kvchat.kernels import parallel
from kvchat.kernels.act import geglu, glu_fused, swiglu
from kvchat.kernels.attention import NO_SINKS, attention_checked, round_q_to_vec_dot_type
from kvchat.kernels.fused_norm import add_rms_norm, norm_add_rms_norm
from kvchat.kernels.ggml_types import GGMLType
from kvchat.kernels.norm import rms_norm
from kvchat.kernels.qkv_store import prepare_qkv_store
from kvchat.kernels.rope import _ONE, prepare_qkv_planned, rope_plan
from kvchat.runtime.memory.attn_rotation import rotate
from kvchat.runtime.memory.kv_view import gather_k, gather_v_trans

_Q_AS_IS = (int(GGMLType.F32), int(GGMLType.F16))  # K types whose flash K·Q takes Q in f32 (blocks.round_q_like_ggml)
_F16 = int(GGMLType.F16)


class Launch(NamedTuple):
    """How this forward's kernels launch, passed down to every step: numba's thread count (read
    once per forward), the matmul threshold of the step (multiply-adds from which a matmul
    runs its parallel twin: kernels.parallel's, or the launch tuner's choice for a generated
    token, kernels/launch_tuner.py) and the attention threshold (kernels.parallel's, lowered to
    the matmul threshold when that is lower: on the tuner's PARALLEL arm a generated token's
    attention splits over the threads too, as its matmuls do — OLMoE-shaped, 16 heads of 128 over
    256 cells, 110 -> 62 µs a layer on two threads — and the tuner's step times decide whether that
    arm is worth it)."""

    n_threads: int
    min_macs: int
    attn_min_macs: int


# ---- what an architecture declares ---------------------------------------------------------


def attention(p: "LayerPlan", h: np.ndarray, pos: np.ndarray, mctx, run: Launch) -> np.ndarray:
    """The attention mixer (before the output projection): attention_step through the layer's
    memory context (a KV cache's, an iSWA pair's)."""
    return attention_step(p, h, pos, mctx, run)


def swiglu_ffn(p: "LayerPlan", h: np.ndarray, run: Launch) -> np.ndarray:
    return ffn_step(p, h, False, run.min_macs)


def geglu_ffn(p: "LayerPlan", h: np.ndarray, run: Launch) -> np.ndarray:
    return ffn_step(p, h, True, run.min_macs)


@dataclass(frozen=True)
class LayerSpec:
    """One decoder layer as data (Arch.layer_spec); the defaults are llama's layer."""

    mixer: Callable = attention  # mixer(p, h [n, n_embd], pos i32 [n], mctx, run: Launch) -> [n, width] f32
    project: bool = True  # the mixer's output goes through wo (+ bo) after the last layer's row selection
    norm: str = "pre"  # "pre" | "sandwich" (post_attn_norm / post_ffn_norm before each residual add)
    ffn_norm: str = "ffn_norm"  # the weight of the norm before the FFN (qwen35: post_attn_norm)
    ffn: Callable | None = swiglu_ffn  # ffn(p, h [n, n_embd], run) -> [n, n_embd] f32; None: no FFN (mamba)
    residual_scale: float = 1.0  # multiplies the mixer's and the FFN's outputs before their adds (granite)
    q_scaled: bool = False  # Q times the attention scale before attention, which then runs at scale 1 (gemma, phi3)


@dataclass(frozen=True)
class ModelSpec:
    """The two ends of the loop (Arch.model_spec); the defaults change nothing."""

    embed_scale: float = 1.0  # token embeddings are multiplied by this (gemma: sqrt(n_embd); granite)
    logit_softcap: float = 0.0  # logits l -> cap * tanh(l / cap) (gemma2/3's final_logit_softcapping)
    logit_scale: float = 1.0  # logits are divided by this (granite)


NORM_KINDS = ("pre", "sandwich")


class LayerPlan:
    """One decoder layer's weights by role, its declared kinds (LayerSpec) and its attention
    constants (see the module)."""

    __slots__ = (
        "il",
        "L",
        "hp",
        "mixer",
        "project",
        "ffn",
        "rs",
        "attn_norm",
        "ffn_norm",
        "post_mix_norm",
        "post_ffn_norm",
        "wqkv",
        "wqk",
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
        "q_scale",
        "softcap",
        "sinks",
        "w_gate_up",
        "w_gate",
        "w_up",
        "b_gate",
        "b_up",
        "w_down",
        "b_down",
        "n_ff",
        "moe",
        "qk_norm_full",
    )

    def __init__(self, model, il: int, L, n_ctx_seq: int, spec: LayerSpec | None = None):
        hp = model.hparams
        g = L.__dict__.get
        self.il, self.L, self.hp = il, L, hp
        spec = spec or LayerSpec()
        if spec.norm not in NORM_KINDS:
            raise ValueError(f"layer {il}: norm kind {spec.norm!r} is not one of {NORM_KINDS}")
        sandwich = spec.norm == "sandwich"
        if sandwich and spec.residual_scale != 1.0:
            raise ValueError(f"layer {il}: a residual multiplier with sandwich norms is not implemented")
        self.mixer, self.project, self.ffn = spec.mixer, spec.project, spec.ffn
        self.rs = None if spec.residual_scale == 1.0 else np.float32(spec.residual_scale)
        self.attn_norm = L.attn_norm
        self.ffn_norm = getattr(L, spec.ffn_norm) if spec.ffn is not None else None
        self.post_mix_norm = L.post_attn_norm if sandwich else None
        self.post_ffn_norm = L.post_ffn_norm if sandwich and spec.ffn is not None else None
        self.wqkv, self.bqkv, self.wq, self.wk, self.wv = g("wqkv"), g("bqkv"), g("wq"), g("wk"), g("wv")
        self.wqk = g("wqk")  # Q|K fused when V has another format (QK_FUSION)
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
        scale = scale_f32(hp.kq_scale)
        # q_scale: None, or f32 that Q is multiplied by before attention (LayerSpec.q_scaled: the graph's
        # ggml_scale(Qcur, s), then attention at scale 1)
        self.kq_scale, self.q_scale = (np.float32(1.0), scale) if spec.q_scaled else (scale, None)
        self.softcap = np.float32(hp.attn_logit_softcap)
        sinks = g("attn_sinks")  # f32 [n_head]: a learned logit per head in the softmax (gpt-oss)
        self.sinks = NO_SINKS if sinks is None else np.ascontiguousarray(sinks, dtype=np.float32)
        self.w_gate_up, self.w_gate, self.w_up = g("w_gate_up"), g("w_gate"), g("w_up")
        self.b_gate, self.b_up, self.w_down, self.b_down = g("b_gate"), g("b_up"), g("w_down"), g("b_down")
        self.n_ff = int(hp.n_ff)
        q_full, k_full = g("q_norm_full"), g("k_norm_full")
        self.qk_norm_full = (q_full, k_full) if q_full is not None else None  # olmoe: RMSNorm over all heads
        self.moe = None  # the layer's mixture of experts (runtime/arch/moe.py), when it has a router
        if g("w_gate_inp") is not None:
            from kvchat.runtime.arch.moe import MoEPlan

            self.moe = MoEPlan(hp, L, model.arch.moe_act)


def scale_f32(kq_scale: float) -> np.float32:
    """The attention scale as llama.cpp's graphs compute it in f32, 1.0f / sqrtf(float(n)), for a
    scale 1 / sqrt(n) of an integer n (head size, or n_embd / n_head); other scales (read from a
    file) as they are, rounded to f32. The two differ in the last bit for some n (24, 72, 96)."""
    n = round(1.0 / (kq_scale * kq_scale))
    if n > 0 and abs(1.0 / math.sqrt(n) - kq_scale) <= 1e-12 * kq_scale:
        return np.float32(1.0) / np.sqrt(np.float32(n))
    return np.float32(kq_scale)


def layer_plan(model, il: int, n_ctx_seq: int) -> LayerPlan:
    """The LayerPlan of layer il for a context of n_ctx_seq cells per sequence (LongRoPE picks
    its factors by it), with the arch's LayerSpec of that layer, built on first use and kept on
    the model, so a generated token does not redo its constants for every layer."""
    plans = model.__dict__.setdefault("_layer_plan", {})
    key = (il, n_ctx_seq)
    p = plans.get(key)
    if p is None:
        spec = model.arch.layer_spec(model.hparams, il)
        p = plans[key] = LayerPlan(model, il, model.weights.layers[il], n_ctx_seq, spec)
    return p


def layer_plans(model, n_ctx_seq: int) -> list:
    """layer_plan of every layer, as one list kept on the model (a forward looks it up once)."""
    lists = model.__dict__.setdefault("_layer_plans", {})
    p = lists.get(n_ctx_seq)
    if p is None:
        p = lists[n_ctx_seq] = [layer_plan(model, il, n_ctx_seq) for il in range(len(model.weights.layers))]
    return p


def model_spec(model) -> ModelSpec:
    """The arch's ModelSpec of this model, worked out once and kept on the model."""
    spec = model.__dict__.get("_model_spec")
    if spec is None:
        spec = model.__dict__["_model_spec"] = model.arch.model_spec(model.hparams)
    return spec


# ---- the loop ------------------------------------------------------------------------------


def forward(model, ubatch, mctx, min_macs: int | None = None) -> np.ndarray:
    """Logits f32 [n_outputs, n_vocab] of one ubatch (every architecture's forward; see the
    module). After the last layer's mixer only the output rows go on (llama.cpp's inp_out_ids).
    min_macs: the matmul threshold of this step (kernels.parallel's when None)."""
    hp = model.hparams
    eps = hp.norm_eps
    plans = layer_plans(model, ctx_size(mctx))
    top = model_spec(model)
    pos = np.ascontiguousarray(ubatch.pos, dtype=np.int32)
    x = embed(model, ubatch.token, top.embed_scale)  # [n_tokens, n_embd] f32, the residual stream
    out_ids = output_ids(ubatch)
    last = len(plans) - 1
    if parallel.serial_held():  # a first run's answer before its parallel kernels are compiled
        run = Launch(1, parallel.MATMUL_PAR_MIN_MACS, parallel.ATTN_PAR_MIN_MACS)
    else:
        mm = parallel.MATMUL_PAR_MIN_MACS if min_macs is None else min_macs
        run = Launch(numba.get_num_threads(), mm, min(parallel.ATTN_PAR_MIN_MACS, mm))
    h = rms_norm(x, plans[0].attn_norm, eps)
    for p in plans:
        cur = p.mixer(p, h, pos, mctx, run)
        if p.il == last and out_ids is not None:
            cur, x = cur[out_ids], x[out_ids]
            if x.shape[0] == 0:
                return np.zeros((0, hp.n_vocab), dtype=np.float32)
        if p.project:
            cur = output_step(p, cur, run.min_macs)
        w_next = plans[p.il + 1].attn_norm if p.il < last else model.weights.output_norm
        if p.ffn is None:
            h = residual_norm(x, cur, p.post_mix_norm, p.rs, w_next, eps)
        else:
            h = residual_norm(x, cur, p.post_mix_norm, p.rs, p.ffn_norm, eps)
            h = residual_norm(x, p.ffn(p, h, run), p.post_ffn_norm, p.rs, w_next, eps)
    out = lm_head(model, h, top.logit_softcap, run.min_macs)
    return out if top.logit_scale == 1.0 else out * np.float32(1.0 / top.logit_scale)


def residual_norm(x: np.ndarray, a: np.ndarray, w_post, rs, w_next: np.ndarray, eps: float) -> np.ndarray:
    """One seam of the loop: x [n, d] += rs * post_norm(a) (in place; post_norm when w_post is
    given, rs when not None); returns rmsnorm(x) * w_next [n, d] f32."""
    if w_post is not None:
        return norm_add_rms_norm(a, w_post, x, w_next, eps)
    return add_rms_norm(x, a if rs is None else a * rs, w_next, eps)


def embed(model, tokens, scale: float = 1.0) -> np.ndarray:
    """Token embeddings [n_tokens, n_embd] f32, times scale (ModelSpec.embed_scale)."""
    x = model.weights.tok_embd.get_rows(np.ascontiguousarray(tokens, dtype=np.int32))
    x = np.ascontiguousarray(x, dtype=np.float32)
    if scale != 1.0:
        x *= np.float32(scale)
    return x


def output_ids(ubatch) -> np.ndarray | None:
    """Indices of the ubatch tokens whose logits are wanted; None when all of them are."""
    flags = np.asarray(ubatch.output, dtype=bool)
    if flags.all():
        return None
    return np.flatnonzero(flags)


def lm_head(model, h: np.ndarray, softcap: float = 0.0, min_macs: int | None = None) -> np.ndarray:
    """lm head (+ final soft-cap) of the already normalized h [n_out, n_embd] -> [n_out, n_vocab] f32."""
    out = model.weights.output.matmul(h, min_macs)
    if softcap:
        out = (np.tanh(out * np.float32(1.0 / softcap)) * np.float32(softcap)).astype(np.float32)
    return out


def ctx_size(mctx) -> int:
    """Cells per sequence of the context (llama.cpp's n_ctx_seq: the KV cache's size), which
    picks LongRoPE's factor set; the base cache's for an iSWA context, the attention cache's for
    a hybrid one, 0 without a KV cache."""
    if hasattr(mctx, "get_attn"):  # a hybrid memory's context
        mctx = mctx.get_attn()
    base = getattr(mctx, "ctx_base", mctx)
    kv = getattr(base, "kv", None)
    return int(kv.kv_size) if kv is not None else 0


# ---- the steps of a layer ------------------------------------------------------------------


def qkv_of(p: LayerPlan, h: np.ndarray, min_macs: int | None = None):
    """Q, K, V rows of h ([n, n_embd] f32) -> three [n, width] f32 arrays (column views of the
    fused product when the layer has a fused QKV matrix), biases added, and Q and K each
    RMS-normalized over the whole row when the layer has such norms (olmoe)."""
    q, k, v = _qkv_rows(p, h, min_macs)
    if p.qk_norm_full is not None:
        q = rms_norm(np.ascontiguousarray(q), p.qk_norm_full[0], p.eps)
        k = rms_norm(np.ascontiguousarray(k), p.qk_norm_full[1], p.eps)
    return q, k, v


def _qkv_rows(p: LayerPlan, h: np.ndarray, min_macs):
    return project_qkv(p.wqkv, p.wqk, p.wq, p.wk, p.wv, p.bqkv, h, p.qa, p.qb, min_macs)


def project_qkv(wqkv, wqk, wq, wk, wv, bqkv, h: np.ndarray, a: int, b: int, min_macs):
    """Q, K, V rows of h ([n, n_embd] f32), Q ending at column a and K at b of the concatenation:
    one launch for a fused Q|K|V matrix, two for Q|K fused beside a V of another format, else
    three; biases (bqkv, folded at load) added. Q and K are column views of a fused product."""
    if wqkv is not None:
        qkv = wqkv.matmul(h, min_macs)  # [n, q + k + v] f32
        if bqkv is not None:
            qkv += bqkv
        return qkv[:, :a], qkv[:, a:b], qkv[:, b:]
    if wqk is not None:
        qk = wqk.matmul(h, min_macs)  # [n, q + k] f32
        q, k = qk[:, :a], qk[:, a:]
    else:
        q, k = wq.matmul(h, min_macs), wk.matmul(h, min_macs)
    v = wv.matmul(h, min_macs)
    if bqkv is not None:
        q += bqkv[:a]
        k += bqkv[a:b]
        v += bqkv[b:]
    return q, k, v


def attention_step(p: LayerPlan, h: np.ndarray, pos: np.ndarray, mctx, run: Launch) -> np.ndarray:
    """Self-attention of layer p.il for the ubatch (before the output projection): h [n, n_embd]
    f32, pos i32 [n] -> [n, n_head * head_dim_v] f32."""
    q_in, k_in, v_in = qkv_of(p, h, run.min_macs)
    io = mctx.attn_io(p.il)  # AttnIO
    store = io.store
    if store is not None:  # plain K/V rows: QK-norm, RoPE and the cache write in one launch
        q = prepare_qkv_store(q_in, k_in, v_in, pos, p.rope_args, p.n_head, p.n_head_kv, p.head_dim, store)
        if p.q_scale is not None:
            q = q * p.q_scale
        return attend_io(p, q, io, run.n_threads, par_min=run.attn_min_macs)
    q, k, v = prepare_qkv_planned(
        q_in, k_in, v_in, p.n_head, p.n_head_kv, p.head_dim, pos, p.rope, p.neox, p.q_norm, p.k_norm, p.eps
    )
    if p.q_scale is not None:
        q = q * p.q_scale
    return store_and_attend(p, q, k, v, mctx, io, run.n_threads, par_min=run.attn_min_macs)


def store_and_attend(p: LayerPlan, q, k, v, mctx, io, n_threads: int, kq_scale=None, par_min=None) -> np.ndarray:
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
    return attend_io(p, q, io, n_threads, kq_scale, par_min)


def attend_io(p: LayerPlan, q, io, n_threads: int, kq_scale=None, par_min=None) -> np.ndarray:
    """Attention of q [n, n_head, dk] f32 over the layer's cache views in io (mctx.attn_io),
    K/V of this ubatch already stored; [n, n_head * dv] f32 (rotated back for a rotated V).
    par_min: the attention threshold of the step (Launch.attn_min_macs; None: kernels.parallel's)."""
    type_k = io.type_k
    k_cache, v_cache = io.k, io.v
    if io.view is not None:  # a unified cache shared with other sequences: each in its own stream
        k_cache = gather_k(k_cache, io.view)
        v_cache = gather_k(v_cache, io.view) if io.flash else gather_v_trans(v_cache, io.view)
    if type_k not in _Q_AS_IS or (type_k == _F16 and not io.flash):  # Q in K's vec-dot type, as ggml
        q = round_q_to_vec_dot_type(q, type_k)  # (blocks.round_q_like_ggml)
    if not q.flags.c_contiguous:
        q = np.ascontiguousarray(q)
    out = attention_checked(
        q,
        k_cache,
        type_k,
        v_cache,
        io.type_v,
        io.mask,
        io.tok_stream,
        io.start,
        p.n_head_kv,
        p.kq_scale if kq_scale is None else kq_scale,
        p.softcap,
        io.flash,
        n_threads,
        p.sinks,
        par_min,
    )
    return rotate(out, io.rot_v) if io.rot_v else out  # [n, n_head * dv]


def output_step(p: LayerPlan, attn: np.ndarray, min_macs: int | None = None) -> np.ndarray:
    """Output projection (+ bias): [n, n_head * dv] -> [n, n_embd] f32."""
    out = p.wo.matmul(attn, min_macs)
    if p.bo is not None:
        out += p.bo
    return out


def ffn_step(p: LayerPlan, h: np.ndarray, use_gelu: bool, min_macs: int | None = None) -> np.ndarray:
    """The layer's gated FFN (gated_ffn) on h [n, n_embd] -> [n, n_embd] f32."""
    return gated_ffn(h, p.n_ff, use_gelu, p.w_gate_up, p.w_gate, p.w_up, p.b_gate, p.b_up, p.w_down, p.b_down, min_macs)


def gated_ffn(h, n_ff, use_gelu, w_gate_up, w_gate, w_up, b_gate, b_up, w_down, b_down, min_macs=None):
    """down(act(gate(h)) * up(h)), act GELU (gemma; as ggml's CPU computes it, through its f16
    table: kernels/gelu_table.py) or SiLU. w_gate_up: a fused gate+up matrix or None (then w_gate
    and w_up); biases None where the file has none. h [n, n_embd] f32 -> [n, n_embd] f32."""
    if w_gate_up is not None:
        a = glu_fused(w_gate_up.matmul(h, min_macs), n_ff, use_gelu)
    else:
        g, u = w_gate.matmul(h, min_macs), w_up.matmul(h, min_macs)
        if b_gate is not None:
            g += b_gate
        if b_up is not None:
            u += b_up
        a = geglu(g, u) if use_gelu else swiglu(g, u)
    out = w_down.matmul(a, min_macs)
    if b_down is not None:
        out += b_down
    return out
