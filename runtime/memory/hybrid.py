"""Hybrid memory (llama-memory-hybrid.cpp): a KV cache for the attention layers and a recurrent
memory for the others (LFM2, Qwen3.5, Jamba, Falcon-H1, Granite-4-H).

Both see every ubatch: the split is the recurrent one (equal sequences; sequential unless the
KV cache is unified), the recurrent part is prepared first, then the KV cache; a batch is
accepted only if both can place it. The context applies both (and rolls both back), and the
forward pass asks it for `get_attn()` (an AttentionMemoryContext) in attention layers and
`get_recr()` (a RecurrentMemoryContext) in the others. A sequence's positions are what both
hold: seq_pos_min is the larger minimum, seq_pos_max the smaller maximum.

seq_rm refuses (False, nothing changed) what the recurrent part cannot do - cutting a state in
the middle; llama.cpp trims the KV cache anyway, we keep both untouched so a refused call
leaves nothing half-applied. Rolling a sequence back to an earlier point goes through
seq_checkpoint / seq_restore instead.
"""

from __future__ import annotations

from kvchat.runtime.memory.interface import Memory, MemoryContext, MemoryOpError, MemoryStatus, status_combine
from kvchat.runtime.memory.kv_cache import KVCache
from kvchat.runtime.memory.kv_cache_context import KVCacheContext
from kvchat.runtime.memory.recurrent import MemoryRecurrent, RecurrentContext


class MemoryHybrid(Memory):
    def __init__(
        self,
        hparams,
        type_k: int,
        type_v: int,
        v_trans: bool,
        unified: bool,
        kv_size: int,
        rs_size: int,
        n_seq_max: int,
    ):
        self.hparams = hparams
        is_recr = hparams.is_recurrent
        self.mem_attn = KVCache(
            hparams,
            type_k,
            type_v,
            v_trans,
            unified,
            kv_size,
            n_seq_max,
            n_swa=0,
            filter=lambda il: not is_recr(il),
            name="attn",
        )
        self.mem_recr = MemoryRecurrent(hparams, rs_size, n_seq_max, filter=is_recr)

    def get_mem_attn(self) -> KVCache:
        return self.mem_attn

    def kv_caches(self) -> list:
        return [self.mem_attn]  # the recurrent part holds states, not cells

    def get_mem_recr(self) -> MemoryRecurrent:
        return self.mem_recr

    def memory_type(self) -> str:
        return "llama_memory_hybrid"

    # ---- operations on both -----------------------------------------------------------------

    def clear(self, data: bool = True) -> None:
        self.mem_attn.clear(data)
        self.mem_recr.clear(data)

    def seq_rm(self, seq_id: int, p0: int, p1: int) -> bool:
        snap = self.mem_recr._snapshot()
        if not self.mem_recr.seq_rm(seq_id, p0, p1):
            return False
        if not self.mem_attn.seq_rm(seq_id, p0, p1):
            self.mem_recr._restore(snap)
            return False
        return True

    def seq_cp(self, seq_id_src, seq_id_dst, p0=-1, p1=-1) -> None:
        self.mem_attn.seq_cp(seq_id_src, seq_id_dst, p0, p1)
        self.mem_recr.seq_cp(seq_id_src, seq_id_dst, p0, p1)

    def seq_keep(self, seq_id) -> None:
        self.mem_attn.seq_keep(seq_id)
        self.mem_recr.seq_keep(seq_id)

    def seq_add(self, seq_id, p0, p1, shift) -> None:
        self.mem_attn.seq_add(seq_id, p0, p1, shift)
        self.mem_recr.seq_add(seq_id, p0, p1, shift)

    def seq_div(self, seq_id, p0, p1, d) -> None:
        self.mem_attn.seq_div(seq_id, p0, p1, d)
        self.mem_recr.seq_div(seq_id, p0, p1, d)

    def seq_pos_min(self, seq_id) -> int:
        return max(self.mem_attn.seq_pos_min(seq_id), self.mem_recr.seq_pos_min(seq_id))

    def seq_pos_max(self, seq_id) -> int:
        return min(self.mem_attn.seq_pos_max(seq_id), self.mem_recr.seq_pos_max(seq_id))

    def get_can_shift(self) -> bool:
        return self.mem_attn.get_can_shift()

    def get_can_trim(self) -> bool:
        return False  # the recurrent part cannot

    def seq_checkpoint(self, seq_id: int):
        return self.mem_recr.seq_checkpoint(seq_id)

    def seq_restore(self, seq_id: int, ckpt) -> bool:
        """KV cells after the checkpoint's position go; the recurrent state is the saved one."""
        if not self.mem_recr.seq_restore(seq_id, ckpt):
            return False
        return self.mem_attn.seq_rm(seq_id, ckpt.pos + 1, -1)

    def memory_breakdown(self) -> dict:
        a, r = self.mem_attn.memory_breakdown(), self.mem_recr.memory_breakdown()
        return {"kind": "hybrid", "attn": a, "recr": r, "total_bytes": a["total_bytes"] + r["total_bytes"]}

    def log_line(self) -> str:
        return self.mem_attn.log_line() + "\n" + self.mem_recr.log_line()

    # ---- contexts ---------------------------------------------------------------------------

    def init_batch(self, balloc, n_ubatch: int, embd_all: bool = False):
        balloc.split_reset()
        unified = self.mem_attn.get_n_stream() == 1
        ubatches = []
        while True:
            ub = balloc.split_seq(n_ubatch) if embd_all else balloc.split_equal(n_ubatch, not unified)
            if ub is None:
                break
            ubatches.append(ub)
        if balloc.get_n_used() < balloc.get_n_tokens():
            return HybridContext(self, MemoryStatus.FAILED_PREPARE)
        if not self.mem_recr.prepare(ubatches):
            return HybridContext(self, MemoryStatus.FAILED_PREPARE)
        sinfos = self.mem_attn.prepare(ubatches)
        if sinfos is None:
            return HybridContext(self, MemoryStatus.FAILED_PREPARE)
        return HybridContext(self, MemoryStatus.SUCCESS, sinfos, ubatches)

    def init_full(self):
        ctx = HybridContext(self, MemoryStatus.SUCCESS)
        ctx.ctx_attn, ctx.ctx_recr = self.mem_attn.init_full(), self.mem_recr.init_full()
        return ctx

    def init_update(self, optimize: bool = False):
        ca = self.mem_attn.init_update(optimize)
        cr = self.mem_recr.init_update(optimize)
        ctx = HybridContext(self, status_combine(ca.get_status(), cr.get_status()))
        ctx.ctx_attn, ctx.ctx_recr = ca, cr
        return ctx

    # ---- state: the KV part, then the recurrent part (llama.cpp's order) -------------------

    def state_write(self, io, seq_id: int = -1) -> None:
        self.mem_attn.state_write(io, seq_id)
        self.mem_recr.state_write(io, seq_id)

    def state_parse(self, io, seq_id: int = -1):
        return self.mem_attn.state_parse(io, seq_id), self.mem_recr.state_parse(io, seq_id)

    def state_apply(self, parsed, seq_id: int = -1) -> None:
        """Place both (undoing the KV placement if the recurrent one fails), then copy rows."""
        pa, pr = parsed
        journal: list = []
        placed = self.mem_attn.state_place(pa, seq_id, journal)
        try:
            head = self.mem_recr.state_place(pr, seq_id)
        except Exception:
            self.mem_attn.undo(journal)
            raise
        self.mem_attn.state_write_data(pa, placed)
        self.mem_recr.state_write_data(pr, head)

    def state_read(self, io, seq_id: int = -1) -> None:
        self.state_apply(self.state_parse(io, seq_id), seq_id)


class HybridContext(MemoryContext):
    """The KV cache's and the recurrent memory's contexts over the same ubatches."""

    def __init__(self, mem: MemoryHybrid, status: MemoryStatus, sinfos=None, ubatches=None):
        self.mem = mem
        self.status = status
        self.ubatches = ubatches or []
        self.i_cur = 0
        self.ctx_attn = self.ctx_recr = None
        if status == MemoryStatus.SUCCESS and self.ubatches:
            self.ctx_attn = KVCacheContext(mem.mem_attn, status, sinfos, self.ubatches)
            self.ctx_recr = RecurrentContext(mem.mem_recr, status, self.ubatches)

    def next(self) -> bool:
        self.ctx_attn.next()
        self.ctx_recr.next()
        self.i_cur += 1
        return self.i_cur < len(self.ubatches)

    def apply(self) -> bool:
        if self.status in (MemoryStatus.FAILED_PREPARE, MemoryStatus.FAILED_COMPUTE):
            raise MemoryOpError("apply() on a failed memory context")
        ok = True
        for c in (self.ctx_attn, self.ctx_recr):
            if c is not None and c.get_status() == MemoryStatus.SUCCESS:
                ok = c.apply() and ok
        return ok

    def rollback(self) -> None:
        if self.ctx_recr is not None:
            self.ctx_recr.rollback()
        if self.ctx_attn is not None:
            self.ctx_attn.rollback()

    def get_ubatch(self):
        return self.ubatches[self.i_cur]

    def get_status(self) -> MemoryStatus:
        return self.status

    def get_attn(self) -> KVCacheContext:
        return self.ctx_attn

    def get_recr(self) -> RecurrentContext:
        return self.ctx_recr
