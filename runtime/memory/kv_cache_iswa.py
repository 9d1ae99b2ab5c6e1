"""Interleaved sliding-window attention memory (llama-kv-cache-iswa.cpp): two KV caches.

The base cache holds the full-attention layers for the whole context; the SWA cache holds the
sliding-window layers, and only needs the window: pad256(min(n_ctx_seq, n_swa * (n_seq_max if
unified else 1) + n_ubatch)) cells, because cells that fall out of every token's window are
reused by find_slot. With swa_full it is as large as the base (and can then be context-shifted).
Every sequence operation goes to both; a batch is accepted only if both caches can place it,
and the combined context routes each layer to its cache by hparams.is_swa(il).
"""

from __future__ import annotations

import logging

from kvchat.runtime.cparams import N_CTX_PAD, pad_to
from kvchat.runtime.memory.interface import Memory, MemoryContext, MemoryOpError, MemoryStatus, status_combine
from kvchat.runtime.memory.kv_cache import KVCache
from kvchat.runtime.memory.kv_cache_context import KVCacheContext

log = logging.getLogger(__name__)


class KVCacheISWA(Memory):
    def __init__(
        self,
        hparams,
        type_k: int,
        type_v: int,
        v_trans: bool,
        swa_full: bool,
        unified: bool,
        kv_size: int,
        n_seq_max: int,
        n_ubatch: int,
        filter=None,
    ):
        self.hparams = hparams
        self.unified = unified
        size_base = kv_size
        size_swa = pad_to(min(size_base, hparams.n_swa * (n_seq_max if unified else 1) + n_ubatch), N_CTX_PAD)
        if swa_full:
            log.warning("using full-size SWA cache")
            size_swa = size_base

        def filter_base(il):
            return (filter is None or filter(il)) and not hparams.is_swa(il)

        def filter_swa(il):
            return (filter is None or filter(il)) and hparams.is_swa(il)

        self.kv_base = KVCache(
            hparams, type_k, type_v, v_trans, unified, size_base, n_seq_max, n_swa=0, filter=filter_base, name="base"
        )
        self.kv_swa = KVCache(
            hparams,
            type_k,
            type_v,
            v_trans,
            unified,
            size_swa,
            n_seq_max,
            n_swa=hparams.n_swa,
            filter=filter_swa,
            name="swa",
        )

    def get_base(self) -> KVCache:
        return self.kv_base

    def kv_caches(self) -> list:
        return [self.kv_base, self.kv_swa]

    def get_swa(self) -> KVCache:
        return self.kv_swa

    # ---- operations on both -----------------------------------------------------------------

    def clear(self, data: bool = True) -> None:
        self.kv_base.clear(data)
        self.kv_swa.clear(data)

    def seq_rm(self, seq_id, p0, p1) -> bool:
        r0 = self.kv_base.seq_rm(seq_id, p0, p1)
        r1 = self.kv_swa.seq_rm(seq_id, p0, p1)
        return r0 and r1

    def seq_cp(self, seq_id_src, seq_id_dst, p0=-1, p1=-1) -> None:
        self.kv_base.seq_cp(seq_id_src, seq_id_dst, p0, p1)
        self.kv_swa.seq_cp(seq_id_src, seq_id_dst, p0, p1)

    def seq_keep(self, seq_id) -> None:
        self.kv_base.seq_keep(seq_id)
        self.kv_swa.seq_keep(seq_id)

    def seq_add(self, seq_id, p0, p1, shift) -> None:
        self.kv_base.seq_add(seq_id, p0, p1, shift)
        self.kv_swa.seq_add(seq_id, p0, p1, shift)

    def seq_div(self, seq_id, p0, p1, d) -> None:
        self.kv_base.seq_div(seq_id, p0, p1, d)
        self.kv_swa.seq_div(seq_id, p0, p1, d)

    def seq_pos_min(self, seq_id) -> int:
        # the SWA cache holds a suffix of what the base holds: its min is the usable one
        return self.kv_swa.seq_pos_min(seq_id)

    def seq_pos_max(self, seq_id) -> int:
        return self.kv_swa.seq_pos_max(seq_id)

    def get_can_shift(self) -> bool:
        return (
            self.kv_base.get_can_shift()
            and self.kv_swa.get_can_shift()
            and self.kv_base.get_size() == self.kv_swa.get_size()
        )

    def memory_breakdown(self) -> dict:
        b, s = self.kv_base.memory_breakdown(), self.kv_swa.memory_breakdown()
        return {
            "base": b,
            "swa": s,
            "k_bytes": b["k_bytes"] + s["k_bytes"],
            "v_bytes": b["v_bytes"] + s["v_bytes"],
            "total_bytes": b["total_bytes"] + s["total_bytes"],
        }

    def memory_type(self) -> str:
        return "llama_kv_cache_iswa"

    def log_line(self) -> str:
        return self.kv_base.log_line() + "\n" + self.kv_swa.log_line()

    # ---- contexts ---------------------------------------------------------------------------

    def _try(self, balloc, n_ubatch, split):
        balloc.split_reset()
        ubatches = []
        while True:
            ub = split()
            if ub is None:
                break
            ubatches.append(ub)
        if balloc.get_n_used() < balloc.get_n_tokens():
            return None
        sb = self.kv_base.prepare(ubatches)
        if sb is None:
            return None
        ss = self.kv_swa.prepare(ubatches)
        if ss is None:
            return None
        return KVCacheISWAContext(self, MemoryStatus.SUCCESS, sb, ss, ubatches)

    def init_batch(self, balloc, n_ubatch: int, embd_all: bool = False):
        if self.unified:
            ctx = self._try(balloc, n_ubatch, lambda: balloc.split_simple(n_ubatch))
            if ctx is not None:
                return ctx
        ctx = self._try(balloc, n_ubatch, lambda: balloc.split_equal(n_ubatch, not self.unified))
        if ctx is not None:
            return ctx
        return KVCacheISWAContext(self, MemoryStatus.FAILED_PREPARE)

    def init_full(self):
        return KVCacheISWAContext(self, MemoryStatus.SUCCESS, full=True)

    def init_update(self, optimize: bool = False):
        cb = self.kv_base.init_update(optimize)
        cs = self.kv_swa.init_update(optimize)
        ctx = KVCacheISWAContext(self, status_combine(cb.get_status(), cs.get_status()))
        ctx.ctx_base, ctx.ctx_swa = cb, cs
        return ctx

    # ---- state ------------------------------------------------------------------------------

    def state_write(self, io, seq_id: int = -1) -> None:
        self.kv_base.state_write(io, seq_id)
        self.kv_swa.state_write(io, seq_id)

    def state_parse(self, io, seq_id: int = -1):
        return self.kv_base.state_parse(io, seq_id), self.kv_swa.state_parse(io, seq_id)

    def state_apply(self, parsed, seq_id: int = -1) -> None:
        """Place both caches' cells (undoing the base if the SWA part does not fit), then copy
        the rows: all or nothing."""
        pb, ps = parsed
        jb: list = []
        placed_b = self.kv_base.state_place(pb, seq_id, jb)
        try:
            placed_s = self.kv_swa.state_place(ps, seq_id, [])
        except Exception:
            self.kv_base.undo(jb)
            raise
        self.kv_base.state_write_data(pb, placed_b)
        self.kv_swa.state_write_data(ps, placed_s)

    def state_read(self, io, seq_id: int = -1) -> None:
        self.state_apply(self.state_parse(io, seq_id), seq_id)


class KVCacheISWAContext(MemoryContext):
    """Base + SWA contexts over the same ubatches; layers are routed by hparams.is_swa(il)."""

    def __init__(
        self,
        kv: KVCacheISWA,
        status: MemoryStatus,
        sinfos_base=None,
        sinfos_swa=None,
        ubatches=None,
        full: bool = False,
    ):
        self.kv = kv
        self.status = status
        self.ubatches = ubatches or []
        self.i_next = 0
        self.is_swa = kv.hparams.is_swa
        self.ctx_base = self.ctx_swa = None
        if full:
            self.ctx_base, self.ctx_swa = kv.kv_base.init_full(), kv.kv_swa.init_full()
        elif status == MemoryStatus.SUCCESS and self.ubatches:
            self.ctx_base = KVCacheContext(kv.kv_base, status, sinfos_base, self.ubatches)
            self.ctx_swa = KVCacheContext(kv.kv_swa, status, sinfos_swa, self.ubatches)
        self.type_k = kv.kv_base.type_k
        self.type_v = kv.kv_base.type_v
        self.v_trans = kv.kv_base.v_trans

    def next(self) -> bool:
        self.ctx_base.next()
        self.ctx_swa.next()
        self.i_next += 1
        return self.i_next < len(self.ubatches)

    def apply(self) -> bool:
        if self.status in (MemoryStatus.FAILED_PREPARE, MemoryStatus.FAILED_COMPUTE):
            raise MemoryOpError("apply() on a failed memory context")
        ok = True
        if self.ctx_base is not None and self.ctx_base.get_status() == MemoryStatus.SUCCESS:
            ok = self.ctx_base.apply() and ok
        if self.ctx_swa is not None and self.ctx_swa.get_status() == MemoryStatus.SUCCESS:
            ok = self.ctx_swa.apply() and ok
        return ok

    def rollback(self) -> None:
        self.ctx_swa.rollback()
        self.ctx_base.rollback()

    def get_ubatch(self):
        return self.ubatches[self.i_next]

    def get_status(self) -> MemoryStatus:
        return self.status

    def get_base(self):
        return self.ctx_base

    def get_swa(self):
        return self.ctx_swa

    def _ctx(self, il):
        return self.ctx_swa if self.is_swa(il) else self.ctx_base

    def get_n_kv(self, il: int | None = None) -> int:
        """n_kv of the cache layer il uses (the base cache when il is None)."""
        return (self.ctx_base if il is None else self._ctx(il)).get_n_kv()

    def cpy_k(self, il, k_cur) -> None:
        self._ctx(il).cpy_k(il, k_cur)

    def cpy_v(self, il, v_cur) -> None:
        self._ctx(il).cpy_v(il, v_cur)

    def get_k(self, il):
        return self._ctx(il).get_k(il)

    def get_v(self, il):
        return self._ctx(il).get_v(il)

    def get_rot(self, il):
        return self._ctx(il).get_rot(il)

    def kq_mask(self, il):
        return self._ctx(il).kq_mask(il)

    def attn_io(self, il):
        return self._ctx(il).attn_io(il)

    def kq_start(self, il):
        return self._ctx(il).kq_start(il)
