"""kernels/stand_in.py: a first run's Q5_0 / Q4_0 matrices held as Q8_0 hold the same numbers and
multiply bit-identically, the choice follows what numba holds compiled, the compile plan lists the
native kernels for the next load, and the weight cache keeps the two packings apart."""

from __future__ import annotations

import numpy as np
import pytest

from kvchat.kernels import stand_in
from kvchat.kernels.ggml_types import GGMLType
from kvchat.kernels.matmul import QMatrix, format_entries, format_ready
from kvchat.kernels.qlayout import FORMATS, QFormatType
from kvchat.kernels.quants import dequantize
from kvchat.kernels.stand_in import as_held, first_run_formats
from kvchat.runtime import model as model_module
from kvchat.runtime.model import Model
from tests.helpers.gguf_factory import quantized_copy, write_tiny_model
from tests.test_matmul import random_raw
from tests.test_weight_cache import _logits, _matrices, _packs

Q5_0, Q4_0, Q8_0, Q4_K = GGMLType.Q5_0, GGMLType.Q4_0, GGMLType.Q8_0, GGMLType.Q4_K


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A fresh KVCHAT_CACHE with the weight cache on; its packed/ directory."""
    monkeypatch.setenv("KVCHAT_CACHE", str(tmp_path / "kv"))
    monkeypatch.delenv("KVCHAT_WEIGHT_CACHE", raising=False)
    return tmp_path / "kv" / "packed"


@pytest.mark.parametrize("t", [Q5_0, Q4_0], ids=lambda t: t.name)
def test_a_block_held_as_q8_0_dequantizes_to_the_same_numbers(t):
    raw = random_raw(t, 40, 256, seed=3)
    held = as_held(raw, t, Q8_0)
    assert held.shape == (40, 8 * 34)
    np.testing.assert_array_equal(dequantize(held, Q8_0, 256), dequantize(raw, t, 256))


def test_only_the_listed_formats_are_held_as_others():
    with pytest.raises(ValueError, match="Q4_1 is not held as Q8_0"):
        as_held(random_raw(GGMLType.Q4_1, 32, 32), GGMLType.Q4_1, Q8_0)


@pytest.mark.parametrize("t", [Q5_0, Q4_0], ids=lambda t: t.name)
def test_a_matrix_held_as_q8_0_multiplies_bit_identically_for_every_batch_and_both_twins(t, monkeypatch):
    raw = random_raw(t, 70, 320, seed=5)  # 70 rows: a partial 32-row group
    native = QMatrix(raw, t, 320)
    monkeypatch.setattr(stand_in, "_held", {int(t): int(Q8_0)})
    held = QMatrix(raw, t, 320)
    assert (native.kind, native.fmt) == ("int", FORMATS[t])
    assert (held.kind, held.fmt, held.t) == ("int:Q8_0", FORMATS[Q8_0], t)
    rng = np.random.default_rng(1)
    for n in (1, 3, 7, 64):
        x = rng.standard_normal((n, 320)).astype(np.float32)
        for min_macs in (1 << 62, 0):  # the serial twin, the parallel one
            np.testing.assert_array_equal(held.matmul(x, min_macs), native.matmul(x, min_macs))


def test_a_format_is_held_as_another_only_while_its_own_kernel_is_not_compiled():
    ready = {Q8_0: False, Q5_0: False, Q4_0: False}

    def first_run(types, **kw):
        return first_run_formats(types, lambda t: ready[t], **kw)

    with first_run({Q5_0, Q8_0, Q4_K}) as held:
        assert held == {Q5_0: Q8_0} and stand_in.held_as(Q5_0) == Q8_0 and stand_in.held_as(Q4_K) is None
    assert stand_in.held_as(Q5_0) is None  # only during the load
    with first_run({Q5_0, Q4_K}) as held:
        assert held == {}  # Q8_0 neither needed nor compiled: nothing saved
    ready[Q8_0] = True
    with first_run({Q5_0, Q4_0, Q4_K}) as held:
        assert held == {Q5_0: Q8_0, Q4_0: Q8_0}
    ready[Q5_0] = True
    with first_run({Q5_0, Q8_0}) as held:
        assert held == {}
    ready[Q5_0] = False
    with first_run({Q5_0, Q8_0}, enabled=False) as held:
        assert held == {}


def test_the_native_entries_name_both_twins_of_the_format_and_follow_an_in_process_compile():
    serial, par = format_entries(Q5_0)
    assert (serial[1], par[1]) == ("matmul_q_serial", "matmul_q")
    assert QFormatType(FORMATS[Q5_0]) in serial[2] and QFormatType(FORMATS[Q5_0]) in par[2]
    QMatrix(random_raw(Q5_0, 32, 256), Q5_0, 256).matmul(np.ones((1, 256), np.float32), 1 << 62)
    assert format_ready(Q5_0)  # compiled (or loaded from numba's cache) in this process now


def _mixed_model(tmp_path):
    """A tiny llama whose layers are Q5_0 and whose head and embedding are Q8_0 (as Gemma-3's file)."""
    src = write_tiny_model(tmp_path / "f32.gguf", n_embd=256, n_ff=512, n_head=4, n_head_kv=2, tied=False)
    mid = quantized_copy(src, tmp_path / "q5.gguf", Q5_0, only=lambda name: name.startswith("blk."))
    return quantized_copy(mid, tmp_path / "mixed.gguf", Q8_0)


def test_a_model_loaded_with_stand_ins_answers_as_the_native_load_and_its_pack_is_replaced_once_native(
    tmp_path,
    cache,
    monkeypatch,
):
    path = _mixed_model(tmp_path)
    monkeypatch.setenv("KVCHAT_WEIGHT_CACHE", "0")
    native = Model.load(path)
    want = _logits(native)
    assert native.stand_ins == {} and {qm.t for qm in _matrices(native).values()} == {Q5_0, Q8_0}
    monkeypatch.delenv("KVCHAT_WEIGHT_CACHE")
    ready = {Q5_0: False}
    monkeypatch.setattr(model_module, "format_ready", lambda t: ready.get(t, True))

    def load(**kw):
        m = Model.load(path, **kw)
        kinds = {qm.kind for qm in _matrices(m).values() if qm.t == Q5_0}
        return m, kinds, _logits(m)

    m, kinds, got = load(first_run=True)  # a first run: repacked as Q8_0, the pack written
    assert m.stand_ins == {Q5_0: Q8_0} and kinds == {"int:Q8_0"}
    np.testing.assert_array_equal(got, want)
    (pack,) = [cache / p for p in _packs(cache)]
    written = pack.stat().st_mtime_ns
    m, kinds, got = load(first_run=True)  # the same again: the stand-in pack mapped, not rewritten
    assert kinds == {"int:Q8_0"} and pack.stat().st_mtime_ns == written
    np.testing.assert_array_equal(got, want)
    ready[Q5_0] = True  # the plan's native kernels are cached now
    m, kinds, got = load(first_run=True)
    assert m.stand_ins == {} and kinds == {"int"} and pack.stat().st_mtime_ns != written
    np.testing.assert_array_equal(got, want)
    rewritten = pack.stat().st_mtime_ns
    m, kinds, got = load()  # a plain load maps the native pack
    assert kinds == {"int"} and pack.stat().st_mtime_ns == rewritten
    np.testing.assert_array_equal(got, want)


PLAN = """
import json, sys
from kvchat.kernels.numba_start import install
install()
from kvchat.runtime.cparams import ContextParams
from kvchat.runtime.startup.compile_worker import plan
serial, rest = plan(sys.argv[1], ContextParams(n_ctx=128), 16)
name = lambda e: e[1] + "".join(" " + a.fmt.name for a in e[2] if hasattr(a, "fmt"))
print(json.dumps([[name(e) for e in serial], [name(e) for e in rest]]))
"""


def test_a_first_runs_plan_compiles_the_held_format_first_and_the_native_kernels_last(tmp_path):
    """From an empty numba cache (a subprocess): the serial set's integer matmul is Q8_0's only,
    the native Q5_0 twins and the vocabulary's kernels close the plan (a first run reads its
    vocabulary with their Python twins), and the plan reads no token text (none compiled)."""
    import json
    import os
    import subprocess
    import sys

    from tests.conftest import ROOT

    path = _mixed_model(tmp_path)
    cache_dir = tmp_path / "numba"
    env = dict(os.environ, NUMBA_CACHE_DIR=str(cache_dir), KVCHAT_CACHE=str(tmp_path / "kv"))
    out = subprocess.run(
        [sys.executable, "-c", PLAN, str(path)], env=env, cwd=ROOT, capture_output=True, text=True, check=True
    )
    serial, rest = json.loads(out.stdout.strip().splitlines()[-1])
    assert [e for e in serial if e.startswith("matmul_q")] == ["matmul_q_serial q8_0"]
    assert rest[-4:] == ["matmul_q_serial q5_0", "matmul_q q5_0", "scan_strings", "_build_table"]
    assert not [p for p in cache_dir.rglob("*") if "gguf_strings" in p.name or "string_array" in p.name]


VOCAB = """
import sys
from kvchat.kernels.numba_start import install
install()
from kvchat.kernels import gguf_strings
from kvchat.kernels.compile_plan import behind_workers, compile_entry
from kvchat.runtime.gguf import file, string_array
from kvchat.runtime.model import Model
from kvchat.runtime.startup.compile_worker import vocab_entries

TWINS = {"scan": gguf_strings.scan_strings_py, "table": string_array._build_table_py}
file.scan_strings_py = lambda *a: (print("python scan") or TWINS["scan"](*a))
string_array._build_table_py = lambda *a: (print("python table") or TWINS["table"](*a))
with behind_workers():
    a = Model.load(sys.argv[1]).vocab.tokenize("Hello there", add_special=False)
print("compiled")
for e in vocab_entries():
    compile_entry(e)
with behind_workers():
    b = Model.load(sys.argv[1]).vocab.tokenize("Hello there", add_special=False)
print(a == b)
"""


def test_a_first_run_reads_its_vocabulary_in_python_until_the_planned_kernels_are_compiled(tmp_path):
    """From an empty numba cache (a subprocess): a first run's load takes the Python twins of the
    vocabulary's kernels; once the plan's entries for them are compiled, the same load calls the
    kernels (the entries have the real calls' types), and both tokenize alike."""
    import os
    import subprocess
    import sys

    from tests.conftest import ROOT

    path = write_tiny_model(tmp_path / "m.gguf", n_vocab=300)  # a BPE vocabulary: tokens and merges
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "numba"), KVCHAT_CACHE=str(tmp_path / "kv"))
    out = subprocess.run(
        [sys.executable, "-c", VOCAB, str(path)], env=env, cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split("\n")
    first, second = out[: out.index("compiled")], out[out.index("compiled") + 1 :]
    assert "python scan" in first and "python table" in first
    assert "python scan" not in second and "python table" not in second
    assert second[-2] == "True"
