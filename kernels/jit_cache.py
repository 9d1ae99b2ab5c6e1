"""numba's on-disk kernel cache: whether it is warm (the CLI's first-run wording), and loading
from it without numba's compiler set-up.

numba compiles a kernel on its first call and keeps the machine code on disk (cache=True), so
only the first run on a machine — or the first after kvchat's kernels changed — spends minutes
compiling; every later start loads the cached code in milliseconds. The CLI asks
`kernels_compiled()` before it loads a model and, when it says no, words its spinner as
"compiling kernels, first run only…" rather than leaving a long wait unexplained.

The probe reads the cache index of one kernel every forward pass calls (the integer matmul):
numba's index is empty or missing when nothing was compiled, when the kernel's source changed
since (the stamp differs) or when another numba version wrote it — exactly the cases in which
the run is about to compile. It only reads a small pickle; nothing is compiled or loaded.

`lean_cache_loads()` (installed by kernels/__init__.py): numba's `Cache.load_overload` refreshes
the CPU target before every cache lookup, and the first refresh imports every lowering registry
numba has (numpy linalg, random generators, typed containers, jitclass, ...) — what *compiling*
needs, not loading: 0.23 s and 43 MiB resident measured on this machine, a sixth of a warm
`kvchat run`'s start. A cached kernel only needs its machine code linked and the NRT's C helpers
registered (rtsys.initialize). A cache miss still compiles as before: numba's compiler refreshes
the target itself (CompilerBase.__init__) before typing anything.

`lazy_link_modules()` (installed with it): a cached kernel is stored as its machine code plus its
optimized LLVM IR as bitcode, kept so that a function compiled later can inline it. numba parses
that bitcode on every load — about half of a cache load (5-15 ms per kernel here, 22 kernels
before the first token) — only to list the symbols the object defines. Those are read from the
object file's own ELF symbol table instead (the same set, checked for every kernel of a warm
run), and the bitcode is parsed when something asks for it (a new compile linking the kernel in).
A non-ELF object (macOS, Windows) loads the way numba loads it.
"""

from __future__ import annotations

import struct


def kernels_compiled() -> bool:
    """True when numba's cache holds a compiled version of a hot-path kernel for this source: the
    integer matmul's serial twin (quantized weights) or the serial RMS norm (every model, float
    weights too: a tiny F32 model never calls the integer matmul)."""
    try:
        from kvchat.kernels.matmul_int import matmul_q_serial
        from kvchat.kernels.norm import _rms_norm_ser

        # numba's IndexDataCacheFile of each
        return any(bool(k._cache._cache_file._load_index()) for k in (matmul_q_serial, _rms_norm_ser))
    except Exception:  # another numba layout, an unreadable cache dir: assume warm, stay quiet
        return True


def lean_cache_loads() -> bool:
    """Make numba's cache loads skip the target refresh (module docstring). True when installed;
    False (numba left as it is) when this numba's Cache lacks the methods it relies on."""
    from numba.core import caching
    from numba.core.runtime import nrt

    cache = caching.Cache
    if getattr(cache.load_overload, "_kvchat_lean", False):
        return True
    if (
        not all(hasattr(cache, a) for a in ("load_overload", "_load_overload", "_guard_against_spurious_io_errors"))
        or not hasattr(nrt.rtsys, "initialize")
        or not hasattr(nrt.rtsys, "_init")
    ):
        return False

    def load_overload(self, sig, target_context):
        if not nrt.rtsys._init:  # the NRT symbols cached code links against
            init_nrt(target_context)
        with self._guard_against_spurious_io_errors():
            return self._load_overload(sig, target_context)
        return None  # the guard swallowed a spurious I/O error: compile instead

    load_overload._kvchat_lean = True
    load_overload.__doc__ = cache.load_overload.__doc__
    cache.load_overload = load_overload
    lazy_link_modules()
    numba_environments_unimported()
    return True


def numba_environments_unimported() -> bool:
    """A cached kernel's environments (one per function compiled into it, inlined numba overloads
    included) name their module, and numba imports it to hand its globals to the environment:
    loading the first kernel imported numba.np.arrayobj and what it pulls in (unicode, charseq,
    sort implementations; ~0.03-0.07 s) for the array overloads inlined into every kernel.
    Only object-mode code reads an environment's globals, and no code of numba's own modules
    runs in object mode, so a numba module not imported yet gets an environment holding just its
    name (what pickling the environment reads); every other module is imported as numba does.
    True when installed; False (numba left as it is) when this numba's environment differs."""
    import sys

    from numba.core import environment

    rebuild = getattr(environment, "_rebuild_env", None)
    if getattr(rebuild, "_kvchat_lazy", False):
        return True
    env_class = getattr(environment, "Environment", None)
    if (
        rebuild is None
        or env_class is None
        or not hasattr(environment, "lookup_environment")
        or not hasattr(env_class, "_memo")
    ):
        return False

    def rebuild_env(modname, consts, env_name):
        if modname in sys.modules or not str(modname).startswith("numba."):
            return rebuild(modname, consts, env_name)
        env = environment.lookup_environment(env_name)
        if env is not None:
            return env
        env = env_class({"__name__": modname})
        env.consts[:] = consts
        env.env_name = env_name
        env_class._memo[env_name] = env
        return env

    rebuild_env._kvchat_lazy = True
    environment._rebuild_env = rebuild_env
    return True


def init_nrt(target_context) -> None:
    """numba's runtime with its machine code from kvchat's cache (kernels/nrt_cache.py); numba's
    own rtsys.initialize if that fails for any reason."""
    from numba.core.runtime import nrt

    try:
        from kvchat.kernels.nrt_cache import initialize

        initialize(target_context)
    except Exception:
        nrt.rtsys.initialize(target_context)


def elf_defined_symbols(obj: bytes) -> set[str] | None:
    """Names of the functions and data objects an ELF64 little-endian object file defines (its
    symbol table's FUNC / OBJECT entries with a section); None for any other kind of object."""
    if len(obj) < 64 or obj[:4] != b"\x7fELF" or obj[4] != 2 or obj[5] != 1:
        return None
    (shoff,) = struct.unpack_from("<Q", obj, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", obj, 0x3A)
    if shentsize < 64 or shoff + shnum * shentsize > len(obj):
        return None
    sections = [struct.unpack_from("<IIQQQQIIQQ", obj, shoff + i * shentsize) for i in range(shnum)]
    names: set[str] = set()
    for _, sh_type, _, _, offset, size, link, _, _, entsize in sections:
        if sh_type != 2 or entsize < 24 or link >= shnum:  # SHT_SYMTAB
            continue
        strtab = sections[link][4]
        for at in range(offset, offset + size - entsize + 1, entsize):
            st_name, st_info, _, st_shndx = struct.unpack_from("<IBBH", obj, at)
            if st_shndx != 0 and st_info & 0xF in (1, 2):  # defined; STT_OBJECT, STT_FUNC
                start = strtab + st_name
                names.add(obj[start : obj.index(b"\0", start)].decode("utf-8", "surrogateescape"))
    return names


def lazy_link_modules() -> bool:
    """Cached kernels load without parsing their linking bitcode (module docstring). True when
    installed; False (numba left as it is) when this numba's code library differs."""
    import llvmlite.binding as ll
    from numba.core import codegen

    lib = codegen.CPUCodeLibrary
    if getattr(lib._unserialize, "_kvchat_lazy", False):
        return True
    if not all(
        hasattr(lib, a)
        for a in (
            "_unserialize",
            "enable_object_caching",
            "_set_compiled_object",
            "_finalize_final_module",
            "_get_module_for_linking",
        )
    ):
        return False
    numba_unserialize = lib._unserialize.__func__

    def shared_module(self):
        state = self.__dict__
        bitcode = state.pop("_kvchat_bitcode", None)
        if bitcode is not None:  # first use: a compile is linking this kernel into a new one
            state["_kvchat_shared"] = ll.parse_bitcode(bitcode)
        return state.get("_kvchat_shared", state.get("_shared_module"))

    def set_shared_module(self, module):
        self.__dict__.pop("_kvchat_bitcode", None)
        self.__dict__["_kvchat_shared"] = module

    def unserialize(cls, codegen_, state):
        name, kind, data = state
        symbols = elf_defined_symbols(data[0]) if kind == "object" else None
        if symbols is None:
            return numba_unserialize(cls, codegen_, state)
        self = codegen_.create_library(name)
        self.enable_object_caching()
        self._set_compiled_object(data[0])
        self.__dict__["_kvchat_bitcode"] = data[1]
        self._finalize_final_module()  # links the machine code into the execution engine
        self._codegen._engine._defined_symbols |= symbols  # what numba reads from the bitcode
        return self

    unserialize._kvchat_lazy = True
    lib._shared_module = property(shared_module, set_shared_module)
    lib._unserialize = classmethod(unserialize)
    return True
