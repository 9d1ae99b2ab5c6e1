"""Hyper-parameters read from GGUF metadata (llama.cpp's llama_hparams), for any architecture.

`read_common(gf, arch)` reads and sanity-checks the keys every decoder has; the file's
architecture adds its own keys and checks on top (runtime/arch/<name>.py: `read_hparams`, an
`HParams` subclass for its extras) and checks each weight's shape against its tensor schema:
`kvchat.runtime.arch.read_hparams(gf)` does the whole, as `arch.read_hparams(gf, read_common(gf,
arch))`. This module is a leaf: it knows no architecture and imports none. Defaults follow
llama.cpp's loader: n_head_kv = n_head, head sizes = n_embd / n_head unless key_length /
value_length say otherwise, n_rot = head size, rope base 10000, no sliding window.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from kvchat.kernels.ggml_types import type_name
from kvchat.runtime.gguf.file import GGUFFile, GGUFValueType

ROPE_SCALING_TYPES = ("none", "linear")  # an arch accepts "yarn" (gpt-oss) in its rope_scaling_types
MAX_LAYERS = 512  # llama.cpp's LLAMA_MAX_LAYERS
MAX_DIM = 1 << 20  # sanity cap on widths and head counts


@dataclass
class HParams:
    """Hyper-parameters of one model: the fields every decoder has. An architecture with keys
    of its own declares a subclass with those extras (runtime/arch/<name>.py). Per-layer values
    are uniform except the sliding-window flag (`swa_layers[il]`); a subclass may override the
    per-layer methods."""

    arch: str
    n_vocab: int
    n_ctx_train: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    n_embd_head_k: int
    n_embd_head_v: int
    n_ff: int
    norm_eps: float
    rope_type: str  # "norm" | "neox"
    n_rot: int
    rope_freq_base: float
    rope_freq_scale: float
    rope_freq_base_swa: float
    n_swa: int  # sliding window size; 0 = no sliding-window layers
    swa_layers: list[bool]
    use_qk_norm: bool
    tied_output: bool  # no output.weight: logits reuse token_embd.weight
    attn_logit_softcap: float = 0.0
    kq_scale: float = 0.0  # attention scale; 0 = 1/sqrt(n_embd_head_k) (set in __post_init__)
    rope_freq_scale_swa: float = 1.0
    rope_scaling_type: str = "linear"
    n_ctx_orig: int = 0  # rope.scaling.original_context_length (default n_ctx_train)
    swa_pattern: int = 0  # n of "every n-th layer is global" when given that way (0 = none)
    rope_layers: list[bool] | None = None  # per layer: applies RoPE (None = every layer)
    rope_freq_factors: np.ndarray | None = None  # f32 [n_rot/2] divisors for every layer (rope_freqs)
    rope_factors_long: np.ndarray | None = None  # LongRoPE: used when n_ctx_seq > n_ctx_orig
    rope_factors_short: np.ndarray | None = None
    rope_attn_factor: float = 1.0  # multiplies RoPE's cos and sin (rope.scaling.attn_factor)

    def __post_init__(self) -> None:
        # hand-built HParams (tests, stubs) get the same defaults as the loader
        if not self.kq_scale:
            self.kq_scale = 1.0 / math.sqrt(self.n_embd_head_k)
        if not self.n_ctx_orig:
            self.n_ctx_orig = self.n_ctx_train

    # ------------------------------------------------------------------ per layer
    def is_swa(self, il: int) -> bool:
        return self.swa_layers[il]

    def n_embd_k_gqa(self, il: int = 0) -> int:
        """Width of one token's K row in layer il (all kv heads)."""
        return self.n_embd_head_k * self.n_head_kv

    def n_embd_v_gqa(self, il: int = 0) -> int:
        return self.n_embd_head_v * self.n_head_kv

    def has_kv(self, il: int) -> bool:
        """Whether layer il stores its own K/V (no layer shares a cache in these archs)."""
        return 0 <= il < self.n_layer

    def rope_base(self, il: int) -> float:
        """RoPE frequency base of layer il (sliding layers may have their own, rope.freq_base_swa)."""
        return self.rope_freq_base_swa if self.is_swa(il) else self.rope_freq_base

    def rope_scale(self, il: int) -> float:
        return self.rope_freq_scale_swa if self.is_swa(il) else self.rope_freq_scale

    def has_rope(self, il: int) -> bool:
        """Whether layer il rotates Q and K (NoPE layers do not; nor does the K-shift touch them)."""
        return self.rope_layers is None or bool(self.rope_layers[il])

    def rope_factors(self, il: int, n_ctx_seq: int) -> np.ndarray | None:
        """Per-pair frequency divisors of layer il for a context of n_ctx_seq cells per sequence
        (llama_model::get_rope_factors): rope_freqs if the model has them, else LongRoPE's long
        set when n_ctx_seq > n_ctx_orig and the short one otherwise; None = no factors."""
        if self.rope_freq_factors is not None:
            return self.rope_freq_factors
        if n_ctx_seq > self.n_ctx_orig:
            return self.rope_factors_long
        return self.rope_factors_short

    def rope_args(self, il: int, n_ctx_seq: int) -> dict:
        """Keyword arguments of kvchat.kernels.rope for layer il: n_rot (0 for a NoPE layer), freq_base,
        freq_scale, freq_factors, attn_factor. With YaRN (rope.scaling.type "yarn", ext_factor 1 as
        llama.cpp sets it) the factors carry each pair's ramp mix and attn_factor YaRN's magnitude
        (kernels/rope.py: yarn_factors, yarn_mscale)."""
        if self.rope_scaling_type == "yarn" and self.has_rope(il):
            from kvchat.kernels.rope import yarn_factors, yarn_mscale

            return dict(
                n_rot=self.n_rot,
                freq_base=self.rope_base(il),
                freq_scale=self.rope_scale(il),
                freq_factors=yarn_factors(
                    self.n_rot, self.rope_base(il), self.n_ctx_orig, self.rope_factors(il, n_ctx_seq)
                ),
                attn_factor=yarn_mscale(self.rope_freq_scale, self.rope_attn_factor),
            )
        return dict(
            n_rot=self.n_rot if self.has_rope(il) else 0,
            freq_base=self.rope_base(il),
            freq_scale=self.rope_scale(il),
            freq_factors=self.rope_factors(il, n_ctx_seq),
            attn_factor=self.rope_attn_factor,
        )

    @property
    def can_shift(self) -> bool:
        """K can be re-roped in place (context shift): true for every rope arch we support."""
        return self.rope_type in ("norm", "neox")

    @property
    def n_swa_layers(self) -> int:
        return sum(self.swa_layers)

    @property
    def n_gqa(self) -> int:
        return self.n_head // self.n_head_kv


def read_common(gf: GGUFFile, arch, given: dict | None = None) -> dict:
    """The HParams fields every architecture has, read from `<arch>.*` keys and validated.
    `arch` supplies rope_type, qk_norm and whether RoPE must span the whole head. `given`
    (n_ff, n_head, n_head_kv) replaces keys an architecture reads its own way (a recurrent
    model has no attention heads or FFN; LFM2 lists kv heads per layer)."""
    k = lambda name: f"{arch.name}.{name}"  # noqa: E731
    given = given or {}

    n_layer = scalar_int(gf, k("block_count"), 1, MAX_LAYERS)
    n_embd = scalar_int(gf, k("embedding_length"), 1, MAX_DIM)
    n_ff = given["n_ff"] if "n_ff" in given else scalar_int(gf, k("feed_forward_length"), 1, MAX_DIM)
    n_ctx_train = gf.get_int(k("context_length"), min_value=1)
    n_head = given["n_head"] if "n_head" in given else scalar_int(gf, k("attention.head_count"), 1, MAX_DIM)
    n_head_kv = (
        given["n_head_kv"]
        if "n_head_kv" in given
        else scalar_int(gf, k("attention.head_count_kv"), 1, MAX_DIM, default=n_head)
    )
    if n_head % n_head_kv:
        gf.fail(k("attention.head_count_kv"), f"head_count {n_head} is not a multiple of head_count_kv {n_head_kv}")
    if k("attention.key_length") not in gf.metadata or k("attention.value_length") not in gf.metadata:
        if n_embd % n_head:
            gf.fail(
                k("attention.head_count"),
                f"embedding_length {n_embd} is not divisible by head_count {n_head} "
                f"(and no key_length/value_length given)",
            )
    head_k = scalar_int(gf, k("attention.key_length"), 1, MAX_DIM, default=n_embd // n_head)
    head_v = scalar_int(gf, k("attention.value_length"), 1, MAX_DIM, default=n_embd // n_head)
    n_rot = scalar_int(gf, k("rope.dimension_count"), 1, MAX_DIM, default=head_k)
    if arch.full_rotary and n_rot != head_k:
        gf.fail(k("rope.dimension_count"), f"{n_rot} must equal the head size {head_k} for {arch.name}")
    if n_rot > head_k or n_rot % 2:
        gf.fail(k("rope.dimension_count"), f"{n_rot} must be even and at most the head size {head_k}")

    norm_eps = gf.get_float(k("attention.layer_norm_rms_epsilon"))
    if not 0.0 < norm_eps < 1.0:
        gf.fail(k("attention.layer_norm_rms_epsilon"), f"{norm_eps} is not in (0, 1)")

    rope_base = positive(gf, k("rope.freq_base"), 10000.0)
    scaling = gf.get_str(k("rope.scaling.type"), "linear")
    known = ROPE_SCALING_TYPES + tuple(arch.rope_scaling_types)
    if scaling not in known:
        gf.fail(k("rope.scaling.type"), f"rope scaling '{scaling}' is not supported; supported: {', '.join(known)}")
    factor = gf.get_float(k("rope.scaling.factor"), None)
    if factor is None:
        factor = gf.get_float(k("rope.scale_linear"), 0.0)
    if factor < 0:
        gf.fail(k("rope.scaling.factor"), f"{factor} is negative")
    rope_scale = 1.0 if factor == 0.0 else 1.0 / factor
    n_ctx_orig = gf.get_int(k("rope.scaling.original_context_length"), n_ctx_train, min_value=1)
    attn_factor = positive(gf, k("rope.scaling.attn_factor"), 1.0)

    return dict(
        arch=arch.name,
        n_vocab=_vocab_size(gf, arch.name),
        n_ctx_train=n_ctx_train,
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
        n_head_kv=n_head_kv,
        n_embd_head_k=head_k,
        n_embd_head_v=head_v,
        n_ff=n_ff,
        norm_eps=norm_eps,
        rope_type=arch.rope_type,
        n_rot=n_rot,
        rope_freq_base=rope_base,
        rope_freq_scale=rope_scale,
        rope_freq_base_swa=rope_base,
        n_swa=0,
        swa_layers=[False] * n_layer,
        use_qk_norm=arch.qk_norm,
        tied_output="output.weight" not in gf.tensors,
        kq_scale=1.0 / math.sqrt(head_k),
        rope_scaling_type=scaling,
        n_ctx_orig=n_ctx_orig,
        rope_attn_factor=attn_factor,
    )


def rope_factor_tensor(gf: GGUFFile, name: str, n_rot: int) -> np.ndarray | None:
    """A RoPE frequency-factor tensor (rope_freqs / rope_factors_long / _short: f32 [n_rot/2],
    positive) as a private array; None if the file has none."""
    ti = gf.tensors.get(name)
    if ti is None:
        return None
    if tuple(ti.shape) != (n_rot // 2,) or int(ti.ggml_type) != 0:
        gf.fail(
            f"tensor {name}", f"must be F32 of shape [{n_rot // 2}], got {type_name(ti.ggml_type)} {list(ti.shape)}"
        )
    ff = np.ascontiguousarray(ti.data).reshape(-1).view(np.float32).copy()
    if not np.all(np.isfinite(ff)) or np.any(ff <= 0):
        gf.fail(f"tensor {name}", "frequency factors must be finite and positive")
    return ff


# ---------------------------------------------------------------------- key helpers
def scalar_int(gf: GGUFFile, key: str, lo: int, hi: int, default=...) -> int:
    """An integer key; a per-layer array is accepted only if all its entries are equal."""
    if key in gf.metadata and gf.value_types[key][0] == GGUFValueType.ARRAY:
        arr = gf.metadata[key]
        if not isinstance(arr, np.ndarray) or arr.dtype.kind not in "iu" or arr.size == 0:
            gf.fail(key, "must be an integer or an array of integers")
        if np.any(arr != arr[0]):
            gf.fail(key, "per-layer values that differ are not supported")
        v = int(arr[0])
    else:
        v = gf.get_int(key, default)
    if not lo <= v <= hi:
        gf.fail(key, f"{v} is not in [{lo}, {hi}]")
    return v


def positive(gf: GGUFFile, key: str, default: float) -> float:
    v = gf.get_float(key, default)
    if v <= 0:
        gf.fail(key, f"{v} must be positive")
    return v


def _vocab_size(gf: GGUFFile, arch: str) -> int:
    tokens = gf.get("tokenizer.ggml.tokens")
    if tokens is None:
        gf.fail("tokenizer.ggml.tokens", "missing (required: the model has no vocabulary)")
    n = len(tokens)
    declared = gf.get_int(f"{arch}.vocab_size", n, min_value=1)
    if declared != n:
        gf.fail(f"{arch}.vocab_size", f"{declared} differs from the {n} entries of tokenizer.ggml.tokens")
    return n


def swa_layers(gf: GGUFFile, key: str, n_layer: int, default_pattern: int) -> tuple[list[bool], int]:
    """Sliding-window flags per layer (llama_hparams::set_swa_pattern): an explicit bool array
    at `key`, or `n` (key, else default_pattern) meaning layers il % n < n - 1 slide and every
    n-th is global (n = 0: every layer slides). Returns (flags, n; 0 for an explicit array)."""
    if key in gf.metadata and gf.value_types[key] == (GGUFValueType.ARRAY, GGUFValueType.BOOL):
        arr = gf.metadata[key]
        if len(arr) != n_layer:
            gf.fail(key, f"has {len(arr)} entries for {n_layer} layers")
        return [bool(x) for x in arr], 0
    n = gf.get_int(key, default_pattern, min_value=0)
    return [n == 0 or il % n < n - 1 for il in range(n_layer)], n
