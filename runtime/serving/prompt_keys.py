"""The names of the prompt cache's blocks (runtime/serving/prompt_cache.py): which memories it can
serve, the model file's sha256, the salt of a configuration, and the chained keys of a prompt.

A prompt is cut into blocks of BLOCK tokens. Block k's key is a chained hash,
`key_k = sha256(key_{k-1} || tokens of block k)`, `key_0 = salt`, and the salt is a sha256 of
everything the bytes depend on: the model file's sha256, the cache types, V layout (flash
attention), Hadamard rotation sizes, sliding window and swa_full, layer counts, BLOCK and the
format version.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

BLOCK = 128
FORMAT_VERSION = 1


def cacheable(memory) -> bool:
    """Whether a sequence of `memory` is all KV cells (Memory.kv_caches), so that a prefix of it
    can be stored and restored block by block; False when part of the state is a recurrent one
    (recurrent, hybrid: get_can_trim), which no prefix of cells restores."""
    return memory.get_can_trim() and bool(memory.kv_caches())


def file_sha256(path, memo_dir: Path | None = None) -> str:
    """sha256 of a whole file, memoized per (path, size, mtime) in memo_dir/models.json."""
    p = Path(path).resolve()
    st = p.stat()
    tag = f"{p}|{st.st_size}|{st.st_mtime_ns}"
    memo = memo_dir / "models.json" if memo_dir is not None else None
    table = {}
    if memo is not None:
        try:
            table = json.loads(memo.read_text())
            if isinstance(table, dict) and isinstance(table.get(tag), str):
                return table[tag]
        except (OSError, ValueError):
            table = {}
    h = hashlib.sha256()
    with open(p, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    digest = h.hexdigest()
    if memo is not None:
        try:
            from kvchat.runtime.memory.state import atomic_write

            table = table if isinstance(table, dict) else {}
            table[tag] = digest
            atomic_write(memo, json.dumps(table).encode())
        except OSError:
            pass
    return digest


def cache_salt(model_sha256: str, cparams, memory) -> str:
    from kvchat.kernels.ggml_types import type_info

    caches = memory.kv_caches() if cacheable(memory) else []
    desc = {
        "format": FORMAT_VERSION,
        "block": BLOCK,
        "model": model_sha256,
        "type_k": type_info(cparams.type_k).name,
        "type_v": type_info(cparams.type_v).name,
        "flash_attn": bool(cparams.flash_attn),
        "swa_full": bool(cparams.swa_full),
        "caches": [
            {
                "v_trans": c.v_trans,
                "n_rot": [c.n_rot_k, c.n_rot_v],
                "n_swa": c.n_swa,
                "layers": [l.il for l in c.layers],
            }
            for c in caches
        ],
    }
    return hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest()


def block_keys(salt: str, ids, n_blocks: int) -> list[str]:
    keys, prev = [], bytes.fromhex(salt)
    for k in range(n_blocks):
        blk = np.asarray(ids[k * BLOCK : (k + 1) * BLOCK], dtype="<i4").tobytes()
        prev = hashlib.sha256(prev + blk).digest()
        keys.append(prev.hex())
    return keys
