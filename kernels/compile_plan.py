"""Which (kernel, signature) pairs a run will call, found before anything compiles, and compiling
one such pair on its own — what lets worker processes compile a run's kernels side by side
(kvchat.runtime.startup.compile_ahead) while the chat already takes input.

numba learns a kernel's signature at its first call, from the arguments, and compiles then. A
*dry run* (`dry_run()`) finds the signatures without compiling: while it is active, a call that
numba would compile for (`Dispatcher._compile_for_args`, the dispatcher's miss path) only notes
`(module, qualname, argument types)` — the types numba itself would compile for — and returns a
stand-in that does nothing; a kernel that is already compiled or cached runs as usual. The
caller drives the code it wants planned (a warm-up decode of the real model, in a process of
its own: the stand-ins leave garbage in every output) and gets the pairs in call order. Only
kernels called from Python are seen; the kernels they call are compiled with them.

`compile_entry(entry)` compiles one pair as its first call would (numba's `Dispatcher.compile`:
loaded from numba's cache when there, else compiled and saved), without calling it.
`is_cached(entry)` asks numba's index the way a load does (as kernels/warm_set.py's covered()).

An entry is `(module, qualname, signature)`: plain strings and numba types, so it pickles, and a
process that imports the module finds the same dispatcher.
"""

from __future__ import annotations

import importlib
import os
from contextlib import contextmanager


def find_kernel(module: str, qualname: str):
    """The dispatcher `module.qualname` names (the module imported), else None."""
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj if hasattr(obj, "compile") and hasattr(obj, "py_func") else None


class _StandIn:
    """An overload's place while dry: its entry point does nothing."""

    objectmode = True  # skipped where numba lists its compiled (nopython) signatures

    @staticmethod
    def entry_point(*args, **kws):
        return None


_dry_depth = 0  # dry_run() blocks open in this process


def dry_running() -> bool:
    """True inside dry_run(): a kernel called now is noted, not run (code with a non-numba
    alternative, e.g. kernels/qlayout.py's numpy repack, takes the kernel then)."""
    return _dry_depth > 0


@contextmanager
def dry_run():
    """Note, not compile, the kernels called in the block; yields the list of entries (filled in
    call order, each once). Code that looks a compiled overload up (dispatcher.overloads[sig])
    finds the stand-in; every stand-in is removed when the block ends."""
    from numba.core import dispatcher

    cls = dispatcher.Dispatcher
    own = cls.__dict__.get("_compile_for_args")  # numba defines it on a base class
    entries: list = []
    seen: set = set()
    placed: list = []  # (dispatcher, argument types) given a stand-in

    def note_only(self, *args, **kws):
        sig = tuple(self.typeof_pyval(a) for a in args)
        entry = (self.py_func.__module__, self.py_func.__qualname__, sig)
        if entry not in seen:
            seen.add(entry)
            entries.append(entry)
        if sig not in self.overloads:
            self.overloads[sig] = _StandIn
            placed.append((self, sig))
        return _StandIn.entry_point

    global _dry_depth
    cls._compile_for_args = note_only
    _dry_depth += 1
    try:
        yield entries
    finally:
        _dry_depth -= 1
        if own is None:
            del cls._compile_for_args
        else:
            cls._compile_for_args = own
        for disp, sig in placed:
            if disp.overloads.get(sig) is _StandIn:
                del disp.overloads[sig]


def compile_entry(entry) -> None:
    """Compile (or load from numba's cache) one entry; LookupError when its kernel is gone."""
    module, qualname, sig = entry
    kernel = find_kernel(module, qualname)
    if kernel is None:
        raise LookupError(f"{module}.{qualname} is not a numba kernel")
    kernel.compile(sig)


def entry_of(kernel, args) -> tuple:
    """The entry a call of `kernel` with these arguments compiles (numba's types of them)."""
    py = kernel.py_func
    return py.__module__, py.__qualname__, tuple(kernel.typeof_pyval(a) for a in args)


def ready(kernel, args) -> bool:
    """True when calling `kernel` with these arguments compiles nothing: compiled in this process
    (not a dry run's stand-in) or held by numba's cache."""
    entry = entry_of(kernel, args)
    compiled = kernel.overloads.get(entry[2])
    return not compiled.objectmode if compiled is not None else is_cached(entry)


_behind = 0  # compiling_behind() blocks open in this process


def compiling_behind() -> bool:
    """True inside behind_workers(): this run's kernels compile in worker processes, so code
    with a plain-Python twin (the vocabulary's kernels) runs that twin while its kernel is not
    ready, and the plan compiles the kernel for the next run."""
    return _behind > 0


@contextmanager
def behind_workers(active: bool = True):
    """Mark a block (a first run's model load) as compiling_behind() when active."""
    global _behind
    _behind += bool(active)
    try:
        yield
    finally:
        _behind -= bool(active)


def is_cached(entry) -> bool:
    """True when numba's cache holds this entry for this source, numba and CPU (a load would
    find it); False on any doubt."""
    module, qualname, sig = entry
    try:
        kernel = find_kernel(module, qualname)
        cache = getattr(kernel, "_cache", None)
        if cache is None or not hasattr(kernel, "targetctx"):
            return False
        key = cache._index_key(sig, kernel.targetctx.codegen())
        data_name = cache._cache_file._load_index().get(key)
        return data_name is not None and os.path.isfile(os.path.join(cache._cache_path, data_name))
    except Exception:
        return False
