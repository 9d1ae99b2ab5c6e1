"""The mixture-of-experts FFN block, once for every MoE architecture (llama.cpp: build_moe_ffn in
src/llama-graph.cpp, ggml_mul_mat_id).

What the block declares:
- hyper-parameters (`MoEHParams`, read by `read_moe`): n_expert, n_expert_used (k), n_ff_exp
  (expert FFN width: `expert_feed_forward_length`, else n_ff / k as llama.cpp falls back),
  the gating function (softmax | sigmoid | softmax_weight = gpt-oss's softmax over the selected
  k), whether the k weights are normalized to sum 1, their scale, and the shared expert's width;
- weights (runtime/arch/moe_schema.py: `moe_tensors`): the router `ffn_gate_inp` [n_embd,
  n_expert] (+ optional bias), the
  stacked experts `ffn_{gate,up,down}_exps` [n_embd, n_ff_exp, n_expert] / [n_ff_exp, n_embd,
  n_expert] (+ optional per-expert biases [n_ff_exp|n_embd, n_expert]), the optional
  expert-selection bias `exp_probs_b` and the optional shared expert `ffn_{gate,up,down}_shexp`
  with its scalar gate `ffn_gate_inp_shexp`; gate and up of the experts are stacked per expert
  at load (`moe_schema.EXPERT_GATE_UP_FUSION`, one matmul per expert);
- the computation (`moe_ffn`): router logits -> kernels/moe_route.py (gating, top-k in
  llama.cpp's order, normalization, scale) -> kernels/matmul_id.py (each expert's weights once
  per ubatch, in their quantized blocks) -> activation (SiLU-GLU, or gpt-oss's clamped SwiGLU)
  -> down -> times the weights -> the k slots added in selection order (ggml's chain of adds)
  -> + the shared expert.
An MoE arch file declares its HParams class and tensors through these, and its layers as
`LayerSpec(ffn=moe_ffn_step)` (`with_moe(spec)`): the one layer loop of runtime/arch/layer_plan.py
then runs the layer's MoEPlan (`LayerPlan.moe`, built for every layer with a router) as its FFN.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvchat.kernels.act import glu_fused, swiglu
from kvchat.kernels.ggml_types import GGMLType
from kvchat.kernels.matmul import QMatrix
from kvchat.kernels.moe_route import GATING_NAMES, GATING_SOFTMAX, route_experts
from kvchat.runtime.hparams import HParams, scalar_int

LLAMA_GATING_IDS = {1: "softmax", 2: "sigmoid", 3: "softmax_weight"}  # <arch>.expert_gating_func values
MAX_EXPERTS = 512  # llama.cpp's LLAMA_MAX_EXPERTS


@dataclass
class MoEHParams(HParams):
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0
    n_ff_shexp: int = 0  # shared expert's FFN width; 0 = no shared expert
    expert_gating: str = "softmax"
    expert_weights_norm: bool = False
    expert_weights_scale: float = 0.0  # 0 or 1 = not scaled


def read_moe(gf, arch: str, fields: dict, *, gating: str = "softmax", norm: bool = False, ff_is_n_ff=False) -> dict:
    """The MoE keys of `<arch>.*` as MoEHParams fields (added to `fields`, which it returns).
    gating / norm: the architecture's fixed choice (llama.cpp hard-codes them per arch);
    ff_is_n_ff: the experts are feed_forward_length wide (olmoe, granitemoe)."""
    k = lambda name: f"{arch}.{name}"  # noqa: E731
    n_expert = scalar_int(gf, k("expert_count"), 1, MAX_EXPERTS)
    n_used = scalar_int(gf, k("expert_used_count"), 1, MAX_EXPERTS)
    if n_used > n_expert:
        gf.fail(k("expert_used_count"), f"{n_used} is more than expert_count {n_expert}")
    n_ff_exp = scalar_int(gf, k("expert_feed_forward_length"), 0, 1 << 20, default=0) or fields["n_ff"] // n_used
    if ff_is_n_ff:
        n_ff_exp = fields["n_ff"]
    fields.update(
        n_expert=n_expert,
        n_expert_used=n_used,
        n_ff_exp=n_ff_exp,
        n_ff_shexp=scalar_int(gf, k("expert_shared_feed_forward_length"), 0, 1 << 20, default=0),
        expert_gating=gating,
        expert_weights_norm=norm,
        expert_weights_scale=gf.get_float(k("expert_weights_scale"), 0.0),
    )
    return fields


class MoEPlan:
    """One layer's MoE FFN: its weights by role and constants, built once (layer_plan.LayerPlan.moe)."""

    __slots__ = (
        "w_gate_inp",
        "b_gate_inp",
        "exp_probs_b",
        "w_gate_up",
        "w_gate",
        "w_up",
        "w_down",
        "b_gate",
        "b_up",
        "b_down",
        "k",
        "n_ff",
        "gating",
        "norm",
        "scale",
        "act",
        "shexp",
        "w_gate_inp_shexp",
        "b_gate_up",
    )

    def __init__(self, hp, L, act: str = "silu"):
        g = L.__dict__.get
        self.w_gate_inp, self.b_gate_inp, self.exp_probs_b = g("w_gate_inp"), g("b_gate_inp"), g("exp_probs_b")
        self.w_gate_up, self.w_gate, self.w_up = g("w_gate_up_exps"), g("w_gate_exps"), g("w_up_exps")
        self.w_down = g("w_down_exps")
        self.b_gate, self.b_up, self.b_down = g("b_gate_exps"), g("b_up_exps"), g("b_down_exps")
        # gate and up biases side by side per expert [n_expert, 2 n_ff], as the fused gate|up rows:
        # one gather and one add on a decoded token's [k, 2 n_ff] product (gpt-oss)
        self.b_gate_up = None
        if self.w_gate_up is not None and self.b_gate is not None:
            self.b_gate_up = np.ascontiguousarray(np.concatenate([self.b_gate, self.b_up], axis=1), dtype=np.float32)
        self.k, self.n_ff = int(hp.n_expert_used), int(hp.n_ff_exp)
        self.gating = GATING_NAMES.get(hp.expert_gating, GATING_SOFTMAX)
        self.norm, self.scale = bool(hp.expert_weights_norm), float(hp.expert_weights_scale)
        self.act = act
        has_shexp = g("w_down_shexp") is not None
        self.shexp = (
            (g("w_gate_up_shexp"), g("w_gate_shexp"), g("w_up_shexp"), g("w_down_shexp")) if has_shexp else None
        )
        w = g("w_gate_inp_shexp")  # f32 [n_embd]: a one-row matrix, so its dot is the batch-invariant kernel's
        self.w_gate_inp_shexp = None if w is None else QMatrix(w.view(np.uint8).reshape(1, -1), GGMLType.F32, w.size)


def moe_ffn_step(p, h: np.ndarray, run) -> np.ndarray:
    """The FFN kind of an MoE layer (LayerSpec.ffn): the layer plan's MoE FFN on h."""
    return moe_ffn(p.moe, h, run.min_macs)


def with_moe(spec):
    """A LayerSpec with the MoE FFN in place of its dense one."""
    import dataclasses

    return dataclasses.replace(spec, ffn=moe_ffn_step)


def moe_ffn(p: MoEPlan, h: np.ndarray, min_macs: int | None = None) -> np.ndarray:
    """The MoE FFN of h f32 [n, n_embd] -> [n, n_embd] f32 (see the module)."""
    n = h.shape[0]
    logits = p.w_gate_inp.matmul(h, min_macs)  # [n, n_expert]
    if p.b_gate_inp is not None:
        logits += p.b_gate_inp
    ids, w = route_experts(logits, p.k, p.gating, p.norm, p.scale, p.exp_probs_b)  # [n, k] i32, f32
    k, f = p.k, p.n_ff
    if p.w_gate_up is not None and p.b_gate is None:
        gu = p.w_gate_up.matmul_id(h, ids, min_macs).reshape(n * k, 2 * f)  # [(t, s), gate | up]
        act = glu_fused(gu, f, False, k) if p.act == "silu" else swiglu_oai(gu[:, :f], gu[:, f:])
    elif p.b_gate_up is not None and p.act != "silu":  # gpt-oss: ggml_add_id on both halves at once
        gu = p.w_gate_up.matmul_id(h, ids, min_macs)  # [n, k, 2f]
        gu += p.b_gate_up[ids]
        act = swiglu_oai(gu[:, :, :f], gu[:, :, f:])  # [n, k, f]
    else:
        if p.w_gate_up is not None:
            gu = p.w_gate_up.matmul_id(h, ids, min_macs)  # [n, k, 2f]
            g, u = gu[:, :, :f], gu[:, :, f:]
        else:
            g, u = p.w_gate.matmul_id(h, ids, min_macs), p.w_up.matmul_id(h, ids, min_macs)  # [n, k, f]
        if p.b_gate is not None:  # ggml_add_id: each slot gets its expert's bias
            g = g + p.b_gate[ids]
            u = u + p.b_up[ids]
        g, u = np.ascontiguousarray(g).reshape(n * k, f), np.ascontiguousarray(u).reshape(n * k, f)
        act = swiglu(g, u) if p.act == "silu" else swiglu_oai(g, u)
    d = p.w_down.matmul_id(act.reshape(n, k, f), ids, min_macs)  # [n, k, n_embd]
    if p.b_down is not None:
        d += p.b_down[ids]
    d *= w[:, :, None]  # ggml_mul by the weights
    out = d[:, 0].copy()
    for s in range(1, k):  # ggml's chain of adds over the slot views
        out += d[:, s]
    if p.shexp is not None:
        out += shared_expert(p, h, min_macs)
    return out


def shared_expert(p: MoEPlan, h: np.ndarray, min_macs: int | None = None) -> np.ndarray:
    """The shared expert (a SiLU-GLU FFN every token runs), times sigmoid(ffn_gate_inp_shexp · h)
    when the layer has that gate (qwen35moe, qwen2moe): [n, n_embd] f32."""
    w_gu, w_g, w_u, w_d = p.shexp
    if w_gu is not None:
        a = glu_fused(w_gu.matmul(h, min_macs), w_d.k, False)
    else:
        a = swiglu(w_g.matmul(h, min_macs), w_u.matmul(h, min_macs))
    y = w_d.matmul(a, min_macs)
    if p.w_gate_inp_shexp is not None:
        z = p.w_gate_inp_shexp.matmul(h, min_macs)  # [n, 1] f32
        y *= (np.float32(1.0) / (np.float32(1.0) + np.exp(-z))).astype(np.float32)
    return y


def swiglu_oai(g: np.ndarray, u: np.ndarray, alpha: float = 1.702, limit: float = 7.0) -> np.ndarray:
    """gpt-oss's clamped SwiGLU as ggml's CPU computes it (ggml_compute_forward_swiglu_oai_f32):
    x = min(g, limit), y = clamp(u, -limit, limit), out = x / (1 + expf(alpha * -x)) * (y + 1), in
    float32 with libm's expf (correctly rounded: the float64 exp rounded once). Its output is the
    down projection's input, quantized per block for a quantized expert (MXFP4: q8_0), so a last-bit
    difference here can move a quantization step. g, u [..., f] f32 (strided views allowed) ->
    [..., f] f32. Each step is one f32 numpy operation, written into the arrays it made (a decoded
    gpt-oss token: 4 x 2880 values a layer, where the passes and copies cost as much as the exp)."""
    f32 = np.float32
    x = np.minimum(g, f32(limit))
    e = np.exp(np.multiply(x, f32(-alpha)), dtype=np.float64).astype(np.float32)  # alpha * -x, exactly
    e += f32(1.0)
    x /= e
    y = np.clip(u, f32(-limit), f32(limit))
    y += f32(1.0)
    x *= y
    return x


def token_read_bytes(gf, hp) -> int:
    """Weight bytes one decoded token reads, from the file's tensors: every matrix once, of the
    stacked experts only its k of n_expert (an expert's share of the tensor), of the token
    embedding one row unless it is also the output head (tied)."""
    n_exp, k = int(getattr(hp, "n_expert", 0) or 0), int(getattr(hp, "n_expert_used", 0) or 0)
    total = 0
    for t in gf.tensors.values():
        if len(t.shape) == 3 and n_exp and int(t.shape[2]) == n_exp:
            total += t.nbytes * k // n_exp
        elif t.name.endswith("_exps.bias") and n_exp:
            total += t.nbytes * k // n_exp
        elif t.name == "token_embd.weight" and "output.weight" in gf.tensors:
            total += t.nbytes // int(t.shape[-1])
        else:
            total += t.nbytes
    return total
