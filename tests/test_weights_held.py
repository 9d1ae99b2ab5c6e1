"""Weights are held once, in about their file's bytes (issue 11 item 4).

- each quantized type's repacked matrix (kernels/qlayout.py) holds exactly the bytes the layout
  needs: the file's own bits per value, the f16 scales as they are, and the K-quants' packed
  6-bit scale / min bytes unpacked to one i8 each. The bound per type is that count, computed
  here from the block format, not measured;
- after Model.load no page of the model file stays in the process's resident set (the repacked
  copy is the only one held): counted from /proc/self/pagemap on Linux.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest

from kvchat.kernels.ggml_types import GGMLType, type_info
from kvchat.kernels.matmul import QMatrix
from kvchat.kernels.qlayout import FORMATS
from tests.test_matmul import random_raw

# packed bytes per block of the type's block size (m a multiple of 32 rows): values + scales
_PACKED_PER_BLOCK = {
    GGMLType.Q4_0: 16 + 2,  # the file's 18: nibbles + d
    GGMLType.Q4_1: 16 + 2 + 2,  # 20: + m
    GGMLType.Q5_0: 16 + 4 + 2,  # 22: nibbles + one bit plane + d
    GGMLType.Q5_1: 16 + 4 + 2 + 2,  # 24
    GGMLType.Q8_0: 32 + 2,  # 34
    GGMLType.IQ4_NL: 32 + 2,  # 18 in the file: table values held as i8 (left: nibble + lookup)
    GGMLType.MXFP4: 16 + 1,  # as in the file: the e2m1 codes as nibbles, the e8m0 exponent byte
    GGMLType.Q2_K: 128 + 2 + 2 + 16 + 16,  # 84 in the file: 2-bit values held as nibbles
    GGMLType.Q3_K: 128 + 2 + 16,  # 110 in the file: 3-bit values held as nibbles
    GGMLType.Q4_K: 128 + 2 + 2 + 8 + 8,  # 144 in the file + 4 B: 6-bit scales / mins as i8
    GGMLType.Q5_K: 128 + 32 + 2 + 2 + 8 + 8,  # 176 + 4 B
    GGMLType.Q6_K: 128 + 64 + 2 + 16,  # the file's 210: nibbles + two bit planes + d + scales
}
# formats held in exactly their file bytes (no widening at all)
_EXACT = {GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1, GGMLType.Q8_0, GGMLType.Q6_K}


@pytest.mark.parametrize("t", list(FORMATS), ids=lambda t: t.name)
def test_repacked_matrix_holds_the_bytes_its_layout_needs_and_no_more(t):
    info = type_info(t)
    k, m = 2 * 256, 96
    qm = QMatrix(random_raw(t, m, k), t, k)
    blocks = m * k // info.block_size
    assert qm.nbytes == blocks * info.type_size
    assert qm.packed_nbytes == blocks * _PACKED_PER_BLOCK[t]
    if t in _EXACT:
        assert qm.packed_nbytes == qm.nbytes
    elif t in (GGMLType.Q4_K, GGMLType.Q5_K):
        assert qm.packed_nbytes <= 1.03 * qm.nbytes


def _resident_pages(a: np.ndarray) -> int:
    """Pages of a's memory mapped in this process (the present bit of /proc/self/pagemap)."""
    first, last = a.ctypes.data // 4096, (a.ctypes.data + a.nbytes - 1) // 4096
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(first * 8)
        entries = np.frombuffer(f.read((last - first + 1) * 8), "<u8")
    return int(((entries >> np.uint64(63)) & np.uint64(1)).sum())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="pagemap and MADV_DONTNEED are Linux's")
def test_model_file_pages_leave_the_resident_set_once_the_weights_are_repacked(gemma3_path):
    from kvchat.runtime.model import Model

    model = Model.load(gemma3_path)
    try:
        raw = model.gguf.raw
        held = sum(getattr(w, "packed_nbytes", 0) for L in model.weights.layers for w in vars(L).values())
        assert held > 0
        # the file's 253 MB are not resident next to their repacked copy: at most one 2 MiB page
        assert _resident_pages(raw) * 4096 <= 2 << 20
        # an embedding lookup reads a few rows of the file back, and only those
        model.weights.tok_embd.get_rows(np.array([5, 70000], np.int32))
        assert _resident_pages(raw) * 4096 <= 3 * (2 << 20)
    finally:
        model.close()


def _untied_and_tied(tmp_path):
    from tests.helpers.gguf_factory import write_tiny_model

    kw = dict(n_layer=1, n_embd=64, n_head=4, n_head_kv=2, n_ff=64, weight_type=GGMLType.Q8_0)
    return (
        write_tiny_model(tmp_path / "untied.gguf", tied=False, **kw),
        write_tiny_model(tmp_path / "tied.gguf", tied=True, **kw),
    )


def test_an_embedding_with_its_own_head_is_looked_up_in_the_file_and_not_repacked(tmp_path, monkeypatch):
    """Only get_rows reads token_embd when output.weight exists: no packed copy is held or cached
    (a 7B-shaped q4_K model: 111 MiB), and its rows are the file's, dequantized exactly."""
    import gguf

    from kvchat.runtime.model import Model, TokenRows
    from kvchat.runtime.weights.cache import _read_table, packs_dir

    monkeypatch.setenv("KVCHAT_CACHE", str(tmp_path / "kv"))
    monkeypatch.setenv("KVCHAT_WEIGHT_CACHE", "1")
    untied, tied = _untied_and_tied(tmp_path)
    model = Model.load(untied)
    try:
        embd, out = model.weights.tok_embd, model.weights.output
        assert isinstance(embd, TokenRows) and not hasattr(embd, "packed_nbytes")
        assert isinstance(out, QMatrix) and out is not embd
        ti = model.gguf.tensors["token_embd.weight"]
        assert embd.raw is ti.data and (embd.m, embd.k, embd.t) == (model.hparams.n_vocab, 64, GGMLType.Q8_0)
        ids = np.array([0, 7, model.hparams.n_vocab - 1, 7], np.int32)
        want = gguf.quants.dequantize(np.asarray(ti.data)[ids], gguf.GGMLQuantizationType.Q8_0)
        np.testing.assert_array_equal(embd.get_rows(ids), want.reshape(4, 64))
        assert _resident_pages(ti.data) == 0  # a prompt's looked-up rows: file pages released again
        one = np.array([9], np.int32)
        embd_row_9 = gguf.quants.dequantize(np.asarray(ti.data)[9:10], gguf.GGMLQuantizationType.Q8_0).reshape(1, 64)
        for _ in range(TokenRows.RELEASE_EVERY - 1):  # generated tokens: released every RELEASE_EVERY
            np.testing.assert_array_equal(embd.get_rows(one), embd_row_9)
        assert _resident_pages(ti.data) > 0
        embd.get_rows(one)
        assert _resident_pages(ti.data) == 0
        with pytest.raises(IndexError):
            embd.get_rows(np.array([model.hparams.n_vocab], np.int32))
    finally:
        model.close()
    (pack,) = packs_dir().iterdir()
    with open(pack, "rb") as f:
        names = set(_read_table(f, pack.stat().st_size)["tensors"])
    assert "output.weight" in names and "token_embd.weight" not in names

    model = Model.load(tied)  # a tied embedding is also the head: one packed QMatrix
    try:
        assert isinstance(model.weights.tok_embd, QMatrix) and model.weights.output is model.weights.tok_embd
    finally:
        model.close()
