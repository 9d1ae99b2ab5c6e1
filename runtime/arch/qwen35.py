"""qwen35 (src/models/qwen35.cpp + delta-net-base.cpp): Qwen3.5, gated delta-net linear
attention with a gated full-attention layer every full_attention_interval-th layer.

Every layer is x += mixer(attn_norm(x)); x += SwiGLU(post_attention_norm(x)).
Linear layers (gated delta net, H_k = ssm.group_count key heads, H_v = ssm.time_step_rank
value heads of S = ssm.state_size; value head h reads key head h % H_k):
    qkv  = silu(conv1d(attn_qkv(h)))                  [q (H_k*S) | k (H_k*S) | v (H_v*S)]
    q, k = l2_norm(q), l2_norm(k)                     (q is scaled by 1/sqrt(S) in the rule)
    g    = softplus(ssm_alpha(h) + ssm_dt_bias) * ssm_a    (ssm_a = -exp(A_log), stored so)
    b    = sigmoid(ssm_beta(h))
    o    = gated delta rule (kernels/delta_net.py), token by token (its docstring says why)
    out  = ssm_out(RMSNorm_ssm_norm(o) * silu(attn_gate(h)))     (per value head)
Attention layers: attn_q gives per head [query (head_dim) | gate (head_dim)]; QK-norm; IMROPE
with the text positions [p, p, p, 0], i.e. NEOX rope on the first n_rot dims of each head;
the attention output is multiplied by sigmoid(gate) before attn_output.
Memory: hybrid (KV cache for the attention layers, conv + delta states for the others).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvchat.kernels.delta_net import gated_delta_rule
from kvchat.kernels.rope import prepare_qkv
from kvchat.runtime.arch.base import Arch, Tensor
from kvchat.runtime.arch.blocks import attend, opt, qkv_projection
from kvchat.runtime.arch.layer_plan import LayerSpec, ctx_size
from kvchat.runtime.arch.recurrent_blocks import (
    causal_conv,
    create_hybrid_memory,
    dense,
    l2_norm,
    rms_norm_last,
    sigmoid,
    silu,
    softplus,
    without_attention,
)
from kvchat.runtime.hparams import MAX_DIM, HParams, scalar_int


@dataclass
class Qwen35HParams(HParams):
    d_conv: int = 4
    d_inner: int = 0  # H_v * S
    d_state: int = 0  # S: key and value head size of the linear layers
    dt_rank: int = 0  # H_v
    n_group: int = 0  # H_k
    recurrent_layers: list = field(default_factory=list)

    def is_recurrent(self, il: int) -> bool:
        return bool(self.recurrent_layers[il])

    def has_kv(self, il: int) -> bool:
        return 0 <= il < self.n_layer and not self.is_recurrent(il)

    def conv_dim(self) -> int:
        return self.d_inner + 2 * self.n_group * self.d_state

    def n_embd_r(self) -> int:
        return (self.d_conv - 1) * self.conv_dim()

    def n_embd_s(self) -> int:
        return self.d_state * self.d_inner


def linear_attention(hp, L, h, rctx, il, min_macs: int | None = None) -> np.ndarray:
    """Gated delta-net mixer: h f32 [n, n_embd] -> f32 [n, n_embd]."""
    n, S, h_k, h_v = h.shape[0], hp.d_state, hp.n_group, hp.dt_rank
    n_rs = rctx.get_n_rs()
    n_st = n // n_rs
    kdim = h_k * S
    qkv = silu(causal_conv(rctx, il, L.ssm_qkv.matmul(h, min_macs), dense(L, "ssm_conv1d"), hp.d_conv))
    q = l2_norm(qkv[:, :kdim].reshape(n_rs, n_st, h_k, S), hp.norm_eps)
    k = l2_norm(qkv[:, kdim : 2 * kdim].reshape(n_rs, n_st, h_k, S), hp.norm_eps)
    v = qkv[:, 2 * kdim :].reshape(n_rs, n_st, h_v, S)
    g = softplus(L.ssm_alpha.matmul(h, min_macs) + L.ssm_dt_b) * L.ssm_a  # [n, H_v] log decay
    b = sigmoid(L.ssm_beta.matmul(h, min_macs))
    state = np.ascontiguousarray(rctx.get_s(il).reshape(n_rs, h_v, S, S))  # [.., S_v, S_k]
    o = gated_delta_rule(q, k, v, g.reshape(n_rs, n_st, h_v), b.reshape(n_rs, n_st, h_v), state)
    rctx.cpy_s(il, state.reshape(n_rs, -1))
    z = L.ssm_gate.matmul(h, min_macs).reshape(n, h_v, S)
    out = rms_norm_last(o.reshape(n, h_v, S), L.ssm_norm, hp.norm_eps) * silu(z)
    return L.ssm_out.matmul(np.ascontiguousarray(out.reshape(n, h_v * S), dtype=np.float32), min_macs)


def gated_attention(p, h, pos, mctx, run) -> np.ndarray:
    """A full-attention layer's mixer (its output projection included) through the hybrid's KV
    cache: h f32 [n, n_embd] -> f32 [n, n_embd]."""
    hp, il, L, actx = p.hp, p.il, p.L, mctx.get_attn()
    n, hd, nh = h.shape[0], hp.n_embd_head_k, hp.n_head
    q_full, k, v = qkv_projection(L, h, (2 * hd * nh, hp.n_embd_k_gqa(il), hp.n_embd_v_gqa(il)), run.min_macs)
    qg = q_full.reshape(n, nh, 2, hd)
    gate = np.ascontiguousarray(qg[:, :, 1, :]).reshape(n, nh * hd)
    q, k, v = prepare_qkv(
        np.ascontiguousarray(qg[:, :, 0, :]).reshape(n, nh * hd),
        k,
        v,
        nh,
        hp.n_head_kv,
        hd,
        pos,
        neox=True,
        q_norm=opt(L, "q_norm"),
        k_norm=opt(L, "k_norm"),
        eps=hp.norm_eps,
        **hp.rope_args(il, ctx_size(actx)),
    )
    out = attend(p, q, k, v, actx, run.n_threads, hp.kq_scale) * sigmoid(gate)
    return L.wo.matmul(np.ascontiguousarray(out, dtype=np.float32), run.min_macs)


def linear_mixer(p, h, pos, mctx, run) -> np.ndarray:
    return linear_attention(p.hp, p.L, h, mctx.get_recr(), p.il, run.min_macs)


# every layer: x += mixer(attn_norm(x)); x += SwiGLU(post_attention_norm(x))
LINEAR_LAYER = LayerSpec(mixer=linear_mixer, project=False, ffn_norm="post_attn_norm")
ATTENTION_LAYER = LayerSpec(mixer=gated_attention, project=False, ffn_norm="post_attn_norm")


class Qwen35(Arch):
    name = "qwen35"
    rope_type = "neox"  # IMROPE on text positions (see the module docstring)
    qk_norm = True

    def read_hparams(self, gf, fields) -> Qwen35HParams:
        k = lambda name: f"{self.name}.{name}"  # noqa: E731
        n_layer = fields["n_layer"]
        if gf.get_int(k("nextn_predict_layers"), 0) != 0:
            gf.fail(k("nextn_predict_layers"), "multi-token-prediction layers are not supported")
        interval = gf.get_int(k("full_attention_interval"), 4, min_value=1)
        hp = Qwen35HParams(
            **fields,
            d_conv=scalar_int(gf, k("ssm.conv_kernel"), 2, 64),
            d_inner=scalar_int(gf, k("ssm.inner_size"), 1, MAX_DIM),
            d_state=scalar_int(gf, k("ssm.state_size"), 1, MAX_DIM),
            dt_rank=scalar_int(gf, k("ssm.time_step_rank"), 1, MAX_DIM),
            n_group=scalar_int(gf, k("ssm.group_count"), 1, MAX_DIM),
            recurrent_layers=[(il + 1) % interval != 0 for il in range(n_layer)],
        )
        if hp.d_inner != hp.dt_rank * hp.d_state or hp.dt_rank % hp.n_group:
            gf.fail(
                k("ssm.inner_size"),
                f"{hp.d_inner} must be time_step_rank * state_size with time_step_rank a multiple of group_count",
            )
        return hp

    def layer_tensors(self, hp, il):
        """The llama block's schema with post_attention_norm before the FFN; attention layers'
        attn_q holds query and gate rows; linear layers have the delta-net weights instead."""
        e, p = hp.n_embd, f"blk.{il}."
        t = super().layer_tensors(hp, il)
        del t["ffn_norm"]
        t["post_attn_norm"] = Tensor(p + "post_attention_norm.weight", (e,))
        if not hp.is_recurrent(il):
            t["wq"] = Tensor(p + "attn_q.weight", (e, 2 * hp.n_embd_head_k * hp.n_head))
            t.pop("bq", None)
            return t
        hv, conv = hp.dt_rank, hp.conv_dim()
        t = without_attention(t)
        t.update(
            {
                "ssm_qkv": Tensor(p + "attn_qkv.weight", (e, conv)),
                "ssm_gate": Tensor(p + "attn_gate.weight", (e, hp.d_inner)),
                "ssm_conv1d": Tensor(p + "ssm_conv1d.weight", (hp.d_conv, conv)),
                "ssm_dt_b": Tensor(p + "ssm_dt.bias", (hv,)),
                "ssm_a": Tensor(p + "ssm_a", (hv,)),
                "ssm_beta": Tensor(p + "ssm_beta.weight", (e, hv)),
                "ssm_alpha": Tensor(p + "ssm_alpha.weight", (e, hv)),
                "ssm_norm": Tensor(p + "ssm_norm.weight", (hp.d_state,)),
                "ssm_out": Tensor(p + "ssm_out.weight", (hp.d_inner, e)),
            }
        )
        return t

    def layer_spec(self, hp, il):
        return LINEAR_LAYER if hp.is_recurrent(il) else ATTENTION_LAYER

    def create_memory(self, hparams, cparams):
        return create_hybrid_memory(hparams, cparams)


ARCH = Qwen35()
