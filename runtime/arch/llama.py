"""llama (src/models/llama.cpp): SmolLM2, Llama 2/3/3.1/3.2, Mistral-style files.

Per layer: x += Wo·attn(rope(Q), rope(K), V) of RMSNorm(x); x += down(silu(gate)·up) of
RMSNorm(x), with the optional output and FFN biases llama.cpp allows. RoPE spans the whole
head. Llama 3.1/3.2 RoPE scaling is entirely the `rope_freqs.weight` tensor (f32 [head/2], one
for all layers): per-frequency divisors of the rotation speed, which the converter computed
from the HF rope_scaling (factor, low/high_freq_factor, original context). The layer loop is the
default one (runtime/arch/layer_plan.py: the declared defaults are this layer); qwen2, qwen3,
phi3 and smollm3 differ only in their weights and hyper-parameters (biases / QK-norm apply when
the layer has them).
"""

from __future__ import annotations

from kvchat.runtime.arch.base import Arch, Tensor
from kvchat.runtime.hparams import rope_factor_tensor


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


ARCH = Llama()
