"""A persistent prefix cache: a sequence's KV cells saved in fixed token blocks on disk, so a new
process with the same prompt prefix (system prompt, `-f` document) decodes only the rest.

Keys (runtime/serving/prompt_keys.py). A prompt is cut into blocks of BLOCK tokens, each named
by a chained hash under a salt of the whole configuration, so a key names one exact prefix under
one exact configuration, and block k can be trusted only after blocks 1..k-1 matched.

Entries. One file per block, `<key>.kvpc`: magic, a JSON header (salt, key, previous key, block
index, the block's tokens, and per cache the positions of the cells stored), the K/V rows of
those cells per layer as the cache holds them, and a sha256 of all of it. Block k holds the
cells of positions [(k-1)*BLOCK, k*BLOCK) of the full-attention cache, and for a sliding-window
cache the cells of those positions still in the window when the block was decoded (the prefill
decodes block by block and saves each block right away, so a window never loses them first).

Restore. The longest run of blocks 1..k whose files exist and check out is put into the
sequence with the memory's own state_apply (find_slot placement, all or nothing); a SWA cache
gets the cells of the last n_swa positions, which must all be present. A file that fails any
check is deleted with a one-line warning and the restore stops before it. Restoring reproduces
the cells' bytes exactly, so the answer is the one a full prefill gives.

Size. The directory never holds more than max_bytes of entries: before a block is written the
least recently used entries (mtime, refreshed on every hit) are deleted to make room; a block
larger than the whole budget is not written.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

import numpy as np

from kvchat.runtime.serving.prompt_keys import BLOCK, block_keys, cacheable

MAGIC = b"KVCPBLK1"
SUFFIX = ".kvpc"
_DIGEST = 32


class EntryError(Exception):
    """A cache file that is truncated, corrupt or from another configuration."""


class PromptCache:
    """Block files under `directory` for one model + cache configuration (the salt)."""

    def __init__(self, directory, max_bytes: int, salt: str, warn=None):
        self.dir = Path(directory)
        self.max_bytes = int(max_bytes)
        self.salt = salt
        self.warn = warn or (lambda text: None)
        self.n_written = 0

    # ---- files ---------------------------------------------------------------------------------

    def _path(self, key: str) -> Path:
        return self.dir / f"{key}{SUFFIX}"

    def _entries(self) -> list[tuple[float, int, Path]]:
        out = []
        try:
            for p in self.dir.iterdir():
                if p.name.endswith(SUFFIX):
                    try:
                        st = p.stat()
                    except OSError:
                        continue
                    out.append((st.st_mtime, st.st_size, p))
        except OSError:
            return []
        return out

    def total_bytes(self) -> int:
        return sum(size for _, size, _ in self._entries())

    def _make_room(self, need: int, keep: set) -> bool:
        """Delete least recently used entries until `need` more bytes fit; False if impossible."""
        if need > self.max_bytes:
            return False
        entries = sorted(self._entries())
        total = sum(size for _, size, _ in entries)
        for _, size, p in entries:
            if total + need <= self.max_bytes:
                break
            if p in keep:
                continue
            try:
                p.unlink()
                total -= size
            except OSError:
                pass
        return total + need <= self.max_bytes

    def _drop(self, path: Path, why: str) -> None:
        self.warn(f"prompt cache: ignoring {path.name} ({why}); deleted")
        try:
            path.unlink()
        except OSError:
            pass

    # ---- encoding ------------------------------------------------------------------------------

    @staticmethod
    def _encode(header: dict, arrays: list[np.ndarray]) -> bytes:
        h = json.dumps(header, separators=(",", ":")).encode()
        body = b"".join([MAGIC, struct.pack("<I", len(h)), h] + [a.tobytes() for a in arrays])
        return body + hashlib.sha256(body).digest()

    def _decode(self, blob: bytes, key: str, prev: str, index: int, tokens, caches, seq_strm):
        """-> [(pos i32 [n], [(k rows, v rows) per layer], cell i64 [n], head, table)] per
        cache (table: i64 [2, m] cells and positions of the sequence then, SWA caches only);
        EntryError if anything is off."""
        if len(blob) < len(MAGIC) + 4 + _DIGEST or blob[: len(MAGIC)] != MAGIC:
            raise EntryError("not a prompt-cache entry")
        body, digest = blob[:-_DIGEST], blob[-_DIGEST:]
        if hashlib.sha256(body).digest() != digest:
            raise EntryError("checksum mismatch: truncated or corrupted")
        (hlen,) = struct.unpack_from("<I", body, len(MAGIC))
        off = len(MAGIC) + 4
        try:
            h = json.loads(body[off : off + hlen])
        except ValueError:
            raise EntryError("bad header") from None
        off += hlen
        if (
            not isinstance(h, dict)
            or h.get("salt") != self.salt
            or h.get("key") != key
            or h.get("prev") != prev
            or h.get("index") != index
        ):
            raise EntryError("saved for another model, configuration or prefix")
        if h.get("tokens") != [int(t) for t in tokens]:
            raise EntryError("its tokens do not match its key")
        hc = h.get("caches")
        if not isinstance(hc, list) or len(hc) != len(caches):
            raise EntryError("cache count mismatch")
        out = []
        for c, desc in zip(caches, hc):
            if not isinstance(desc, dict):
                raise EntryError("bad cache description")
            try:
                pos = np.asarray(desc.get("pos"), dtype=np.int64)
                cell = np.asarray(desc.get("cell"), dtype=np.int64)
                head = int(desc.get("head"))
            except (TypeError, ValueError):
                raise EntryError("bad cell description") from None
            if (
                pos.ndim != 1
                or cell.shape != pos.shape
                or (pos.size and (pos.min() < 0 or pos.max() > 2**31 - 2 or cell.min() < 0 or cell.max() >= c.kv_size))
                or not 0 <= head <= c.kv_size
            ):
                raise EntryError("bad positions or cells")
            table = None
            if c.n_swa > 0:
                try:
                    table = np.asarray(desc.get("table"), dtype=np.int64)
                except (TypeError, ValueError):
                    raise EntryError("bad cell table") from None
                if (
                    table.ndim != 2
                    or table.shape[0] != 2
                    or (table.size and (table.min() < 0 or table[0].max() >= c.kv_size))
                ):
                    raise EntryError("bad cell table")
            n = int(pos.size)
            rows = []
            for l in c.layers:
                kshape = (n, l.k.shape[2])
                vshape = (l.v.shape[1], n * c.v_elem_bytes) if c.v_trans else (n, l.v.shape[2])
                parts = []
                for shape in (kshape, vshape):
                    nb = shape[0] * shape[1]
                    if off + nb > len(body):
                        raise EntryError("truncated rows")
                    parts.append(np.frombuffer(body, dtype=np.uint8, count=nb, offset=off).reshape(shape).copy())
                    off += nb
                rows.append((parts[0], parts[1]))
            out.append((pos.astype(np.int32), rows, cell, head, table))
        if off != len(body):
            raise EntryError("trailing bytes")
        return out

    # ---- store ---------------------------------------------------------------------------------

    def store_block(self, memory, seq_id: int, ids, index: int, keys: list[str]) -> bool:
        """Save block `index` (0-based) of ids from the cells seq_id holds now; True if written."""
        key = keys[index]
        path = self._path(key)
        if path.exists():
            try:
                os.utime(path)
            except OSError:
                pass
            return False
        caches = memory.kv_caches()
        a, b = index * BLOCK, (index + 1) * BLOCK
        header_caches, arrays = [], []
        for c in caches:
            strm = c.seq_to_stream[seq_id]
            cells = c.cells[strm]
            idxs = cells.cells_of_seq(seq_id, a, b)
            idxs = idxs[np.argsort(cells.pos[idxs], kind="stable")]
            if np.any(cells.shift[idxs] != 0):
                return False  # a pending K-shift: the rows are not those of these positions yet
            pos = cells.pos[idxs]
            if c.n_swa == 0 and not np.array_equal(pos, np.arange(a, b)):
                return False
            desc = {"pos": [int(p) for p in pos], "cell": [int(i) for i in idxs], "head": int(c.heads[strm])}
            if c.n_swa > 0:  # the whole cell table of the sequence, masked leftovers included
                t = cells.cells_of_seq(seq_id, 0, 2**31 - 1)
                desc["table"] = [[int(i) for i in t], [int(p) for p in cells.pos[t]]]
            header_caches.append(desc)
            for k_rows, v_rows in c.read_rows(strm, idxs):
                arrays.extend([np.ascontiguousarray(k_rows), np.ascontiguousarray(v_rows)])
        header = {
            "salt": self.salt,
            "key": key,
            "prev": keys[index - 1] if index else self.salt,
            "index": index,
            "tokens": [int(t) for t in ids[a:b]],
            "caches": header_caches,
        }
        blob = self._encode(header, arrays)
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            keep = {self._path(k) for k in keys[:index]}
            if not self._make_room(len(blob), keep):
                return False
            from kvchat.runtime.memory.state import atomic_write

            atomic_write(path, blob)
        except OSError as e:
            self.warn(f"prompt cache: cannot write {path}: {e.strerror or e}")
            return False
        self.n_written += 1
        return True

    # ---- restore -------------------------------------------------------------------------------

    def restore(self, memory, seq_id: int, ids) -> int:
        """Put the longest cached prefix of ids (leaving at least one token) into the empty
        sequence seq_id; returns its length in tokens (0: nothing restored, memory unchanged)."""
        from kvchat.runtime.memory.kv_cache_state import StreamState
        from kvchat.runtime.memory.state import StateError

        if not cacheable(memory):
            return 0
        caches = memory.kv_caches()
        n_blocks = (len(ids) - 1) // BLOCK
        keys = block_keys(self.salt, ids, n_blocks)
        blocks = []
        for k, key in enumerate(keys):
            path = self._path(key)
            try:
                blob = path.read_bytes()
            except FileNotFoundError:
                break
            except OSError as e:
                self.warn(f"prompt cache: cannot read {path.name}: {e.strerror or e}")
                break
            try:
                blocks.append(
                    self._decode(
                        blob, key, keys[k - 1] if k else self.salt, k, ids[k * BLOCK : (k + 1) * BLOCK], caches, None
                    )
                )
            except EntryError as e:
                self._drop(path, str(e))
                break
        while blocks:
            try:
                exact = self._assemble_exact(caches, blocks, seq_id)
                if exact is None or not _place_exact(caches, exact, seq_id):
                    got = self._assemble_window(caches, blocks)
                    if got is None:
                        blocks.pop()  # a sliding window's cells are not all there: shorter prefix
                        continue
                    parsed = [
                        [StreamState(c.seq_to_stream[seq_id], pos, [[seq_id]] * int(pos.size), ks, vs)]
                        for c, (pos, ks, vs) in zip(caches, got)
                    ]
                    memory.state_apply(parsed[0] if len(parsed) == 1 else tuple(parsed), seq_id)
            except StateError as e:
                self.warn(f"prompt cache: cached prefix not restored ({e})")
                return 0
            for key in keys[: len(blocks)]:
                try:
                    os.utime(self._path(key))
                except OSError:
                    pass
            return len(blocks) * BLOCK
        return 0

    @staticmethod
    def _rows(c, blocks, ci, sel_of_block):
        """K and V rows per layer, concatenated over blocks (sel_of_block[j]: which of block j's cells)."""
        ks, vs = [], []
        for il in range(len(c.layers)):
            ks.append(np.concatenate([b[ci][1][il][0][sel] for b, sel in zip(blocks, sel_of_block)]))
            if c.v_trans:
                el = c.v_elem_bytes
                parts = [
                    b[ci][1][il][1][:, (sel[:, None] * el + np.arange(el)).reshape(-1)]
                    for b, sel in zip(blocks, sel_of_block)
                ]
                vs.append(np.concatenate(parts, axis=1))
            else:
                vs.append(np.concatenate([b[ci][1][il][1][sel] for b, sel in zip(blocks, sel_of_block)]))
        return ks, vs

    def _assemble_exact(self, caches, blocks, seq_id):
        """Per cache (pos, K rows, V rows, cells, head) recreating the saving run's cell table as
        it was after the last block - masked sliding-window leftovers included, since they steer
        where later tokens land. None if a cell of that table has no saved rows."""
        out = []
        for ci, c in enumerate(caches):
            last = blocks[-1][ci]
            if c.n_swa > 0:
                want = {(int(i), int(p)) for i, p in zip(*last[4])}
            else:
                want = None
            sels, pos, cell = [], [], []
            for b in blocks:
                bp, bc = b[ci][0], b[ci][2]
                if want is None:
                    sel = np.arange(bp.size)
                else:
                    sel = np.asarray([j for j in range(bp.size) if (int(bc[j]), int(bp[j])) in want], dtype=np.int64)
                sels.append(sel)
                pos.append(bp[sel])
                cell.append(bc[sel])
            pos, cell = np.concatenate(pos), np.concatenate(cell)
            if want is not None and len(want) != pos.size:
                return None
            ks, vs = self._rows(c, blocks, ci, sels)
            out.append((pos, ks, vs, cell, last[3]))
        return out

    def _assemble_window(self, caches, blocks):
        """Per cache (pos, K rows, V rows) of the prefix, a SWA cache keeping only its window
        (what a sequence state holds). None if the window is incomplete."""
        n = len(blocks) * BLOCK
        out = []
        for ci, c in enumerate(caches):
            lo = max(n - c.n_swa, 0) if c.n_swa > 0 else 0
            sels = [np.flatnonzero(b[ci][0] >= lo) for b in blocks]
            pos = np.concatenate([b[ci][0][sel] for b, sel in zip(blocks, sels)])
            if not np.array_equal(np.sort(pos), np.arange(lo, n)):
                return None
            ks, vs = self._rows(c, blocks, ci, sels)
            out.append((pos, ks, vs))
        return out


def _place_exact(caches, got, seq_id: int) -> bool:
    """Put the cells back at the cell indices they were saved from, with the saved heads, when
    the sequence's stream is empty there (a fresh run): then the restored memory is the one the
    saving run had, cell for cell, and later tokens land where they landed then. False (nothing
    changed) when that is not possible; the caller then places them like a state load."""
    for c, (pos, ks, vs, cell, head) in zip(caches, got):
        cells = c.cells[c.seq_to_stream[seq_id]]
        if np.unique(cell).size != cell.size or np.any(cells.pos[cell] >= 0) or cells.seq_pos_max(seq_id) >= 0:
            return False
    for c, (pos, ks, vs, cell, head) in zip(caches, got):
        strm = c.seq_to_stream[seq_id]
        cells = c.cells[strm]
        for i, p in zip(cell.tolist(), pos.tolist()):
            cells.pos_set(i, p)
            cells.seq_add(i, seq_id)
        c.write_rows(strm, cell, list(zip(ks, vs)))
        c.heads[strm] = int(head)
    return True


def prefill(ctx, seq_id: int, ids, cache: PromptCache, pos0: int = 0) -> tuple[int, int]:
    """Restore the longest cached prefix of ids into the (empty) sequence, then decode block by
    block up to the last full block before the final token, saving each new block.

    Returns (n_reused, n_in_memory): tokens restored, and tokens of ids now in the sequence (the
    caller decodes ids[n_in_memory:], at least the last token, itself)."""
    from kvchat.runtime.generate import decode_tokens

    if not cacheable(ctx.memory) or pos0 != 0 or len(ids) <= BLOCK:
        return 0, 0
    n_blocks = (len(ids) - 1) // BLOCK
    n_reused = cache.restore(ctx.memory, seq_id, ids)
    keys = block_keys(cache.salt, ids, n_blocks)
    n = n_reused
    for k in range(n_reused // BLOCK, n_blocks):
        decode_tokens(ctx, ids[k * BLOCK : (k + 1) * BLOCK], k * BLOCK, seq_id, logits="none")
        n = (k + 1) * BLOCK
        cache.store_block(ctx.memory, seq_id, ids, k, keys)
    return n_reused, n
