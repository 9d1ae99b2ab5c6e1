"""Write a llama-architecture F16 GGUF of any shape with seeded random weights, one tensor at a time.

(--n-expert: an olmoe mixture of experts; --arch gpt-oss: a gpt-oss with MXFP4 experts and Q8_0
matrices, benchmarks/random_gpt_oss.py.)

Why: memory and speed claims for a large model (issue 11: "a 7B Q4 model must fit where llama.cpp
fits") need a file of that shape, and no real 7B file is on the machine. Weights are random
(normal * --scale, norms 1.0) so activations stay finite; the tokenizer (every tokenizer.* key)
is copied from a real GGUF so prompts tokenize as with that model. Tensors are generated and
written one by one, so peak memory is about one tensor's float32 draw plus its F16 copy (~1.2 GB for a
49152 x 4096 embedding), not the model. Quantize the result with llama.cpp's `llama-quantize F16FILE OUT Q4_K_M`,
or write K-quants directly with `--ftype q4_k_m` (random valid Q4_K / Q6_K blocks, Q6_K where
llama-quantize's Q4_K_M puts it: output, and attn_v / ffn_down in its "more bits" layers): the
values are not a quantization of anything, but every block is well-formed and dequantizes to
finite values of about --scale, which is all a speed measurement needs (#24).

    python benchmarks/make_random_model.py OUT.gguf --tokenizer-from SmolLM2-135M-Instruct.Q4_1.gguf \\
        --n-embd 4096 --n-layer 32 --n-ff 11008 --n-head 32 --n-head-kv 32   # Llama-2-7B's shape

With --n-expert N the file is a mixture of experts of OLMoE's architecture ("olmoe": Q and K
RMS-normalized over the whole projection, neox RoPE, own output, every layer's FFN a router
`ffn_gate_inp` (F32, as llama-quantize leaves it) and stacked experts `ffn_{gate,up,down}_exps`
--n-ff wide, --n-expert-used of them per token); with --ftype q4_k_m the experts are random Q4_K
blocks (ffn_down_exps Q6_K in llama-quantize's "more bits" layers) written directly (#25):

    python benchmarks/make_random_model.py olmoe-shaped.gguf --tokenizer-from SmolLM2-135M-Instruct.Q4_1.gguf \\
        --n-embd 2048 --n-layer 16 --n-ff 1024 --n-head 16 --n-head-kv 16 --n-expert 64 --n-expert-used 8 \\
        --ftype q4_k_m --name random-olmoe-1b-7b   # OLMoE-1B-7B's shape
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import gguf
import numpy as np

VT = gguf.GGUFValueType


def tokenizer_fields(src: Path) -> list[tuple[str, object, VT, VT | None]]:
    """(key, value, type, array item type) of every tokenizer.* key in `src`."""
    reader = gguf.GGUFReader(src)
    out = []
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            sub = field.types[1] if field.types[0] == VT.ARRAY else None
            out.append((key, field.contents(), field.types[0], sub))
    return out


def pad_vocab(tok: list, n_vocab: int) -> list:
    """The tokenizer keys with tokens.ggml.tokens (and token_type, scores) padded to n_vocab with
    unused tokens ("<|unused_i|>", type 5: never matched as text), so that the embedding and the
    output have a larger model's vocabulary (gpt-oss: 201088)."""
    n = next(len(v) for k, v, _, _ in tok if k == "tokenizer.ggml.tokens")
    extra = max(0, n_vocab - n)
    pads = {
        "tokenizer.ggml.tokens": [f"<|unused_{i}|>" for i in range(extra)],
        "tokenizer.ggml.token_type": [5] * extra,
        "tokenizer.ggml.scores": [0.0] * extra,
    }
    return [(k, list(v) + pads[k] if k in pads else v, vt, sub) for k, v, vt, sub in tok]


def tensor_plan(a: argparse.Namespace, n_vocab: int) -> list[tuple[str, tuple[int, ...]]]:
    """(name, numpy shape) in file order; numpy shape is GGUF's ne reversed (rows, cols)."""
    head = a.n_embd // a.n_head
    kv = a.n_head_kv * head
    plan = [("token_embd.weight", (n_vocab, a.n_embd))]
    for i in range(a.n_layer):
        p = f"blk.{i}."
        plan += [
            (p + "attn_norm.weight", (a.n_embd,)),
            (p + "attn_q.weight", (a.n_embd, a.n_embd)),
            (p + "attn_k.weight", (kv, a.n_embd)),
            (p + "attn_v.weight", (kv, a.n_embd)),
            (p + "attn_output.weight", (a.n_embd, a.n_embd)),
            (p + "ffn_norm.weight", (a.n_embd,)),
            (p + "ffn_gate.weight", (a.n_ff, a.n_embd)),
            (p + "ffn_up.weight", (a.n_ff, a.n_embd)),
            (p + "ffn_down.weight", (a.n_embd, a.n_ff)),
        ]
    plan += [("output_norm.weight", (a.n_embd,)), ("output.weight", (n_vocab, a.n_embd))]
    if a.n_expert:  # olmoe: full-projection Q/K norms and stacked experts in place of the dense FFN
        moe = []
        for name, shape in plan:
            if name.endswith(("ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")):
                if name.endswith("ffn_gate.weight"):
                    p = name[: -len("ffn_gate.weight")]
                    moe.append((p + "ffn_gate_inp.weight", (a.n_expert, a.n_embd)))
                moe.append((name.replace(".weight", "_exps.weight"), (a.n_expert, *shape)))
                continue
            moe.append((name, shape))
            if name.endswith("attn_output.weight"):
                p = name[: -len("attn_output.weight")]
                moe += [(p + "attn_q_norm.weight", (a.n_embd,)), (p + "attn_k_norm.weight", (kv,))]
        plan = moe
    return plan


def make_tensor(shape: tuple[int, ...], index: int, seed: int, scale: float, dtype=np.float16) -> np.ndarray:
    """Norm weights (1-D) are 1.0 in F32; matrices are normal * scale in F16 (the router: F32), seeded per tensor."""
    if len(shape) == 1:
        return np.ones(shape, dtype=np.float32)
    rng = np.random.default_rng([seed, index])
    draw = rng.standard_normal(shape, dtype=np.float32)
    draw *= np.float32(scale)
    return draw.astype(dtype)


QK = gguf.GGMLQuantizationType
K_BLOCK = {QK.Q4_K: 144, QK.Q6_K: 210}  # bytes per 256 values


def _more_bits(i: int, n: int) -> bool:
    """llama-quantize's use_more_bits: the layers whose attn_v / ffn_down Q4_K_M keeps in Q6_K."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def q4_k_m_type(name: str, n_layer: int) -> "gguf.GGMLQuantizationType":
    """The type llama-quantize's Q4_K_M gives a matrix of this file (the llama tensor names)."""
    if name == "output.weight":
        return QK.Q6_K
    more = ("attn_v.weight", "ffn_down.weight", "ffn_down_exps.weight")
    if name.endswith(more) and _more_bits(int(name.split(".")[1]), n_layer):
        return QK.Q6_K
    return QK.Q4_K


def make_k_blocks(shape: tuple[int, ...], qtype, index: int, seed: int, scale: float) -> np.ndarray:
    """Random well-formed blocks u8 [rows, cols / 256 * block bytes] of Q4_K or Q6_K whose values
    are of about `scale`: random quants and sub-block scales, the f16 super-block scales chosen
    so that d * sub-scale * quant spans about ±3 scale (Q4_K's min term centres it)."""
    rows, cols = int(np.prod(shape[:-1])), shape[-1]  # a stack of experts: all their rows
    nb = cols // 256
    rng = np.random.default_rng([seed, index])
    blocks = rng.integers(0, 256, size=(rows, nb, K_BLOCK[qtype]), dtype=np.uint8)
    if qtype == QK.Q4_K:  # d, dmin (f16), 12 bytes of 6-bit scales and mins, 128 bytes of nibbles
        d = np.float16(scale / 150.0)
        blocks[:, :, 0:2] = np.frombuffer(d.tobytes(), dtype=np.uint8)
        blocks[:, :, 2:4] = np.frombuffer(np.float16(float(d) * 7.5).tobytes(), dtype=np.uint8)
    else:  # Q6_K: 128 bytes low nibbles, 64 bytes high bits, 16 int8 scales, d (f16) last
        blocks[:, :, 192:208] = rng.integers(1, 32, size=(rows, nb, 16), dtype=np.uint8)
        blocks[:, :, 208:210] = np.frombuffer(np.float16(scale / 300.0).tobytes(), dtype=np.uint8)
    return blocks.reshape(*shape[:-1], nb * K_BLOCK[qtype])


def _router(name: str) -> bool:
    return name.endswith("ffn_gate_inp.weight")


def write_model(a: argparse.Namespace, tok: list[tuple[str, object, VT, VT | None]]) -> None:
    if a.n_vocab:
        tok = pad_vocab(tok, a.n_vocab)
    n_vocab = next(len(v) for k, v, _, _ in tok if k == "tokenizer.ggml.tokens")
    if a.arch == "gpt-oss":
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from random_gpt_oss import write

        w = gguf.GGUFWriter(a.out, "gpt-oss")
        write(w, a, n_vocab, tok)
        w.close()
        return
    arch = "olmoe" if a.n_expert else "llama"
    w = gguf.GGUFWriter(a.out, arch)
    w.add_name(a.name)
    w.add_block_count(a.n_layer)
    w.add_context_length(a.n_ctx)
    w.add_embedding_length(a.n_embd)
    w.add_feed_forward_length(a.n_ff)
    w.add_head_count(a.n_head)
    w.add_head_count_kv(a.n_head_kv)
    w.add_rope_freq_base(a.rope_base)
    w.add_layer_norm_rms_eps(a.rms_eps)
    w.add_rope_dimension_count(a.n_embd // a.n_head)
    w.add_vocab_size(n_vocab)
    if a.n_expert:
        w.add_expert_count(a.n_expert)
        w.add_expert_used_count(a.n_expert_used)
    kq = a.ftype == "q4_k_m"
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M if kq else gguf.LlamaFileType.MOSTLY_F16)
    for key, value, vtype, sub in tok:
        w.add_key_value(key, value, vtype, sub)
    plan = tensor_plan(a, n_vocab)
    for name, shape in plan:
        if kq and len(shape) >= 2 and not _router(name):
            qt = q4_k_m_type(name, a.n_layer)
            row = shape[-1] // 256 * K_BLOCK[qt]
            nbytes = int(np.prod(shape[:-1])) * row
            w.add_tensor_info(name, (*shape[:-1], row), np.dtype(np.uint8), nbytes, raw_dtype=qt)
            continue
        dtype = np.float32 if len(shape) == 1 or _router(name) else np.float16
        w.add_tensor_info(name, shape, np.dtype(dtype), int(np.prod(shape)) * np.dtype(dtype).itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for index, (name, shape) in enumerate(plan):
        if kq and len(shape) >= 2 and not _router(name):
            w.write_tensor_data(make_k_blocks(shape, q4_k_m_type(name, a.n_layer), index, a.seed, a.scale))
        else:
            args = (np.float32,) if _router(name) else ()
            w.write_tensor_data(make_tensor(shape, index, a.seed, a.scale, *args))
    w.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--tokenizer-from", type=Path, required=True, help="GGUF whose tokenizer.* keys to copy")
    ap.add_argument("--n-embd", type=int, default=4096)
    ap.add_argument("--n-layer", type=int, default=32)
    ap.add_argument("--n-ff", type=int, default=11008)
    ap.add_argument("--n-head", type=int, default=32)
    ap.add_argument("--n-head-kv", type=int, default=32)
    ap.add_argument("--n-ctx", type=int, default=4096, help="llama.context_length")
    ap.add_argument("--rope-base", type=float, default=10000.0)
    ap.add_argument("--rms-eps", type=float, default=1e-5)
    ap.add_argument("--scale", type=float, default=0.02, help="std of the random matrix weights")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--name", default="random-llama")
    ap.add_argument("--ftype", choices=("f16", "q4_k_m"), default="f16", help="matrices in F16, or K-quant blocks")
    ap.add_argument("--n-expert", type=int, default=0, help="experts per layer (0: a dense llama; else olmoe)")
    ap.add_argument("--n-expert-used", type=int, default=8, help="experts a token is routed to")
    ap.add_argument(
        "--arch",
        choices=("llama", "gpt-oss"),
        default="llama",
        help="gpt-oss: MXFP4 experts (benchmarks/random_gpt_oss.py)",
    )
    ap.add_argument("--head-dim", type=int, default=0, help="gpt-oss: values per head (0: n-embd / n-head)")
    ap.add_argument("--n-vocab", type=int, default=0, help="pad the copied tokenizer with unused tokens to this size")
    a = ap.parse_args(argv)
    if a.arch == "gpt-oss":
        a.head_dim = a.head_dim or a.n_embd // a.n_head
        if not a.n_expert or not 0 < a.n_expert_used <= a.n_expert or a.n_embd % 32 or a.n_ff % 32 or a.head_dim % 32:
            ap.error("--arch gpt-oss needs --n-expert, 0 < --n-expert-used <= it, and multiples of 32 for the widths")
        if a.n_head % a.n_head_kv:
            ap.error("--n-head must divide by --n-head-kv")
    elif a.n_expert and not (0 < a.n_expert_used <= a.n_expert and a.n_head_kv == a.n_head):
        ap.error("--n-expert needs 0 < --n-expert-used <= --n-expert and --n-head-kv equal to --n-head (olmoe)")
    if a.arch == "llama" and (a.n_embd % a.n_head or a.n_head % a.n_head_kv):
        ap.error("--n-embd must divide by --n-head, and --n-head by --n-head-kv")
    if a.ftype == "q4_k_m" and (a.n_embd % 256 or a.n_ff % 256):
        ap.error("--ftype q4_k_m needs --n-embd and --n-ff that are multiples of 256 (the K-quant block)")
    if a.out.exists():
        ap.error(f"{a.out} exists; remove it or choose another path")
    try:
        tok = tokenizer_fields(a.tokenizer_from)
    except (OSError, ValueError) as e:
        ap.error(f"--tokenizer-from {a.tokenizer_from}: not a readable GGUF file ({e})")
    if not any(k == "tokenizer.ggml.tokens" for k, _, _, _ in tok):
        ap.error(f"--tokenizer-from {a.tokenizer_from}: this GGUF has no tokenizer.ggml.tokens; give a model's file")
    tmp = a.out.with_name(a.out.name + ".part")
    a.out, final = tmp, a.out
    try:
        write_model(a, tok)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, final)
    print(final)
    return 0


if __name__ == "__main__":
    sys.exit(main())
