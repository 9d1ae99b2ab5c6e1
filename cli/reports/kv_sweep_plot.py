"""kv-sweep's figure: Mean KLD against KV bytes per token (Pareto front joined), and the KLD by
depth of each configuration. matplotlib is an optional extra: `pip install -e '.[plot]'`."""

from __future__ import annotations

import os
from pathlib import Path

from kvchat.runtime.errors import KvchatError


def require_matplotlib():
    """The pyplot module on a file-only backend, or a one-line error saying how to get it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise KvchatError("--plot needs matplotlib: pip install -e '.[plot]' (or pip install matplotlib)") from None
    return plt


def plot_sweep(path, rows: list[dict], title: str) -> None:
    plt = require_matplotlib()
    ctxs = sorted({r["n_ctx"] for r in rows})
    fig, axes = plt.subplots(1, 2, figsize=(13, 5.2))
    ax = axes[0]
    markers = "os^D"
    for ci, n_ctx in enumerate(ctxs):
        sub = [r for r in rows if r["n_ctx"] == n_ctx]
        floor = min([r["mean_kld"] for r in sub if r["mean_kld"] > 0] or [1e-6]) / 3
        xs = [r["kv_bytes_per_token"] for r in sub]
        ys = [max(r["mean_kld"], floor) for r in sub]
        ax.scatter(
            xs,
            ys,
            marker=markers[ci % len(markers)],
            s=36,
            zorder=3,
            label=f"n_ctx {n_ctx}",
            c=["tab:red" if r.get("pareto") else "tab:blue" for r in sub],
        )
        for r, x, y in zip(sub, xs, ys):
            lab = f"{r['type_k']}/{r['type_v']}" + ("" if r["rot"] == "auto" else " rot off")
            ax.annotate(lab, (x, y), textcoords="offset points", xytext=(4, 3), fontsize=7)
        front = sorted((r["kv_bytes_per_token"], max(r["mean_kld"], floor)) for r in sub if r.get("pareto"))
        if front:
            ax.step(
                [f[0] for f in front],
                [f[1] for f in front],
                where="post",
                color="tab:red",
                lw=1.2,
                zorder=2,
                label=f"Pareto front (n_ctx {n_ctx})",
            )
    ax.set_yscale("log")
    ax.set_xlabel("KV cache bytes per token (all layers)")
    ax.set_ylabel("Mean KLD vs f16/f16 (nats, log scale)")
    ax.set_title("Cache size against damage")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)

    ax = axes[1]
    for r in rows:
        if r["type_k"] == "f16" and r["type_v"] == "f16":
            continue
        prof = r["kld_by_depth"]
        xs = [(b["pos_from"] + b["pos_to"]) / 2 for b in prof]
        ys = [b["mean_kld"] for b in prof]
        lab = f"{r['type_k']}/{r['type_v']}" + ("" if r["rot"] == "auto" else " rot off")
        ax.plot(xs, ys, marker=".", lw=1, label=lab + (f" @{r['n_ctx']}" if len(ctxs) > 1 else ""))
    ax.set_yscale("log")
    ax.set_xlabel("position in the chunk (scored positions)")
    ax.set_ylabel("Mean KLD in the bin")
    ax.set_title("KLD by depth")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path = Path(path)
    tmp = path.with_name(path.stem + ".tmp" + path.suffix)
    try:
        fig.savefig(tmp, dpi=110)
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise KvchatError(f"cannot write the plot '{path}': {e.strerror}") from None
    finally:
        plt.close(fig)
