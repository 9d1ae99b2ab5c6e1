"""`kvchat perplexity ...` with the ggml-order emulations of benchmarks/fidelity/ggml_order.py
installed (Q4_1 matmuls, f16 flash attention): what kvchat's KLD against llama.cpp would be with
those two orders in its kernels.

    python benchmarks/fidelity/perplexity_ggml_order.py [--kernel-q4_1] perplexity -m smollm2 -t 2 \\
        --kl-divergence-base smol_f16.kld --kl-divergence -fa on

--kernel-q4_1: only the flash attention emulated; Q4_1 runs kvchat's own kernel in ggml's order
(KVCHAT_GGML_ORDER=1, kernels/matmul_lanes.py).
"""

import os
import sys
from pathlib import Path

kernel_q4_1 = "--kernel-q4_1" in sys.argv
if kernel_q4_1:
    sys.argv.remove("--kernel-q4_1")
    os.environ["KVCHAT_GGML_ORDER"] = "1"  # read when kvchat.kernels.qlayout is imported
sys.path.insert(0, str(Path(__file__).resolve().parent))
import ggml_order  # noqa: E402

ggml_order.install(q4_1=not kernel_q4_1)
from kvchat.cli.app import main

sys.argv[0] = "kvchat"
main()
