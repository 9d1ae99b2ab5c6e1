"""kernels/compile_plan.py (a dry run lists the kernels a call path needs without compiling them;
one entry compiles on its own) and kernels/cache_writes.py (numba's cache saves with several
writers), on small kernels of a module written in a temporary folder (its own numba cache)."""

import os
import subprocess
import sys
import textwrap
import uuid

import numpy as np
import pytest

from tests.conftest import ROOT

MODULE = textwrap.dedent(
    '''
    import numpy as np
    from numba import njit

    @njit(cache=True)
    def inner(x):
        return x * 2

    @njit(cache=True)
    def outer(a, out):
        for i in range(a.shape[0]):
            out[i] = inner(a[i]) + 1
    '''
)


@pytest.fixture
def kmod(tmp_path, monkeypatch):
    """A fresh module `kp_<n>` with two cached kernels (outer calls inner), importable here."""
    name = f"kp_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib

    return importlib.import_module(name)


def test_a_dry_run_lists_the_kernels_called_compiles_none_and_leaves_no_trace(kmod):
    from kvchat.kernels.compile_plan import dry_run

    a = np.arange(4, dtype=np.float32)
    out = np.zeros(4, np.float32)
    with dry_run() as entries:
        kmod.outer(a, out)
        kmod.outer(a, out)  # once in the list
        kmod.outer(a.astype(np.int64), out)
    assert [(m, q) for m, q, _ in entries] == [(kmod.__name__, "outer")] * 2
    assert [str(t) for t in entries[0][2]] == ["array(float32, 1d, C)", "array(float32, 1d, C)"]
    assert [str(t) for t in entries[1][2]] == ["array(int64, 1d, C)", "array(float32, 1d, C)"]
    assert out.tolist() == [0, 0, 0, 0]  # nothing ran
    assert len(kmod.outer.overloads) == 0 and len(kmod.inner.overloads) == 0  # nothing compiled, no stand-in left
    kmod.outer(a, out)  # after the block: numba compiles and runs as usual
    assert out.tolist() == [1, 3, 5, 7]


def test_a_compiled_kernel_runs_for_real_inside_a_dry_run(kmod):
    from kvchat.kernels.compile_plan import dry_run

    a = np.arange(3, dtype=np.float32)
    out = np.zeros(3, np.float32)
    kmod.outer(a, out)
    out[:] = 0
    with dry_run() as entries:
        kmod.outer(a, out)
    assert entries == [] and out.tolist() == [1, 3, 5]


def test_an_entry_compiles_into_the_cache_and_the_next_process_only_loads_it(kmod, tmp_path):
    from kvchat.kernels.compile_plan import compile_entry, dry_run, is_cached

    a = np.arange(3, dtype=np.float32)
    out = np.zeros(3, np.float32)
    with dry_run() as entries:
        kmod.outer(a, out)
    (entry,) = entries
    assert not is_cached(entry)
    compile_entry(entry)
    assert is_cached(entry)
    assert len(kmod.outer.overloads) == 1  # compiled, not called
    code = textwrap.dedent(
        f"""
        import sys, numpy as np
        sys.path.insert(0, {str(tmp_path)!r})
        import {kmod.__name__} as m
        out = np.zeros(3, np.float32)
        m.outer(np.arange(3, dtype=np.float32), out)
        print(out.tolist(), sum(m.outer.stats.cache_hits.values()), sum(m.outer.stats.cache_misses.values()))
        """
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert res.stdout.strip() == "[1.0, 3.0, 5.0] 1 0"  # loaded from the cache (a hit), nothing compiled
    with pytest.raises(LookupError):
        compile_entry((kmod.__name__, "no_such_kernel", entry[2]))


def test_a_cache_save_writes_the_data_before_the_index_names_it(kmod, monkeypatch):
    from numba.core import caching

    from kvchat.kernels import cache_writes

    assert cache_writes.install()
    order = []
    cls = caching.IndexDataCacheFile
    save_index, save_data = cls._save_index, cls._save_data
    monkeypatch.setattr(cls, "_save_index", lambda self, o: (order.append("index"), save_index(self, o))[1])
    monkeypatch.setattr(cls, "_save_data", lambda self, n, d: (order.append("data"), save_data(self, n, d))[1])
    kmod.inner(np.float64(1.0))
    assert order == ["data", "index"]


WRITER = textwrap.dedent(
    """
    import sys, time
    from kvchat.kernels.numba_start import install
    install()
    from numba.core import caching
    load_index = caching.IndexDataCacheFile._load_index
    def slow_load_index(self):  # widens the window between reading the index and writing it
        got = load_index(self)
        time.sleep(0.3)
        return got
    caching.IndexDataCacheFile._load_index = slow_load_index
    sys.path.insert(0, sys.argv[1])
    import numpy as np
    import {name} as m
    t_start = float(sys.argv[3])
    while time.time() < t_start:  # both writers start their compiles together
        time.sleep(0.005)
    for dt in sys.argv[2].split(","):
        m.inner(np.dtype(dt).type(3))
    """
)


def test_two_processes_compiling_one_kernel_at_once_keep_every_signature(kmod, tmp_path):
    """Without the lock both writers read the same index (each reading held open 0.3 s here), take
    the same data file name, and the index written last loses the other's entry."""
    import time

    script = tmp_path / "writer.py"
    script.write_text(WRITER.format(name=kmod.__name__))
    go = repr(time.time() + 3.0)
    kinds = [["int8", "int16", "int32", "int64"], ["float32", "float64", "uint8", "uint16"]]
    procs = [subprocess.Popen([sys.executable, str(script), str(tmp_path), ",".join(k), go], cwd=ROOT) for k in kinds]
    assert [p.wait(timeout=600) for p in procs] == [0, 0]
    check = textwrap.dedent(
        f"""
        import sys, numpy as np
        sys.path.insert(0, {str(tmp_path)!r})
        import {kmod.__name__} as m
        for dt in {kinds[0] + kinds[1]!r}:
            v = m.inner(np.dtype(dt).type(3))
            assert v == 6, (dt, v)
        print(sum(m.inner.stats.cache_misses.values()), len(m.inner.overloads))
        """
    )
    res = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, cwd=ROOT, check=True)
    assert res.stdout.split() == ["0", "8"]  # all eight signatures loaded, none compiled again


def test_a_kernels_twins_are_one_job_and_such_jobs_go_first():
    """Twins share their body (a cached kernel both call): one worker compiles them in turn."""
    from kvchat.runtime.startup.compile_ahead import jobs_of

    entries = [("m", "embed", "s1"), ("k", "matmul_q", "q4"), ("a", "flash_par", "s"), ("a", "flash_ser", "s")]
    entries += [("k", "matmul_q_serial", "q4"), ("m", "embed", "s2"), ("a", "flash_parity", "s")]
    jobs = [[i for i, _ in job] for job in jobs_of(entries)]
    assert jobs == [[1, 4], [0, 5], [2, 3], [6]]  # the matmul twins: a known long compile
    assert sorted(i for job in jobs for i in job) == list(range(len(entries)))


def test_the_known_long_compiles_go_first_so_the_first_answer_waits_for_the_longest_only():
    """A serial set planned short-first left its longest kernel (flash attention) to start last,
    one worker idle meanwhile; the known long ones go first, the rest keep the plan's order."""
    from kvchat.runtime.startup.compile_ahead import jobs_of

    names = ["_powf", "_rms_norm_ser", "matmul_q_serial", "build_kq_mask", "_prep_store_tokens", "_flash_units"]
    entries = [("k", name, "s") for name in names] + [("k", "matmul_q_serial", "q8")]
    order = [entries[job[0][0]][1] for job in jobs_of(entries, twins=False)]
    assert order == ["_flash_units", "matmul_q_serial", "matmul_q_serial", "_prep_store_tokens"] + [
        "_powf",
        "_rms_norm_ser",
        "build_kq_mask",
    ]
