"""benchmarks/page_in.py: the files vs_llamacpp --page-in reads before a kvchat run are the weight
pack kvchat wrote for that model, and after page_in every byte of them is in the page cache."""

from __future__ import annotations

import sys
from pathlib import Path

from kvchat.runtime.model import Model
from tests.helpers.gguf_factory import write_tiny_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from page_in import kvchat_packs, page_in, resident  # noqa: E402


def test_the_pack_kvchat_wrote_is_found_and_paged_in(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCHAT_CACHE", str(tmp_path / "kv"))
    monkeypatch.delenv("KVCHAT_WEIGHT_CACHE", raising=False)
    model = write_tiny_model(tmp_path / "m.gguf", arch="llama", n_layer=2)
    assert kvchat_packs(model, {"KVCHAT_CACHE": str(tmp_path / "kv")}) == []
    Model.load(model).close()  # repacks and writes the pack
    written = sorted((tmp_path / "kv" / "packed").glob("*.kvpack"))
    packs = kvchat_packs(model, {"KVCHAT_CACHE": str(tmp_path / "kv")})
    assert packs == written and len(packs) == 1
    assert kvchat_packs(tmp_path / "other.gguf", {"KVCHAT_CACHE": str(tmp_path / "kv")}) == []
    n, secs = page_in(packs + [model])
    assert n == sum(p.stat().st_size for p in packs + [model]) and secs >= 0
    assert resident(packs[0]) == 1.0 and resident(model) == 1.0


def test_resident_of_an_empty_file_is_whole(tmp_path):
    p = tmp_path / "empty"
    p.write_bytes(b"")
    assert resident(p) == 1.0
