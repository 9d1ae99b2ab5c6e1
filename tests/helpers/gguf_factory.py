"""Tiny random GGUF models for unit tests (any helper may import this).

    from tests.helpers.gguf_factory import write_tiny_model
    path = write_tiny_model(tmp_path / "m.gguf", arch="gemma3", weight_type=GGMLType.Q8_0)

The file is a complete model of the given architecture: every tensor kvchat.runtime.hparams expects
(shapes taken from `kvchat.runtime.hparams.expected_tensors`, so the two cannot drift apart), random
weights scaled 1/sqrt(fan_in) so activations stay O(1), a small vocabulary Vocab can load, and a
ChatML chat template. Vocabularies:
- "bpe" (default for llama/qwen2/qwen3; tokenizer.ggml.model "gpt2"): ids 0..2 are
  <|endoftext|> <|im_start|> <|im_end|> (control), then the 256 byte-level tokens in GPT-2's
  byte->unicode order, then the merged tokens of a few words (" the", "hello", ...).
- "spm" (default for gemma3; model "llama"): <pad> <eos> <bos> <unk> <|im_start|> <|im_end|>,
  the 256 <0xXX> byte tokens, then "▁" and a few scored pieces.
`n_vocab` larger than the natural size pads with <unused_i> tokens (type UNUSED).

Options beyond the signature's sizes:
  head_dim=None (writes attention.key_length/value_length), n_ctx_train=512, rope_freq_base,
  n_swa=16 and swa_pattern=None (gemma3 only), tied=True (False writes output.weight),
  qkv_bias (default True for qwen2), vocab="bpe"|"spm", chat_template=CHATML (None omits it),
  metadata={full key: value} added last (value None deletes a key; (value, GGUFValueType) forces
  the type), drop_tensors=(names...) to leave tensors out, extra_tensors={name: f32 array}
  written after the schema's (e.g. rope_freqs.weight), optional_tensors=(names...) of the
  schema's optional tensors to write too, output_tokens=(ids...) writes an output.weight that
  makes the model say only those tokens (write_tiny_chat_model uses it), added_tokens=((text,
  type), ...) appends tokens after the natural vocabulary (thinking markers: tests/test_reasoning.py).
"""

from __future__ import annotations

import math
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import GGUFValueType as VT

from kvchat.kernels.ggml_types import GGMLType
from kvchat.runtime.arch import ARCHS, expected_tensors, get_arch
from kvchat.runtime.hparams import HParams

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
MOE_ARCHS = ("qwen3moe", "olmoe", "granitemoe", "gpt-oss", "qwen35moe")  # write_tiny_model adds expert keys
WORDS = ("the", " the", "hello", " hello", " world", " and", "ing", " chat")

# llama.cpp token types
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


def gpt2_byte_chars() -> list[str]:
    """GPT-2's byte -> printable unicode char table (index = byte value)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, extra = [], 0
    for b in range(256):
        if b in keep:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def bpe_vocab():
    """(tokens, token_types, merges, special ids) of the tiny byte-level BPE vocabulary."""
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    types = [CONTROL] * 3
    table = gpt2_byte_chars()
    tokens += table
    types += [NORMAL] * 256
    merges, known = [], set(tokens)
    for word in WORDS:
        pieces = [table[b] for b in word.encode("utf-8")]
        left = pieces[0]
        for right in pieces[1:]:
            merged = left + right
            if merged not in known:
                merges.append(f"{left} {right}")
                tokens.append(merged)
                types.append(NORMAL)
                known.add(merged)
            left = merged
    specials = {"bos": 1, "eos": 2, "unk": None, "pad": 2, "eot": 2}
    return tokens, types, merges, None, specials


def spm_vocab():
    """(tokens, token_types, merges=None, scores, special ids) of the tiny SPM vocabulary."""
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<|im_start|>", "<|im_end|>"]
    types = [CONTROL, CONTROL, CONTROL, UNKNOWN, CONTROL, CONTROL]
    scores = [-1000.0] * len(tokens)
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [BYTE] * 256
    scores += [0.0] * 256
    pieces = ["▁"] + sorted({w.replace(" ", "▁") for w in WORDS} | {"▁t", "▁h", "he", "th", "ll", "lo"})
    for i, p in enumerate(pieces):
        tokens.append(p)
        types.append(NORMAL)
        scores.append(-1.0 - i * 0.5 + len(p))  # longer pieces score higher
    specials = {"bos": 2, "eos": 1, "unk": 3, "pad": 0, "eot": 5}
    return tokens, types, None, scores, specials


def write_tiny_model(
    path,
    arch: str = "llama",
    n_layer: int = 2,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int = 2,
    n_ff: int = 128,
    n_vocab: int | None = None,
    weight_type: int = GGMLType.F32,
    seed: int = 0,
    **overrides,
) -> Path:
    """Write a valid tiny random model of `arch` to `path` and return the path (see module doc)."""
    opts = dict(
        head_dim=None,
        n_ctx_train=512,
        rope_freq_base=10000.0,
        n_swa=16,
        swa_pattern=None,
        tied=True,
        qkv_bias=arch == "qwen2",
        vocab="spm" if arch == "gemma3" else "bpe",
        chat_template=CHATML,
        metadata=None,
        drop_tensors=(),
        norm_eps=1e-6,
        extra_tensors=None,
        optional_tensors=(),
        output_tokens=None,
        added_tokens=(),
        n_expert=8,
        n_expert_used=2,
        n_ff_exp=None,
        n_ff_shexp=0,
    )
    unknown = set(overrides) - set(opts)
    if unknown:
        raise TypeError(f"unknown write_tiny_model options: {sorted(unknown)}")
    opts.update(overrides)
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {sorted(ARCHS)}")
    path = Path(path)
    rng = np.random.default_rng(seed)

    tokens, types, merges, scores, sp = bpe_vocab() if opts["vocab"] == "bpe" else spm_vocab()
    for text, kind in opts["added_tokens"]:  # (text, token type): marker tokens of a model family
        tokens.append(text)
        types.append(kind)
        if scores is not None:
            scores.append(-1000.0)
    if n_vocab is not None:
        if n_vocab < len(tokens):
            raise ValueError(f"n_vocab must be at least {len(tokens)} for the {opts['vocab']} vocabulary")
        pad = n_vocab - len(tokens)
        tokens += [f"<unused_{i}>" for i in range(pad)]
        types += [UNUSED] * pad
        if scores is not None:
            scores += [-1000.0] * pad
    head = opts["head_dim"] or n_embd // n_head

    meta = dict(opts["metadata"] or {})
    w = gguf.GGUFWriter(str(path), meta.pop("general.architecture", None) or arch)  # writes that key
    kv = {
        "general.name": f"tiny-{arch}",
        f"{arch}.block_count": n_layer,
        f"{arch}.context_length": opts["n_ctx_train"],
        f"{arch}.embedding_length": n_embd,
        f"{arch}.feed_forward_length": n_ff,
        f"{arch}.attention.head_count": n_head,
        f"{arch}.attention.head_count_kv": n_head_kv,
        f"{arch}.attention.layer_norm_rms_epsilon": (float(opts["norm_eps"]), VT.FLOAT32),
        f"{arch}.rope.freq_base": (float(opts["rope_freq_base"]), VT.FLOAT32),
        "tokenizer.ggml.model": "gpt2" if opts["vocab"] == "bpe" else "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": (types, VT.INT32),
        "tokenizer.ggml.bos_token_id": sp["bos"],
        "tokenizer.ggml.eos_token_id": sp["eos"],
        "tokenizer.ggml.padding_token_id": sp["pad"],
    }
    moe = arch in MOE_ARCHS
    if moe:
        kv[f"{arch}.expert_count"] = opts["n_expert"]
        kv[f"{arch}.expert_used_count"] = opts["n_expert_used"]
        kv[f"{arch}.expert_feed_forward_length"] = opts["n_ff_exp"] or n_ff
        if opts["n_ff_shexp"]:
            kv[f"{arch}.expert_shared_feed_forward_length"] = opts["n_ff_shexp"]
    if opts["head_dim"]:
        kv[f"{arch}.attention.key_length"] = head
        kv[f"{arch}.attention.value_length"] = head
    if opts["vocab"] == "bpe":
        kv["tokenizer.ggml.pre"] = "qwen2" if arch.startswith("qwen") else "smollm"
        kv["tokenizer.ggml.merges"] = merges
        kv["tokenizer.ggml.add_bos_token"] = False
    else:
        kv["tokenizer.ggml.pre"] = "default"
        kv["tokenizer.ggml.scores"] = (scores, VT.FLOAT32)
        kv["tokenizer.ggml.unknown_token_id"] = sp["unk"]
        kv["tokenizer.ggml.add_bos_token"] = True
        kv["tokenizer.ggml.add_space_prefix"] = False
    if arch == "gemma3" and opts["n_swa"]:
        kv["gemma3.attention.sliding_window"] = opts["n_swa"]
        if opts["swa_pattern"] is not None:
            kv["gemma3.attention.sliding_window_pattern"] = opts["swa_pattern"]
    if opts["chat_template"] is not None:
        kv["tokenizer.chat_template"] = opts["chat_template"]
    for key, value in meta.items():
        if value is None:
            kv.pop(key, None)
        else:
            kv[key] = value
    for key, value in kv.items():
        _add_kv(w, key, value)

    hp = _hparams_for_shapes(arch, n_layer, n_embd, n_head, n_head_kv, head, n_ff, len(tokens))
    if moe:
        from kvchat.runtime.arch.moe import MoEHParams

        hp = MoEHParams(
            **vars(hp),
            n_expert=opts["n_expert"],
            n_expert_used=opts["n_expert_used"],
            n_ff_exp=opts["n_ff_exp"] or n_ff,
            n_ff_shexp=opts["n_ff_shexp"],
        )
    for name, (shape, required) in expected_tensors(hp).items():
        if name in opts["drop_tensors"]:
            continue
        if not required:
            wanted = (name == "output.weight" and (not opts["tied"] or opts["output_tokens"])) or (
                opts["qkv_bias"] and name.endswith((".attn_q.bias", ".attn_k.bias", ".attn_v.bias"))
            )
            if not wanted and name not in opts["optional_tensors"]:
                continue
        if name == "output.weight" and opts["output_tokens"] is not None:
            _add_favouring_output(w, shape, opts["output_tokens"], seed)
            continue
        _add_weight(w, name, shape, weight_type, rng)
    for name, value in (opts["extra_tensors"] or {}).items():
        w.add_tensor(name, np.ascontiguousarray(value, dtype=np.float32))

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _add_favouring_output(w: gguf.GGUFWriter, shape: tuple, ids, seed: int) -> None:
    """output.weight whose rows are zero except for `ids` (N(0, 4/fan_in)): every other token
    gets logit 0 while some favoured one is far above it, so sampling picks a favoured token."""
    k, m = shape
    rng = np.random.default_rng(seed + 7919)
    x = np.zeros((m, k), dtype=np.float32)  # [n_vocab, n_embd] f32
    ids = np.asarray(sorted(set(int(i) for i in ids)), dtype=np.int64)
    x[ids] = (2.0 * rng.standard_normal((ids.size, k)) / math.sqrt(k)).astype(np.float32)
    w.add_tensor("output.weight", x)


def printable_token_ids() -> list[int]:
    """Ids of the BPE vocabulary's letters, digits, space and punctuation (bytes 0x20..0x7e)
    and its merged words: what a tiny chat model should say so a terminal shows it plainly."""
    tokens = bpe_vocab()[0]
    table = gpt2_byte_chars()
    wanted = {table[b] for b in range(0x20, 0x7F)} | {t for t in tokens[259:]}
    return [i for i, t in enumerate(tokens) if t in wanted]


def write_tiny_chat_model(path, seed: int = 0, **overrides) -> Path:
    """A tiny llama with the ChatML template that answers in printable text and never ends its
    turn by itself (no end-of-generation token is favoured): answers run to -n, and a pty shows
    them as plain characters. The CLI contract tests chat with it (tests/test_cli_contract*.py)."""
    opts = dict(arch="llama", n_ctx_train=4096, output_tokens=printable_token_ids())
    opts.update(overrides)
    return write_tiny_model(path, seed=seed, **opts)


def _hparams_for_shapes(arch, n_layer, n_embd, n_head, n_head_kv, head, n_ff, n_vocab) -> HParams:
    """Just enough of an HParams for expected_tensors() to list the shapes."""
    return HParams(
        arch=arch,
        n_vocab=n_vocab,
        n_ctx_train=1,
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
        n_head_kv=n_head_kv,
        n_embd_head_k=head,
        n_embd_head_v=head,
        n_ff=n_ff,
        norm_eps=1e-6,
        rope_type=get_arch(arch).rope_type,
        n_rot=head,
        rope_freq_base=1e4,
        rope_freq_scale=1.0,
        rope_freq_base_swa=1e4,
        n_swa=0,
        swa_layers=[False] * n_layer,
        use_qk_norm=get_arch(arch).qk_norm,
        tied_output=True,
    )


def _add_weight(w: gguf.GGUFWriter, name: str, shape: tuple, weight_type: int, rng) -> None:
    """A random tensor of ggml shape `shape`: vectors are F32 norms (≈1) or biases (≈0);
    matrices (and stacks of expert matrices, ne [k, m, n_expert]) are N(0, 1/fan_in) in
    `weight_type`; a 2-D bias (per-expert biases) is F32 ≈ 0."""
    if len(shape) == 1 or name.endswith(".bias"):
        base = 1.0 if name.endswith("norm.weight") else 0.0
        w.add_tensor(name, (base + 0.1 * rng.standard_normal(shape[::-1])).astype(np.float32))
        return
    k = shape[0]
    x = (rng.standard_normal(shape[::-1]) / math.sqrt(k)).astype(np.float32)  # [(n_expert,) m, k] f32
    qt = QT(int(weight_type))
    if qt == QT.F32:
        w.add_tensor(name, x)
    elif qt == QT.F16:
        w.add_tensor(name, x.astype(np.float16))
    else:
        w.add_tensor(name, gguf.quants.quantize(x, qt), raw_dtype=qt)


def _add_kv(w: gguf.GGUFWriter, key: str, value) -> None:
    """Add one key, inferring the GGUF type unless given as (value, GGUFValueType)."""
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], VT):
        value, vtype = value
    else:
        vtype = _infer_type(value)
    if vtype == VT.ARRAY or isinstance(value, (list, np.ndarray)):
        items = list(value)
        if vtype == VT.ARRAY:
            sub = _infer_type(items[0]) if items else VT.UINT32
        else:
            sub, vtype = vtype, VT.ARRAY
        w.add_key_value(key, items, VT.ARRAY, sub_type=sub)
    else:
        w.add_key_value(key, value, vtype)


def _infer_type(value) -> VT:
    if isinstance(value, bool):
        return VT.BOOL
    if isinstance(value, int):
        return VT.UINT32 if 0 <= value < 1 << 32 else VT.INT64
    if isinstance(value, float):
        return VT.FLOAT32
    if isinstance(value, str):
        return VT.STRING
    if isinstance(value, (list, np.ndarray)):
        return VT.ARRAY
    raise TypeError(f"cannot infer a GGUF type for {type(value).__name__}")


def split_gguf_file(src, out_prefix, n_split: int) -> list[Path]:
    """Re-write the GGUF `src` as llama.cpp's gguf-split does: parts `{out_prefix}-0000i-of-0000n.gguf`,
    the first with every metadata key, all with split.no / split.count / split.tensors.count, the
    tensors in file order cut into `n_split` contiguous runs. Returns the part paths in order.
    Read with gguf-py's reader (not ours), so the loader under test does not check itself."""
    reader = gguf.GGUFReader(str(src))
    tensors = list(reader.tensors)
    if not 1 < n_split <= len(tensors):
        raise ValueError(f"n_split must be in 2..{len(tensors)}")
    bounds = [round(i * len(tensors) / n_split) for i in range(n_split + 1)]
    arch = reader.fields["general.architecture"].contents()
    paths = []
    for i in range(n_split):
        path = Path(f"{out_prefix}-{i + 1:05d}-of-{n_split:05d}.gguf")
        w = gguf.GGUFWriter(str(path), arch)
        if i == 0:
            for key, field in reader.fields.items():
                if key.startswith("GGUF.") or key == "general.architecture":
                    continue
                sub = field.types[-1] if field.types[0] == VT.ARRAY else None
                w.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
        else:
            w.kv_data[0].pop("general.architecture")
        w.add_key_value("split.no", i, VT.UINT16)
        w.add_key_value("split.count", n_split, VT.UINT16)
        w.add_key_value("split.tensors.count", len(tensors), VT.INT32)
        for t in tensors[bounds[i] : bounds[i + 1]]:
            # t.data is numpy-ordered (float types) or [rows, row bytes] u8 (quantized types)
            w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        paths.append(path)
    return paths


def quantized_copy(src, dst, weight_type: int = GGMLType.Q8_0, only=None) -> Path:
    """Copy the GGUF model `src` to `dst` with every 2-D (and 3-D expert) F32/F16 weight quantized to
    `weight_type` (gguf's reference quantizer; rows whose length is not a multiple of the block
    stay as they are) and all metadata, 1-D tensors and other tensors unchanged. only(name): which
    weights to quantize (default all)."""
    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(str(dst), arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        vtype = VT(field.types[0])
        sub = VT(field.types[1]) if vtype == VT.ARRAY else None
        value = field.contents()
        if name == "general.file_type":  # llama_ftype of the new mix
            value = {QT.Q8_0: 7, QT.Q4_0: 2, QT.Q4_1: 3, QT.F16: 1, QT.MXFP4: 38}.get(QT(int(weight_type)), value)
        w.add_key_value(name, value, vtype, sub_type=sub)
    qt = QT(int(weight_type))
    block = gguf.GGML_QUANT_SIZES[qt][0]
    for t in reader.tensors:
        data = np.asarray(t.data)
        quantize = len(t.shape) in (2, 3) and not t.name.endswith(".bias") and (only is None or only(t.name))
        if quantize and t.tensor_type in (QT.F32, QT.F16) and int(t.shape[0]) % block == 0:
            x = data.astype(np.float32).reshape([int(d) for d in t.shape[::-1]])  # [(n_expert,) m, k]
            w.add_tensor(t.name, gguf.quants.quantize(x, qt), raw_dtype=qt)
        else:
            w.add_tensor(t.name, data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(dst)
