"""What kvchat changes in numba and llvmlite, applied by one explicit `install()` — called by the
CLI's entry point (kvchat.cli.app.main) and the compile workers (kvchat.runtime.startup.compile_worker)
before numba is first imported; importing kvchat.kernels changes nothing.

`install()` applies, in this order (pieces(); each returns False and leaves numba as it is when
this numba differs from what it expects; tests/test_numba_patches.py fails when one no longer
applies on the numba/llvmlite range pyproject.toml pins):
- `cache_writes`: numba's cache saves safe with several writers (kernels/cache_writes.py) — the
  compile workers and the chat write one cache at once;
- `warm_set`: the record of the kernels a warm-up loaded (kernels/warm_set.py);
- the start-up pieces below and kernels/jit_cache.py's `lean_cache_loads` (cached kernels load
  without numba's compiler set-up, the NRT from a cache), kept because each measurably shortens
  a warm start (docs/performance.md "Start-up" has each one's saving, side by side).
`KVCHAT_STARTUP_SKIP=name,...` leaves the named pieces out (benchmarks/startup_pieces.py and
benchmarks/startup.py --skip measure a piece's worth that way). Removed in #23 because they did
not measurably pay (docs/performance.md): a LazyLoader importlib.metadata put in sys.modules,
numba imported with PyYAML hidden, numba's llvm_lock events skipped without a listener.

The start-up pieces keep numba's behaviour for everything a caller could observe:
- `cheap_extension_scan()`: numba scans every installed distribution's entry points (through
  importlib.metadata) for `numba_extensions` when the first kernel loads. It is skipped when no
  distribution's `entry_points.txt` names the group, read directly from the directories
  importlib.metadata searches; anything else (a name found, a zip or egg file on sys.path,
  another kind of finder) runs numba's own.
- `arrays_typed_without_numpy_ma()`: typing an array argument asks whether it is a
  numpy.ma.MaskedArray, which imports numpy.ma on first use; before numpy.ma is imported no such
  array can exist, so numba's own code runs with a stand-in class no object is an instance of.
- `dispatchers_made_cheaply()`: ~140 kernels are decorated at import and a run calls ~25. Each
  decoration computed the function's signature twice (the dispatcher and its compiler) and set
  up its cache (finding and test-writing the cache directory, hashing the source); the second
  signature is the first one, and the cache is set up when the kernel first compiles or loads.
"""

from __future__ import annotations

import os
import sys

SKIP_ENV = "KVCHAT_STARTUP_SKIP"


def _lean_cache_loads() -> bool:
    from kvchat.kernels.jit_cache import lean_cache_loads

    return lean_cache_loads()


def _cache_writes() -> bool:
    from kvchat.kernels import cache_writes

    return cache_writes.install()


def _warm_set() -> bool:
    from kvchat.kernels import warm_set

    return warm_set.install()


def pieces() -> list:
    """(name, function) in the order install() applies them. lean_cache_loads replaces numba's
    load_overload and warm_set wraps whatever is there, so warm_set comes after it (the other
    order drops warm_set's notes: no warm set is ever recorded and every warm run warms up)."""
    return [
        ("cache_writes", _cache_writes),
        ("lean_cache_loads", _lean_cache_loads),
        ("warm_set", _warm_set),
        ("cheap_extension_scan", cheap_extension_scan),
        ("arrays_typed_without_numpy_ma", arrays_typed_without_numpy_ma),
        ("dispatchers_made_cheaply", dispatchers_made_cheaply),
    ]


_installed: dict = {}


def install() -> dict:
    """Apply every piece not named in KVCHAT_STARTUP_SKIP, once per process; returns
    {name: True if applied}."""
    if _installed:
        return dict(_installed)
    import kvchat.kernels  # noqa: F401 (numba's threading environment first)

    skip = {s.strip() for s in os.environ.get(SKIP_ENV, "").split(",") if s.strip()}
    for name, apply in pieces():
        _installed[name] = False if name in skip else bool(apply())
    return dict(_installed)


GROUP = b"numba_extensions"


def extensions_may_be_declared() -> bool:
    """False only when no distribution importlib.metadata would find declares GROUP: it finds
    them through sys.meta_path's find_distributions (the path finder: *.dist-info, *.egg-info,
    and an .egg directory's EGG-INFO, in each sys.path directory)."""
    from importlib.machinery import PathFinder

    if any(hasattr(f, "find_distributions") and f is not PathFinder for f in sys.meta_path):
        return True
    for entry in sys.path:
        root = entry or "."
        try:
            children = os.scandir(root)
        except NotADirectoryError:
            return True  # a zip or egg file: numba's scan reads it
        except OSError:
            continue  # missing: nothing there for importlib.metadata either
        egg = os.path.basename(root).lower().endswith(".egg")
        with children:
            for child in children:
                low = child.name.lower()
                if not (low.endswith((".dist-info", ".egg-info")) or (egg and low == "egg-info")):
                    continue
                try:
                    with open(os.path.join(child.path, "entry_points.txt"), "rb") as f:
                        if GROUP in f.read():
                            return True
                except OSError:
                    continue  # none (or a PKG-INFO file): no entry points
    return False


def cheap_extension_scan() -> bool:
    from numba.core import entrypoints

    numba_init_all = entrypoints.init_all
    if getattr(numba_init_all, "_kvchat", False):
        return True
    if not hasattr(entrypoints, "_already_initialized"):
        return False

    def init_all():
        if not entrypoints._already_initialized and not extensions_may_be_declared():
            entrypoints._already_initialized = True  # numba's scan would find nothing to run
        numba_init_all()

    init_all._kvchat = True
    init_all.__doc__ = numba_init_all.__doc__
    entrypoints.init_all = init_all
    return True


class _NoMaskedArray:
    """Stands for numpy.ma.MaskedArray while numpy.ma is not imported: nothing is an instance."""


class _NumpyWithoutMa:
    """numpy, except that `.ma.MaskedArray` is _NoMaskedArray (and importing nothing)."""

    class ma:
        MaskedArray = _NoMaskedArray

    def __getattr__(self, name):
        import numpy

        return getattr(numpy, name)


def arrays_typed_without_numpy_ma() -> bool:
    import types

    import numpy as np
    from numba.core.typing import typeof

    numba_typeof = typeof.typeof_impl.registry.get(np.ndarray)
    if getattr(numba_typeof, "_kvchat", False):
        return True
    if numba_typeof is None or numba_typeof.__globals__.get("np") is not np:
        return False
    before_ma = types.FunctionType(
        numba_typeof.__code__,
        dict(numba_typeof.__globals__, np=_NumpyWithoutMa()),
        numba_typeof.__name__,
        numba_typeof.__defaults__,
        numba_typeof.__closure__,
    )

    def typeof_ndarray(val, c):
        return (numba_typeof if "numpy.ma" in sys.modules else before_ma)(val, c)

    typeof_ndarray._kvchat = True
    typeof.typeof_impl.register(np.ndarray)(typeof_ndarray)
    return True


class LazyFunctionCache:
    """numba's FunctionCache for py_func, made when first used (dispatchers_made_cheaply)."""

    def __init__(self, py_func):
        self._py_func = py_func
        self._made = None

    def __getattr__(self, name):
        if self._made is None:
            from numba.core.caching import FunctionCache

            self._made = FunctionCache(self._py_func)
        return getattr(self._made, name)


def dispatchers_made_cheaply() -> bool:
    from numba.core import dispatcher, utils

    if getattr(utils.pysignature, "_kvchat", False):
        return True
    if not hasattr(dispatcher, "_FunctionCompiler") or not hasattr(dispatcher.Dispatcher, "enable_caching"):
        return False
    numba_signature = utils.pysignature
    last = [None, None, None]  # function, its __defaults__, signature

    def pysignature(fn):
        """inspect.signature, remembering the last function's (asked twice per dispatcher)."""
        if last[0] is fn and last[1] is getattr(fn, "__defaults__", None):
            return last[2]
        sig = numba_signature(fn)
        last[:] = fn, getattr(fn, "__defaults__", None), sig
        return sig

    def enable_caching(self):
        self._cache = LazyFunctionCache(self.py_func)

    pysignature._kvchat = True
    utils.pysignature = pysignature
    dispatcher.Dispatcher.enable_caching = enable_caching
    return True
