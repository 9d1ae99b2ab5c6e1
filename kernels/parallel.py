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
