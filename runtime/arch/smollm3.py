"""smollm3 (src/models/smollm3.cpp): the llama block, except that every fourth layer
((il + 1) % 4 == 0) applies no RoPE to Q and K (NoPE). The step 4 is fixed in llama.cpp
(n_no_rope_layer_step; no GGUF key, HF's no_rope_layers list is not consulted).

A NoPE layer's cached keys carry no position, so the K-shift leaves them alone
(HParams.has_rope); llama.cpp's K-shift rotates them too.
"""

from kvchat.runtime.arch.base import Arch

NO_ROPE_LAYER_STEP = 4


class SmolLM3(Arch):
    name = "smollm3"
    rope_type = "norm"
    full_rotary = True

    def read_hparams(self, gf, fields):
        fields["rope_layers"] = [(il + 1) % NO_ROPE_LAYER_STEP != 0 for il in range(fields["n_layer"])]
        return super().read_hparams(gf, fields)


ARCH = SmolLM3()
