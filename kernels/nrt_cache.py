"""numba's runtime (NRT) module from a disk cache instead of LLVM on every start.

numba's NRT is a small LLVM module (atomic reference counts, meminfo access, the abort for an
unresolved symbol) that `rtsys.initialize` builds and compiles with LLVM in every process, at
the first kernel call: ~0.045 s of each warm start (docs/performance.md "Start-up"), the same
machine code every time. `initialize(ctx)` does what rtsys.initialize does, but keeps the
compiled object (and its bitcode, for compiles that link the NRT in) next to numba's kernel
cache, named by a hash of everything the code depends on: the module's IR text, the target
(triple, CPU name, features), numba's and llvmlite's versions and the LLVM optimisation
settings. Any change of those names another file, which is compiled and written once; a
file that cannot be read or written means compiling as numba does.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import tempfile
from pathlib import Path

PREFIX = "kvchat-nrt-"
SUFFIX = ".nbo"


def cache_dir() -> Path:
    """Where numba caches kvchat's kernels: NUMBA_CACHE_DIR, else kernels/__pycache__."""
    from numba.core import config

    return Path(config.CACHE_DIR) if config.CACHE_DIR else Path(__file__).resolve().parent / "__pycache__"


def cache_key(ctx, ir_text: str) -> str:
    import llvmlite
    import numba
    from numba.core import config

    settings = (
        numba.__version__,
        llvmlite.__version__,
        ctx.codegen().magic_tuple(),
        config.OPT,
        config.LOOP_VECTORIZE,
        config.SLP_VECTORIZE,
        config.LLVM_REFPRUNE_PASS,
        config.DEBUGINFO_DEFAULT,
    )
    return hashlib.sha256(repr(settings).encode() + b"\0" + ir_text.encode()).hexdigest()[:32]


def _read(path: Path):
    try:
        name, kind, (obj, bitcode) = pickle.loads(path.read_bytes())
    except Exception:  # missing, truncated, another layout: compile instead
        return None
    if name != "nrt" or kind != "object" or not isinstance(obj, bytes) or not isinstance(bitcode, bytes):
        return None
    return name, kind, (obj, bitcode)


def dump_atomically(path: Path, obj, prefix: str) -> bool:
    """Pickle obj to path atomically (a reader sees the whole file or none): a temp file named
    prefix*.tmp beside it, renamed over it; False, and no temp left, on an OSError. For the
    kernels' own cache files (this one, kernels/warm_set.py): kernels/ sits below runtime/, so it
    cannot use kvchat.runtime.memory.state.atomic_write."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=prefix, suffix=".tmp", dir=path.parent)
        os.fchmod(fd, 0o644)  # as numba writes its cache files
        with os.fdopen(fd, "wb") as f:
            pickle.dump(obj, f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(tmp, path)
    except OSError:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
        return False
    return True


def _write(path: Path, state) -> None:
    """Atomically (dump_atomically); older NRT files in the folder go."""
    if not dump_atomically(path, state, PREFIX):
        return
    try:
        for old in path.parent.glob(PREFIX + "*" + SUFFIX):
            if old != path:
                old.unlink(missing_ok=True)
    except OSError:
        pass


def initialize(ctx) -> str:
    """rtsys.initialize(ctx) with the NRT's machine code from the cache. Returns how the NRT
    came to be: "ready" (already initialised), "cached", "compiled" (and written)."""
    from llvmlite import binding as ll
    from numba.core import config
    from numba.core.compiler_lock import global_compiler_lock
    from numba.core.runtime import _nrt_python as _nrt
    from numba.core.runtime import nrt, nrtdynmod

    rtsys = nrt.rtsys
    with global_compiler_lock:
        if rtsys._init:
            return "ready"
        if config.NRT_STATS:
            _nrt.memsys_enable_stats()
        for py_name, c_address in _nrt.c_helpers.items():  # as rtsys.initialize registers them
            ll.add_symbol(py_name if py_name.startswith("_") else "NRT_" + py_name, c_address)
        ir_module, library = nrtdynmod.create_nrt_module(ctx)
        path = cache_dir() / f"{PREFIX}{cache_key(ctx, str(ir_module))}{SUFFIX}"
        state = _read(path)
        how = "cached"
        if state is not None:
            try:
                library = ctx.codegen().unserialize_library(state)
            except Exception:  # an object this LLVM refuses: compile a fresh module
                state = None
                ir_module, library = nrtdynmod.create_nrt_module(ctx)
        if state is None:
            how = "compiled"
            library.enable_object_caching()
            library.add_ir_module(ir_module)
            library.finalize()
            _write(path, library.serialize_using_object_code())
        rtsys._library = library
        rtsys._init = True
        return how
