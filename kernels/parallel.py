"""When a kernel runs on several threads: the one table of parallel-work thresholds.

A numba ``prange`` launch wakes the OpenMP pool, whose workers spin only briefly and then sleep
(GOMP_SPINCOUNT, kernels/__init__.py): a launch that finds them asleep costs 11-43 µs on this
2-core machine when it is shared, more than a small kernel's whole run. So each kernel with a
serial twin runs the twin below its threshold; results are bit-identical either way (every
kernel's array_equal tests). One exception: during a one-token step (generation) the matmul
threshold is chosen per step from measured step times by kernels/launch_tuner.py, unless the
user set KVCHAT_MATMUL_PAR_MIN_MACS.
Names: ``<KERNEL>_PAR_MIN_<UNIT>``, the unit of work the kernel compares against. Kernels read
them as ``parallel.NAME`` at call time, so a test can lower one with monkeypatch.
Measurements: docs/performance.md.
"""

import os

MATMUL_PAR_MIN_MACS = int(os.environ.get("KVCHAT_MATMUL_PAR_MIN_MACS", 4_000_000))  # n * m * k of one matmul
QUANT_ACT_PAR_MIN_ROWS = 16  # rows of x quantized to q8 blocks inside a parallel matmul
ATTN_PAR_MIN_MACS = 1 << 20  # n_tokens * n_head * n_kv * head_dim of one attention call
RMS_NORM_PAR_MIN_ROWS = 16
GLU_PAR_MIN_ROWS = 8
ROPE_PAR_MIN_TOKENS = 16  # prepare_qkv (split + QK-norm + RoPE)
DEQUANT_PAR_MIN_ROWS = 8  # rows dequantized at once (get_rows: embedding lookups)
ROUTE_PAR_MIN_TOKENS = 16  # tokens routed to their experts at once (kernels/moe_route.py)


# ---- serial only, for a while -------------------------------------------------------------------
# A first run's answer need not wait for the parallel twins: its compile workers build the serial
# kernels first (kvchat.runtime.startup.compile_ahead), the answer runs on them with every threshold out
# of reach, and the thresholds come back once the parallel twins are cached too. The twins give the
# same bits (batch invariance), so when the switch happens — even inside a forward — changes nothing
# but speed. Kernels without a serial twin (always parallel) are in the serial set as they are.

_HELD = ("MATMUL_PAR_MIN_MACS", "ATTN_PAR_MIN_MACS", "RMS_NORM_PAR_MIN_ROWS", "GLU_PAR_MIN_ROWS")
_HELD += ("ROPE_PAR_MIN_TOKENS", "DEQUANT_PAR_MIN_ROWS", "ROUTE_PAR_MIN_TOKENS")
_OUT_OF_REACH = 1 << 62
_saved: dict = {}


def hold_serial() -> None:
    """Every kernel with a serial twin runs it until release() (the forward also passes one thread
    to attention and ignores the launch tuner's matmul threshold: runtime/arch/layer_plan.py)."""
    g = globals()
    for name in _HELD:
        if name not in _saved:
            _saved[name] = g[name]
            g[name] = _OUT_OF_REACH


def release() -> None:
    """The thresholds as they were before hold_serial() (idempotent)."""
    g = globals()
    for name, value in list(_saved.items()):
        g[name] = value
        del _saved[name]


def serial_held() -> bool:
    return bool(_saved)
