"""A loaded model: GGUF file, hyper-parameters, vocabulary, weights, and its architecture.

Nothing here names an architecture: the arch (runtime/arch/<name>.py) gives the tensor schema
the weights are loaded from, the fusions applied at load, the forward pass and the memory.
Weights stay in their GGUF block formats (QMatrix on the mmap'd rows). Projections that read the
same input and share a format are fused at load as the arch declares (Q|K|V into one matrix,
gate|up into one), so each layer issues fewer, larger matmul launches; that copies rows, it
never dequantizes them. The packed layouts are cached on disk per model file
(runtime/weights/cache.py): a warm start maps them and does not read the packed tensors' rows.
"""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from kvchat.kernels import stand_in
from kvchat.kernels.compile_plan import behind_workers
from kvchat.kernels.ggml_types import GGMLType, row_bytes
from kvchat.kernels.matmul import QMatrix, format_ready, release_file_pages
from kvchat.kernels.matmul_id import ExpertMatrix
from kvchat.kernels.qlayout_numpy import model_repack
from kvchat.kernels.stand_in import first_run_formats
from kvchat.runtime.arch import get_arch, is_supported, read_hparams, unsupported_message
from kvchat.runtime.errors import ModelFileError
from kvchat.runtime.gguf.file import GGUFFile
from kvchat.runtime.gguf.split import open_gguf
from kvchat.runtime.hparams import HParams
from kvchat.runtime.weights.cache import open_store
from kvchat.runtime.weights.os_memory import (
    heap_for_step_arrays,
    map_large_allocations,
    release_library_pages,
    trim_heap,
)

# llama_ftype ids (general.file_type) -> the names llama.cpp prints (llama_model_ftype_name)
LLAMA_FTYPE_NAMES = {
    0: "all F32",
    1: "F16",
    2: "Q4_0",
    3: "Q4_1",
    7: "Q8_0",
    8: "Q5_0",
    9: "Q5_1",
    10: "Q2_K - Medium",
    11: "Q3_K - Small",
    12: "Q3_K - Medium",
    13: "Q3_K - Large",
    14: "Q4_K - Small",
    15: "Q4_K - Medium",
    16: "Q5_K - Small",
    17: "Q5_K - Medium",
    18: "Q6_K",
    25: "IQ4_NL",
    32: "BF16",
    38: "MXFP4 MoE",
}


class Layer(SimpleNamespace):
    """The weights of one block: one attribute per entry of the arch's tensor schema (QMatrix for
    matrices, f32 vectors for norms and biases, None for an optional weight the file lacks), plus
    the fused matrices and biases its fusions declare."""

    def __repr__(self) -> str:
        held = ", ".join(k for k, v in vars(self).items() if v is not None)
        return f"{type(self).__name__}({held})"


class Weights(SimpleNamespace):
    """Model-level weights by schema attribute (tok_embd, output_norm, output, ...) and `layers`.
    `output` is tok_embd itself when the file has no output.weight (tied head)."""

    __repr__ = Layer.__repr__


class Model:
    """Everything needed to run one GGUF model. `forward(ubatch, mctx)` is what Context calls."""

    def __init__(self, gf: GGUFFile, hparams: HParams, vocab, weights: Weights, arch):
        self.gguf = gf
        self.path = Path(gf.path)
        self.hparams = hparams
        self.vocab = vocab
        self.weights = weights
        self.arch = arch  # kvchat.runtime.arch.<name>.ARCH: schema, forward, create_memory
        self.stand_ins: dict = {}  # file type -> the type its matrices are held as (kernels/stand_in.py)

    @classmethod
    def load(cls, path, weights_context=None, first_run: bool = False, vocab: bool = True) -> "Model":
        """Open, validate and map a GGUF model. ModelFileError (one line) if we cannot run it.
        weights_context: a context manager factory the weights load inside (a compile plan's dry
        run: kvchat.runtime.startup.compile_worker), the header and vocabulary outside it.
        first_run: a run whose kernels compile in workers: it may hold a format whose kernel is
        not compiled in one it compiles anyway (kernels/stand_in.py; model.stand_ins lists them)
        and reads the vocabulary with the kernels' Python twins while they are not compiled
        (kernels/compile_plan.compiling_behind); the plan compiles those kernels for the next run.
        vocab=False: no vocabulary (model.vocab None; the file's token texts are not read), for a
        load that only decodes token ids (a compile plan's)."""
        with behind_workers(first_run):
            map_large_allocations()  # freed load temporaries leave the resident set (runtime/weights/os_memory.py)
            try:
                return cls._load(path, weights_context, first_run, vocab)
            finally:
                heap_for_step_arrays()  # a decode step's arrays reuse heap pages: no page faults (os_memory)

    @classmethod
    def _load(cls, path, weights_context, first_run: bool, vocab: bool) -> "Model":
        from kvchat.runtime.text.vocab import Vocab

        gf = open_gguf(path, read_strings=vocab)  # a split model's parts open as one file
        try:
            if not is_supported(gf.arch):
                raise ModelFileError(f"{gf.path}: {unsupported_message(gf.arch)}")
            arch = get_arch(gf.arch)
            hp = read_hparams(gf)
            vocab = Vocab.from_gguf(gf) if vocab else None
            release_file_pages(gf.raw)  # the metadata's pages: the vocabulary holds its own copies
            release_library_pages()  # LLVM's pages, touched linking the first kernels (os_memory)
            with (
                weights_context() if weights_context is not None else nullcontext(),
                model_repack(gf.file_size),
                first_run_formats(matrix_types(gf), format_ready, enabled=first_run) as held,
            ):
                weights = load_weights(gf, hp, arch)
            release_file_pages(
                gf.raw
            )  # all repacked: drop the file's pages (huge pages a tensor only partly covered too)
            trim_heap()
        except BaseException:
            gf.close()
            raise
        model = cls(gf, hp, vocab, weights, arch)
        model.stand_ins = held
        return model

    def forward(self, ubatch, mctx, min_macs: int | None = None) -> np.ndarray:
        """Logits f32 [n_outputs, n_vocab] for the ubatch's tokens flagged as outputs; min_macs:
        the matmul threshold of this step (kernels/launch_tuner.py; the configured one when None)."""
        return self.arch.forward(self, ubatch, mctx, min_macs)

    def create_memory(self, cparams):
        """The memory this model needs for cparams (llama_model::create_memory)."""
        return self.arch.create_memory(self.hparams, cparams)

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


def _cached(packs, name: str, t: int, k: int, m: int) -> tuple | None:
    """The weight cache's packing of a matrix, or None (it is repacked, and the file rewritten) —
    also for a stand-in packing this load does not use (kernels/stand_in.usable)."""
    hit = packs.get(name, t, k, m) if packs is not None else None
    if hit is not None and not stand_in.usable(hit[0], t):
        packs.missed, hit = True, None
    return hit


def matrix_types(gf: GGUFFile) -> set:
    """The ggml types of the file's matrices that the matmul kernels read (not a token embedding
    that only its rows are looked up from)."""
    own_head = "output.weight" in gf.tensors
    return {
        int(ti.ggml_type)
        for name, ti in gf.tensors.items()
        if len(ti.shape) == 2 and not (own_head and name == "token_embd.weight")
    }


def _rows_of(ti) -> int:
    """A tensor's row count from its shape (ne1 * ne2 ...), without reading its rows."""
    return int(np.prod(ti.shape[1:], dtype=np.int64))


def _qmatrix(gf: GGUFFile, name: str, packs=None) -> QMatrix:
    """A matrix tensor as a QMatrix on its file rows: its packing mapped from the weight cache
    when that has it (the rows are then not read), else repacked (and recorded for the cache)."""
    ti = gf.tensors[name]
    t, k, m = int(ti.ggml_type), int(ti.shape[0]), _rows_of(ti)
    hit = _cached(packs, name, t, k, m)
    if hit is not None and getattr(ti, "made_on_read", False):  # a self-draft's requantized rows: not made
        qm = QMatrix(None, t, k, keep_raw=False, packed=hit, m=m)
    else:
        qm = QMatrix(ti.data, t, k, packed=hit)
    if packs is not None:
        packs.put(name, t, k, m, qm.packing())
    return qm


class TokenRows:
    """The token embedding of a model whose output matrix is its own (output.weight in the file).

    Only get_rows reads it, a few rows a token, so it is not repacked for the matmul kernels: its
    rows stay in the file's mapping, resident only while looked up. Repacking it would hold a
    copy no kernel reads (a 7B-shaped q4_K model with a 49152-token vocabulary: 111 MiB) and
    write it to the weight cache. A tied model's embedding is its head: a QMatrix, packed."""

    RELEASE_EVERY = 32  # one-row lookups between releases: releasing costs ~0.36 ms (7B), a row ~0.14 MB resident

    def get_rows(self, ids: np.ndarray) -> np.ndarray:
        """ids i32 [n] -> f32 [n, k], as QMatrix.get_rows; then the file pages the lookups mapped are
        released (fault-around maps ~0.14 MB a row: a 500-token prompt left 67 MiB of a 7B's
        embedding resident): after every prompt, and after every RELEASE_EVERY generated tokens
        (a release per token would add ~0.2 ms to each)."""
        rows = QMatrix.get_rows(self, ids)  # reads raw, m, t, k only (and checks the ids)
        self._lookups += 1
        if rows.shape[0] > 1 or self._lookups >= self.RELEASE_EVERY:
            release_file_pages(self.raw)
            self._lookups = 0
        return rows

    def __init__(self, raw: np.ndarray, t: int, k: int):
        self.raw, self.t, self.k, self.m = raw, int(t), int(k), int(raw.shape[0])
        self._lookups = 0  # one-row lookups since the last release
        self.nbytes = self.m * row_bytes(self.t, self.k)

    def __repr__(self) -> str:
        return f"TokenRows({GGMLType(self.t).name}, m={self.m}, k={self.k})"


def _token_rows(gf: GGUFFile, name: str) -> TokenRows | None:
    ti = gf.tensors.get(name)
    if ti is None:
        return None
    t, k = int(ti.ggml_type), int(ti.shape[0])
    if ti.data.ndim != 2 or ti.data.shape[1] != row_bytes(t, k):
        gf.fail(name, f"rows of {ti.data.shape[-1]} bytes, {GGMLType(t).name} x {k} needs {row_bytes(t, k)}")
    return TokenRows(ti.data, t, k)


def _vector(gf: GGUFFile, name: str) -> np.ndarray | None:
    """A small f32 (or f16) 1-D weight as a private f32 array; None if the file has none."""
    ti = gf.tensors.get(name)
    if ti is None:
        return None
    raw = np.ascontiguousarray(ti.data).reshape(-1)
    out = None
    if int(ti.ggml_type) == GGMLType.F32:
        out = raw.view(np.float32).copy()
    elif int(ti.ggml_type) == GGMLType.F16:
        out = raw.view(np.float16).astype(np.float32)
    if out is not None:
        release_file_pages(ti.data)  # reading 1 KB may have mapped a whole 2 MiB file page
        return out
    gf.fail(name, f"a 1-D weight must be F32 or F16, not {GGMLType(int(ti.ggml_type)).name}")


def _fused(infos: list, packs=None) -> QMatrix | None:
    """One QMatrix over the rows of several same-format matrices of equal row length, else None.
    Cached under the parts' names joined by "+" (a weight-cache hit copies no rows)."""
    t0, k0 = int(infos[0].ggml_type), int(infos[0].shape[0])
    if any(int(i.ggml_type) != t0 or int(i.shape[0]) != k0 for i in infos):
        return None
    name, m = "+".join(i.name for i in infos), sum(_rows_of(i) for i in infos)
    hit = _cached(packs, name, t0, k0, m)
    if hit is not None:
        qm = QMatrix(None, t0, k0, keep_raw=False, packed=hit, m=m)
    else:
        raw = np.concatenate([i.data for i in infos], axis=0)  # [sum m, row_bytes] u8
        for i in infos:
            release_file_pages(i.data)  # the parts' file pages: only the repacked rows stay resident
        qm = QMatrix(raw, t0, k0, keep_raw=False)
    if packs is not None:
        packs.put(name, t0, k0, m, qm.packing())
    return qm


def _load_one(gf: GGUFFile, spec, packs=None):
    """A schema entry: QMatrix for a matrix, ExpertMatrix for a stack of expert matrices (3-D),
    an f32 array for a 1-D weight (or a 2-D one of a float type the schema marks as per-expert
    biases), None if absent."""
    if spec.name not in gf.tensors:
        return None
    if len(spec.shape) == 3:
        return _experts([gf.tensors[spec.name]], spec.shape[2], packs)
    if len(spec.shape) == 2 and spec.name.endswith(".bias"):  # per-expert biases [n, n_expert]
        v = _vector(gf, spec.name)
        return v.reshape(spec.shape[1], spec.shape[0])  # [n_expert, n] f32
    return _qmatrix(gf, spec.name, packs) if len(spec.shape) == 2 else _vector(gf, spec.name)


def _experts(infos: list, n_expert: int, packs=None) -> ExpertMatrix | None:
    """One ExpertMatrix over the stacked expert tensors `infos` (rows of each expert concatenated
    across the parts), or None when the parts differ in format or row length. Its stacked
    packing is cached under the parts' names joined by "+" and "#experts"."""
    t0, k0 = int(infos[0].ggml_type), int(infos[0].shape[0])
    if any(int(i.ggml_type) != t0 or int(i.shape[0]) != k0 for i in infos):
        return None
    name = "+".join(i.name for i in infos) + "#experts"
    ms = [int(i.data.shape[0]) // n_expert for i in infos]
    hit = packs.get(name, t0, k0, sum(ms)) if packs is not None else None
    if hit is not None:
        em = ExpertMatrix([], t0, k0, n_expert, packed=hit, ms=ms)
    else:
        em = ExpertMatrix([i.data for i in infos], t0, k0, n_expert)
    if packs is not None:
        packs.put(name, t0, k0, sum(ms), em.packing())
    return em


def load_group(gf: GGUFFile, specs: dict, fusions=(), packs=None) -> dict:
    """attribute -> loaded weight for one schema group (the model level or one layer), with the
    fusions that apply to it (all their parts declared) done before any QMatrix is built, so a
    fused projection's rows are held once."""
    out: dict = {}
    for f in fusions:
        if not all(p in specs for p in f.parts) or any(p in out for p in f.parts):
            continue  # not this schema's, or its parts already fused by an earlier fusion
        biases = [_vector(gf, specs[b].name) if b in specs else None for b in f.biases]
        has_bias = any(b is not None for b in biases)
        if f.bias_into is not None and (has_bias or f.bias_into not in specs):
            sizes = [specs[p].shape[1] for p in f.parts]
            out[f.bias_into] = (
                np.concatenate([b if b is not None else np.zeros(n, np.float32) for b, n in zip(biases, sizes)])
                if has_bias
                else None
            )
            out.update({b: None for b in f.biases})  # folded into bias_into
        infos = [gf.tensors.get(specs[p].name) for p in f.parts]
        fused = None
        if all(i is not None for i in infos) and (f.bias_into is not None or not has_bias):
            shape = specs[f.parts[0]].shape
            fused = _experts(infos, shape[2], packs) if len(shape) == 3 else _fused(infos, packs)
        if fused is not None:
            out[f.into] = fused
            out.update({p: None for p in f.parts})
        elif f.into not in specs:  # a target the schema also declares (phi3's attn_qkv) loads below
            out[f.into] = None
    for attr, spec in specs.items():
        if attr not in out:
            out[attr] = _load_one(gf, spec, packs)
    return out


def load_weights(gf: GGUFFile, hp: HParams, arch) -> Weights:
    """The arch's schema loaded from gf: packed matrices mapped from the weight cache
    (runtime/weights/cache.py) when it holds them, else repacked and then written to it."""
    schema = arch.tensors(hp)
    packs = open_store(gf)
    model_specs = dict(schema.model)
    embd = None
    out_spec = model_specs.get("output")
    if "tok_embd" in model_specs and out_spec is not None and out_spec.name in gf.tensors:
        embd = _token_rows(gf, model_specs.pop("tok_embd").name)  # its own head: only looked up
    w = Weights(
        **load_group(gf, model_specs, packs=packs),
        layers=[Layer(**load_group(gf, specs, arch.fusions, packs)) for specs in schema.layers],
    )
    if embd is not None:
        w.tok_embd = embd
    if getattr(w, "output", None) is None:
        w.output = w.tok_embd  # tied head
    if packs is not None:
        packs.save()
    return w
