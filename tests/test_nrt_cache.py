"""kernels/nrt_cache.py: numba's runtime module compiled once, then loaded from the cache."""

import os
import subprocess
import sys

import numpy as np

from tests.conftest import ROOT

# a cached kernel that needs the NRT (it allocates and returns an array), called in a new process
SCRIPT = """
import numpy as np
from kvchat.kernels.numba_start import install
install()  # as kvchat.cli.app.main does (the NRT cache is part of its lean cache loads)
import kvchat.kernels.nrt_cache as nc
hows = []
real = nc.initialize
nc.initialize = lambda ctx: hows.append(real(ctx)) or hows[-1]
from numba import njit

@njit(cache=True)
def ramp(n):
    out = np.empty(n, np.float32)
    for i in range(n):
        out[i] = np.float32(i) * np.float32(0.5) + np.float32(1.0)
    return out[1:] * out[:-1]

result = ramp(33).tobytes().hex()
print(hows and hows[0])
print(result)
"""


def _run(tmp_path):
    (tmp_path / "nrt_probe.py").write_text(SCRIPT)
    env = dict(
        os.environ, NUMBA_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)])
    )
    out = subprocess.run(
        [sys.executable, "-c", "import nrt_probe"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        cwd=tmp_path,
        timeout=600,
    )
    how, result = out.stdout.split("\n")[:2]
    return how, result


def _nrt_files(tmp_path):
    return sorted((tmp_path / "cache").glob("kvchat-nrt-*.nbo"))


def test_the_nrt_compiles_once_then_loads_from_the_cache_with_the_same_results(tmp_path):
    ramp = np.arange(33, dtype=np.float32) * np.float32(0.5) + np.float32(1.0)
    first = _run(tmp_path)
    assert first == ("compiled", (ramp[1:] * ramp[:-1]).tobytes().hex())
    files = _nrt_files(tmp_path)
    assert len(files) == 1
    assert _run(tmp_path) == ("cached", first[1])
    assert _nrt_files(tmp_path) == files  # read, not rewritten under another name


def test_a_stale_or_broken_nrt_file_is_rebuilt(tmp_path):
    first = _run(tmp_path)
    (path,) = _nrt_files(tmp_path)
    stale = path.with_name("kvchat-nrt-" + "0" * 32 + ".nbo")  # another numba, CPU or IR
    path.rename(stale)
    assert _run(tmp_path) == ("compiled", first[1])
    assert _nrt_files(tmp_path) == [path]  # the stale file is gone, this key's written
    path.write_bytes(path.read_bytes()[:100])  # truncated
    assert _run(tmp_path) == ("compiled", first[1])
    assert _run(tmp_path) == ("cached", first[1])
