"""The kernels a warm-up loaded, so that a later start can tell that none of them would compile.

The CLI decodes a couple of tokens before the prompt (kvchat.runtime.generate.warm_up) so that a kernel
whose numba cache entry is missing or stale compiles under its "warming up kernels" spinner,
not silently inside the answer. On a warm cache those decodes only load kernels, which the
prompt and the answer load anyway: ~0.08 s of a warm start spent before the first token for
nothing (docs/performance.md "Start-up").

`install()` (kernels/__init__.py) notes every (kernel, signature) numba loads from its cache or
compiles and saves. After a warm-up, `record(name)` writes that set next to numba's cache under
a name the caller derives from what decides the kernels (model file, context parameters);
`covered(name)` is True when such a set exists and every entry would load from numba's cache
now — asked the way numba asks at a load (the function's index file for this numba version and
source stamp, holding the key of this signature, CPU and bytecode, and its data file present).
Then nothing the warm-up decodes can compile and the caller may skip it; any doubt (no set, a
changed source, another numba, an unreadable file, a kernel that cannot be found) is False.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import pickle

PREFIX = "kvchat-warm-"
SUFFIX = ".pkl"
FORMAT = 1
KEEP = 64  # sets kept beside numba's cache, the most recently written: one per model file and context

_used: dict = {}  # (module, qualname, signature) -> the dispatcher's py_func, in load order


def install() -> bool:
    """Note every cache load that hits and every compile that is saved; True when installed."""
    from numba.core import caching

    cache = caching.Cache
    if getattr(cache.load_overload, "_kvchat_noted", False):
        return True
    numba_load, numba_save = cache.load_overload, cache.save_overload

    def load_overload(self, sig, target_context):
        data = numba_load(self, sig, target_context)
        if data is not None:
            _note(self, sig)
        return data

    def save_overload(self, sig, data):
        numba_save(self, sig, data)
        _note(self, sig)

    load_overload._kvchat_noted = True
    load_overload.__doc__, save_overload.__doc__ = numba_load.__doc__, numba_save.__doc__
    cache.load_overload, cache.save_overload = load_overload, save_overload
    return True


def _note(cache, sig) -> None:
    py_func = getattr(cache, "_py_func", None)
    if py_func is not None:
        _used.setdefault((py_func.__module__, py_func.__qualname__, sig), py_func)


def name_for(*parts) -> str:
    """A set's name from what decides which kernels a run calls (their repr)."""
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:32]


def _path(name: str):
    from kvchat.kernels.nrt_cache import cache_dir

    return cache_dir() / f"{PREFIX}{name}{SUFFIX}"


def _find(module: str, qualname: str):
    """The dispatcher (or plain function) `module.qualname` names, else None."""
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def record(name: str) -> bool:
    """Write the kernels noted so far as set `name`; False (nothing written) when one of them
    cannot be found again by its module and name (a kernel made inside a function)."""
    entries = []
    for (module, qualname, sig), py_func in list(_used.items()):
        try:
            found = _find(module, qualname)
        except Exception:
            return False
        if getattr(found, "py_func", found) is not py_func:
            return False
        entries.append((module, qualname, sig))
    if not entries:
        return False
    from kvchat.kernels.nrt_cache import dump_atomically

    path = _path(name)
    if not dump_atomically(path, (FORMAT, entries), PREFIX):
        return False
    _prune(path.parent)
    return True


def _prune(folder) -> None:
    """Remove all but the KEEP most recently written sets in folder: a set is named after a
    model file and context (a test suite writes hundreds), and a forgotten one costs only a
    two-token warm-up at that model's next start."""
    sets = []
    for p in folder.glob(f"{PREFIX}*{SUFFIX}"):
        try:
            sets.append((p.stat().st_mtime_ns, p))
        except OSError:
            pass  # removed meanwhile by another process
    for _, p in sorted(sets, reverse=True)[KEEP:]:
        try:
            p.unlink()
        except OSError:
            pass


def covered(name: str) -> bool:
    """True when set `name` exists and each of its kernels would load from numba's cache."""
    try:
        fmt, entries = pickle.loads(_path(name).read_bytes())
        if fmt != FORMAT or not entries:
            return False
        indexes = {}  # one read of each kernel's index
        for module, qualname, sig in entries:
            found = _find(module, qualname)
            cache = getattr(found, "_cache", None)
            if cache is None or not hasattr(found, "targetctx"):
                return False
            key = cache._index_key(sig, found.targetctx.codegen())
            if id(found) not in indexes:
                indexes[id(found)] = cache._cache_file._load_index()
            data_name = indexes[id(found)].get(key)
            if data_name is None or not os.path.isfile(os.path.join(cache._cache_path, data_name)):
                return False
    except Exception:  # no set, an unreadable one, a kernel gone or renamed: warm up
        return False
    return True
