"""A generated token's arrays reuse the last token's memory: no page faults per step (#24).

Model.load fixes glibc's mmap threshold low while it repacks (runtime/weights/os_memory.py: freed
load temporaries leave the resident set) and raises it after. With the low threshold every array
of 256 KiB or more — a 262144-token vocabulary's logits are 1 MiB — got a fresh mapping per step,
and touching it cost one page fault per 4 KiB page (Gemma-3 270M: 515 faults, 1-2.5 ms of system
time per token). Counted with getrusage's minor faults, so Linux with glibc only.
"""

from __future__ import annotations

import resource
import sys

import numpy as np
import pytest

from tests.helpers.gguf_factory import write_tiny_model

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc and minor-fault counts")

N_VOCAB = 70_000  # logits rows of 280 KB: above the load's 256 KiB mmap threshold, below the step's


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def test_generated_tokens_fault_in_no_fresh_pages_after_a_load(tmp_path):
    from kvchat.runtime.context import Context
    from kvchat.runtime.cparams import ContextParams
    from kvchat.runtime.generate import decode_one
    from kvchat.runtime.model import Model

    model = Model.load(write_tiny_model(tmp_path / "m.gguf", n_layer=1, n_vocab=N_VOCAB))
    try:
        ctx = Context(model, ContextParams(n_ctx=64))
        row_pages = N_VOCAB * 4 // 4096  # one logits row's pages
        for pos in range(4):  # kernels loaded, buffers in place
            decode_one(ctx, 5 + pos, pos)
        f0 = _faults()
        for pos in range(4, 36):  # 32 steps: each allocates its logits row twice (head, copy)
            logits = decode_one(ctx, 5 + pos, pos)
        faults = _faults() - f0
        assert logits.shape == (N_VOCAB,)
        # before: 2 * row_pages a step (2 * 32 * 68 = 4352 here, 4416 counted); now the heap's pages are
        # reused (68: the heap grows by one row once)
        assert faults < 4 * row_pages, faults

        f0 = _faults()
        for _ in range(16):  # a step-sized numpy array, allocated and written 16 times
            a = np.empty(1 << 18, np.float32)  # 1 MiB
            a[:] = 1.0
            del a
        assert _faults() - f0 < 4 * 256, "a 1 MiB array faults its pages in at every allocation"  # before: 16 * 257
    finally:
        model.close()
