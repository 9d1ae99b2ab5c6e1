"""kvchat's intermediate tensors of one decode, named as llama.cpp's graph names them, for
compare_tensors.py: attn_norm, Qcur / Kcur / Vcur (the matmuls), Qrope, kqv_out (attention
before the output projection), attn_out, ffn_inp, ffn_norm, ffn_out, l_out per layer, and the
logits. Dense attention models (every layer an attention layer with a gated FFN).

    python benchmarks/fidelity/kvchat_tensors.py -m smollm2 --tokens toks.txt --out DIR [--fa on|off]
        [--ggml-order]

--tokens: token ids separated by spaces (the ones given to dump_tensors); one decode of them,
n_ctx = n_batch = n_ubatch = 512, 2 threads, f16 cache. --ggml-order installs
benchmarks/fidelity/ggml_order.py first.
"""

import argparse
import sys
from pathlib import Path

import numpy as np

ap = argparse.ArgumentParser()
ap.add_argument("-m", "--model", required=True)
ap.add_argument("--tokens", required=True, type=Path)
ap.add_argument("--out", required=True, type=Path)
ap.add_argument("--fa", default="on")
ap.add_argument("--ggml-order", action="store_true")
a = ap.parse_args()
if a.ggml_order:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import ggml_order

    ggml_order.install()
import kvchat.runtime.arch.layer_plan as lp
from kvchat.cli.sources.models import resolve_model
from kvchat.runtime.batch import Batch
from kvchat.runtime.context import Context
from kvchat.runtime.cparams import ContextParams
from kvchat.runtime.model import Model

a.out.mkdir(parents=True, exist_ok=True)
state = {"il": -1, "seam": 0}


def save(name, x):
    np.save(a.out / f"{name}.npy", np.asarray(x, dtype=np.float32))


qkv_of, attend_io, output_step, residual_norm = lp.qkv_of, lp.attend_io, lp.output_step, lp.residual_norm
prepare_qkv_store, gated_ffn, rms_norm = lp.prepare_qkv_store, lp.gated_ffn, lp.rms_norm


def qkv_of_(p, h, min_macs=None):
    state["il"], state["seam"] = p.il, 0
    q, k, v = qkv_of(p, h, min_macs)
    save(f"Qcur-{p.il}", q), save(f"Kcur-{p.il}", k), save(f"Vcur-{p.il}", v)
    return q, k, v


def prepare_qkv_store_(q, k, v, pos, *rest):
    out = prepare_qkv_store(q, k, v, pos, *rest)
    save(f"Qrope-{state['il']}", out)
    return out


def attend_io_(p, q, io, n_threads, kq_scale=None, par_min=None):
    out = attend_io(p, q, io, n_threads, kq_scale, par_min)
    save(f"kqv_out-{p.il}", out)
    return out


def output_step_(p, x, min_macs=None):
    out = output_step(p, x, min_macs)
    save(f"attn_out-{p.il}", out)
    return out


def residual_norm_(x, y, w_post, rs, w_next, eps):
    h = residual_norm(x, y, w_post, rs, w_next, eps)
    il = state["il"]
    if state["seam"] == 0:
        save(f"ffn_inp-{il}", x), save(f"ffn_norm-{il}", h)
    else:
        save(f"l_out-{il}", x), save(f"attn_norm-{il + 1}", h)
    state["seam"] += 1
    return h


def gated_ffn_(h, *args, **kw):
    out = gated_ffn(h, *args, **kw)
    save(f"ffn_out-{state['il']}", out)
    return out


def rms_norm_(x, w, eps):
    out = rms_norm(x, w, eps)
    if state["il"] == -1:
        save("attn_norm-0", out)
    return out


lp.qkv_of, lp.attend_io, lp.output_step, lp.residual_norm = qkv_of_, attend_io_, output_step_, residual_norm_
lp.prepare_qkv_store, lp.gated_ffn, lp.rms_norm = prepare_qkv_store_, gated_ffn_, rms_norm_
tokens = [int(t) for t in a.tokens.read_text().split()]
ctx = Context(
    Model.load(resolve_model(a.model)),
    ContextParams(n_ctx=512, n_batch=512, n_ubatch=512, flash_attn=a.fa, n_threads=2),
)
if ctx.decode(Batch.one_seq(tokens, 0, all_logits=True)) != 0:
    raise SystemExit(f"decode failed: {ctx.last_error}")
save("logits", ctx.get_logits())
