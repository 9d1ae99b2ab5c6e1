"""The packed weights cached on disk (runtime/weights/cache.py): a warm load maps byte-identical
packs and answers with identical logits; any change of the model file or the layout, and any
truncated or corrupt file, rebuilds the pack and never uses it; an unwritable cache or an
interrupted write leaves the load working and no file behind; `kvchat rm` removes the pack."""

from __future__ import annotations

import mmap
import os

import numpy as np
import pytest

import kvchat.runtime.weights.cache as wc
from kvchat.kernels.ggml_types import GGMLType
from kvchat.kernels.matmul import FLOAT_TYPES, QMatrix
from kvchat.kernels.qlayout import FORMATS
from kvchat.runtime.batch import Batch
from kvchat.runtime.context import Context
from kvchat.runtime.cparams import ContextParams
from kvchat.runtime.memory.state import TMP_TAG
from kvchat.runtime.model import Model
from tests.helpers.gguf_factory import write_tiny_model
from tests.test_matmul import random_raw

TOKENS = [1, 17, 42, 99, 7, 250, 3, 64]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A fresh KVCHAT_CACHE with the weight cache on; its packed/ directory."""
    monkeypatch.setenv("KVCHAT_CACHE", str(tmp_path / "kv"))
    monkeypatch.delenv("KVCHAT_WEIGHT_CACHE", raising=False)
    return tmp_path / "kv" / "packed"


def _packs(d) -> list:
    return sorted(p.name for p in d.iterdir()) if d.is_dir() else []


def _matrices(model) -> dict:
    """Every QMatrix of the model by attribute path (fused ones included)."""
    out = {k: v for k, v in vars(model.weights).items() if isinstance(v, QMatrix)}
    for i, layer in enumerate(model.weights.layers):
        out.update({f"{i}.{k}": v for k, v in vars(layer).items() if isinstance(v, QMatrix)})
    return out


def _logits(model):
    ctx = Context(model, ContextParams(n_ctx=64, n_batch=len(TOKENS), n_ubatch=len(TOKENS)))
    assert ctx.decode(Batch.one_seq(TOKENS, 0, all_logits=True)) == 0, ctx.last_error
    return ctx.get_logits().copy()


def _mapped(a: np.ndarray) -> bool:
    b = a
    while isinstance(b, np.ndarray):
        b = b.base
    return isinstance(b, memoryview) and isinstance(b.obj, mmap.mmap)


def _embd(path) -> tuple:
    """(name, t, k, m) of the token embedding, as PackStore.get takes them."""
    from kvchat.runtime.gguf.file import GGUFFile

    ti = GGUFFile(path).tensors["token_embd.weight"]
    return ti.name, int(ti.ggml_type), int(ti.shape[0]), int(ti.data.shape[0])


def _load(path):
    model = Model.load(path)
    return model, _matrices(model), _logits(model)


@pytest.mark.parametrize(
    "arch,wt",
    [
        ("llama", GGMLType.Q4_1),
        ("qwen2", GGMLType.Q8_0),
        ("gemma3", GGMLType.Q4_0),
        ("llama", GGMLType.Q5_0),
        ("llama", GGMLType.F16),
        ("llama", GGMLType.F32),
    ],
    ids=lambda v: getattr(v, "name", v),
)
def test_a_warm_load_maps_packs_byte_identical_to_the_in_memory_repack_and_gives_equal_logits(
    tmp_path, cache, monkeypatch, arch, wt
):
    path = write_tiny_model(tmp_path / "m.gguf", arch=arch, weight_type=wt, n_embd=256, n_ff=512, tied=False)
    monkeypatch.setenv("KVCHAT_WEIGHT_CACHE", "0")
    _, plain, want = _load(path)
    assert _packs(cache) == []
    monkeypatch.delenv("KVCHAT_WEIGHT_CACHE")
    _, cold, cold_logits = _load(path)  # repacks and writes the pack
    assert len(_packs(cache)) == 1
    _, warm, warm_logits = _load(path)  # maps it
    assert set(plain) == set(warm) and any("qkv" in n or "gate_up" in n for n in warm)  # fusions covered
    for name, qm in plain.items():
        got = warm[name]
        assert (got.kind, got.m, got.k, got.t, got.packed_nbytes) == (qm.kind, qm.m, qm.k, qm.t, qm.packed_nbytes)
        for a, b in zip(qm._packed, got._packed, strict=True):
            assert a.dtype == b.dtype and a.shape == b.shape and a.flags.writeable == b.flags.writeable
            np.testing.assert_array_equal(a, b)
            assert b.size == 0 or _mapped(b), name
    np.testing.assert_array_equal(cold_logits, want)
    np.testing.assert_array_equal(warm_logits, want)


@pytest.mark.parametrize("t", list(FORMATS) + [GGMLType(t) for t in FLOAT_TYPES], ids=lambda t: GGMLType(t).name)
def test_every_weight_type_round_trips_byte_exact_and_multiplies_identically(tmp_path, t):
    model_file = tmp_path / "model.bin"
    model_file.write_bytes(b"x")
    files = [str(model_file)]
    k, m = 512, 70  # m not a multiple of the 32 interleaved rows: padding rows are stored too
    qm = QMatrix(random_raw(t, m, k), t, k)
    store = wc.PackStore(tmp_path / "packed", files)
    assert store.get("w", int(t), k, m) is None
    store.put("w", int(t), k, m, qm.packing())
    store.save()
    again = wc.PackStore(tmp_path / "packed", files)
    hit = again.get("w", int(t), k, m)
    assert hit is not None and hit[0] == qm.kind
    for a, b in zip(qm._packed, hit[1], strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert a.tobytes() == b.tobytes()
    assert again.get("w", int(t), k, m + 1) is None  # another shape is not this entry
    mapped = QMatrix(None, t, k, keep_raw=False, packed=hit, m=m)
    x = np.random.default_rng(1).standard_normal((3, k)).astype(np.float32)
    np.testing.assert_array_equal(mapped.matmul(x), qm.matmul(x))


def _one_pack(cache):
    (name,) = _packs(cache)
    return cache / name


def test_a_changed_model_file_is_repacked_and_its_old_pack_removed(tmp_path, cache, monkeypatch):
    path = write_tiny_model(tmp_path / "m.gguf", weight_type=GGMLType.Q8_0)
    Model.load(path)
    old = _one_pack(cache)
    write_tiny_model(path, weight_type=GGMLType.Q8_0, seed=1)  # same path, other weights
    os.utime(path, ns=(1, old.stat().st_mtime_ns + 10**9))
    _, warm, logits = _load(path)
    new = _one_pack(cache)
    assert new != old and new.name.split("-")[0] == old.name.split("-")[0]  # same model, new key
    monkeypatch.setenv("KVCHAT_WEIGHT_CACHE", "0")
    _, _, want = _load(path)
    np.testing.assert_array_equal(logits, want)


def test_a_new_layout_version_gives_another_key_and_a_rebuilt_pack(tmp_path, cache, monkeypatch):
    import kvchat.kernels.qlayout

    path = write_tiny_model(tmp_path / "m.gguf", weight_type=GGMLType.Q4_0)
    Model.load(path)
    old = _one_pack(cache)
    monkeypatch.setattr(kvchat.kernels.qlayout, "LAYOUT_VERSION", kvchat.kernels.qlayout.LAYOUT_VERSION + 1)
    gf_files = [os.path.realpath(path)]
    assert wc.PackStore(cache, gf_files).get(*_embd(path)) is None
    Model.load(path)
    assert _packs(cache) == [_one_pack(cache).name] and _one_pack(cache) != old


def _damage(how: str, p):
    data = bytearray(p.read_bytes())
    if how == "truncated":
        data = data[: len(data) - 100]
    elif how == "table byte":
        data[60] ^= 0x20
    elif how == "magic":
        data[0] ^= 1
    elif how == "appended":
        data += b"\0" * 64
    p.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["truncated", "table byte", "magic", "appended"])
def test_a_truncated_or_corrupt_pack_is_never_used_and_is_rebuilt(tmp_path, cache, how):
    path = write_tiny_model(tmp_path / "m.gguf", weight_type=GGMLType.Q4_1)
    _, _, want = _load(path)
    p = _one_pack(cache)
    good = p.read_bytes()
    _damage(how, p)
    store = wc.PackStore(cache, [os.path.realpath(path)])
    assert store.get(*_embd(path)) is None  # not used
    _, warm, logits = _load(path)
    np.testing.assert_array_equal(logits, want)
    assert not any(_mapped(a) for qm in warm.values() for a in qm._packed if a.size)  # repacked, not mapped
    assert p.read_bytes() == good  # rebuilt


def test_an_unwritable_cache_loads_without_it_and_leaves_nothing(tmp_path, monkeypatch):
    path = write_tiny_model(tmp_path / "m.gguf", weight_type=GGMLType.Q8_0)
    monkeypatch.setenv("KVCHAT_WEIGHT_CACHE", "0")
    _, _, want = _load(path)
    monkeypatch.delenv("KVCHAT_WEIGHT_CACHE")
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the cache directory should be")
    monkeypatch.setenv("KVCHAT_CACHE", str(blocker))
    _, _, logits = _load(path)
    np.testing.assert_array_equal(logits, want)
    assert blocker.read_text().startswith("a file")


def test_a_full_disk_or_an_interrupted_write_leaves_no_file_behind(tmp_path, cache, monkeypatch):
    path = write_tiny_model(tmp_path / "m.gguf", weight_type=GGMLType.Q8_0)
    real_write = wc.PackStore._write

    def fails(exc):
        def write(self, f):
            real_write(self, f)  # the whole temporary file is written, then the failure
            raise exc

        return write

    monkeypatch.setattr(wc.PackStore, "_write", fails(OSError(28, "No space left on device")))
    _, _, logits = _load(path)
    assert _packs(cache) == []
    monkeypatch.setattr(wc.PackStore, "_write", fails(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        Model.load(path)
    assert _packs(cache) == []
    monkeypatch.setattr(wc.PackStore, "_write", real_write)
    _, _, again = _load(path)
    np.testing.assert_array_equal(again, logits)
    assert len(_packs(cache)) == 1


def test_temporaries_of_dead_writers_and_packs_of_deleted_models_are_swept(tmp_path, cache):
    a = write_tiny_model(tmp_path / "a.gguf", weight_type=GGMLType.Q8_0)
    b = write_tiny_model(tmp_path / "b.gguf", weight_type=GGMLType.Q8_0, seed=2)
    Model.load(a)
    pack_a = _one_pack(cache)
    dead = cache / f".{pack_a.name}{TMP_TAG}999999999-x1y2z3"  # atomic_write's name, no such pid
    dead.write_bytes(b"half")
    legacy = cache / f".{pack_a.name}.999999998.tmp"  # session 7's temporary name
    legacy.write_bytes(b"half")
    mine = cache / f".{pack_a.name}{TMP_TAG}{os.getpid()}-a1b2c3"
    mine.write_bytes(b"busy")
    a.unlink()
    Model.load(b)  # writing b's pack sweeps
    assert not pack_a.exists() and not dead.exists() and not legacy.exists() and mine.exists()
    assert len([n for n in _packs(cache) if n.endswith(wc.SUFFIX)]) == 1


def test_the_switch_off_writes_nothing(tmp_path, cache, monkeypatch):
    monkeypatch.setenv("KVCHAT_WEIGHT_CACHE", "0")
    Model.load(write_tiny_model(tmp_path / "m.gguf", weight_type=GGMLType.Q8_0))
    assert not cache.exists()


def test_rm_removes_the_models_pack(tmp_path, cache, capsys):
    from kvchat.cli.app import main
    from kvchat.cli.sources.catalog import KNOWN_MODELS

    models = cache.parent / "models"
    models.mkdir(parents=True)
    path = write_tiny_model(models / KNOWN_MODELS["smollm2"].file_name, weight_type=GGMLType.Q8_0)
    other = write_tiny_model(tmp_path / "other.gguf", weight_type=GGMLType.Q4_0)
    Model.load(path)
    Model.load(other)
    packs = {p: p.stat().st_size for p in cache.iterdir()}
    assert len(packs) == 2
    size = path.stat().st_size
    try:
        main(["rm", "smollm2"])
    except SystemExit as e:
        assert e.code in (0, None)
    (kept,) = cache.iterdir()
    freed = size + sum(n for p, n in packs.items() if p != kept)
    out = capsys.readouterr().out
    from kvchat.cli.sources.catalog import human_size

    assert out.startswith(f"removed smollm2 ({human_size(freed)} freed)")
    assert wc.PackStore(cache, [os.path.realpath(other)]).get(*_embd(other)) is not None


def test_a_self_drafts_copy_is_cached_beside_its_targets_pack_and_mapped_on_the_next_load(
    cache, reference_dir, monkeypatch
):
    """self:q4_0's requantized matrices go to a pack of their own (the target's stays); the next
    copy maps it: no calibration forward, no row made, the same logits bit for bit."""
    import kvchat.runtime.speculative.self_quant as sq

    target = Model.load(reference_dir / "tiny" / "llama3rope_s1.gguf")
    target_packs = _packs(cache)
    assert len(target_packs) == 1
    cold = sq.quantized_copy(target, "q4_0")
    packs = _packs(cache)
    assert len(packs) == 2 and target_packs[0] in packs
    cold_logits = _logits(cold)

    def no_calibration(model, text=None):
        raise AssertionError("a cached copy measured its importances again")

    monkeypatch.setattr(sq, "activation_importance", no_calibration)
    warm = sq.quantized_copy(target, "q4_0")
    assert _packs(cache) == packs
    layer = warm.weights.layers[0]
    fused = [v for v in vars(layer).values() if isinstance(v, QMatrix)]
    assert fused and all(v.raw is None and all(_mapped(a) for a in v._packed if a.size) for v in fused)
    np.testing.assert_array_equal(_logits(warm), cold_logits)
    q8 = sq.quantized_copy(target, "q8_0")  # another type: another pack, the others kept
    assert len(_packs(cache)) == 3 and set(packs) <= set(_packs(cache))
    assert not np.array_equal(_logits(q8), cold_logits)
    target.close()
