"""numba's cache writes made safe for several processes compiling into one cache at once.

kvchat compiles its kernels in worker processes beside the chat (kvchat.runtime.startup.compile_ahead),
and two kvchat processes may start on a cold cache at the same time. numba keeps one index file
per kernel (its compiled signatures -> data file names) and writes a new entry as: read the
index, take the first free data name, write the index, then the data (each file by temp+rename,
so a reader never sees half a file). Two writers of one kernel (two signatures, or a kernel
that two compiling kernels both call) can interleave: both read the same index, both take
`name.1.nbc`, the last index written loses the other's entry, and the data file may hold the
other signature's machine code — which numba would load for this signature without checking
(its `load_overload` trusts the index): a wrong kernel, not just a recompile.

`install()` replaces `IndexDataCacheFile.save` by the same steps taken under an exclusive
`fcntl` lock on a lock file beside the index (`<index>.lock`), with the index re-read inside
the lock and the data written before the index names it, so a reader that finds an entry
always finds its data. Loads stay lock-free (every file still changes by rename). Without
fcntl (Windows) saves keep the data-first order only.
"""

from __future__ import annotations

import itertools
import os
from contextlib import contextmanager

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None


@contextmanager
def index_locked(index_path: str):
    """An exclusive lock on `<index_path>.lock` for the block (none without fcntl)."""
    if fcntl is None:  # pragma: no cover
        yield
        return
    fd = os.open(index_path + ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def locked_save(self, key, data) -> None:
    """numba's IndexDataCacheFile.save: one writer at a time per index, data before index."""
    os.makedirs(self._cache_path, exist_ok=True)
    with index_locked(self._index_path):
        overloads = self._load_index()
        data_name = overloads.get(key)
        if data_name is not None:  # the same signature again: its data file is replaced
            self._save_data(data_name, data)
            return
        existing = set(overloads.values())
        data_name = next(n for n in map(self._data_name, itertools.count(1)) if n not in existing)
        self._save_data(data_name, data)
        overloads[key] = data_name
        self._save_index(overloads)


def install() -> bool:
    """Replace numba's save (module docstring); True when installed, False (numba left as it is)
    when this numba's cache file class lacks what the replacement calls."""
    from numba.core import caching

    cls = getattr(caching, "IndexDataCacheFile", None)
    if cls is None:
        return False
    if getattr(cls.save, "_kvchat_locked", False):
        return True
    needed = ("_load_index", "_save_index", "_save_data", "_data_name", "_index_path", "_cache_path")
    probe = cls.__new__(cls)
    cls.__init__(probe, os.devnull, "probe", None)  # the instance attributes this numba sets
    if not all(hasattr(cls, n) or hasattr(probe, n) for n in needed):
        return False
    locked_save._kvchat_locked = True
    locked_save.__doc__ = cls.save.__doc__
    cls.save = locked_save
    return True
