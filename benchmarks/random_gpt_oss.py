"""The gpt-oss layout for benchmarks/make_random_model.py (--arch gpt-oss): tensors, metadata and
random valid MXFP4 / Q8_0 blocks, as llama.cpp's gpt-oss-20b GGUF holds them.

Why: the speed and memory of a gpt-oss-20b (issue 25: ~12 GB, MXFP4 experts, tg vs llama-bench,
peak RSS <= file + 200 MB) need a file of that shape, and no real one is on the machine. As
ggml-org's file: experts MXFP4 (ffn_{gate,up,down}_exps, [n_expert, n_ff, n_embd]), every other
matrix Q8_0 (attention, token embedding, output), router ffn_gate_inp F32, biases on q/k/v/o, the
router and the experts, one sink logit a head (attn_sinks), post_attention_norm before the FFN,
YaRN RoPE, sliding-window attention on every other layer. The values are not a quantization of
anything: MXFP4 codes are uniform, their exponent byte chosen so a weight is about --scale; Q8_0
quants uniform with d = scale / 73 (the std of a uniform int8 is ~73); norms 1, biases and sinks 0.

gpt-oss-20b's shape (and the vocabulary padded to its 201088 tokens with unused ones, so the
embedding and output are its size: --n-vocab):

    python benchmarks/make_random_model.py gpt-oss-20b-shaped.gguf --arch gpt-oss \\
        --tokenizer-from SmolLM2-135M-Instruct.Q4_1.gguf --n-vocab 201088 --n-embd 2880 --n-layer 24 \\
        --n-ff 2880 --n-head 64 --n-head-kv 8 --head-dim 64 --n-expert 32 --n-expert-used 4 \\
        --n-ctx 131072 --rope-base 150000 --name random-gpt-oss-20b
"""

from __future__ import annotations

import gguf
import numpy as np

QT = gguf.GGMLQuantizationType
MXFP4_BLOCK, Q8_0_BLOCK = 17, 34  # bytes per 32 values
SLIDING_WINDOW, YARN_FACTOR, YARN_ORIG_CTX = 128, 32.0, 4096  # gpt-oss-20b's config
FILE_TYPE_MXFP4_MOE = 38  # llama_ftype LLAMA_FTYPE_MOSTLY_MXFP4_MOE


def tensor_plan(a, n_vocab: int) -> list[tuple[str, tuple[int, ...], int]]:
    """(name, numpy shape, ggml type) in file order (numpy shape: GGUF's ne reversed)."""
    q, kv, e, f, d = a.n_head * a.head_dim, a.n_head_kv * a.head_dim, a.n_expert, a.n_ff, a.n_embd
    plan = [("token_embd.weight", (n_vocab, d), QT.Q8_0)]
    for i in range(a.n_layer):
        p = f"blk.{i}."
        plan += [
            (p + "attn_norm.weight", (d,), QT.F32),
            (p + "attn_q.weight", (q, d), QT.Q8_0),
            (p + "attn_q.bias", (q,), QT.F32),
            (p + "attn_k.weight", (kv, d), QT.Q8_0),
            (p + "attn_k.bias", (kv,), QT.F32),
            (p + "attn_v.weight", (kv, d), QT.Q8_0),
            (p + "attn_v.bias", (kv,), QT.F32),
            (p + "attn_output.weight", (d, q), QT.Q8_0),
            (p + "attn_output.bias", (d,), QT.F32),
            (p + "attn_sinks.weight", (a.n_head,), QT.F32),
            (p + "post_attention_norm.weight", (d,), QT.F32),
            (p + "ffn_gate_inp.weight", (e, d), QT.F32),
            (p + "ffn_gate_inp.bias", (e,), QT.F32),
            (p + "ffn_gate_exps.weight", (e, f, d), QT.MXFP4),
            (p + "ffn_gate_exps.bias", (e, f), QT.F32),
            (p + "ffn_up_exps.weight", (e, f, d), QT.MXFP4),
            (p + "ffn_up_exps.bias", (e, f), QT.F32),
            (p + "ffn_down_exps.weight", (e, d, f), QT.MXFP4),
            (p + "ffn_down_exps.bias", (e, d), QT.F32),
        ]
    return plan + [("output_norm.weight", (d,), QT.F32), ("output.weight", (n_vocab, d), QT.Q8_0)]


def add_metadata(w: "gguf.GGUFWriter", a, n_vocab: int) -> None:
    arch = "gpt-oss"
    w.add_name(a.name)
    w.add_block_count(a.n_layer)
    w.add_context_length(a.n_ctx)
    w.add_embedding_length(a.n_embd)
    w.add_feed_forward_length(a.n_ff)
    w.add_expert_feed_forward_length(a.n_ff)
    w.add_head_count(a.n_head)
    w.add_head_count_kv(a.n_head_kv)
    w.add_key_length(a.head_dim)
    w.add_value_length(a.head_dim)
    w.add_rope_dimension_count(a.head_dim)
    w.add_rope_freq_base(a.rope_base)
    w.add_layer_norm_rms_eps(a.rms_eps)
    w.add_vocab_size(n_vocab)
    w.add_expert_count(a.n_expert)
    w.add_expert_used_count(a.n_expert_used)
    w.add_uint32(f"{arch}.attention.sliding_window", SLIDING_WINDOW)
    w.add_string(f"{arch}.rope.scaling.type", "yarn")
    w.add_float32(f"{arch}.rope.scaling.factor", YARN_FACTOR)
    w.add_uint32(f"{arch}.rope.scaling.original_context_length", YARN_ORIG_CTX)
    w.add_file_type(FILE_TYPE_MXFP4_MOE)


def row_bytes(shape: tuple[int, ...], qtype) -> int:
    return shape[-1] // 32 * (MXFP4_BLOCK if qtype == QT.MXFP4 else Q8_0_BLOCK)


def make_blocks(shape: tuple[int, ...], qtype, index: int, seed: int, scale: float) -> np.ndarray:
    """Random well-formed MXFP4 or Q8_0 blocks u8 [..., cols / 32 * block bytes] (module docstring)."""
    rows, nb = int(np.prod(shape[:-1])), shape[-1] // 32
    rng = np.random.default_rng([seed, index])
    if qtype == QT.MXFP4:  # e8m0 exponent byte, 16 bytes of codes: |value| averages ~4.5 * 2^(e - 128)
        blocks = rng.integers(0, 256, size=(rows, nb, MXFP4_BLOCK), dtype=np.uint8)
        blocks[:, :, 0] = 128 + int(np.round(np.log2(scale / 4.5)))
    else:  # f16 d, 32 int8 quants
        blocks = rng.integers(-127, 128, size=(rows, nb, Q8_0_BLOCK), dtype=np.int8).view(np.uint8)
        blocks[:, :, 0:2] = np.frombuffer(np.float16(scale / 73.0).tobytes(), dtype=np.uint8)
    return blocks.reshape(*shape[:-1], nb * blocks.shape[-1])


def make_float(name: str, shape: tuple[int, ...], index: int, seed: int, scale: float) -> np.ndarray:
    """F32 tensors: norms 1, the router normal * scale, biases and sinks 0."""
    if name.endswith("norm.weight"):
        return np.ones(shape, np.float32)
    if name.endswith("ffn_gate_inp.weight"):
        return np.random.default_rng([seed, index]).standard_normal(shape, dtype=np.float32) * np.float32(scale)
    return np.zeros(shape, np.float32)


def write(w: "gguf.GGUFWriter", a, n_vocab: int, tok: list) -> None:
    """Header, tokenizer keys, tensor infos, then each tensor's data, one at a time."""
    add_metadata(w, a, n_vocab)
    for key, value, vtype, sub in tok:
        w.add_key_value(key, value, vtype, sub)
    plan = tensor_plan(a, n_vocab)
    for name, shape, qt in plan:
        if qt == QT.F32:
            w.add_tensor_info(name, shape, np.dtype(np.float32), int(np.prod(shape)) * 4)
        else:
            row = row_bytes(shape, qt)
            w.add_tensor_info(
                name, (*shape[:-1], row), np.dtype(np.uint8), int(np.prod(shape[:-1])) * row, raw_dtype=qt
            )
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for index, (name, shape, qt) in enumerate(plan):
        if qt == QT.F32:
            w.write_tensor_data(make_float(name, shape, index, a.seed, a.scale))
        else:
            w.write_tensor_data(make_blocks(shape, qt, index, a.seed, a.scale))
