"""lfm2 (src/models/lfm2.cpp): LiquidAI LFM2, short-conv layers and GQA attention layers.

A layer attends iff lfm2.attention.head_count_kv[il] > 0; the others are gated short convs:
    B, C, x = split(in_proj(h))               (three n_embd chunks, in that order)
    out     = out_proj(C * conv(B * x))       causal conv, kernel L_cache, no bias; its state
                                              keeps the last L_cache - 1 values of B * x
Attention layers: per-head RMS QK-norm, NEOX RoPE, scale 1/sqrt(head_dim). Every layer is
x += op(attn_norm(x)); x += SwiGLU(ffn_norm(x)). The final norm is stored as
token_embd_norm.weight (llama.cpp's naming). Memory: hybrid (KV cache for the attention
layers, conv states for the others).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvchat.runtime.arch.base import Arch, Tensor
from kvchat.runtime.arch.layer_plan import LayerSpec, attention_step
from kvchat.runtime.arch.recurrent_blocks import causal_conv, create_hybrid_memory, dense, without_attention
from kvchat.runtime.gguf.file import GGUFValueType
from kvchat.runtime.hparams import HParams, read_common, scalar_int


@dataclass
class LFM2HParams(HParams):
    l_cache: int = 3
    kv_heads: list = field(default_factory=list)  # head_count_kv per layer (0: short conv)

    def is_recurrent(self, il: int) -> bool:
        return self.kv_heads[il] == 0

    def has_kv(self, il: int) -> bool:
        return 0 <= il < self.n_layer and not self.is_recurrent(il)

    def n_embd_r(self) -> int:
        return self.n_embd * (self.l_cache - 1)

    def n_embd_s(self) -> int:
        return 0


def shortconv_block(hp, L, h, rctx, il, min_macs: int | None = None) -> np.ndarray:
    e = hp.n_embd
    bcx = L.conv_in_proj.matmul(h, min_macs)  # [n, 3 * n_embd]: B | C | x
    bx = np.ascontiguousarray(bcx[:, :e] * bcx[:, 2 * e :])
    conv = causal_conv(rctx, il, bx, dense(L, "conv"), hp.l_cache)
    return L.conv_out_proj.matmul(np.ascontiguousarray(bcx[:, e : 2 * e] * conv), min_macs)


def shortconv_mixer(p, h, pos, mctx, run) -> np.ndarray:
    """A short-conv layer's mixer in the layer loop: mctx is the hybrid memory's context."""
    return shortconv_block(p.hp, p.L, h, mctx.get_recr(), p.il, run.min_macs)


def attention_mixer(p, h, pos, mctx, run) -> np.ndarray:
    """An attention layer's mixer (before the output projection) through the hybrid's KV cache."""
    return attention_step(p, h, pos, mctx.get_attn(), run)


SHORTCONV_LAYER = LayerSpec(mixer=shortconv_mixer, project=False)
ATTENTION_LAYER = LayerSpec(mixer=attention_mixer)


class LFM2(Arch):
    name = "lfm2"
    rope_type = "neox"
    qk_norm = True

    def read_common(self, gf) -> dict:
        key = "lfm2.attention.head_count_kv"
        heads = gf.metadata.get(key)
        if gf.value_types.get(key, (None,))[0] != GGUFValueType.ARRAY:
            gf.fail(key, "must list the kv heads of every layer (0 for a short-conv layer)")
        nz = sorted({int(h) for h in heads if int(h) > 0})
        if len(nz) != 1:
            gf.fail(key, f"attention layers must share one kv head count, got {nz or 'none'}")
        return read_common(gf, self, given={"n_head_kv": nz[0]})

    def read_hparams(self, gf, fields) -> LFM2HParams:
        heads = [int(h) for h in gf.metadata["lfm2.attention.head_count_kv"]]
        if len(heads) != fields["n_layer"]:
            gf.fail("lfm2.attention.head_count_kv", f"has {len(heads)} entries for {fields['n_layer']} layers")
        return LFM2HParams(**fields, l_cache=scalar_int(gf, "lfm2.shortconv.l_cache", 2, 64), kv_heads=heads)

    def model_tensors(self, hp):
        t = super().model_tensors(hp)
        t["output_norm"] = Tensor("token_embd_norm.weight", (hp.n_embd,))
        return t

    def layer_tensors(self, hp, il):
        """The llama block's schema (QK-norm attention, gated FFN); a short-conv layer has its
        conv projections instead of the attention weights."""
        t = super().layer_tensors(hp, il)
        if not hp.is_recurrent(il):
            return t
        e, p = hp.n_embd, f"blk.{il}."
        t = without_attention(t)
        t.update(
            {
                "conv_in_proj": Tensor(p + "shortconv.in_proj.weight", (e, 3 * e)),
                "conv": Tensor(p + "shortconv.conv.weight", (hp.l_cache, e)),
                "conv_out_proj": Tensor(p + "shortconv.out_proj.weight", (e, e)),
            }
        )
        return t

    def layer_spec(self, hp, il):
        return SHORTCONV_LAYER if hp.is_recurrent(il) else ATTENTION_LAYER

    def create_memory(self, hparams, cparams):
        return create_hybrid_memory(hparams, cparams)


ARCH = LFM2()
