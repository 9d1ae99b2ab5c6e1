"""CPU time of importing the architectures a llama-family model does not need, on top of what its
process imports anyway (model, context, the llama arch): the dense ones and the recurrent ones
(their memories and kernels). This is why runtime/arch/__init__.py loads each arch module on first
use (#27). Run it against a tree whose registry is lazy (main before the change, or through
benchmarks/tree_env's shim); a tree that imports them all eagerly already has them loaded.

    python benchmarks/arch_import_cost.py
"""

import sys
import time

import kvchat.runtime.context  # noqa: F401
import kvchat.runtime.model  # noqa: F401
from kvchat.runtime.arch import get_arch

get_arch("llama")


def cpu_ms(names: str) -> float:
    t0 = time.process_time()
    for n in names.split():
        __import__("kvchat.runtime.arch." + n)
    return 1e3 * (time.process_time() - t0)


if "kvchat.runtime.arch.qwen35" in sys.modules:
    raise SystemExit("the recurrent archs are already imported: nothing to measure")
dense = cpu_ms("gemma2 gemma3 granite phi3 qwen2 qwen3 smollm3")
recurrent = cpu_ms("mamba lfm2 qwen35")
print(f"dense {dense:.1f} ms  recurrent {recurrent:.1f} ms (CPU time)")
