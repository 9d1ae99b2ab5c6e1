"""Tiny models of odd attention shapes, one or two per architecture (#24): head sizes 8, 12, 24,
40, 72 and 80, GQA ratios 1, 3 and 5, n_embd that is not a power of two. Written by
tests/gguf_factory.py, seeded, so the same file comes out on every machine; llama.cpp's outputs on
them (tests/refgen/make_odd_shape_refs.py, kept in tests/data/odd_shape_refs.json) are compared
with kvchat's in tests/test_odd_head_sizes.py.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tests.conftest import REFERENCE_DIR
from tests.helpers.gguf_factory import write_tiny_model

# name -> (head size, n_head, n_head_kv, n_embd): every head size and GQA ratio of the issue
SHAPES = {
    "h8g5": (8, 5, 1, 40),
    "h12g3": (12, 6, 2, 72),
    "h24g1": (24, 3, 3, 72),
    "h40g3": (40, 3, 1, 120),
    "h72g5": (72, 5, 1, 360),
    "h80g1": (80, 2, 2, 160),
}

# architecture -> the shapes its tiny models take (all of them meet every head size and GQA ratio)
ARCH_SHAPES = {
    "llama": ("h8g5", "h12g3", "h24g1", "h40g3", "h72g5", "h80g1"),
    "qwen2": ("h12g3", "h72g5"),
    "qwen3": ("h8g5", "h40g3"),
    "gemma3": ("h24g1", "h72g5"),
    "gemma2": ("h12g3", "h80g1"),
    "granite": ("h8g5", "h24g1"),
    "smollm3": ("h12g3", "h40g3"),
    "phi3": ("h8g5", "h80g1"),
}

# The hybrids' attention layers at odd shapes: copies of the shared tiny lfm2 / qwen35 models
# (REFERENCE_DIR/tiny, SmolLM2's tokenizer) with other head counts, whose attention tensors are
# drawn anew (the rest is the template's). name -> (template, {key: value}, head size, n_head, n_head_kv)
HYBRIDS = {
    "lfm2_h8g1": ("lfm2_s1", {"lfm2.attention.head_count": 8, "lfm2.attention.head_count_kv": [0, 8, 0, 8]}, 8, 8, 8),
    "qwen35_h24g5": (
        "qwen35_s1",
        {
            "qwen35.attention.head_count": 5,
            "qwen35.attention.head_count_kv": 1,
            "qwen35.attention.key_length": 24,
            "qwen35.attention.value_length": 24,
        },
        24,
        5,
        1,
    ),
    "qwen35_h12g3": (
        "qwen35_s1",
        {
            "qwen35.attention.head_count": 6,
            "qwen35.attention.head_count_kv": 2,
            "qwen35.attention.key_length": 12,
            "qwen35.attention.value_length": 12,
        },
        12,
        6,
        2,
    ),
}

# the prompt: token ids of the factory's vocabularies (both have at least 259 tokens)
TOKENS = [int(t) for t in np.random.default_rng(24).integers(3, 259, size=24)]
N_GEN = 8


def model_name(arch: str, shape: str) -> str:
    return f"{arch}_{shape}"


def write_odd_model(directory, arch: str, shape: str) -> Path:
    """The tiny F32 model of `arch` at `shape` (SHAPES) in `directory`; its path."""
    head, n_head, n_head_kv, n_embd = SHAPES[shape]
    path = Path(directory) / f"{model_name(arch, shape)}.gguf"
    extra = {}
    if arch == "phi3":  # partial rotary; a general.name without "phi3" (llama.cpp's vocab quirk)
        assert n_head * head == n_embd, "llama.cpp's phi3 needs n_head * head size = n_embd"
        extra["metadata"] = {"general.name": "tiny-phi", "phi3.rope.dimension_count": head * 3 // 4 // 2 * 2}
        extra["optional_tensors"] = tuple(f"blk.{i}.attn_qkv.weight" for i in range(2))  # the fused QKV
    elif arch == "granite":
        extra["metadata"] = {
            "granite.embedding_scale": 6.0,
            "granite.residual_scale": 0.5,
            "granite.attention.scale": 0.2,
            "granite.logit_scale": 0.5,
        }
    elif arch == "gemma2":
        extra["metadata"] = {
            "gemma2.attention.sliding_window": 8,
            "gemma2.attn_logit_softcapping": 20.0,
            "gemma2.final_logit_softcapping": 15.0,
        }
    elif arch == "gemma3":
        extra["n_swa"] = 8
    return write_tiny_model(
        path,
        arch=arch,
        n_layer=2,
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=n_head_kv,
        n_ff=96,
        head_dim=head,
        seed=sum(map(ord, model_name(arch, shape))),
        **extra,
    )


def _attention_shapes(template: str, name: str, n_embd: int, head: int, n_head: int, n_head_kv: int):
    """The new ggml shape of an attention tensor of the template (None: keep the template's)."""
    q_rows = 2 * n_head * head if template.startswith("qwen35") else n_head * head  # qwen35: query + gate
    for suffix, shape in (
        ("attn_q.weight", (n_embd, q_rows)),
        ("attn_k.weight", (n_embd, n_head_kv * head)),
        ("attn_v.weight", (n_embd, n_head_kv * head)),
        ("attn_output.weight", (n_head * head, n_embd)),
        ("attn_q_norm.weight", (head,)),
        ("attn_k_norm.weight", (head,)),
    ):
        if name.endswith(suffix):
            return shape
    return None


def write_hybrid_model(directory, name: str) -> Path:
    """HYBRIDS[name] written into `directory` (seeded: the same bytes every time); its path."""
    import gguf

    template, keys, head, n_head, n_head_kv = HYBRIDS[name]
    src = gguf.GGUFReader(REFERENCE_DIR / "tiny" / f"{template}.gguf")
    arch = src.fields["general.architecture"].contents()
    path = Path(directory) / f"{name}.gguf"
    w = gguf.GGUFWriter(str(path), arch)
    for f in src.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture":
            continue
        value = keys.get(f.name, f.contents())
        w.add_key_value(f.name, value, f.types[0], f.types[1] if len(f.types) > 1 else None)
    n_embd = int(src.fields[f"{arch}.embedding_length"].contents())
    rng = np.random.default_rng(sum(map(ord, name)))
    for t in src.tensors:
        x = np.asarray(t.data, dtype=np.float32)  # F32 template: [rows, cols]
        shape = _attention_shapes(template, t.name, n_embd, head, n_head, n_head_kv)
        if shape is not None:
            std = float(x.std())
            base = float(x.mean()) if len(shape) == 1 else 0.0
            x = (base + std * rng.standard_normal(shape[::-1])).astype(np.float32)
        w.add_tensor(t.name, np.ascontiguousarray(x))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def model_names() -> list[str]:
    """Every odd-shape model: the factory's per architecture, then the hybrids."""
    return [model_name(a, s) for a, shapes in ARCH_SHAPES.items() for s in shapes] + list(HYBRIDS)


def write_model(directory, name: str) -> Path:
    """The odd-shape model `name` (model_names()) written into `directory`."""
    if name in HYBRIDS:
        return write_hybrid_model(directory, name)
    arch, shape = name.rsplit("_", 1)
    return write_odd_model(directory, arch, shape)
