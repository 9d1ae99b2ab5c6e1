"""What an architecture module declares, and the defaults of a llama-style attention decoder.

An architecture is one module runtime/arch/<name>.py holding an `ARCH` object (a subclass of
`Arch`, registered by one line in runtime/arch/__init__.py). It declares:
- `name`, `rope_type` ("norm" | "neox"), `qk_norm`, `full_rotary`, `rope_scaling_types`: the
  table entries llama.cpp keeps per architecture (llama_model_rope_type, ...);
- `read_hparams(gf, fields)`: its own GGUF keys and checks on top of the common fields that
  kvchat.runtime.hparams.read_common read; returns an HParams (or its subclass with the extras);
- `tensors(hp) -> Schema`: every weight, as attribute -> Tensor(GGUF name, ggml shape,
  required); the generic loader (runtime/model.py) fills `model.weights` and one `Layer`
  namespace per block from it, so the forward reads `L.wq`, `L.ffn_norm`, ...;
- `fusions`: load-time hooks that fuse projections reading the same input (Q|K|V, gate|up)
  into one matrix when they share a format, and fold their biases into one vector;
- `layer_spec(hp, il) -> LayerSpec` and `model_spec(hp) -> ModelSpec`: its layers as data (the
  mixer, the norm kind, the FFN, the residual multiplier; embedding scale, logit soft-cap and
  scale) for the one layer loop every architecture runs (runtime/arch/layer_plan.py: `forward`,
  llm_build_*'s shape); the defaults are llama's;
- `create_memory(hparams, cparams)`: the memory it needs (llama_model::create_memory). The
  default is the attention one: a KV cache, or the base + SWA pair for sliding-window models.
A new dense architecture is this module and one registry line; the mixers of the other layer
kinds live beside their archs (runtime/arch/blocks.py, recurrent_blocks.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvchat.runtime.arch.layer_plan import LayerSpec, ModelSpec, forward
from kvchat.runtime.hparams import HParams, read_common
from kvchat.runtime.memory.kv_cache import KVCache
from kvchat.runtime.memory.kv_cache_iswa import KVCacheISWA


@dataclass(frozen=True)
class Tensor:
    """One weight of the schema: its GGUF name, its shape in ggml ne order, and whether a file
    must have it (optional ones are None on the loaded layer when absent)."""

    name: str
    shape: tuple[int, ...]
    required: bool = True


@dataclass(frozen=True)
class Fuse:
    """Load-time fusion of the matrices `parts` (attributes) into the attribute `into`, done when
    all parts are present with one format and row length (rows are copied once; the parts are
    then None). `bias_into` names the concatenation of the `biases` of the parts (zeros where a
    part has none), built whenever any is present; with bias_into None, parts that have biases
    stay separate."""

    into: str
    parts: tuple[str, ...]
    biases: tuple[str, ...] = ()
    bias_into: str | None = None


@dataclass
class Schema:
    """attribute -> Tensor for the model-level weights and for each layer."""

    model: dict[str, Tensor]
    layers: list[dict[str, Tensor]] = field(default_factory=list)

    def expected(self) -> dict[str, tuple[tuple[int, ...], bool]]:
        """GGUF name -> (shape, required), model weights first then layer by layer."""
        out = {t.name: (t.shape, t.required) for t in self.model.values()}
        for layer in self.layers:
            out.update({t.name: (t.shape, t.required) for t in layer.values()})
        return out


QKV_FUSION = Fuse("wqkv", ("wq", "wk", "wv"), biases=("bq", "bk", "bv"), bias_into="bqkv")
# Q|K alone when QKV_FUSION could not fuse (V in another format: Q4_K_M's Q6_K V in half the
# layers): one launch fewer a layer. Its biases are already folded into bqkv by QKV_FUSION.
QK_FUSION = Fuse("wqk", ("wq", "wk"))
GATE_UP_FUSION = Fuse("w_gate_up", ("w_gate", "w_up"), biases=("b_gate", "b_up"))


class Arch:
    """A llama-style decoder: pre-norm attention + gated FFN blocks, tied or separate head."""

    name = ""
    rope_type = "norm"
    qk_norm = False  # per-head RMSNorm of Q and K (attn_q_norm / attn_k_norm required)
    full_rotary = False  # rope.dimension_count must equal the head size
    rope_scaling_types: tuple[str, ...] = ()  # accepted beyond "none" / "linear"
    fusions: tuple[Fuse, ...] = (QKV_FUSION, QK_FUSION, GATE_UP_FUSION)
    moe_act = "silu"  # activation of a mixture-of-experts FFN (runtime/arch/moe.py): "silu" | "swiglu_oai"

    # ---- hyper-parameters
    def read_common(self, gf) -> dict:
        """The common fields (kvchat.runtime.hparams.read_common); an architecture whose files lack
        some of those keys passes them in (read_common's `given`)."""
        return read_common(gf, self)

    def read_hparams(self, gf, fields: dict) -> HParams:
        """The model's HParams from the common fields plus this architecture's keys."""
        return HParams(**fields)

    # ---- tensor schema
    def tensors(self, hp) -> Schema:
        return Schema(self.model_tensors(hp), [self.layer_tensors(hp, il) for il in range(hp.n_layer)])

    def model_tensors(self, hp) -> dict[str, Tensor]:
        e, v = hp.n_embd, hp.n_vocab
        return {
            "tok_embd": Tensor("token_embd.weight", (e, v)),
            "output_norm": Tensor("output_norm.weight", (e,)),
            "output": Tensor("output.weight", (e, v), False),
        }  # absent: tied to tok_embd

    def layer_tensors(self, hp, il: int) -> dict[str, Tensor]:
        """Attention (Q, K, V, output; optional Q/K/V biases) and the gated FFN of block il."""
        e, ff = hp.n_embd, hp.n_ff
        q_dim, kd, vd = hp.n_embd_head_k * hp.n_head, hp.n_embd_k_gqa(il), hp.n_embd_v_gqa(il)
        p = f"blk.{il}."
        t = {
            "attn_norm": Tensor(p + "attn_norm.weight", (e,)),
            "wq": Tensor(p + "attn_q.weight", (e, q_dim)),
            "wk": Tensor(p + "attn_k.weight", (e, kd)),
            "wv": Tensor(p + "attn_v.weight", (e, vd)),
            "wo": Tensor(p + "attn_output.weight", (hp.n_embd_head_v * hp.n_head, e)),
            "ffn_norm": Tensor(p + "ffn_norm.weight", (e,)),
            "w_gate": Tensor(p + "ffn_gate.weight", (e, ff)),
            "w_up": Tensor(p + "ffn_up.weight", (e, ff)),
            "w_down": Tensor(p + "ffn_down.weight", (ff, e)),
            "bq": Tensor(p + "attn_q.bias", (q_dim,), False),
            "bk": Tensor(p + "attn_k.bias", (kd,), False),
            "bv": Tensor(p + "attn_v.bias", (vd,), False),
        }
        if self.qk_norm:
            t["q_norm"] = Tensor(p + "attn_q_norm.weight", (hp.n_embd_head_k,))
            t["k_norm"] = Tensor(p + "attn_k_norm.weight", (hp.n_embd_head_k,))
        return t

    # ---- graph: the layer loop of runtime/arch/layer_plan.py, from these declarations
    def layer_spec(self, hp, il: int) -> LayerSpec:
        """Layer il as data: llama's (attention, pre-norm, SwiGLU FFN, plain residual adds)."""
        return LayerSpec()

    def model_spec(self, hp) -> ModelSpec:
        """The ends of the loop: no embedding scale, no logit soft-cap or scale."""
        return ModelSpec()

    forward = staticmethod(forward)  # (model, ubatch, mctx) -> logits f32 [n_outputs, n_vocab]

    # ---- memory
    def create_memory(self, hparams, cparams):
        return create_attention_memory(hparams, cparams)


def model_uses_iswa(hparams) -> bool:
    """True when the model interleaves sliding-window layers (llama.cpp: swa_type != NONE)."""
    n_swa = int(getattr(hparams, "n_swa", 0) or 0)
    layers = getattr(hparams, "swa_layers", None) or []
    return n_swa > 0 and any(bool(x) for x in layers)


def create_attention_memory(hparams, cparams):
    """KVCacheISWA for sliding-window models, else KVCache of n_ctx_seq cells per stream."""
    if model_uses_iswa(hparams):
        return KVCacheISWA(
            hparams,
            cparams.type_k,
            cparams.type_v,
            v_trans=cparams.v_trans,
            swa_full=cparams.swa_full,
            unified=cparams.kv_unified,
            kv_size=cparams.n_ctx_seq,
            n_seq_max=cparams.n_seq_max,
            n_ubatch=cparams.n_ubatch,
        )
    return KVCache(
        hparams,
        cparams.type_k,
        cparams.type_v,
        v_trans=cparams.v_trans,
        unified=cparams.kv_unified,
        kv_size=cparams.n_ctx_seq,
        n_seq_max=cparams.n_seq_max,
        n_swa=0,
    )
