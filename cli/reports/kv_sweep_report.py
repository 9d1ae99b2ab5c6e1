"""kv-sweep's outputs: provenance, the row dicts, the Pareto front, JSON and CSV files.

JSON: {"provenance": {...}, "rows": [...], "pairs": [...]}; CSV: one line per row with the same
scalar columns (the depth profile as `kld_by_depth` = "from-to:mean;..."). Files are written to a
temp name and renamed, so an interrupted run leaves no half file.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import math
import os
import platform
import re
from datetime import datetime, timezone
from pathlib import Path

from kvchat.runtime.errors import KvchatError

# the columns every row has, in table / CSV order
COLUMNS = [
    "type_k",
    "type_v",
    "rot",
    "n_ctx",
    "n_tokens",
    "mean_kld",
    "mean_kld_unc",
    "median_kld",
    "p99_kld",
    "max_kld",
    "same_top_p",
    "same_top_p_unc",
    "rms_dp",
    "rms_dp_unc",
    "ppl",
    "ppl_base",
    "ppl_ratio",
    "ppl_ratio_unc",
    "ln_ppl_ratio",
    "kv_bytes_per_token",
    "kv_bytes_per_token_at_ctx",
    "kv_mib_at_ctx",
    "state_bytes",
    "session_bytes",
    "pareto",
    "seconds",
    "cpu_seconds",
]


def sha256_file(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def kvchat_version() -> str:
    try:
        from importlib.metadata import version

        return version("kvchat")
    except Exception:  # not installed (a bare checkout on PYTHONPATH)
        return "unknown"


def load_average() -> list[float] | None:
    """The machine's 1/5/15-minute load averages (None where the OS has none): kv-sweep records
    them so its times and speed columns can be read against how busy the machine was."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def provenance(model_path, text_path, flags: dict, n_threads, run: dict | None = None) -> dict:
    """run: {"seconds", "cpu_seconds", "load_average": {"start", "end"}} of the whole sweep."""
    return dict(
        model=str(model_path),
        model_sha256=sha256_file(model_path),
        text=str(text_path),
        text_sha256=sha256_file(text_path),
        kvchat_version=kvchat_version(),
        flags=flags,
        n_threads=n_threads,
        cpu_count=os.cpu_count(),
        python=platform.python_version(),
        machine=platform.machine(),
        date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        **({"run": run} if run is not None else {}),
    )


def mark_pareto(rows: list[dict]) -> None:
    """rows[i]["pareto"] = True when no other row of the same n_ctx has fewer-or-equal KV bytes
    per token and a lower-or-equal Mean KLD with one of them strictly better."""
    for r in rows:
        r["pareto"] = not any(
            o is not r
            and o["n_ctx"] == r["n_ctx"]
            and o["kv_bytes_per_token"] <= r["kv_bytes_per_token"]
            and o["mean_kld"] <= r["mean_kld"]
            and (o["kv_bytes_per_token"] < r["kv_bytes_per_token"] or o["mean_kld"] < r["mean_kld"])
            for o in rows
        )


SPEED_KEY = re.compile(r"^(pp|tg)\d+( @ d\d+)?$")  # llama-bench's test names


def speed_columns(rows: list[dict]) -> list[str]:
    names: list[str] = []
    for r in rows:
        names += [k for k in r if SPEED_KEY.match(k) and k not in names]
    return names


def _atomic_text(path, text: str) -> None:
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise KvchatError(f"cannot write '{path}': {e.strerror}") from None


def _clean(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_clean(v) for v in x]
    return x


def write_json(path, prov: dict, rows: list[dict], pairs: list[dict], needle: list[dict] | None = None) -> None:
    doc = dict(provenance=prov, rows=rows, pairs=pairs)
    if needle:
        doc["needle"] = needle
    _atomic_text(path, json.dumps(_clean(doc), indent=2) + "\n")


def depth_string(profile: list[dict]) -> str:
    return ";".join(f"{b['pos_from']}-{b['pos_to']}:{b['mean_kld']:.6g}" for b in profile)


def write_csv(path, rows: list[dict]) -> None:
    cols = COLUMNS + speed_columns(rows) + ["kld_by_depth"]
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=cols, extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({**r, "kld_by_depth": depth_string(r["kld_by_depth"])})
    _atomic_text(path, buf.getvalue())


def render_table(rows: list[dict], console) -> None:
    """The rich table: one line per configuration, Pareto-front rows starred."""
    from rich.table import Table

    speeds = speed_columns(rows)
    t = Table(title="KV cache configurations vs f16/f16 (same tokens)", header_style="bold")
    for name in (
        "K/V",
        "n_ctx",
        "Mean KLD",
        "99% KLD",
        "Same top p",
        "RMS Δp",
        "PPL ratio",
        "KV B/token",
        "KV MiB @ n_ctx",
        "session MiB",
    ):
        t.add_column(name, justify="left" if name == "K/V" else "right", no_wrap=True)
    for s in speeds:
        t.add_column(s + " t/s", justify="right", no_wrap=True)
    for r in rows:
        star = "★ " if r.get("pareto") else "  "
        rot = "" if r["rot"] == "auto" else " rot off"
        cells = [
            f"{star}{r['type_k']}/{r['type_v']}{rot}",
            str(r["n_ctx"]),
            f"{r['mean_kld']:.5f} ± {r['mean_kld_unc']:.5f}",
            f"{r.get('p99_kld', float('nan')):.4f}",
            f"{100 * r['same_top_p']:.2f} %",
            f"{100 * r['rms_dp']:.3f} %",
            f"{r['ppl_ratio']:.4f} ± {r['ppl_ratio_unc']:.4f}",
            f"{r['kv_bytes_per_token']:,}",
            f"{r['kv_mib_at_ctx']:.2f}",
            f"{r['session_bytes'] / 2**20:.2f}",
        ]
        cells += [f"{r[s]:.1f}" if s in r else "" for s in speeds]
        t.add_row(*cells)
    console.print(t)
    console.print(
        "★ Pareto front: no other configuration is both smaller and closer to f16/f16. ± = standard error over tokens."
    )
