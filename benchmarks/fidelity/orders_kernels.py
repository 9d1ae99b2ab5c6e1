"""The ggml-order kernels' time against the default ones, in process (docs/performance.md,
"Accuracy", issue 24 fid9, fid10): python benchmarks/fidelity/orders_kernels.py attention N_HEAD
N_HEAD_KV D | q4_1 | gemma [GGUF]. attention: flash attention of f16 K/V under a causal mask,
default kernel vs kernels/attention_ggml.py (kvchat.kernels.attention.GGML_FLASH), min over repeated
calls; q4_1: matmul_q_serial of random q4_1 matrices of SmolLM2's shapes, default order vs ggml's
lanes; gemma: matmul_q_serial of Gemma-3 270m's real matrices of each type (q5_0, q8_0, q4_K,
q6_K; the tied q8_0 output's first 8192 rows), default order vs ggml's batch order (QFormat.lanes).
Ratios only (the machine is shared); run under flock /tmp/kvchat-bench.lock."""

import sys
import time

import numpy as np


def attention(n_head, n_head_kv, dk):
    import kvchat.kernels.attention as att
    from kvchat.kernels.ggml_types import GGMLType

    rng = np.random.default_rng(0)
    for n_tokens, n_kv in ((512, 512), (1, 128), (1, 640), (1, 4096)):
        for threads in (1, 2):
            q = rng.standard_normal((n_tokens, n_head, dk)).astype(np.float32)
            k, v = (
                rng.standard_normal((1, n_kv, n_head_kv * dk)).astype(np.float16).view(np.uint8).reshape(1, n_kv, -1)
                for _ in range(2)
            )
            mask = np.zeros((n_tokens, n_kv), np.float32)
            for t in range(n_tokens):
                mask[t, n_kv - n_tokens + t + 1 :] = -np.inf
            ts = np.zeros(n_tokens, np.int32)
            best = {}
            for mode in (False, True):
                att.GGML_FLASH = mode
                f = lambda: att.attention(  # noqa: E731
                    q, k, GGMLType.F16, v, GGMLType.F16, mask, ts, n_head_kv, 0.125, flash=True, n_threads=threads
                )
                f()
                for _ in range(7 if n_tokens > 1 else 200):
                    t0 = time.perf_counter()
                    f()
                    best[mode] = min(best.get(mode, 1e9), time.perf_counter() - t0)
            print(
                f"{n_tokens:4d} tokens {n_kv:5d} cells {threads} threads: default {best[False] * 1e3:.3f} ms, "
                f"ggml {best[True] * 1e3:.3f} ms, {best[True] / best[False]:.2f}x",
                flush=True,
            )


def q4_1():
    from kvchat.kernels.cpu import select_isa
    from kvchat.kernels.ggml_types import GGMLType
    from kvchat.kernels.matmul import QMatrix
    from kvchat.kernels.matmul_int import matmul_q_serial

    isa = select_isa()
    rng = np.random.default_rng(1)
    for k, m in ((576, 1536), (1536, 576)):
        b = rng.integers(0, 256, (m, k // 32, 20), dtype=np.uint8)
        for o, sd in ((0, 0.01), (2, 0.05)):  # d, m as f16
            b[:, :, o : o + 2] = (
                (rng.standard_normal((m, k // 32)) * sd).astype(np.float16).view(np.uint8).reshape(m, -1, 2)
            )
        qm = QMatrix(b.reshape(m, -1), GGMLType.Q4_1, k)
        fmts = {"default": qm.fmt._replace(lanes=False), "lanes": qm.fmt._replace(lanes=True)}
        for n in (1, 64):
            x = rng.standard_normal((n, k)).astype(np.float32)
            y = np.empty((n, m), np.float32)
            best = {}
            for f in fmts.values():
                matmul_q_serial(isa, f, *qm._packed, x, y, 32)
            for _ in range(15 if n == 1 else 5):
                for name, f in fmts.items():
                    t0 = time.perf_counter()
                    for _ in range(20 if n == 1 else 2):
                        matmul_q_serial(isa, f, *qm._packed, x, y, 32)
                    best[name] = min(best.get(name, 1e9), time.perf_counter() - t0)
            print(f"k {k} m {m} {n} tokens: lanes / default {best['lanes'] / best['default']:.2f}x", flush=True)


def gemma(path):
    import os

    from gguf import GGUFReader

    from kvchat.kernels.cpu import select_isa
    from kvchat.kernels.ggml_types import GGMLType
    from kvchat.kernels.matmul import QMatrix
    from kvchat.kernels.matmul_int import matmul_q_serial

    isa = select_isa()
    tensors = {t.name: t for t in GGUFReader(os.path.expanduser(path)).tensors}
    rng = np.random.default_rng(1)
    for name, rows in (
        ("blk.0.attn_q.weight", None),  # q5_0 640 -> 1024
        ("blk.0.ffn_gate.weight", None),  # q5_0 640 -> 2048
        ("blk.0.attn_v.weight", None),  # q8_0 640 -> 256
        ("token_embd.weight", 8192),  # q8_0 output, 8192 of its 262144 rows
        ("blk.2.ffn_down.weight", None),  # q4_K 2048 -> 640
        ("blk.0.attn_output.weight", None),  # q4_K 1024 -> 640
        ("blk.0.ffn_down.weight", None),  # q6_K 2048 -> 640
    ):
        t = tensors[name]
        k = int(t.shape[0])
        raw = np.asarray(t.data).reshape(int(t.shape[1]), -1)[:rows]
        qm = QMatrix(np.ascontiguousarray(raw), GGMLType(int(t.tensor_type)), k)
        fmts = {"default": qm.fmt._replace(lanes=False), "ggml": qm.fmt._replace(lanes=True)}
        for n in (1, 64, 512):
            x = rng.standard_normal((n, k)).astype(np.float32)
            y = np.empty((n, qm.m), np.float32)
            best = {}
            for f in fmts.values():
                matmul_q_serial(isa, f, *qm._packed, x, y, 32)
            reps = max(1, int(2e6 // (qm.m * k * n // 64 + 1)))
            for _ in range(9 if n < 512 else 3):
                for nm, f in fmts.items():
                    t0 = time.perf_counter()
                    for _ in range(reps):
                        matmul_q_serial(isa, f, *qm._packed, x, y, 32)
                    best[nm] = min(best.get(nm, 1e9), (time.perf_counter() - t0) / reps)
            print(
                f"{name:26s} {qm.fmt.name:5s} k {k:5d} m {qm.m:5d} {n:3d} tokens: default "
                f"{best['default'] * 1e3:8.3f} ms, ggml {best['ggml'] * 1e3:8.3f} ms, "
                f"{best['ggml'] / best['default']:.2f}x",
                flush=True,
            )


if __name__ == "__main__":
    if sys.argv[1] == "attention":
        attention(*map(int, sys.argv[2:5]))
    elif sys.argv[1] == "gemma":
        gemma(sys.argv[2] if len(sys.argv) > 2 else "~/.cache/kvchat/models/gemma-3-270m-q4_k_m.gguf")
    else:
        q4_1()
