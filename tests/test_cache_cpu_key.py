"""A kernel cache built on one CPU is never loaded on a CPU without its instructions.

numba keys every cache entry on (signature, target triple, CPU name, CPU feature string, the
function's bytecode); kvchat's integer kernels also carry their instruction path in the signature
(kernels/simd_int.py: IsaType), and kvchat's own layers over numba's cache (jit_cache's lean
loads, warm_set, nrt_cache, the weight pack key) must keep that key. A wider CPU is simulated
with NUMBA_CPU_NAME / NUMBA_CPU_FEATURES: numba then compiles for it (the code is never run
here: this machine may lack those instructions) and writes the cache as that CPU would. Then
the real host, forced onto the portable path (KVCHAT_ISA=portable), must compile its own copy
of the very same kernel and signature — and the wide process must find its entry (the check can
see a hit when there is one).
"""

import json
import os
import subprocess
import sys

# a Zen 4: AVX-512 with VNNI and BF16 (the machine of issue #23)
WIDE = {
    "NUMBA_CPU_NAME": "znver4",
    "NUMBA_CPU_FEATURES": "+64bit,+adx,+aes,+avx,+avx2,+avx512bf16,+avx512bitalg,+avx512bw,+avx512cd,"
    "+avx512dq,+avx512f,+avx512ifma,+avx512vbmi,+avx512vbmi2,+avx512vl,+avx512vnni,+avx512vpopcntdq,"
    "+bmi,+bmi2,+cx16,+f16c,+fma,+lzcnt,+movbe,+pclmul,+popcnt,+sse,+sse2,+sse3,+sse4.1,+sse4.2,"
    "+ssse3,+xsave",
}

# In a child: compile (not run) kvchat's rms_norm sum for this process's CPU (numba's view of it),
# report whether numba loaded it from the cache; with RUN=1 also run it (on this host only). A
# small kernel: seconds of compiling, where the integer matmul would take minutes; numba's key is
# the same for every kernel, and the integer kernels also carry their path in the signature.
CHILD_SMALL = r"""
import json, os
import numpy as np
import kvchat.kernels
from kvchat.kernels.cpu import ISA
from kvchat.kernels.norm import sum_sq_f64

x = np.arange(64, dtype=np.float32) / 8
sig = (sum_sq_f64.typeof_pyval(x),)
sum_sq_f64.compile(sig)
out = {"isa": ISA.name, "hits": sum(sum_sq_f64.stats.cache_hits.values()),
       "misses": sum(sum_sq_f64.stats.cache_misses.values())}
if os.environ.get("RUN") == "1":
    out["close"] = bool(sum_sq_f64(x) == sum(float(np.float32(v * v)) for v in x))
print("RESULT " + json.dumps(out))
"""


def _child(cache_dir, extra_env, run=False, code=CHILD_SMALL):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NUMBA_CPU", "KVCHAT_ISA"))}
    env.update(NUMBA_CACHE_DIR=str(cache_dir), KVCHAT_ISA="portable", RUN="1" if run else "0", **extra_env)
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=3600)
    assert p.returncode == 0, p.stderr[-3000:]
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT ") :])


def _wide_then_host(cache, code):
    wide = _child(cache, WIDE, code=code)
    assert wide == {"isa": "portable", "hits": 0, "misses": 1}  # compiled for the wide CPU, saved
    assert _child(cache, WIDE, code=code)["hits"] == 1  # the wide CPU loads its own entry back
    host = _child(cache, {}, run=True, code=code)  # this machine (no AVX-512): same kernel and signature
    assert host["hits"] == 0 and host["misses"] == 1, host  # its own compile, not the wide code
    assert host["close"]
    assert _child(cache, {}, code=code)["hits"] == 1  # and the host's entry is there for the host


def test_a_cache_from_a_wider_cpu_is_not_loaded_here(tmp_path):
    """kvchat's rms_norm sum compiled for a Zen 4 (AVX-512) and saved; this CPU, forced onto the
    portable path, compiles its own instead of loading it."""
    _wide_then_host(tmp_path, CHILD_SMALL)


def test_the_instruction_path_is_part_of_every_integer_kernel_signature():
    """An entry compiled for one path is never looked up for another: their numba types differ."""
    from numba import typeof

    from kvchat.kernels.simd_int import ISA_NAMES, Isa

    types = {typeof(Isa(name)) for name in ISA_NAMES}
    assert len(types) == len(ISA_NAMES)


def test_the_weight_pack_key_names_the_instruction_path(monkeypatch, tmp_path):
    """A weight pack written on one path is not read on another (runtime/weights/cache.py)."""
    import kvchat.kernels.cpu as cpu
    from kvchat.kernels.simd_int import Isa
    from kvchat.runtime.weights import cache as wc

    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    keys = set()
    for name in ("avx2", "portable"):
        monkeypatch.setattr(cpu, "ISA", Isa(name))
        keys.add(wc.pack_key([str(model)]))
    assert len(keys) == 2
