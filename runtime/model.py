"""A loaded model: GGUF file, hyper-parameters, vocabulary, weights, and its architecture's forward.

Weights stay in their GGUF block formats (QMatrix views on the mmap). Projections that read the
same input and share a format are fused at load — Q|K|V into one matrix, gate|up into one — so
each layer issues fewer, larger matmul launches; that copies rows, it never dequantizes them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kernels.ggml_types import GGMLType
from kernels.matmul import QMatrix
from runtime.errors import ModelFileError
from runtime.gguf_file import GGUFFile
from runtime.gguf_split import open_gguf
from runtime.hparams import HParams


# llama_ftype ids (general.file_type) -> the names llama.cpp prints (llama_model_ftype_name)
LLAMA_FTYPE_NAMES = {
    0: "all F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1",
    10: "Q2_K - Medium", 11: "Q3_K - Small", 12: "Q3_K - Medium", 13: "Q3_K - Large",
    14: "Q4_K - Small", 15: "Q4_K - Medium", 16: "Q5_K - Small", 17: "Q5_K - Medium",
    18: "Q6_K", 25: "IQ4_NL", 32: "BF16",
}


@dataclass
class Layer:
    """The weights of one transformer block. Optional ones are None when the file has none."""

    attn_norm: np.ndarray  # [n_embd] f32
    wqkv: QMatrix | None  # fused Q|K|V rows when all three share a format
    wq: QMatrix | None
    wk: QMatrix | None
    wv: QMatrix | None
    bqkv: np.ndarray | None  # [q_dim + k_dim + v_dim] f32 (qwen2)
    wo: QMatrix
    bo: np.ndarray | None
    ffn_norm: np.ndarray
    w_gate_up: QMatrix | None  # fused gate|up rows when both share a format
    w_gate: QMatrix | None
    w_up: QMatrix | None
    w_down: QMatrix
    b_gate: np.ndarray | None = None
    b_up: np.ndarray | None = None
    b_down: np.ndarray | None = None
    q_norm: np.ndarray | None = None  # [head_dim] f32 (qwen3, gemma3)
    k_norm: np.ndarray | None = None
    post_attn_norm: np.ndarray | None = None  # gemma3
    post_ffn_norm: np.ndarray | None = None


@dataclass
class Weights:
    tok_embd: QMatrix  # [n_vocab, n_embd] rows
    output: QMatrix  # tok_embd itself when the output is tied
    output_norm: np.ndarray
    layers: list[Layer] = field(default_factory=list)


class Model:
    """Everything needed to run one GGUF model. `forward(ubatch, mctx)` is what Context calls."""

    def __init__(self, gf: GGUFFile, hparams: HParams, vocab, weights: Weights, arch):
        self.gguf = gf
        self.path = Path(gf.path)
        self.hparams = hparams
        self.vocab = vocab
        self.weights = weights
        self.arch = arch  # module from runtime.arch with forward(model, ubatch, mctx)

    @classmethod
    def load(cls, path) -> "Model":
        """Open, validate and map a GGUF model. ModelFileError (one line) if we cannot run it."""
        from runtime.arch import ARCHS
        from runtime.text.vocab import Vocab

        gf = open_gguf(path)  # a split model's parts open as one file
        try:
            arch = ARCHS.get(gf.arch)
            if arch is None:
                raise ModelFileError(
                    f"{gf.path}: architecture '{gf.arch}' is not supported; "
                    f"supported: {', '.join(ARCHS)}")
            hp = HParams.from_gguf(gf)
            vocab = Vocab.from_gguf(gf)
            weights = load_weights(gf, hp)
        except BaseException:
            gf.close()
            raise
        return cls(gf, hp, vocab, weights, arch)

    def forward(self, ubatch, mctx) -> np.ndarray:
        """Logits f32 [n_outputs, n_vocab] for the ubatch's tokens flagged as outputs."""
        return self.arch.forward(self, ubatch, mctx)

    # ---- description (info, bench) ----------------------------------------------------------
    @property
    def n_params(self) -> int:
        return sum(t.n_elements for t in self.gguf.tensors.values())

    @property
    def size_bytes(self) -> int:
        return sum(t.nbytes for t in self.gguf.tensors.values())

    @property
    def ftype_name(self) -> str:
        """The file's quantization mix as llama.cpp names it (general.file_type, e.g. "Q4_K - Medium");
        for a file without that key, the format holding most weight bytes."""
        ftype = self.gguf.metadata.get("general.file_type")
        if isinstance(ftype, int) and ftype in LLAMA_FTYPE_NAMES:
            return LLAMA_FTYPE_NAMES[ftype]
        counts: dict[str, int] = {}
        for t in self.gguf.tensors.values():
            if len(t.shape) >= 2:
                name = GGMLType(int(t.ggml_type)).name
                counts[name] = counts.get(name, 0) + t.nbytes
        return max(counts, key=counts.get) if counts else "?"

    def close(self) -> None:
        self.gguf.close()


# ---- loading -------------------------------------------------------------------------------

def _qmatrix(gf: GGUFFile, name: str) -> QMatrix:
    ti = gf.tensors[name]
    return QMatrix(ti.data, int(ti.ggml_type), int(ti.shape[0]))


def _vector(gf: GGUFFile, name: str) -> np.ndarray | None:
    """A small f32 (or f16) 1-D weight as a private f32 array; None if the file has none."""
    ti = gf.tensors.get(name)
    if ti is None:
        return None
    raw = np.ascontiguousarray(ti.data).reshape(-1)
    if int(ti.ggml_type) == GGMLType.F32:
        return raw.view(np.float32).copy()
    if int(ti.ggml_type) == GGMLType.F16:
        return raw.view(np.float16).astype(np.float32)
    gf.fail(name, f"a 1-D weight must be F32 or F16, not {GGMLType(int(ti.ggml_type)).name}")


def _fused(gf: GGUFFile, names: list[str]) -> QMatrix | None:
    """One QMatrix over the rows of several same-format matrices of equal row length, else None."""
    infos = [gf.tensors[n] for n in names]
    t0, k0 = int(infos[0].ggml_type), int(infos[0].shape[0])
    if any(int(i.ggml_type) != t0 or int(i.shape[0]) != k0 for i in infos):
        return None
    raw = np.concatenate([i.data for i in infos], axis=0)  # [sum m, row_bytes] u8
    return QMatrix(raw, t0, k0)


def _concat_bias(parts: list[np.ndarray | None], sizes: list[int]) -> np.ndarray | None:
    if all(p is None for p in parts):
        return None
    return np.concatenate([p if p is not None else np.zeros(n, np.float32) for p, n in zip(parts, sizes)])


def load_layer(gf: GGUFFile, hp: HParams, il: int) -> Layer:
    p = f"blk.{il}."
    qkv = [p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"]
    wqkv = _fused(gf, qkv)
    sizes = [hp.n_embd_head_k * hp.n_head, hp.n_embd_k_gqa(il), hp.n_embd_v_gqa(il)]
    gate_up = [p + "ffn_gate.weight", p + "ffn_up.weight"]
    w_gate_up = _fused(gf, gate_up)
    b_gate, b_up = _vector(gf, p + "ffn_gate.bias"), _vector(gf, p + "ffn_up.bias")
    if b_gate is not None or b_up is not None:
        w_gate_up = None  # keep the bias path simple: separate projections
    return Layer(
        attn_norm=_vector(gf, p + "attn_norm.weight"),
        wqkv=wqkv,
        wq=None if wqkv else _qmatrix(gf, qkv[0]),
        wk=None if wqkv else _qmatrix(gf, qkv[1]),
        wv=None if wqkv else _qmatrix(gf, qkv[2]),
        bqkv=_concat_bias([_vector(gf, p + f"attn_{x}.bias") for x in "qkv"], sizes),
        wo=_qmatrix(gf, p + "attn_output.weight"),
        bo=_vector(gf, p + "attn_output.bias"),
        ffn_norm=_vector(gf, p + "ffn_norm.weight"),
        w_gate_up=w_gate_up,
        w_gate=None if w_gate_up else _qmatrix(gf, gate_up[0]),
        w_up=None if w_gate_up else _qmatrix(gf, gate_up[1]),
        w_down=_qmatrix(gf, p + "ffn_down.weight"),
        b_gate=b_gate, b_up=b_up, b_down=_vector(gf, p + "ffn_down.bias"),
        q_norm=_vector(gf, p + "attn_q_norm.weight"),
        k_norm=_vector(gf, p + "attn_k_norm.weight"),
        post_attn_norm=_vector(gf, p + "post_attention_norm.weight"),
        post_ffn_norm=_vector(gf, p + "post_ffw_norm.weight"),
    )


def load_weights(gf: GGUFFile, hp: HParams) -> Weights:
    if "blk.0.rope_freqs.weight" in gf.tensors or "rope_freqs.weight" in gf.tensors:
        gf.fail("rope_freqs.weight", "per-frequency RoPE factors (llama 3.1 style) are not supported yet")
    tok_embd = _qmatrix(gf, "token_embd.weight")
    output = tok_embd if hp.tied_output else _qmatrix(gf, "output.weight")
    return Weights(tok_embd=tok_embd, output=output, output_norm=_vector(gf, "output_norm.weight"),
                   layers=[load_layer(gf, hp, il) for il in range(hp.n_layer)])
