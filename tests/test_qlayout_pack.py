"""The compiled repack (kernels/qlayout_pack.py) writes the bytes of the numpy build it replaced
(kernels/qlayout_numpy.py), for every weight type, partial row groups and sliced matrices alike."""

import numpy as np
import pytest

from kvchat.kernels import qlayout, qlayout_numpy
from kvchat.kernels.ggml_types import GGMLType
from kvchat.kernels.qlayout import FORMATS, repack_int
from kvchat.kernels.qlayout_numpy import repack_reference
from tests.test_matmul import random_raw


def assert_same_packed(got, want):
    assert got[0] == want[0]
    for name, a, b in zip(want[1]._fields, got[1], want[1]):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        np.testing.assert_array_equal(a, b, err_msg=name)


@pytest.mark.parametrize("t", list(FORMATS), ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, 37, 96])
def test_every_format_packs_to_the_numpy_builds_bytes(t, m):
    k = 512
    raw = random_raw(t, m, k, seed=m)
    raw[:, ::7] = 255  # every bit set somewhere: high bits, bit planes, sign bits, 6-bit scales
    assert_same_packed(repack_int(raw, t, k), repack_reference(raw, t, k))


@pytest.mark.parametrize("t", list(FORMATS), ids=lambda t: t.name)
def test_a_matrix_packed_in_slices_equals_one_packed_at_once(t, monkeypatch):
    k = 256
    raw = random_raw(t, 100, k, seed=5)
    want = repack_reference(raw, t, k)
    monkeypatch.setattr(qlayout, "REPACK_ROWS", 32)
    seen = []
    got = repack_int(raw, t, k, done=lambda part: seen.append(part.shape[0]))
    assert seen == [32, 32, 32, 4]  # every row read once, then handed back
    assert_same_packed(got, want)


def test_read_only_rows_pack_like_writable_ones():
    t, k = next(iter(FORMATS)), 256
    raw = random_raw(t, 64, k, seed=9)
    ro = raw.copy()
    ro.flags.writeable = False
    assert_same_packed(repack_int(ro, t, k), repack_int(raw, t, k))


@pytest.mark.parametrize("t", list(FORMATS), ids=lambda t: t.name)
def test_a_small_models_first_repack_takes_numpy_and_writes_the_same_bytes(t, monkeypatch):
    from kvchat.kernels import qlayout_pack

    k = 256
    raw = random_raw(t, 100, k, seed=9)
    raw[:, ::5] = 255
    want = repack_int(raw, t, k)
    monkeypatch.setattr(qlayout_numpy, "_compiled_pack_ready", lambda: False)
    monkeypatch.setattr(qlayout, "REPACK_ROWS", 32)  # slices and a partial last row group

    def refuse(*args):
        raise AssertionError("the compiled pass ran")

    monkeypatch.setattr(qlayout_pack, "pack_rows", refuse)
    with qlayout_numpy.model_repack(qlayout_numpy.NUMPY_REPACK_BELOW - 1):
        got = repack_int(raw, t, k)
    assert_same_packed(got, want)
    if t != GGMLType.MXFP4:  # mxfp4 only moves bytes, with numpy always
        with (
            qlayout_numpy.model_repack(qlayout_numpy.NUMPY_REPACK_BELOW),
            pytest.raises(AssertionError, match="compiled pass"),
        ):
            repack_int(raw, t, k)  # a large model compiles the pass: it is 4x faster


def test_the_compiled_pass_counts_as_ready_once_compiled_or_inside_a_dry_run(monkeypatch):
    from kvchat.kernels.compile_plan import dry_run

    with dry_run():
        assert qlayout_numpy._compiled_pack_ready()
    t = next(iter(FORMATS))
    raw = random_raw(t, 32, 256, seed=1)
    repack_int(raw, t, 256)  # compiled (or loaded) here
    assert qlayout_numpy._compiled_pack_ready()
    with qlayout_numpy.model_repack(1):
        assert qlayout._numpy_fill is None
    with monkeypatch.context() as m:
        m.setattr(qlayout_numpy, "_compiled_pack_ready", lambda: False)
        with qlayout_numpy.model_repack(1):
            assert qlayout._numpy_fill is qlayout_numpy.fill_rows
    assert qlayout._numpy_fill is None
