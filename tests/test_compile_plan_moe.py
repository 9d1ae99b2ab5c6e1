"""The compile plan of a quantized MoE model (runtime/startup/compile_worker.plan): its warm-up
decode runs under the dry run, where the router's kernel does not run, and still reaches every
layer, so the experts' one-launch matmul (kernels/matmul_id_q.py) and what follows the first MoE
layer are planned — serial twin in the serial set, parallel twin in the rest. A fresh
NUMBA_CACHE_DIR in a subprocess: nothing is cached, so every kernel the run calls is listed."""

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.slow

PLAN = """
import json, sys
from kvchat.kernels.numba_start import install
install()
from kvchat.runtime.cparams import ContextParams
from kvchat.runtime.startup.compile_worker import plan
serial, rest = plan(sys.argv[1], ContextParams(n_ctx=256), 64)
print(json.dumps([[e[1] for e in serial], [e[1] for e in rest]]))
"""


def test_a_quantized_moe_models_plan_holds_the_expert_kernels_and_every_layer_after_them(tmp_path):
    from tests.helpers.arch_refs import model_path
    from tests.helpers.gguf_factory import quantized_copy

    q8 = quantized_copy(model_path("olmoe_s1"), tmp_path / "olmoe_s1-q8_0.gguf")
    # a tiny model's products stay below the default parallel threshold: lowered, so that the
    # 64-token warm-up reaches the parallel twins, as a real model's does
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "numba"), KVCHAT_MATMUL_PAR_MIN_MACS="100000")
    out = subprocess.run(
        [sys.executable, "-c", PLAN, str(q8)], capture_output=True, text=True, env=env, cwd=ROOT, timeout=1200
    )
    assert out.returncode == 0, out.stderr
    serial, rest = json.loads(out.stdout.strip().splitlines()[-1])
    assert "matmul_id_q_serial" in serial and "matmul_id_q" in rest
    assert "_glu_rows_ser" in serial  # the experts' activation: the decode went on past the routed matmul
    assert "decode: compute failed" not in out.stderr
