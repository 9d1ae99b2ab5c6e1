"""The memory abstraction (llama-memory.h): what a Context needs of "the model's memory".

A `Memory` turns a validated batch into a `MemoryContext` (init_batch): the ubatches plus where
each goes, decided by a dry run that leaves the memory untouched. Only `MemoryContext.apply()`
mutates memory - one ubatch at a time, right before its forward pass - so a decode that fails
to find room changes nothing, and one that fails mid-way can be undone precisely.

Which memory a model gets is the model's business (llama_model::create_memory): each
architecture declares it (runtime/arch/base.py: create_memory; kvchat.runtime.arch.create_memory asks
the arch of the hparams).
"""

from __future__ import annotations

from enum import IntEnum
from typing import NamedTuple, Protocol, runtime_checkable

import numpy as np


class MemoryStatus(IntEnum):
    SUCCESS = 0
    NO_UPDATE = 1
    FAILED_PREPARE = 2
    FAILED_COMPUTE = 3


def status_is_fail(status: MemoryStatus) -> bool:
    return status in (MemoryStatus.FAILED_PREPARE, MemoryStatus.FAILED_COMPUTE)


def status_combine(s0: MemoryStatus, s1: MemoryStatus) -> MemoryStatus:
    """Combined status of two memory contexts (iSWA): any failure wins, then any update."""
    has_update = False
    for s in (s0, s1):
        if s == MemoryStatus.SUCCESS:
            has_update = True
        elif s != MemoryStatus.NO_UPDATE:
            return s
    return MemoryStatus.SUCCESS if has_update else MemoryStatus.NO_UPDATE


class MemoryOpError(RuntimeError):
    """A memory operation that cannot be done with this configuration (e.g. K-shift refused)."""


class MemoryContext:
    """The state needed to process one batch (or one memory update) - llama_memory_context_i.

    Context.decode drives it: for each ubatch `get_ubatch()`, `apply()`, the forward pass,
    `next()`; on any failure after an apply, `rollback()`. The forward pass then asks the
    context for what its layers need: an attention context (`AttentionMemoryContext`), a
    recurrent one (`RecurrentMemoryContext`), or a hybrid holding one of each."""

    def next(self) -> bool:
        """Consume the current ubatch; False when there is none left."""
        raise NotImplementedError

    def apply(self) -> bool:
        """Apply the current ubatch (or the update) to memory - the only mutation of memory."""
        raise NotImplementedError

    def rollback(self) -> None:
        """Undo every apply() made through this context (a failed or aborted decode): memory
        is left exactly as it was before the first apply."""
        raise NotImplementedError

    def get_ubatch(self):
        raise NotImplementedError

    def get_status(self) -> MemoryStatus:
        raise NotImplementedError


class KVStore(NamedTuple):
    """Where a kernel may write the ubatch's fresh K/V rows itself (kernels/qkv_store.py: what
    cpy_k and cpy_v do, as llama.cpp's cpy_k hands the graph a set_rows view)."""

    k_rows: np.ndarray  # u8 [n_stream, kv_size, row_bytes_k]: the layer's whole K array
    v_rows: np.ndarray  # u8 [n_stream, kv_size, row_bytes_v]
    strm: np.ndarray  # i64 [n_tokens]: stream of each token's slot cell
    cell: np.ndarray  # i64 [n_tokens]: its cell
    type_k: int
    type_v: int


class AttnIO(NamedTuple):
    """Everything attention layer il reads and writes for one ubatch (AttentionMemoryContext.attn_io)."""

    store: KVStore | None  # None when V is stored transposed or K/V are rotated: use cpy_k / cpy_v
    k: np.ndarray  # get_k: u8 [n_stream, n_kv, row_bytes_k] view
    type_k: int
    v: np.ndarray  # get_v: u8 [n_stream, n_kv, row_bytes_v] view, or the whole transposed buffer
    type_v: int
    flash: bool  # not v_trans: the flash path of attention
    mask: np.ndarray  # kq_mask: f32 [n_tokens, n_kv] of 0 / -inf
    tok_stream: np.ndarray  # i32 [n_tokens]: stream of each token
    start: np.ndarray | None  # kq_start: i64 [n_tokens], or None for cell 0
    rot_k: int  # get_rot: Hadamard chunk sizes (0 = none)
    rot_v: int
    # None, or the ubatch's position view (runtime/memory/kv_view.py): then mask and tok_stream
    # are the view's, start is None, and the reader gathers k and v into it after the store
    view: object = None


@runtime_checkable
class AttentionMemoryContext(Protocol):
    """What a forward pass may ask of the memory context of an attention layer (the KV cache's
    view for the current ubatch; an iSWA context routes each call by layer)."""

    type_k: int  # GGMLType of the K cache
    type_v: int
    v_trans: bool  # V stored transposed (flash attention off)

    def get_n_kv(self, il: int | None = None) -> int:
        """Cells the attention of layer il spans (padded; the same for every layer of a cache)."""

    def cpy_k(self, il: int, k_cur: np.ndarray) -> None:
        """Store f32 [n_tokens, n_embd_k_gqa] keys of the ubatch into its slot cells."""

    def cpy_v(self, il: int, v_cur: np.ndarray) -> None:
        """Store f32 [n_tokens, n_embd_v_gqa] values (transposed when v_trans)."""

    def get_k(self, il: int) -> tuple[np.ndarray, int]:
        """(u8 [n_stream, n_kv, row_bytes_k] view, type_k)."""

    def get_v(self, il: int) -> tuple[np.ndarray, int]:
        """(u8 [n_stream, n_kv, row_bytes_v] view, type_v), or the whole transposed buffer."""

    def get_rot(self, il: int) -> tuple[int, int]:
        """(n_rot_k, n_rot_v) Hadamard chunk sizes applied before storing (0 = none)."""

    def kq_mask(self, il: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(f32 [n_tokens, n_kv] 0/-inf mask, i32 [n_tokens] stream of each token)."""

    def kq_start(self, il: int | None = None) -> np.ndarray | None:
        """i64 [n_tokens] cell where each token's attention sums begin (the cell of the oldest
        position it sees, for a sliding-window ring), or None for cell 0."""

    def attn_io(self, il: int) -> AttnIO:
        """All of the above for layer il in one call (the forward's per-layer path)."""


@runtime_checkable
class RecurrentMemoryContext(Protocol):
    """What a forward pass may ask of the memory context of a recurrent layer (llama.cpp's
    llama_memory_recurrent_context + build_rs): per sequence of the ubatch one state cell; the
    layer reads its states with `get_r/get_s` (gathered from each sequence's source cell,
    zeroed where the cell is new) and writes the updated ones back with `cpy_r/cpy_s`."""

    def get_n_rs(self) -> int:
        """Sequences (state cells) in the current ubatch: the ubatch holds n_rs equal
        sequences of n_seq_tokens tokens each."""

    def get_r(self, il: int) -> np.ndarray:
        """f32 [n_rs, n_embd_r]: the conv states of layer il, in ubatch sequence order."""

    def get_s(self, il: int) -> np.ndarray:
        """f32 [n_rs, n_embd_s]: the SSM / delta states of layer il."""

    def cpy_r(self, il: int, r: np.ndarray) -> None:
        """Store the updated conv states f32 [n_rs, n_embd_r] into the sequences' cells."""

    def cpy_s(self, il: int, s: np.ndarray) -> None:
        """Store the updated SSM / delta states f32 [n_rs, n_embd_s]."""


class SeqCheckpoint:
    """What seq_restore needs to bring a sequence back to this point: its last position then,
    and (recurrent memories) the saved state, a sequence state blob."""

    __slots__ = ("seq_id", "pos", "blob")

    def __init__(self, seq_id: int, pos: int, blob: bytes | None = None):
        self.seq_id, self.pos, self.blob = seq_id, pos, blob

    @property
    def n_bytes(self) -> int:
        return len(self.blob) if self.blob else 0


class Memory:
    """Interface of a model's memory (llama_memory_i)."""

    def memory_type(self) -> str:
        """llama.cpp's class name of this memory (what `kvchat info` prints)."""
        raise NotImplementedError

    def init_batch(self, balloc, n_ubatch: int, embd_all: bool = False) -> MemoryContext:
        raise NotImplementedError

    def init_full(self) -> MemoryContext:
        raise NotImplementedError

    def init_update(self, optimize: bool = False) -> MemoryContext:
        raise NotImplementedError

    def get_can_shift(self) -> bool:
        raise NotImplementedError

    def clear(self, data: bool = True) -> None:
        raise NotImplementedError

    def seq_rm(self, seq_id: int, p0: int, p1: int) -> bool:
        raise NotImplementedError

    def seq_cp(self, seq_id_src: int, seq_id_dst: int, p0: int, p1: int) -> None:
        raise NotImplementedError

    def seq_keep(self, seq_id: int) -> None:
        raise NotImplementedError

    def seq_add(self, seq_id: int, p0: int, p1: int, shift: int) -> None:
        raise NotImplementedError

    def seq_div(self, seq_id: int, p0: int, p1: int, d: int) -> None:
        raise NotImplementedError

    def seq_pos_min(self, seq_id: int) -> int:
        raise NotImplementedError

    def seq_pos_max(self, seq_id: int) -> int:
        raise NotImplementedError

    def memory_breakdown(self) -> dict:
        raise NotImplementedError

    def kv_caches(self) -> list:
        """The KV caches (KVCache) this memory holds, in a fixed order: itself (a KV cache), base
        then SWA (iSWA), the attention part (hybrid); [] for a recurrent memory. What `/kv` maps,
        what a cache-type conversion re-stores, what branches count shared cells in. Whether
        they are the whole of the memory's state (what a prefix cache needs) is get_can_trim():
        a hybrid's KV cache is listed, but its recurrent states are not cells."""
        return []

    def get_can_trim(self) -> bool:
        """Whether seq_rm can remove any run of a sequence's positions (its tail, a middle run
        for a context shift). False for memories holding a state instead of positions."""
        return True

    def seq_checkpoint(self, seq_id: int) -> SeqCheckpoint:
        """A point seq_restore can return seq_id to. A KV cache keeps every position, so the
        position is enough; a recurrent memory saves the state (it cannot be cut later)."""
        return SeqCheckpoint(seq_id, self.seq_pos_max(seq_id))

    def seq_restore(self, seq_id: int, ckpt: SeqCheckpoint) -> bool:
        """Make seq_id what it was at the checkpoint (positions after it are dropped); False
        (nothing changed) if that cannot be done."""
        return self.seq_rm(seq_id, ckpt.pos + 1, -1)

    def state_write(self, io, seq_id: int = -1) -> None:
        raise NotImplementedError

    def state_read(self, io, seq_id: int = -1) -> None:
        raise NotImplementedError

    def state_parse(self, io, seq_id: int = -1):
        """Read and validate a state without changing anything (first half of state_read)."""
        raise NotImplementedError

    def state_apply(self, parsed, seq_id: int = -1) -> None:
        """Install a parsed state; raises (with memory unchanged) if it cannot be placed."""
        raise NotImplementedError
