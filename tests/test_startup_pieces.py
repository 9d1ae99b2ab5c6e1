"""Start-up pieces: the first-run probe of numba's kernel cache (the CLI's "compiling kernels,
first run only" wording), cache loads without numba's compiler registries, and the serial twin
of row dequantization (embedding lookups)."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvchat.kernels import parallel
from kvchat.kernels.ggml_types import GGMLType
from kvchat.kernels.matmul import QMatrix
from kvchat.kernels.quants import dequantize
from tests.test_matmul import random_raw

INSTALL = "from kvchat.kernels.numba_start import install\ninstall()\n"  # as kvchat.cli.app.main does
PROBE = "from kvchat.kernels.jit_cache import kernels_compiled; print(kernels_compiled())"
REGISTRIES = ("numba.np.linalg", "numba.typed.typeddict", "numba.experimental.jitclass.base")
LOAD_CACHED = f"""
import sys, numpy as np
from kvchat.kernels.matmul import QMatrix
from tests.test_matmul import random_raw
qm = QMatrix(random_raw(2, 32, 64), 2, 64)
print(qm.matmul(np.arange(64, dtype=np.float32)[None]).tobytes().hex())
print(sorted(m for m in {REGISTRIES!r} if m in sys.modules))
"""


def test_an_empty_numba_cache_reads_as_a_first_run(tmp_path):
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]  # the probe compiled nothing


def test_a_compiled_matmul_reads_as_a_warm_cache():
    from kvchat.kernels.jit_cache import kernels_compiled

    qm = QMatrix(random_raw(GGMLType.Q4_0, 32, 64), GGMLType.Q4_0, 64)
    qm.matmul(np.ones((1, 64), np.float32))  # compiles (and caches) the serial kernel if needed
    assert kernels_compiled()


def test_a_cached_kernel_loads_in_a_new_process_without_numbas_compiler_registries():
    from tests.conftest import ROOT

    qm = QMatrix(random_raw(GGMLType.Q4_0, 32, 64), GGMLType.Q4_0, 64)
    expected = qm.matmul(np.arange(64, dtype=np.float32)[None])  # compiles (and caches) if needed
    out = subprocess.run(
        [sys.executable, "-c", INSTALL + LOAD_CACHED],
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    got, loaded = out.stdout.split("\n")[:2]
    assert got == expected.tobytes().hex()
    assert loaded == "[]"


def test_a_cache_miss_still_compiles_with_every_registry(tmp_path):
    """The lean load leaves compiling alone: a new kernel using np.cumsum (a numba.np.arraymath
    registration) compiles, is cached, and loads from the cache in the next process."""
    from tests.conftest import ROOT

    (tmp_path / "lean_probe.py").write_text(
        INSTALL + "import numpy as np\nfrom numba import njit\n"
        "@njit(cache=True)\ndef norm(x):\n    return np.cumsum(x * x)[-1]\n"
    )
    code = (
        "import numpy as np, lean_probe; print(lean_probe.norm(np.array([3.0, 4.0])), lean_probe.norm.stats.cache_hits)"
    )
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{ROOT}", NUMBA_CACHE_DIR=str(tmp_path / "cache"))
    runs = [
        subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout.split()
        for _ in range(2)
    ]
    assert runs[0][0] == runs[1][0] == "25.0"
    assert runs[0][1] == "Counter()" and runs[1][1] != "Counter()"  # compiled, then loaded


def test_a_kernel_loaded_from_the_cache_links_into_a_new_compile(tmp_path):
    """The lazy load keeps the kernel's bitcode unparsed until a new compile inlines the kernel:
    `outer` (not cached) compiles against `inner` loaded from the cache, then both give 7.0."""
    from tests.conftest import ROOT

    (tmp_path / "lazy_probe.py").write_text(
        INSTALL + "from numba import njit\n"
        "@njit(cache=True)\ndef inner(x):\n    return x * 3.0\n"
        "@njit(cache=True)\ndef outer(x):\n    return inner(x) + 1.0\n"
    )
    code = (
        "import lazy_probe as p\nr = p.inner(2.0)\n"
        "lib = p.inner.overloads[p.inner.signatures[0]].library\n"
        "print(r, '_kvchat_bitcode' in vars(lib), sum(p.inner.stats.cache_hits.values()), "
        "p.outer(2.0), '_kvchat_bitcode' in vars(lib))"
    )
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{ROOT}", NUMBA_CACHE_DIR=str(tmp_path / "cache"))
    subprocess.run([sys.executable, "-c", "import lazy_probe; lazy_probe.inner(2.0)"], env=env, check=True)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["6.0", "True", "1", "7.0", "False"]  # loaded lazily, parsed to link


ELF_SYMBOLS = """
import llvmlite.binding as ll
from numba.core import codegen
from kvchat.kernels.jit_cache import elf_defined_symbols
lazy = codegen.CPUCodeLibrary._unserialize.__func__
seen = []
def spy(cls, cg, state):
    obj, bitcode = state[2]
    module = ll.parse_bitcode(bitcode)
    numba_reads = {g.name for gs in (module.functions, module.global_variables) for g in gs
                   if not g.is_declaration}
    seen.append((elf_defined_symbols(obj) == numba_reads, len(numba_reads) > 0))
    return lazy(cls, cg, state)
codegen.CPUCodeLibrary._unserialize = classmethod(spy)
import numpy as np
from kvchat.kernels.matmul import QMatrix
from tests.test_matmul import random_raw
QMatrix(random_raw(2, 32, 64), 2, 64).matmul(np.ones((1, 64), np.float32))
print(len(seen) > 0 and all(a and b for a, b in seen))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ELF objects")
def test_the_symbols_read_from_a_cached_object_are_the_ones_numba_reads_from_its_bitcode():
    from tests.conftest import ROOT

    QMatrix(random_raw(GGMLType.Q4_0, 32, 64), GGMLType.Q4_0, 64).matmul(np.ones((1, 64), np.float32))
    out = subprocess.run(
        [sys.executable, "-c", INSTALL + ELF_SYMBOLS],
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    assert out.stdout.strip() == "True"


def test_a_file_that_is_not_an_elf_object_gets_no_symbol_set():
    from kvchat.kernels.jit_cache import elf_defined_symbols

    assert elf_defined_symbols(b"\xcf\xfa\xed\xfe" + bytes(100)) is None  # Mach-O: numba's own load
    assert elf_defined_symbols(b"\x7fELF") is None  # truncated


RELEASE = """
import numpy as np
from kvchat.kernels.matmul import QMatrix
from kvchat.runtime.weights.os_memory import release_library_pages
from tests.test_matmul import random_raw
qm = QMatrix(random_raw(2, 32, 64), 2, 64)
x = np.arange(64, dtype=np.float32)[None]
before = qm.matmul(x).tobytes().hex()
print(release_library_pages() > 0, release_library_pages() < (1 << 20))
print(qm.matmul(x).tobytes().hex() == before, QMatrix(random_raw(3, 32, 64), 3, 64).m)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/smaps and madvise")
def test_llvms_clean_pages_leave_the_resident_set_and_every_kernel_still_runs():
    from tests.conftest import ROOT

    QMatrix(random_raw(GGMLType.Q4_1, 32, 64), GGMLType.Q4_1, 64)  # compiled (and cached) if needed
    out = subprocess.run(
        [sys.executable, "-c", INSTALL + RELEASE],
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    assert out.stdout.split() == ["True", "True", "True", "32"]  # released once, then nothing left


PAGE_KINDS = """
import numpy as np
from kvchat.kernels.matmul import QMatrix
from kvchat.runtime.weights.os_memory import LIBRARIES, _clean_ranges_pagemap, _clean_ranges_smaps
from tests.test_matmul import random_raw
QMatrix(random_raw(2, 32, 64), 2, 64).matmul(np.ones((1, 64), np.float32))
pagemap, smaps = _clean_ranges_pagemap(LIBRARIES), _clean_ranges_smaps(LIBRARIES)
print(pagemap == smaps, len(pagemap) > 0, sum(r for _, _, r in pagemap) > 0)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/pagemap and smaps")
def test_pagemap_finds_the_same_clean_library_mappings_and_resident_bytes_as_smaps():
    from tests.conftest import ROOT

    out = subprocess.run(
        [sys.executable, "-c", INSTALL + PAGE_KINDS],
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    assert out.stdout.split() == ["True", "True", "True"]


@pytest.mark.parametrize("t", [GGMLType.Q4_1, GGMLType.Q4_K, GGMLType.Q6_K, GGMLType.F16])
def test_dequantized_rows_are_the_same_alone_and_in_a_batch(t, monkeypatch):
    k = 256
    raw = random_raw(t, 20, k, seed=3)
    batch = dequantize(raw, int(t), k)  # 20 rows: the parallel twin
    assert raw.shape[0] >= parallel.DEQUANT_PAR_MIN_ROWS
    for r in (0, 7, 19):
        np.testing.assert_array_equal(dequantize(raw[r : r + 1], int(t), k)[0], batch[r])  # serial twin
    monkeypatch.setattr(parallel, "DEQUANT_PAR_MIN_ROWS", 1 << 30)
    np.testing.assert_array_equal(dequantize(raw, int(t), k), batch)


@pytest.mark.parametrize("n_ctx", [256, 32])
def test_a_first_run_warm_up_covers_a_long_prompt_and_leaves_the_memory_empty(tiny_model, n_ctx, monkeypatch):
    """64 tokens reach every kernel's parallel twin; a context smaller than that still warms up."""
    from kvchat.runtime.context import Context
    from kvchat.runtime.cparams import ContextParams
    from kvchat.runtime.generate import decode_tokens, warm_up
    from kvchat.runtime.model import Model

    model = Model.load(tiny_model("llama"))
    ctx = Context(model, ContextParams(n_ctx=n_ctx, n_batch=64, n_ubatch=64))
    calls = []
    import kvchat.runtime.generate as gen

    real, real_one = gen.decode_tokens, gen.decode_one

    def spy(ctx_, ids, pos0, seq=0, **kw):
        calls.append((len(ids), pos0))
        return real(ctx_, ids, pos0, seq, **kw)

    def spy_one(ctx_, token, pos, seq=0):
        calls.append((1, pos))
        return real_one(ctx_, token, pos, seq)

    monkeypatch.setattr(gen, "decode_tokens", spy)
    monkeypatch.setattr(gen, "decode_one", spy_one)
    warm_up(ctx, 1, n_prompt=64)
    monkeypatch.undo()
    n = min(64, ctx.n_ctx_seq - 1)
    assert calls == [(n, 0), (1, n)]
    assert ctx.memory.seq_pos_max(0) == -1
    assert decode_tokens(ctx, [1, 2, 3], 0) is not None  # the context still decodes from position 0


@pytest.mark.parametrize("compiled", [False, True])
def test_the_cli_says_it_compiles_only_on_a_first_run(tiny_chat, monkeypatch, compiled):
    """open_engine words its spinners by the cache probe and warms up 64 tokens on a first run
    (in-process: KVCHAT_COMPILE_WORKERS=0; the workers' progress line is tests/test_compile_ahead's)."""
    import contextlib
    import io
    import threading

    import kvchat.cli.chat.setup as setup
    import kvchat.kernels.jit_cache
    import kvchat.kernels.warm_set
    import kvchat.runtime.generate
    from kvchat.cli.chat.render import Renderer
    from kvchat.cli.options import ChatSettings

    class Recording(Renderer):
        @contextlib.contextmanager
        def spinner(self, text):
            self.texts.append(text)
            yield

    warmed = []
    real_warm_up = kvchat.runtime.generate.warm_up
    monkeypatch.setenv("KVCHAT_COMPILE_WORKERS", "0")
    monkeypatch.setattr(kvchat.kernels.jit_cache, "kernels_compiled", lambda: compiled)
    monkeypatch.setattr(kvchat.kernels.warm_set, "covered", lambda name: False)  # no warm-up recorded yet
    monkeypatch.setattr(
        kvchat.runtime.generate,
        "warm_up",
        lambda ctx, tok, n_prompt=2: warmed.append(n_prompt) or real_warm_up(ctx, tok, n_prompt=n_prompt),
    )
    r = Recording(out=io.StringIO())
    r.texts = []
    setup.open_engine(ChatSettings(model=str(tiny_chat), ctx_size=256), r, threading.Event())
    first = [t for t in r.texts if "compiling kernels, first run only" in t]
    assert len(first) == (0 if compiled else 2)  # the load's spinner and the warm-up's
    assert warmed == [2 if compiled else 64]


LEAN_RUN = (
    "import atexit, sys\n"
    "atexit.register(lambda: sys.stderr.write('MODULES %r\\n' % sorted(m for m in "
    "('rich', 'pydantic', 'numba.np.arrayobj', 'typer', 'numpy.ma') if m in sys.modules)))\n"
    "from kvchat.cli.app import main\nmain()\n"
)


def test_a_plain_kvchat_run_imports_none_of_the_modules_a_warm_start_does_not_need(tiny_chat, tmp_path):
    """rich (stderr not a terminal and nothing to say), pydantic and typer (a plain command line),
    numba's array overloads, numpy.ma (no masked array exists): none is imported, and the answer is the one a
    run that imports rich (FORCE_COLOR makes rich treat stderr as a terminal: spinners) gives."""
    from tests.conftest import ROOT

    args = ["run", "-m", str(tiny_chat), "-p", "hi", "-n", "6", "--seed", "3", "--temp", "0.9", "-c", "256"]
    env = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "TTY_COMPATIBLE")}
    env["PYTHONPATH"] = str(ROOT)
    warm = subprocess.run([sys.executable, "-c", LEAN_RUN, *args], env=env, capture_output=True, cwd=tmp_path)
    assert warm.returncode == 0  # a cold cache compiles first (its progress lines use rich): a warm start is measured
    plain = subprocess.run(
        [sys.executable, "-c", LEAN_RUN, *args], env=env, capture_output=True, text=True, cwd=tmp_path, timeout=600
    )
    assert plain.returncode == 0, plain.stderr
    assert plain.stderr.strip().splitlines()[-1] == "MODULES []"
    forced = subprocess.run(
        [sys.executable, "-c", LEAN_RUN, *args],
        env=dict(env, FORCE_COLOR="1"),
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=600,
    )
    assert forced.returncode == 0, forced.stderr
    assert "'rich'" in forced.stderr.strip().splitlines()[-1]
    assert plain.stdout == forced.stdout and len(plain.stdout.strip()) > 0


def test_the_renderer_makes_its_stderr_console_only_when_it_shows_something(monkeypatch):
    import io

    from kvchat.cli.chat.render import Renderer

    monkeypatch.delenv("FORCE_COLOR", raising=False)
    monkeypatch.delenv("TTY_COMPATIBLE", raising=False)
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    r = Renderer(out=io.StringIO())
    with r.spinner("loading"):
        pass
    assert r._err is None  # not a terminal: no spinner, no console
    r.notice("resumed")
    assert r._err is not None and sys.stderr.getvalue() == "resumed\n"
    monkeypatch.setenv("FORCE_COLOR", "1")
    forced = Renderer(out=io.StringIO())
    assert forced._err_is_terminal() is True and forced.err.is_terminal is True


# ---- numba's start-up (kernels/numba_start.py) ----------------------------------------------------

EXTENSION_RUN = """
import sys, numpy as np
from numba import njit
from kvchat.kernels.numba_start import extensions_may_be_declared
@njit
def total(x):
    return x.sum()
print(extensions_may_be_declared(), total(np.arange(4.0)), 'numpy.ma' in sys.modules)
"""


def _fake_distribution(root, name, entry_points):
    info = root / f"{name}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(entry_points)


def test_a_declared_numba_extension_still_initialises_and_an_undeclared_one_costs_no_scan(tmp_path):
    from tests.conftest import ROOT

    plain, extended = tmp_path / "plain", tmp_path / "extended"
    _fake_distribution(plain, "tool", "[console_scripts]\ntool = tool:main\n")
    _fake_distribution(extended, "ext", "[numba_extensions]\ninit = ext_init:init\n")
    (extended / "ext_init.py").write_text("def init():\n    print('extension initialised')\n")
    runs = {}
    for name, root in (("plain", plain), ("extended", extended)):
        env = dict(os.environ, PYTHONPATH=f"{root}{os.pathsep}{ROOT}", NUMBA_CACHE_DIR=str(tmp_path / "cache"))
        runs[name] = subprocess.run(
            [sys.executable, "-c", INSTALL + EXTENSION_RUN],
            env=env,
            capture_output=True,
            text=True,
            check=True,
            cwd=tmp_path,
        ).stdout.split("\n")
    assert runs["plain"][0] == "False 6.0 False"  # no scan, no numpy.ma for typing the array
    assert runs["extended"][:2] == ["extension initialised", "True 6.0 False"]


def test_numba_reads_no_distribution_as_declaring_an_extension_where_the_cheap_check_finds_none():
    """The check is a superset of numba's own scan in this environment (and exercised: no
    extension is installed here, so kvchat's runs skip the scan)."""
    from importlib import metadata

    from kvchat.kernels.numba_start import extensions_may_be_declared

    declared = list(metadata.entry_points().select(group="numba_extensions"))
    assert extensions_may_be_declared() or not declared
    assert not declared and extensions_may_be_declared() is False


TYPEOF = """
import sys, numpy as np, numba
if sys.argv[1] == "kvchat":
    from kvchat.kernels.numba_start import install
    install()
a = np.arange(24, dtype=np.float32).reshape(4, 6)
ro = a.copy(); ro.flags.writeable = False
cases = [a, a.T, a[:, ::2], ro, np.zeros(3, np.int8), np.zeros((2, 2), np.complex128), np.float16([1]),
         np.zeros(0, np.uint64), np.array([True]), a.view(type("Sub", (np.ndarray,), {}))]
print([str(numba.typeof(c)) for c in cases], 'numpy.ma' in sys.modules)
import numpy.ma
try:
    numba.typeof(numpy.ma.masked_array([1, 2]))
except Exception as e:
    print(type(e).__name__, e)
"""


def test_arrays_get_numbas_types_before_and_after_numpy_ma_is_imported():
    from tests.conftest import ROOT

    env = dict(os.environ, PYTHONPATH=str(ROOT))
    said = [
        subprocess.run(
            [sys.executable, "-c", TYPEOF, who], env=env, capture_output=True, text=True, check=True, cwd=ROOT
        ).stdout.splitlines()
        for who in ("numba", "kvchat")
    ]
    assert said[0][0].endswith("True") and said[1][0].endswith("False")  # numba's own imports numpy.ma
    assert said[0][0][:-4] == said[1][0][:-5] and said[0][1:] == said[1][1:]
    assert "MaskedArray" in said[1][1]


def test_a_kernel_sets_up_its_cache_when_first_called_and_loads_from_it_in_the_next_process(tmp_path):
    from tests.conftest import ROOT

    (tmp_path / "late_probe.py").write_text(
        INSTALL + "from numba import njit\n@njit(cache=True)\ndef twice(x):\n    return 2 * x\n"
    )
    code = (
        "import late_probe as p\nbefore = p.twice._cache._made is None\n"
        "print(before, p.twice(21), p.twice._cache._made is not None, sum(p.twice.stats.cache_hits.values()))"
    )
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{ROOT}", NUMBA_CACHE_DIR=str(tmp_path / "cache"))
    runs = [
        subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout.split()
        for _ in range(2)
    ]
    assert runs == [["True", "42", "True", "0"], ["True", "42", "True", "1"]]  # compiled, then loaded


# ---- the warm-up skipped when it could only load kernels (kernels/warm_set.py) --------------------


COUNTED_RUN = (
    "import pathlib, sys\n"
    "import kvchat.kernels.warm_set as ws\n"
    "ws._path = lambda name: pathlib.Path(sys.argv[1]) / f'{name}.pkl'\n"
    "import kvchat.runtime.generate as g\n"
    "real = g.warm_up\n"
    "g.warm_up = lambda *a, **k: (sys.stderr.write('WARM-UP\\n'), real(*a, **k))[1]\n"
    "from kvchat.cli.app import main\n"
    "main(sys.argv[2:])\n"
)  # `kvchat ARGS` in a fresh process (a warm set notes what its process loaded), its warm-ups on stderr


def counted_run(folder, *args):
    """(stdout, warm-ups) of a fresh `kvchat ARGS` whose warm sets live in `folder`."""
    r = subprocess.run([sys.executable, "-c", COUNTED_RUN, str(folder), *args], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return r.stdout, r.stderr.count("WARM-UP")


def test_a_warm_run_skips_the_warm_up_once_its_kernels_are_recorded_and_still_cached(tiny_chat, tmp_path, monkeypatch):
    """First `run`: the warm-up runs and its kernels are recorded; the next skips it and answers
    the same bytes (the chat keeps it); a recorded kernel without a cache entry brings it back."""
    import io
    import pickle
    import threading

    import kvchat.kernels.warm_set as warm_set
    import kvchat.runtime.generate
    from kvchat.cli.chat.render import Renderer
    from kvchat.cli.chat.setup import open_engine
    from kvchat.cli.options import ChatSettings

    args = ["run", "-m", str(tiny_chat), "-p", "hi", "-n", "6", "-c", "256", "--seed", "5", "--temp", "0.8"]
    (first, warm1), (second, warm2) = counted_run(tmp_path, *args), counted_run(tmp_path, *args)
    assert (warm1, warm2) == (1, 0)
    assert first == second and len(first.strip()) > 0
    monkeypatch.setattr(warm_set, "_path", lambda name: tmp_path / f"{name}.pkl")
    warmed = []
    real_warm_up = kvchat.runtime.generate.warm_up
    monkeypatch.setattr(kvchat.runtime.generate, "warm_up", lambda *a, **k: warmed.append(1) or real_warm_up(*a, **k))
    open_engine(ChatSettings(model=str(tiny_chat), ctx_size=256), Renderer(out=io.StringIO()), threading.Event())
    assert warmed == [1]  # the chat warms up while its user reads the prompt, cached or not
    (recorded,) = tmp_path.glob("*.pkl")
    fmt, entries = pickle.loads(recorded.read_bytes())
    kernels_recorded = {(m, q) for m, q, _ in entries}
    assert ("kvchat.kernels.matmul_int", "matmul_q_serial") in kernels_recorded and len(entries) >= 8
    module, qualname, sig = entries[0]
    recorded.write_bytes(pickle.dumps((fmt, entries + [(module, qualname, sig[:-1])])))  # never compiled
    third, warm3 = counted_run(tmp_path, *args)
    assert warm3 == 1 and third == first
    assert warm_set.covered(recorded.stem)  # the warm-up recorded the set as it is now


PROBE_RECORD = (
    "import pathlib, sys\n"
    "import numpy as np\n"
    "from kvchat.kernels.numba_start import install\n"
    "install()\n"
    "import kvchat.kernels.warm_set as ws\n"
    "ws._path = lambda name: pathlib.Path(sys.argv[1]) / f'{name}.pkl'\n"
    "from kvchat.kernels.ggml_types import GGMLType\n"
    "from kvchat.kernels.matmul import QMatrix\n"
    "from tests.test_matmul import random_raw\n"
    "QMatrix(random_raw(GGMLType.Q4_0, 32, 64), GGMLType.Q4_0, 64).matmul(np.ones((1, 64), np.float32))\n"
    "print(ws.record('probe'))\n"
)  # one matmul in a fresh process, its kernels recorded as set "probe"


def test_a_recorded_warm_up_is_not_trusted_when_a_kernels_index_is_stale(tmp_path, monkeypatch):
    """numba's own index lookup decides: an index for other source (another stamp) holds nothing."""
    import kvchat.kernels.warm_set as warm_set

    root = Path(__file__).resolve().parent.parent
    r = subprocess.run([sys.executable, "-c", PROBE_RECORD, str(tmp_path)], capture_output=True, text=True, cwd=root)
    assert r.stdout.strip() == "True", r.stderr
    monkeypatch.setattr(warm_set, "_path", lambda name: tmp_path / f"{name}.pkl")
    assert warm_set.covered("probe")
    from kvchat.kernels.matmul_int import matmul_q_serial

    cache_file = matmul_q_serial._cache._cache_file
    monkeypatch.setattr(cache_file, "_source_stamp", ("another", "source"))
    assert not warm_set.covered("probe")
    assert not warm_set.covered("never-recorded")


def test_only_the_most_recent_warm_sets_are_kept(tmp_path, monkeypatch):
    """record() keeps KEEP sets: the oldest go, a new one and the other recent ones stay."""
    import os

    import kvchat.kernels.warm_set as warm_set

    monkeypatch.setattr(warm_set, "_path", lambda name: tmp_path / f"{warm_set.PREFIX}{name}{warm_set.SUFFIX}")
    monkeypatch.setattr(warm_set, "KEEP", 3)
    monkeypatch.setattr(warm_set, "_used", {("numpy", "dot", ()): __import__("numpy").dot})
    for i in range(5):
        old = tmp_path / f"{warm_set.PREFIX}old{i}{warm_set.SUFFIX}"
        old.write_bytes(b"x")
        os.utime(old, ns=(10**18 + i, 10**18 + i))  # written one after another, long ago
    other = tmp_path / "index.nbi"
    other.write_bytes(b"numba's own file")
    assert warm_set.record("new")
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted(["index.nbi"] + [f"{warm_set.PREFIX}{n}{warm_set.SUFFIX}" for n in ("new", "old3", "old4")])
