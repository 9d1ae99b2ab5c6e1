"""llama (src/models/llama.cpp): SmolLM2, Llama 2/3/3.1/3.2, Mistral-style files.

Per layer: x += Wo·attn(rope(Q), rope(K), V) of RMSNorm(x); x += down(silu(gate)·up) of
RMSNorm(x), with the optional output and FFN biases llama.cpp allows. RoPE spans the whole
head. Llama 3.1/3.2 RoPE scaling is entirely the `rope_freqs.weight` tensor (f32 [head/2], one
for all layers): per-frequency divisors of the rotation speed, which the converter computed
from the HF rope_scaling (factor, low/high_freq_factor, original context). After the last layer's attention only the
rows of output tokens are carried on
(llama.cpp's inp_out_ids). qwen2 and qwen3 reuse this forward (biases / QK-norm apply when the
layer has them).
"""

from __future__ import annotations

import numba
import numpy as np

from kvchat.kernels.fused_norm import add_rms_norm
from kvchat.kernels.norm import rms_norm
from kvchat.runtime.arch.base import Arch, Tensor
from kvchat.runtime.arch.blocks import ctx_size, embed, lm_head, output_ids
from kvchat.runtime.arch.layer_plan import attention_step, ffn_step, layer_plans, output_step
from kvchat.runtime.hparams import rope_factor_tensor


def forward(model, ubatch, mctx) -> np.ndarray:
    """Logits f32 [n_outputs, n_vocab] of one ubatch.

    Each residual add runs fused with the norm that follows it (kernels/fused_norm.py: the same
    arithmetic in one launch): after attention with ffn_norm, after the FFN with the next
    layer's attn_norm, or with output_norm after the last layer. Each layer runs from its plan
    (runtime/arch/layer_plan.py: its weights and constants, worked out once)."""
    hp = model.hparams
    eps = hp.norm_eps
    pos = np.ascontiguousarray(ubatch.pos, dtype=np.int32)
    x = embed(model, ubatch.token)  # [n_tokens, n_embd] f32, the residual stream
    out_ids = output_ids(ubatch)
    plans = layer_plans(model, ctx_size(mctx))
    last = hp.n_layer - 1
    n_threads = numba.get_num_threads()
    h = rms_norm(x, plans[0].L.attn_norm, eps)
    for p in plans:
        attn = attention_step(p, h, pos, mctx, n_threads)  # [n, n_head*dv]
        if p.il == last and out_ids is not None:
            attn, x = attn[out_ids], x[out_ids]
            if x.shape[0] == 0:
                return np.zeros((0, hp.n_vocab), dtype=np.float32)
        h = add_rms_norm(x, output_step(p, attn), p.L.ffn_norm, eps)
        w_next = plans[p.il + 1].L.attn_norm if p.il < last else model.weights.output_norm
        h = add_rms_norm(x, ffn_step(p, h, False), w_next, eps)
    return lm_head(model, h)


class Llama(Arch):
    name = "llama"
    rope_type = "norm"
    full_rotary = True  # llama.cpp asserts n_rot == head size for llama

    def read_hparams(self, gf, fields):
        fields["rope_freq_factors"] = rope_factor_tensor(gf, "rope_freqs.weight", fields["n_rot"])
        return super().read_hparams(gf, fields)

    def model_tensors(self, hp):
        t = super().model_tensors(hp)
        t["rope_freqs"] = Tensor("rope_freqs.weight", (hp.n_rot // 2,), False)
        return t

    def layer_tensors(self, hp, il):
        e, ff = hp.n_embd, hp.n_ff
        p = f"blk.{il}."
        t = super().layer_tensors(hp, il)
        t.update(
            {
                "bo": Tensor(p + "attn_output.bias", (e,), False),
                "b_gate": Tensor(p + "ffn_gate.bias", (ff,), False),
                "b_up": Tensor(p + "ffn_up.bias", (ff,), False),
                "b_down": Tensor(p + "ffn_down.bias", (e,), False),
            }
        )
        return t

    forward = staticmethod(forward)


ARCH = Llama()
