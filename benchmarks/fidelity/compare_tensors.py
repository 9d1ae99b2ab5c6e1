"""kvchat's intermediate tensors (kvchat_tensors.py) against llama.cpp's (dump_tensors.cpp), layer
by layer: the share of elements with equal bits, the max and RMS difference relative to the RMS of
llama.cpp's tensor; then the mean KL divergence of the logits (float64 softmax).

    python benchmarks/fidelity/compare_tensors.py LLAMA_DIR KVCHAT_DIR [--layers N] [--diff-only]
"""

import argparse
from pathlib import Path

import numpy as np

ap = argparse.ArgumentParser()
ap.add_argument("llama", type=Path)
ap.add_argument("kvchat", type=Path)
ap.add_argument("--layers", type=int, default=1000)
ap.add_argument("--diff-only", action="store_true", help="only the tensors that are not bit-identical")
a = ap.parse_args()

files = {}  # (name, op) -> the file of its last node (a name is reused by reshape / rope)
for line in (a.llama / "index.txt").read_text().splitlines():
    if not line.startswith("skip"):
        idx, name, op = line.split()[:3]
        files[(name, op)] = a.llama / f"{idx}_{name}.f32"
PAIRS = [  # (llama.cpp name, op, kvchat name)
    ("attn_norm", "MUL", "attn_norm"),
    ("Qcur", "MUL_MAT", "Qcur"),
    ("Kcur", "MUL_MAT", "Kcur"),
    ("Vcur", "MUL_MAT", "Vcur"),
    ("Qcur", "ROPE", "Qrope"),
    ("kqv_out", "RESHAPE", "kqv_out"),
    ("attn_out", "MUL_MAT", "attn_out"),
    ("ffn_inp", "ADD", "ffn_inp"),
    ("ffn_norm", "MUL", "ffn_norm"),
    ("ffn_out", "MUL_MAT", "ffn_out"),
    ("l_out", "ADD", "l_out"),
]
print(f"{'tensor':16s} {'equal %':>8s} {'max rel':>9s} {'rms rel':>9s}")
for il in range(a.layers):
    if not (a.kvchat / f"Qcur-{il}.npy").exists():
        break
    for lname, op, kname in PAIRS:
        f, g = files.get((f"{lname}-{il}", op)), a.kvchat / f"{kname}-{il}.npy"
        if f is None or not g.exists():
            continue
        ref, got = np.fromfile(f, dtype=np.float32), np.load(g).ravel()
        eq = 100 * np.mean(ref == got)
        if a.diff_only and eq == 100:
            continue
        d = np.abs(ref.astype(np.float64) - got)
        rms = np.sqrt(np.mean(ref.astype(np.float64) ** 2))
        print(f"{kname + '-' + str(il):16s} {eq:8.2f} {d.max() / rms:9.2e} {np.sqrt(np.mean(d**2)) / rms:9.2e}")
ours = np.load(a.kvchat / "logits.npy").astype(np.float64)
theirs = np.fromfile(a.llama / "logits.f32", dtype=np.float32).astype(np.float64).reshape(-1, ours.shape[1])


def log_softmax(x):
    m = x.max(axis=1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=1, keepdims=True))


lp, lq = log_softmax(theirs), log_softmax(ours)
kld = (np.exp(lp) * (lp - lq)).sum(axis=1)
print(f"logits: {100 * np.mean(theirs == ours):.2f} % equal bits, mean KLD {kld.mean():.3g}, max {kld.max():.3g}")
