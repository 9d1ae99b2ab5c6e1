"""`kvchat perplexity ...` with the ggml-order emulations of benchmarks/fidelity/ggml_order.py
installed (Q4_1 matmuls, f16 flash attention): what kvchat's KLD against llama.cpp would be with
those two orders in its kernels.

    python benchmarks/fidelity/perplexity_ggml_order.py perplexity -m smollm2 -t 2 \\
        --kl-divergence-base smol_f16.kld --kl-divergence -fa on
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ggml_order

ggml_order.install()
from kvchat.cli.app import main

sys.argv[0] = "kvchat"
main()
