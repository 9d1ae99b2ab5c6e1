"""`kvchat info -m MODEL`: what a GGUF file holds and what its KV cache will cost.

Only metadata and tensor headers are read (the weights stay on disk), so this is instant. A
file of an architecture kvchat cannot run is still described from its container; then the
reason it cannot run is printed as the error (exit code 1), so scripts can tell the difference.
"""

from __future__ import annotations

from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from kvchat.cli.option_params import hf_option
from kvchat.cli.options import MODEL_HELP
from kvchat.kernels.ggml_types import KV_CACHE_TYPES, row_bytes, type_by_name, type_name
from kvchat.runtime.arch import get_arch, read_hparams
from kvchat.runtime.errors import ModelFileError
from kvchat.runtime.gguf.file import GGUFFile
from kvchat.runtime.gguf.split import open_gguf
from kvchat.runtime.hparams import HParams


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"


def human_count(n: int) -> str:
    for div, suffix in ((1e9, " B"), (1e6, " M"), (1e3, " K")):
        if n >= div:
            return f"{n / div:.2f}{suffix}"
    return str(n)


def kv_bytes_per_token(hp: HParams, cache_type: str, layers=None) -> int | None:
    """Bytes one token's K and V take over `layers` (default all) in cache type `cache_type`;
    None if the rows are not a whole number of that type's blocks."""
    t = type_by_name(cache_type).type_id
    total = 0
    for il in range(hp.n_layer) if layers is None else layers:
        if not hp.has_kv(il):
            continue
        try:
            total += row_bytes(t, hp.n_embd_k_gqa(il)) + row_bytes(t, hp.n_embd_v_gqa(il))
        except ValueError:
            return None
    return total


def weight_types(gf: GGUFFile) -> list[tuple[str, int, int]]:
    """(type name, tensor count, bytes) per weight format, largest first."""
    acc: dict[str, list[int]] = {}
    for t in gf.tensors.values():
        row = acc.setdefault(type_name(t.ggml_type), [0, 0])
        row[0] += 1
        row[1] += t.nbytes
    return sorted(((k, c, b) for k, (c, b) in acc.items()), key=lambda r: -r[2])


def model_rows(gf: GGUFFile, hp: HParams | None) -> list[tuple[str, str]]:
    """The (field, value) rows of the overview table; hyper-parameter rows need `hp`."""
    n_params = sum(t.n_elements for t in gf.tensors.values())
    tokens = gf.get("tokenizer.ggml.tokens")
    rows = [
        ("file", f"{gf.path} ({human_bytes(gf.file_size)}{_parts_text(gf)}, GGUF v{gf.version})"),
        ("name", str(gf.get("general.name", "-"))),
        ("architecture", gf.arch),
        ("parameters", f"{human_count(n_params)} ({n_params:,})"),
        ("tensors", str(len(gf.tensors))),
    ]
    if hp is not None:
        attn = any(hp.has_kv(il) for il in range(hp.n_layer))
        rows += [("layers", str(hp.n_layer))]
        if attn:
            rows += [
                ("attention heads", f"{hp.n_head} (kv heads {hp.n_head_kv}, {hp.n_gqa} per group)"),
                ("head dims", f"k {hp.n_embd_head_k}, v {hp.n_embd_head_v}, rope {hp.n_rot}"),
            ]
        rows += [
            ("embedding", str(hp.n_embd)),
            ("feed-forward", str(hp.n_ff)),
            ("context length", f"{hp.n_ctx_train} (training)"),
            ("memory", memory_text(hp)),
            ("sliding window", _swa_text(hp)),
            ("rope", _rope_text(hp)),
            ("norm eps", f"{hp.norm_eps:g}"),
            ("q/k norm", "yes" if hp.use_qk_norm else "no"),
            ("output", "tied to token embeddings" if hp.tied_output else "own output.weight"),
        ]
        if getattr(hp, "n_expert", 0):
            rows.append(("experts", experts_text(hp)))
        rows.append(("bytes a token reads", bytes_read_text(gf, hp)))
        ends = get_arch(hp.arch).model_spec(hp)  # the arch's embedding scale and logit soft-cap
        if ends.embed_scale != 1.0:
            rows.append(("embedding scale", f"{ends.embed_scale:.4g} (sqrt n_embd)"))
        if ends.logit_softcap:
            rows.append(("final logit softcap", f"{ends.logit_softcap:g}"))
    vocab = f"{len(tokens)} tokens" if tokens is not None else "none"
    model, pre = gf.get("tokenizer.ggml.model"), gf.get("tokenizer.ggml.pre")
    if model:
        vocab += f", tokenizer {model}" + (f" (pre: {pre})" if pre else "")
    rows += [
        ("vocabulary", vocab),
        ("chat template", "yes" if gf.get("tokenizer.chat_template") else "no (ChatML fallback)"),
    ]
    return rows


def experts_text(hp: HParams) -> str:
    """A mixture of experts: how many, how many a token uses, the shared expert, the FFN sizes."""
    shared = f"shared expert FFN {hp.n_ff_shexp}" if hp.n_ff_shexp else "no shared expert"
    gating = hp.expert_gating + (", weights normalized" if hp.expert_weights_norm else "")
    return f"{hp.n_expert} ({hp.n_expert_used} used a token, {shared}), expert FFN {hp.n_ff_exp}, gating {gating}"


def bytes_read_text(gf: GGUFFile, hp: HParams) -> str:
    """Weight bytes a decoded token reads (runtime/arch/moe.py: token_read_bytes) and its share of
    the weights."""
    from kvchat.runtime.arch.moe import token_read_bytes

    n = token_read_bytes(gf, hp)
    total = sum(t.nbytes for t in gf.tensors.values())
    return f"{human_bytes(n)} of {human_bytes(total)} weights ({100.0 * n / max(total, 1):.0f}%)"


def memory_text(hp: HParams) -> str:
    """The memory llama.cpp's create_memory picks for the model, and its per-sequence state."""
    recr = getattr(hp, "is_recurrent", None)
    n_recr = sum(bool(recr(il)) for il in range(hp.n_layer)) if callable(recr) else 0
    if n_recr:
        state = 4 * (hp.n_embd_r() + hp.n_embd_s()) * n_recr
        kind = "llama_memory_recurrent" if n_recr == hp.n_layer else "llama_memory_hybrid"
        text = f"{kind}: recurrent state on {n_recr} layers, {human_bytes(state)} per sequence"
        if n_recr < hp.n_layer:
            text += f"; KV cache on {hp.n_layer - n_recr} attention layers"
        return text
    return "llama_kv_cache_iswa (base + sliding-window caches)" if hp.n_swa else "llama_kv_cache"


def _parts_text(gf: GGUFFile) -> str:
    parts = getattr(gf, "parts", None)  # kvchat.runtime.gguf.split.SplitGGUF
    return f" in {len(parts)} split parts" if parts else ""


def _swa_text(hp: HParams) -> str:
    if not hp.n_swa:
        return "none"
    how = f"every {hp.swa_pattern}th layer global" if hp.swa_pattern > 1 else "per-layer flags"
    return f"{hp.n_swa} tokens on {hp.n_swa_layers} of {hp.n_layer} layers ({how})"


def _rope_text(hp: HParams) -> str:
    text = f"{hp.rope_type}, base {hp.rope_freq_base:g}"
    if hp.n_swa and hp.n_swa_layers:
        text += f" (sliding layers {hp.rope_freq_base_swa:g})"
    if hp.rope_freq_scale != 1.0:
        text += f", scale {hp.rope_freq_scale:g}"
    return text


def kv_table(hp: HParams) -> Table:
    """KV bytes per token for every cache type; iSWA models split global and sliding layers."""
    swa = [il for il in range(hp.n_layer) if hp.is_swa(il)]
    full = [il for il in range(hp.n_layer) if not hp.is_swa(il)]
    table = Table(title="KV cache per token", title_justify="left")
    table.add_column("cache type")
    if swa:
        table.add_column(f"{len(full)} global layers", justify="right")
        table.add_column(f"{len(swa)} sliding layers", justify="right")
        table.add_column(f"sliding layers, full window ({hp.n_swa} tokens)", justify="right")
    else:
        table.add_column("bytes / token", justify="right")
        table.add_column("per 1024 tokens", justify="right")
    for name in KV_CACHE_TYPES:
        per_full = kv_bytes_per_token(hp, name, full)
        if per_full is None:
            table.add_row(name, *(["n/a (row not a whole block)"] + [""] * (len(table.columns) - 2)))
            continue
        if swa:
            per_swa = kv_bytes_per_token(hp, name, swa)
            table.add_row(name, human_bytes(per_full), human_bytes(per_swa), human_bytes(per_swa * hp.n_swa))
        else:
            table.add_row(name, human_bytes(per_full), human_bytes(per_full * 1024))
    if swa:
        table.caption = (
            "sliding layers keep at most the window (plus one ubatch) per sequence; "
            "--swa-full stores every token in them too"
        )
    return table


def show_info(gf: GGUFFile, console: Console) -> None:
    """Print the overview, weights and KV tables; raise the reason if the model cannot run."""
    problem = None
    try:
        hp = read_hparams(gf)
    except ModelFileError as e:
        hp, problem = None, e
    overview = Table(title="Model", title_justify="left", show_header=False)
    overview.add_column(style="bold")
    overview.add_column(overflow="fold")  # a path is shown whole, folded, never cut with an ellipsis
    for field, value in model_rows(gf, hp):
        overview.add_row(field, value)
    console.print(overview)

    weights = Table(title="Weights", title_justify="left")
    weights.add_column("type")
    weights.add_column("tensors", justify="right")
    weights.add_column("bytes", justify="right")
    for name, count, nbytes in weight_types(gf):
        weights.add_row(name, str(count), human_bytes(nbytes))
    console.print(weights)
    if hp is not None and any(hp.has_kv(il) for il in range(hp.n_layer)):
        console.print(kv_table(hp))
    if problem is not None:
        raise problem


def register(app: typer.Typer) -> None:
    @app.command("info")
    def info(
        model: str = typer.Option(None, "-m", "--model", help=MODEL_HELP),
        hf: Optional[str] = hf_option(),
    ):
        """Show a model's architecture, sizes, weight formats and KV cache cost per token."""
        from kvchat.cli.sources.models import locate_model

        source = locate_model(model, hf=hf)
        console = Console(highlight=False)
        with open_gguf(source.path) as gf:
            try:
                show_info(gf, console)
            finally:
                for note in source.notes:  # e.g. what of an Ollama manifest is not used
                    console.print(f"note: {note}")
