"""granite (src/models/granite.cpp): IBM Granite 3.x dense models.

The llama block (NORM RoPE, SwiGLU, optional biases) with four multipliers from the GGUF:
- `embedding_scale`: token embeddings are multiplied by it (0 or absent = 1);
- `attention.scale`: the score scale, *instead of* 1/sqrt(head size) (0 or absent = that);
- `residual_scale`: the attention output and the FFN output of every block are multiplied by
  it before they are added to the residual stream (0 or absent = 1);
- `logit_scale` (required): the logits are divided by it.
`rope.scaling.finetuned` false switches RoPE off in every layer (llama.cpp reads it that way).
The layer loop is the default one with the multipliers declared (layer_spec, model_spec).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvchat.runtime.arch.layer_plan import LayerSpec, ModelSpec
from kvchat.runtime.arch.llama import Llama
from kvchat.runtime.hparams import HParams


@dataclass
class GraniteHParams(HParams):
    embed_scale: float = 1.0
    residual_scale: float = 1.0
    logit_scale: float = 1.0


class Granite(Llama):
    name = "granite"

    def read_hparams(self, gf, fields):
        k = lambda name: f"{self.name}.{name}"  # noqa: E731
        logit_scale = gf.get_float(k("logit_scale"))
        if not logit_scale > 0:
            gf.fail(k("logit_scale"), f"{logit_scale} must be positive")
        attention_scale = gf.get_float(k("attention.scale"), 0.0)
        if attention_scale:
            fields["kq_scale"] = attention_scale
        if not gf.get_bool(k("rope.scaling.finetuned"), True):
            fields["rope_layers"] = [False] * fields["n_layer"]
        hp = super().read_hparams(gf, fields)  # llama's: rope_freqs
        return GraniteHParams(
            **vars(hp),
            embed_scale=gf.get_float(k("embedding_scale"), 0.0) or 1.0,
            residual_scale=gf.get_float(k("residual_scale"), 0.0) or 1.0,
            logit_scale=logit_scale,
        )

    def layer_spec(self, hp, il):
        return LayerSpec(residual_scale=hp.residual_scale)

    def model_spec(self, hp):
        return ModelSpec(embed_scale=hp.embed_scale, logit_scale=hp.logit_scale)


ARCH = Granite()
