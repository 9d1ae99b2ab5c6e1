"""Time to first token: import, Model.load, Context, decode a short prompt, argmax, one more token.

Usage: python benchmarks/ttft.py MODEL.gguf  (set NUMBA_CACHE_DIR to an empty dir for a cold start)
"""

import time

t0 = time.perf_counter()
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tree_env import use_tree

use_tree(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # PYTHONPATH=TREE measures TREE
import numpy as np

from kvchat.runtime.batch import Batch
from kvchat.runtime.context import Context
from kvchat.runtime.cparams import ContextParams
from kvchat.runtime.model import Model

m = Model.load(sys.argv[1])
t1 = time.perf_counter()
ctx = Context(m, ContextParams(n_ctx=4096))
toks = m.vocab.tokenize("The capital of France is", add_special=True)
assert ctx.decode(Batch.one_seq(toks, 0)) == 0
tok = int(np.argmax(ctx.get_logits_ith(-1)))
t2 = time.perf_counter()
assert ctx.decode(Batch.one_seq([tok], len(toks))) == 0
t3 = time.perf_counter()
print(
    f"import+load {t1 - t0:.2f}s, first token {t2 - t0:.2f}s, "
    f"second token +{t3 - t2:.3f}s -> {m.vocab.detokenize([tok])!r}"
)
