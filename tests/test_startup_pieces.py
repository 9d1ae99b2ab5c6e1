"""Start-up pieces: the first-run probe of numba's kernel cache (the CLI's "compiling kernels,
first run only" wording) and the serial twin of row dequantization (embedding lookups)."""
import os
import subprocess
import sys

import numpy as np
import pytest

from kernels import parallel
from kernels.ggml_types import GGMLType
from kernels.matmul import QMatrix
from kernels.quants import dequantize
from tests.test_matmul import random_raw

PROBE = "from kernels.jit_cache import kernels_compiled; print(kernels_compiled())"


def test_an_empty_numba_cache_reads_as_a_first_run(tmp_path):
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]  # the probe compiled nothing


def test_a_compiled_matmul_reads_as_a_warm_cache():
    from kernels.jit_cache import kernels_compiled
    qm = QMatrix(random_raw(GGMLType.Q4_0, 32, 64), GGMLType.Q4_0, 64)
    qm.matmul(np.ones((1, 64), np.float32))  # compiles (and caches) the serial kernel if needed
    assert kernels_compiled()


@pytest.mark.parametrize("t", [GGMLType.Q4_1, GGMLType.Q4_K, GGMLType.Q6_K, GGMLType.F16])
def test_dequantized_rows_are_the_same_alone_and_in_a_batch(t, monkeypatch):
    k = 256
    raw = random_raw(t, 20, k, seed=3)
    batch = dequantize(raw, int(t), k)  # 20 rows: the parallel twin
    assert raw.shape[0] >= parallel.DEQUANT_PAR_MIN_ROWS
    for r in (0, 7, 19):
        np.testing.assert_array_equal(dequantize(raw[r:r + 1], int(t), k)[0], batch[r])  # serial twin
    monkeypatch.setattr(parallel, "DEQUANT_PAR_MIN_ROWS", 1 << 30)
    np.testing.assert_array_equal(dequantize(raw, int(t), k), batch)
