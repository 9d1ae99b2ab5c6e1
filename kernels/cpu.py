"""Which instruction path the integer kernels run (kernels/simd_int.py), chosen once at start-up.

From llvmlite's view of the host CPU (the features numba compiles for): AVX512-VNNI with
AVX512-BW -> ``vnni512``; AVX-VNNI, or AVX512-VNNI with VL -> ``vnni256``; AVX2 -> ``avx2``;
anything else -> ``portable``. ``KVCHAT_ISA=<path>`` forces one (tests run every path the
machine can); a path the CPU cannot run is refused with a clear error rather than crashing on
an illegal instruction. The path is part of every integer kernel's numba signature, and numba
keys its cache on the host CPU's name and features too, so a cache written on a VNNI machine
is never loaded by one without VNNI.
"""

from __future__ import annotations

import os

from kvchat.kernels.simd_int import ISA_NAMES, Isa


def host_features() -> set[str]:
    """The CPU features LLVM sees on this host ("avx2", "avx512vnni", ...)."""
    import llvmlite.binding as llvm

    return {k for k, v in llvm.get_host_cpu_features().items() if v}


def supported_isas(features: set[str] | None = None) -> list[str]:
    """The integer paths this CPU can run, fastest first."""
    f = host_features() if features is None else features
    out = []
    if {"avx512vnni", "avx512bw", "avx512f"} <= f:
        out.append("vnni512")
    if "avxvnni" in f or {"avx512vnni", "avx512vl"} <= f:
        out.append("vnni256")
    if "avx2" in f:
        out.append("avx2")
    out.append("portable")
    return out


def select_isa(env: str | None = None, features: set[str] | None = None) -> Isa:
    """The path to use: KVCHAT_ISA if set (checked against the CPU), else the fastest one."""
    ok = supported_isas(features)
    want = (os.environ.get("KVCHAT_ISA", "") if env is None else env).strip().lower()
    if not want:
        return Isa(ok[0])
    if want not in ISA_NAMES:
        raise ValueError(f"KVCHAT_ISA={want!r} is not an integer kernel path; use one of {', '.join(ISA_NAMES)}")
    if want not in ok:
        raise ValueError(f"KVCHAT_ISA={want} needs CPU features this machine lacks; it can run {', '.join(ok)}")
    return Isa(want)


ISA = select_isa()
