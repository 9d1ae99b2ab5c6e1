"""phi3 (src/models/phi3.cpp): Phi-3 / Phi-3.5 / Phi-4-mini.

The llama-style pre-norm block with three differences in the weights and one in RoPE:
- Q, K and V come from one fused `attn_qkv` matrix, rows [q (n_head·hd) | k | v (n_head_kv·hd
  each)] (separate attn_q/k/v are accepted too); n_head·hd must equal n_embd;
- `ffn_up` holds gate and up (2·n_ff rows): FFN = down(silu(first half) · second half), no
  ffn_gate;
- partial rotary: NEOX RoPE over the first rope.dimension_count dims of each head;
- LongRoPE: `rope_factors_long` / `rope_factors_short` (f32 [n_rot/2], global) divide the
  rotation speeds, the long set iff the context per sequence exceeds
  rope.scaling.original_context_length (llama_model::get_rope_factors), and
  rope.scaling.attn_factor multiplies cos and sin (HParams.rope_args).
Q is scaled by 1/sqrt(head size) (llama.cpp scales Q, then attends with scale 1). Phi's
sliding window is off, as in llama.cpp.
"""

from __future__ import annotations

from kvchat.runtime.arch.base import Arch, Tensor
from kvchat.runtime.arch.layer_plan import LayerSpec
from kvchat.runtime.hparams import rope_factor_tensor

PHI3_LAYER = LayerSpec(q_scaled=True)  # phi3.cpp scales Q by 1/sqrt(head size), attention at scale 1


class Phi3(Arch):
    name = "phi3"
    rope_type = "neox"
    rope_scaling_types = ("longrope",)

    def read_hparams(self, gf, fields):
        n_rot = fields["n_rot"]
        fields["rope_factors_long"] = rope_factor_tensor(gf, "rope_factors_long.weight", n_rot)
        fields["rope_factors_short"] = rope_factor_tensor(gf, "rope_factors_short.weight", n_rot)
        if fields["n_embd_head_k"] * fields["n_head"] != fields["n_embd"]:
            gf.fail("phi3.attention.head_count", "head_count x head size must equal embedding_length for phi3")
        for il in range(fields["n_layer"]):
            p = f"blk.{il}."
            if p + "attn_qkv.weight" not in gf.tensors and not all(p + f"attn_{x}.weight" in gf.tensors for x in "qkv"):
                gf.fail(f"tensor {p}attn_qkv.weight", "missing (required for phi3: fused QKV, or attn_q/k/v)")
        return super().read_hparams(gf, fields)

    def layer_spec(self, hp, il):
        return PHI3_LAYER

    def model_tensors(self, hp):
        t = super().model_tensors(hp)
        half = hp.n_rot // 2
        t["rope_long"] = Tensor("rope_factors_long.weight", (half,), False)
        t["rope_short"] = Tensor("rope_factors_short.weight", (half,), False)
        return t

    def layer_tensors(self, hp, il):
        e, ff = hp.n_embd, hp.n_ff
        qkv = hp.n_embd_head_k * hp.n_head + hp.n_embd_k_gqa(il) + hp.n_embd_v_gqa(il)
        p = f"blk.{il}."
        t = super().layer_tensors(hp, il)
        for name in ("wq", "wk", "wv"):
            t[name] = Tensor(t[name].name, t[name].shape, False)
        del t["w_gate"], t["w_up"]
        t.update(
            {
                "wqkv": Tensor(p + "attn_qkv.weight", (e, qkv), False),
                "bqkv": Tensor(p + "attn_qkv.bias", (qkv,), False),
                "w_gate_up": Tensor(p + "ffn_up.weight", (e, 2 * ff)),
            }
        )
        return t


ARCH = Phi3()
