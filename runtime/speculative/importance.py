"""How much each input column of a layer matrix matters, measured on a calibration text: the mean
square of the activations the matrix multiplies (llama.cpp's imatrix, computed at load).

A self-draft (self_quant.py) rounds its q4_0 copy to the least error weighted by these
(kernels/quants_weighted.py): columns that carry large activations keep their precision. On
SmolLM2's F16 copy the draft then agrees with its target on 0.83 of a story's greedy tokens
instead of 0.755 (docs/performance.md). The text is written for this (English prose, a
dialogue, code, numbers and lists), so the weights do not depend on a conversation and the copy
made at load serves every prompt; decoding it once costs a short prompt's prefill.
"""

from __future__ import annotations

import numpy as np

from kvchat.kernels.matmul import QMatrix

CALIBRATION_TEXT = """\
The harbour town woke slowly. Fishing boats came back before dawn, their decks wet and silver with
the night's catch, and the market opened as soon as the first crates touched the stones. Maria had
run the bakery on the corner for twenty-three years; she knew every captain by the bread he bought.

"Two loaves, and one of the sweet ones," said the old man at the counter. "My granddaughter is
visiting. She says the city has nothing like it."
"Then she should stay longer," Maria answered, wrapping the loaves in paper. "How long is she here?"
"Until Sunday. Then back to her studies: chemistry, third year."

User: Can you explain what a hash table is, in simple terms?
Assistant: A hash table stores values under keys. A hash function turns each key into a number that
picks a bucket, so looking a key up takes about the same time however many items are stored. When
two keys land in the same bucket (a collision), the table keeps both, for example in a short list.

def merge_sorted(a, b):
    \"\"\"Merge two sorted lists into one sorted list.\"\"\"
    i, j, out = 0, 0, []
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            out.append(a[i]); i += 1
        else:
            out.append(b[j]); j += 1
    return out + a[i:] + b[j:]

for (int k = 0; k < n; ++k) { total += weights[k] * values[k]; }

Shopping list for the week:
1. Rice, 2 kg
2. Tomatoes, onions and garlic
3. Olive oil (the 750 ml bottle)
4. Coffee beans, 500 g

In 1969 the first crewed landing on the Moon took place; the mission lasted eight days, three hours
and eighteen minutes. Today, a quarter of the world's electricity comes from renewable sources, and
the share grows by about 1.5 percentage points a year. The meeting is moved to Tuesday at 14:30.
Please bring the report, the budget for 2025 and any questions you have about the new schedule.
"""


def _inputs_by_tensor(model) -> dict:
    """tensor name -> the target's matrix that multiplies the same input (itself, or the fused
    matrix it is part of, e.g. attn_q -> the fused Q|K|V), for every layer's 2-D matrix."""
    schema = model.arch.tensors(model.hparams)
    out = {}
    for spec, layer in zip(schema.layers, model.weights.layers):
        for attr, tensor in spec.items():
            m = getattr(layer, attr, None)
            if m is None:  # fused: the fusion holding attr was loaded instead
                for f in model.arch.fusions:
                    if attr in f.parts and getattr(layer, f.into, None) is not None:
                        m = getattr(layer, f.into)
                        break
            if isinstance(m, QMatrix) and len(tensor.shape) == 2:
                out[tensor.name] = m
    return out


def activation_importance(model, text: str = CALIBRATION_TEXT) -> dict:
    """tensor name -> f32 [k]: the mean over the text's tokens of the square of each input column
    of that layer matrix in a forward of `model` (its own temporary Context)."""
    from kvchat.runtime.context import Context
    from kvchat.runtime.cparams import ContextParams
    from kvchat.runtime.generate import decode_tokens

    by_tensor = _inputs_by_tensor(model)
    sums: dict = {}  # id(matrix) -> [f64 [k] sum of squares, rows]

    def observe(m, matmul):
        def observed(x, min_macs=None):
            rows = np.asarray(x, dtype=np.float32).reshape(-1, x.shape[-1])  # [n, k]
            s = sums.setdefault(id(m), [np.zeros(rows.shape[1]), 0])
            s[0] += np.einsum("ij,ij->j", rows, rows, dtype=np.float64)
            s[1] += rows.shape[0]
            return matmul(x, min_macs)

        return observed

    matrices = {id(m): m for m in by_tensor.values()}
    for m in matrices.values():
        m.matmul = observe(m, m.matmul)  # an instance attribute over the class's method
    try:
        ids = list(model.vocab.tokenize(text, add_special=False))
        ctx = Context(model, ContextParams(n_ctx=len(ids) + 16, n_seq_max=1))
        decode_tokens(ctx, ids, 0, logits="none")
    finally:
        for m in matrices.values():
            del m.matmul
    out = {}
    for name, m in by_tensor.items():
        s = sums.get(id(m))
        if s is not None and s[1]:
            out[name] = (s[0] / s[1]).astype(np.float32)
    return out
