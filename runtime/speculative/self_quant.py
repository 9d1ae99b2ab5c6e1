"""The model drafting for itself: `--spec-type self:q4_0` makes a quantized copy of the target's
weights at load (no second file) and drafts with it.

Generation reads every weight once per token, so a 4-bit copy of a Q8_0 / F16 / BF16 / F32 model
reads 1.9-7x fewer bytes per token, and it agrees with its target far more often than a smaller
model of the family would. The copy is made from the file's rows through the same schema and
fusions as the target (runtime/model.py's load_group on a view of the file whose matrices are
requantized, a slice of rows at a time, so a whole matrix is never held in f32); vectors (norms,
biases) and the token embedding (only looked up) are shared with the target, and the lm head is
a DraftHead (draft_head.py): q8_0 rows of the frequent and the conversation's tokens.
"""

from __future__ import annotations

import numpy as np

from kvchat.kernels.ggml_types import GGMLType, row_bytes
from kvchat.kernels.quants import dequantize, quantize
from kvchat.kernels.quants_weighted import quantize_q4_0_weighted
from kvchat.runtime.errors import KvchatError
from kvchat.runtime.speculative.draft_head import DraftHead, FileRows
from kvchat.runtime.speculative.importance import activation_importance
from kvchat.runtime.weights.cache import open_store

DRAFT_TYPES = {
    "q4_0": GGMLType.Q4_0,
    "q4_1": GGMLType.Q4_1,
    "iq4_nl": GGMLType.IQ4_NL,
    "q5_0": GGMLType.Q5_0,
    "q5_1": GGMLType.Q5_1,
    "q8_0": GGMLType.Q8_0,
}
_BITS = {GGMLType.Q4_0: 4.5, GGMLType.Q4_1: 5.0, GGMLType.IQ4_NL: 4.5, GGMLType.Q5_0: 5.5, GGMLType.Q5_1: 6.0}
_BITS[GGMLType.Q8_0] = 8.5
SOURCE_BITS = {GGMLType.F32: 32.0, GGMLType.F16: 16.0, GGMLType.BF16: 16.0, GGMLType.Q8_0: 8.5}
# what a copy's rows depend on besides the file and the packing code (the weight cache's key)
_COPY_MODULES = (
    "kvchat.runtime.speculative.self_quant",
    "kvchat.runtime.speculative.importance",
    "kvchat.kernels.quants_weighted",
    "kvchat.kernels.quants_legacy",
)
ROWS_PER_SLICE = 4096  # rows dequantized at a time (a 262144 x 640 head would be 640 MiB in f32)


class _Matrix:
    """A 2-D tensor of the file seen as requantized to type t (rows made on first read: a load
    whose weight cache holds the copy's packing never makes them); a q4_0 copy is rounded to the
    error weighted by its input importances (kernels/quants_weighted.py), from importance(name)."""

    made_on_read = True  # runtime/model.py: a cache hit does not read .data

    def __init__(self, info, t: GGMLType, importance):
        self.name, self.shape, self.ggml_type = info.name, info.shape, t
        self._src = info
        self._importance = importance  # name -> f32 [k] or None, computed on first use
        self._data = None

    @property
    def data(self) -> np.ndarray:
        if self._data is None:
            src, k = self._src, int(self._src.shape[0])
            m = int(src.data.shape[0])
            imp = self._importance(self.name) if self.ggml_type == GGMLType.Q4_0 else None
            out = np.empty((m, row_bytes(int(self.ggml_type), k)), np.uint8)  # [m, row_bytes]
            for r in range(0, m, ROWS_PER_SLICE):
                x = dequantize(src.data[r : r + ROWS_PER_SLICE], int(src.ggml_type), k)  # [rows, k] f32
                if imp is not None:
                    out[r : r + x.shape[0]] = quantize_q4_0_weighted(x, imp)
                else:
                    out[r : r + x.shape[0]] = quantize(x, int(self.ggml_type))
            out.flags.writeable = False
            self._data = out
        return self._data


class _RequantizedFile:
    """What load_group reads of a GGUFFile (tensors, fail), with the heavy matrices requantized."""

    def __init__(self, gf, t: GGMLType, importance):
        self._gf = gf
        self.path = gf.path
        self.tensors = {}
        for name, info in gf.tensors.items():
            heavy = (
                len(info.shape) == 2 and info.ggml_type in SOURCE_BITS and int(info.shape[0]) % 32 == 0
            )  # q4_0 .. q8_0 blocks hold 32 values
            self.tensors[name] = _Matrix(info, t, importance) if heavy else info

    def fail(self, field: str, problem: str):
        self._gf.fail(field, problem)


def parse_self_type(text: str) -> GGMLType:
    """'q4_0' (of self:q4_0) -> its GGMLType; KvchatError naming the choices otherwise."""
    t = DRAFT_TYPES.get(text.strip().lower())
    if t is None:
        raise KvchatError(f"--spec-type self:{text}: unknown draft type; use one of {', '.join(DRAFT_TYPES)}")
    return t


def quantized_copy(model, type_name: str):
    """A Model on the same file, hyper-parameters, vocabulary and arch as `model`, its matrices
    requantized to type_name. KvchatError (one line) when the target is not heavier than it."""
    from kvchat.runtime.model import Layer, Model, Weights, load_group

    t = parse_self_type(type_name)
    gf = model.gguf
    by_bits: dict[float, int] = {}
    for info in gf.tensors.values():
        if len(info.shape) == 2:
            bits = SOURCE_BITS.get(info.ggml_type, 0.0)
            by_bits[bits] = by_bits.get(bits, 0) + info.nbytes
    heavy = sum(n for b, n in by_bits.items() if b > _BITS[t])
    if heavy < 0.5 * sum(by_bits.values()):
        raise KvchatError(
            f"--spec-type self:{type_name}: the model is {model.ftype_name}, a {type_name} copy of it reads "
            "about as many bytes per token; self-drafting needs a Q8_0, F16, BF16 or F32 model (or use -md / ngram)"
        )
    measured: dict = {}

    def importance(name: str):
        """q4_0 rounds to an activation-weighted error (importance.py): measured on a calibration
        text once, when the first matrix is made (never when the weight cache holds them all)."""
        if not measured:
            measured["by_name"] = activation_importance(model)
        return measured["by_name"].get(name)

    view = _RequantizedFile(gf, t, importance)
    packs = open_store(gf, variant=f"self:{GGMLType(t).name.lower()}", code=_COPY_MODULES)
    schema = model.arch.tensors(model.hparams)
    specs = dict(schema.model)
    tw = model.weights
    # the embedding is only looked up: the target's rows serve; the head is a DraftHead (q8_0 rows
    # of the first ids and of the conversation's tokens, draft_head.py) on the file's output matrix
    specs.pop("tok_embd", None)
    specs.pop("output", None)
    head = gf.tensors.get("output.weight") or gf.tensors["token_embd.weight"]
    w = Weights(
        **load_group(view, specs, packs=packs),
        layers=[Layer(**load_group(view, s, model.arch.fusions, packs)) for s in schema.layers],
    )
    if packs is not None:
        packs.save()
    w.tok_embd = tw.tok_embd
    w.output = DraftHead(FileRows(head), int(head.data.shape[0]), int(head.shape[0]))
    # nothing is looked up among the requantized matrices: they keep packed rows only. Matrices
    # left as they are (a recurrent layer's conv kernel and A, read as dense rows by
    # recurrent_blocks.dense) keep their rows, which are the file's (mapped, not copied).
    requantized = {id(m._data) for m in view.tensors.values() if isinstance(m, _Matrix) and m._data is not None}
    loaded = [v for layer in w.layers for v in vars(layer).values()]
    for v in loaded:
        raw = getattr(v, "raw", None)
        if raw is not None and hasattr(v, "matmul") and (id(raw) in requantized or id(raw.base) in requantized):
            v.raw = None
    return Model(gf, model.hparams, model.vocab, w, model.arch)
