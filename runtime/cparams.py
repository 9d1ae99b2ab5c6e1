"""Context parameters: what the user asked for (ContextParams) -> what the engine uses (CParams).

Mirrors the resolution in llama.cpp's llama_context constructor (and llama_init_from_model's
checks): n_ctx 0 means the model's training length, n_ctx is padded up to 256, a non-unified
cache splits it into per-sequence streams, n_batch is capped by n_ctx for causal models,
n_ubatch by n_batch, and cache types / flash attention are checked against each other so a
bad combination fails here, with a message a CLI user can act on, instead of deep in a kernel.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from kvchat.kernels.ggml_types import KV_CACHE_TYPES, TYPES, GGMLType, cache_type_by_name, type_info
from kvchat.runtime.errors import CParamsError

log = logging.getLogger(__name__)

LLAMA_MAX_SEQ = 256  # the most sequences one context can hold (llama.cpp's LLAMA_MAX_SEQ)
N_CTX_PAD = 256  # n_ctx (and n_ctx_seq) are padded up to a multiple of this
# V is stored transposed when flash attention is off; a transposed row is one element per
# cell, so only the element formats can hold it
V_TRANS_TYPES = (GGMLType.F32, GGMLType.F16, GGMLType.BF16)
QUANT_V_NEEDS_FA = "quantized V cache was requested, but this requires Flash Attention"


def pad_to(n: int, mult: int) -> int:
    """n rounded up to a multiple of mult (GGML_PAD)."""
    return (n + mult - 1) // mult * mult


@dataclass
class ContextParams:
    """What a user (or the CLI) asks for; 0 / None / "auto" mean "choose for me"."""

    n_ctx: int = 0  # 0 = the model's training context length
    n_batch: int = 2048  # most tokens one decode() call may carry
    n_ubatch: int = 512  # most tokens one forward pass computes (0 = n_batch)
    n_seq_max: int = 1  # distinct sequences (parallel conversations)
    type_k: str = "f16"
    type_v: str = "f16"
    flash_attn: str = "auto"  # "on" | "off" | "auto" (also accepts True/False)
    swa_full: bool = False  # full-size SWA cache (needed to context-shift iSWA models)
    kv_unified: bool = True  # one cell pool shared by all sequences (else one stream per seq)
    n_threads: int | None = None  # numba threads; None = leave numba's default


@dataclass
class CParams:
    """Resolved parameters (llama_cparams). Types are ggml type ids."""

    n_ctx: int
    n_ctx_seq: int  # cells per stream
    n_batch: int
    n_ubatch: int
    n_seq_max: int
    type_k: int
    type_v: int
    flash_attn: bool
    swa_full: bool
    kv_unified: bool
    n_threads: int | None
    n_ctx_train: int
    causal_attn: bool = True
    warnings: list[str] = field(default_factory=list)

    @property
    def v_trans(self) -> bool:
        """V is stored transposed exactly when flash attention is off (as in llama.cpp)."""
        return not self.flash_attn

    @property
    def n_stream(self) -> int:
        return 1 if self.kv_unified else self.n_seq_max


def _positive_int(name: str, value, allow_zero: bool = False) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise CParamsError(f"{name} must be an integer, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        what = "0 or more" if allow_zero else "at least 1"
        raise CParamsError(f"{name} must be {what}, got {value}")
    return value


def _cache_type(which: str, name) -> int:
    if isinstance(name, int) and not isinstance(name, bool):
        if name not in TYPES or not TYPES[name].kv_ok:
            raise CParamsError(
                f"invalid cache type id {name} for {which}; valid cache types: {', '.join(KV_CACHE_TYPES)}"
            )
        return name
    try:
        return cache_type_by_name(str(name)).type_id
    except ValueError as e:
        raise CParamsError(f"{which}: {e}") from None


def _flash_attn(value) -> str:
    if value is True:
        return "on"
    if value is False:
        return "off"
    v = str(value).strip().lower()
    aliases = {
        "on": "on",
        "1": "on",
        "true": "on",
        "enabled": "on",
        "off": "off",
        "0": "off",
        "false": "off",
        "disabled": "off",
        "auto": "auto",
    }
    if v not in aliases:
        raise CParamsError(f"flash_attn must be on, off or auto, got {value!r}")
    return aliases[v]


def resolve_cparams(params: ContextParams, hparams) -> CParams:
    """Resolve user params against the model's hyper-parameters; CParamsError on bad input."""
    warnings: list[str] = []

    n_seq_max = max(1, _positive_int("n_seq_max", params.n_seq_max))
    if n_seq_max > LLAMA_MAX_SEQ:
        raise CParamsError(f"n_seq_max must be <= {LLAMA_MAX_SEQ}, got {n_seq_max}")

    n_ctx_train = int(getattr(hparams, "n_ctx_train", 0) or 0)
    n_ctx = _positive_int("n_ctx", params.n_ctx, allow_zero=True)
    if n_ctx == 0:
        if n_ctx_train <= 0:
            raise CParamsError(
                "n_ctx is 0 and the model does not declare a training context length; pass an explicit context size"
            )
        n_ctx = n_ctx_train
    n_batch_req = _positive_int("n_batch", params.n_batch)
    n_ubatch_req = _positive_int("n_ubatch", params.n_ubatch, allow_zero=True)

    n_ctx = pad_to(n_ctx, N_CTX_PAD)
    if params.kv_unified:
        n_ctx_seq = n_ctx
    else:
        n_ctx_seq = pad_to(n_ctx // n_seq_max, N_CTX_PAD)
        if n_ctx_seq == 0:
            raise CParamsError("n_ctx_seq == 0: n_ctx is too small for n_seq_max streams")
        if n_ctx != n_ctx_seq * n_seq_max:
            n_ctx = n_ctx_seq * n_seq_max
            warnings.append(f"n_ctx is not divisible by n_seq_max - rounding to {n_ctx}")

    causal = True  # every architecture kvchat runs is a causal decoder
    n_batch = min(n_ctx, n_batch_req) if causal else n_batch_req
    n_ubatch = min(n_batch, n_ubatch_req or n_batch)

    type_k = _cache_type("type_k (--cache-type-k)", params.type_k)
    type_v = _cache_type("type_v (--cache-type-v)", params.type_v)

    fa = _flash_attn(params.flash_attn)
    v_quantized = type_info(type_v).block_size > 1
    if fa == "auto":
        fa = "on"  # the CPU path supports flash attention for every cache type
    if v_quantized and fa == "off":
        raise CParamsError(QUANT_V_NEEDS_FA + " (use --flash-attn on or an f16/bf16/f32 V cache)")
    flash = fa == "on"
    if not flash and type_v not in V_TRANS_TYPES:
        raise CParamsError(QUANT_V_NEEDS_FA)

    # a quantized K row is cut into heads by the attention kernels: each head must be whole blocks
    blk_k = type_info(type_k).block_size
    blk_v = type_info(type_v).block_size
    n_layer = int(getattr(hparams, "n_layer", 0) or 0)
    hk = int(getattr(hparams, "n_embd_head_k", 0) or 0)
    hv = int(getattr(hparams, "n_embd_head_v", 0) or 0)
    if n_layer and hk and hk % blk_k != 0:
        raise CParamsError(
            f"K cache type {type_info(type_k).name} with block size {blk_k} does not divide "
            f"n_embd_head_k={hk}; choose another --cache-type-k"
        )
    if n_layer and hv and hv % blk_v != 0:
        raise CParamsError(
            f"V cache type {type_info(type_v).name} with block size {blk_v} does not divide "
            f"n_embd_head_v={hv}; choose another --cache-type-v"
        )

    n_threads = params.n_threads
    if n_threads is not None:
        n_threads = _positive_int("n_threads", n_threads)

    if n_ctx_train and n_ctx_seq > n_ctx_train:
        warnings.append(f"n_ctx_seq ({n_ctx_seq}) > n_ctx_train ({n_ctx_train}) -- possible training context overflow")
    for w in warnings:  # returned to the caller, who shows them once (the CLI prints them)
        log.info("%s", w)

    cp = CParams(
        n_ctx=n_ctx,
        n_ctx_seq=n_ctx_seq,
        n_batch=n_batch,
        n_ubatch=n_ubatch,
        n_seq_max=n_seq_max,
        type_k=type_k,
        type_v=type_v,
        flash_attn=flash,
        swa_full=bool(params.swa_full),
        kv_unified=bool(params.kv_unified),
        n_threads=n_threads,
        n_ctx_train=n_ctx_train,
        causal_attn=causal,
        warnings=warnings,
    )
    check_kv_fits(cp, hparams)
    return cp


# ---- will the KV cache fit in memory? ------------------------------------------------------------


def available_memory() -> int | None:
    """Bytes the kernel says can be allocated without swapping (MemAvailable); None if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def kv_cache_bytes(cp: CParams, hparams) -> tuple[int, int]:
    """(total bytes, bytes per context token) of the K/V buffers a context with `cp` allocates.

    Full-attention layers hold n_ctx cells (all streams together); sliding-window layers of an
    iSWA model only their window (pad256(min(n_ctx_seq, n_swa * n_seq + n_ubatch)) per stream)
    unless --swa-full. Mirrors the sizes runtime/memory/kv_cache*.py allocates."""
    from kvchat.kernels.ggml_types import row_bytes

    n_layer = int(getattr(hparams, "n_layer", 0) or 0)
    if not n_layer or not hasattr(hparams, "n_embd_k_gqa"):
        return 0, 0
    n_swa = int(getattr(hparams, "n_swa", 0) or 0)
    has_kv = getattr(hparams, "has_kv", lambda il: True)
    is_swa = getattr(hparams, "is_swa", lambda il: False)
    swa_cells = (
        pad_to(min(cp.n_ctx_seq, n_swa * (cp.n_seq_max if cp.kv_unified else 1) + cp.n_ubatch), N_CTX_PAD) * cp.n_stream
    )
    total = per_token = 0
    for il in range(n_layer):
        if not has_kv(il):
            continue
        try:
            row = row_bytes(cp.type_k, hparams.n_embd_k_gqa(il)) + row_bytes(cp.type_v, hparams.n_embd_v_gqa(il))
        except (ValueError, TypeError):  # a layout this estimate does not know: no estimate
            return 0, 0
        if n_swa > 0 and is_swa(il) and not cp.swa_full:
            total += row * swa_cells
        else:
            total += row * cp.n_ctx
            per_token += row
    return total, per_token


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def check_kv_fits(cp: CParams, hparams, available: int | None = None) -> None:
    """Refuse, before anything is allocated, a context whose KV cache exceeds the machine's free
    memory: one line with what it needs, what there is, and the largest -c that fits."""
    available = available_memory() if available is None else available
    if not available:
        return
    total, per_token = kv_cache_bytes(cp, hparams)
    if total <= available:
        return
    fixed = total - per_token * cp.n_ctx  # the sliding-window part does not grow with -c
    fit = (available - fixed) // per_token if per_token else 0
    fit = fit // (N_CTX_PAD * cp.n_stream) * (N_CTX_PAD * cp.n_stream)
    seqs = f" for {cp.n_seq_max} sequences" if cp.n_seq_max > 1 else ""
    hint = f"the largest -c that fits is {fit}" if fit >= N_CTX_PAD else "not even the smallest context fits"
    if type_info(cp.type_k).block_size == 1:
        hint += " (a quantized cache, -ctk q8_0 -ctv q8_0, holds about twice as many)"
    raise CParamsError(
        f"-c {cp.n_ctx}{seqs} needs {_gib(total)} of KV cache "
        f"({type_info(cp.type_k).name}/{type_info(cp.type_v).name}) but this machine "
        f"has {_gib(available)} of memory available; {hint}"
    )
