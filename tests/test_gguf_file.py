"""GGUFFile on real and tiny models: the same metadata and tensors as gguf-py's GGUFReader,
tensors as zero-copy read-only views on the one mmap, and a fast vocabulary load."""

from __future__ import annotations

import struct
import time

import gguf
import numpy as np
import pytest

from kvchat.kernels.ggml_types import GGMLType
from kvchat.runtime.gguf.file import GGUFFile
from kvchat.runtime.gguf.file import GGUFValueType as VT
from tests.helpers.gguf_factory import write_tiny_model
from tests.test_gguf_corrupt import ARCH, gguf_bytes, kv_arr, s, tinfo


def assert_same_as_reader(gf: GGUFFile, reader: gguf.GGUFReader, check_all_data: bool):
    """Every metadata field and tensor of `reader` is in `gf` with equal values/bytes."""
    fields = {k: f for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert set(fields) == set(gf.metadata)
    for key, f in fields.items():
        mine = gf.metadata[key]
        if f.types[0] == gguf.GGUFValueType.ARRAY:
            if f.types[-1] == gguf.GGUFValueType.STRING:
                assert mine == f.contents(), key
            else:
                ref = np.array(f.contents())
                assert isinstance(mine, np.ndarray) and mine.shape == ref.shape, key
                assert np.array_equal(mine, ref), key
        else:
            assert mine == f.contents(), key
            assert type(mine) is type(f.contents()), key
    assert len(gf.tensors) == len(reader.tensors)
    for rt in reader.tensors:
        t = gf.tensors[rt.name]
        assert t.shape == tuple(int(d) for d in rt.shape), rt.name
        assert int(t.ggml_type) == int(rt.tensor_type), rt.name
        assert gf.data_offset + t.offset == rt.data_offset, rt.name
        assert t.nbytes == rt.n_bytes, rt.name
        assert t.n_elements == rt.n_elements, rt.name
        if check_all_data or rt.name in ("token_embd.weight", "output_norm.weight"):
            ref = np.asarray(rt.data).reshape(-1).view(np.uint8)
            assert np.array_equal(t.data.reshape(-1), ref), rt.name


def assert_zero_copy(gf: GGUFFile):
    for t in gf.tensors.values():
        assert t.data.dtype == np.uint8 and t.data.ndim == 2
        assert t.data.shape[0] * t.data.shape[1] == t.nbytes
        assert not t.data.flags.writeable and not t.data.flags.owndata
        assert np.shares_memory(t.data, gf.raw)
        start = gf.data_offset + t.offset
        assert t.data.__array_interface__["data"][0] == gf.raw.__array_interface__["data"][0] + start


@pytest.mark.real_model
@pytest.mark.parametrize(
    "which,n_tensors,n_kv,types",
    [
        ("smollm2", 272, 33, {"q4_1": 210, "f32": 61, "q8_0": 1}),
        # GGUFReader needs ~20-50 s to parse the 262144-token vocabulary
        pytest.param(
            "gemma3", 236, 33, {"f32": 109, "q5_0": 81, "q4_K": 27, "q8_0": 10, "q6_K": 9}, marks=pytest.mark.slow
        ),
    ],
)
def test_real_model_matches_gguf_reader(request, which, n_tensors, n_kv, types):
    path = request.getfixturevalue(f"{which}_path")
    gf = GGUFFile(path)
    assert len(gf.tensors) == n_tensors and len(gf.metadata) == n_kv and gf.version == 3
    counts = {}
    for t in gf.tensors.values():
        counts[t.type_info.name] = counts.get(t.type_info.name, 0) + 1
    assert counts == types
    assert_zero_copy(gf)
    assert_same_as_reader(gf, gguf.GGUFReader(path), check_all_data=False)


@pytest.mark.real_model
def test_real_model_values(smollm2_path, gemma3_path):
    sm = GGUFFile(smollm2_path)
    assert sm.arch == "llama" and sm.get("llama.block_count") == 30
    assert sm.tensors["token_embd.weight"].shape == (576, 49152)
    assert sm.tensors["token_embd.weight"].data.shape == (49152, 576 // 32 * 34)
    assert sm.metadata["tokenizer.ggml.tokens"][:3] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert len(sm.metadata["tokenizer.ggml.merges"]) == 48900
    assert sm.value_types["llama.rope.freq_base"] == (VT.FLOAT32, None)
    ge = GGUFFile(gemma3_path)
    assert ge.arch == "gemma3" and ge.get("gemma3.attention.sliding_window") == 512
    tt = ge.metadata["tokenizer.ggml.token_type"]
    assert tt.dtype == np.int32 and tt.shape == (262144,)
    assert ge.metadata["tokenizer.ggml.scores"].dtype == np.float32
    assert ge.metadata["tokenizer.ggml.tokens"][105] == "<start_of_turn>"
    assert "tokenizer.chat_template" not in ge.metadata and "tokenizer.chat_template" in sm.metadata


@pytest.mark.real_model
def test_gemma_vocab_loads_fast(gemma3_path):
    GGUFFile(gemma3_path).close()  # warm numba's cache and the page cache
    best = min(_timed(lambda: GGUFFile(gemma3_path)) for _ in range(3))
    print(f"gemma3 GGUFFile load: {best * 1000:.0f} ms")
    assert best < 0.5


def _timed(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3"])
@pytest.mark.parametrize("wtype", [GGMLType.F32, GGMLType.F16, GGMLType.Q8_0, GGMLType.Q4_0, GGMLType.Q5_1])
def test_tiny_models_match_gguf_reader(tmp_path, arch, wtype):
    path = write_tiny_model(tmp_path / f"{arch}.gguf", arch=arch, weight_type=wtype, tied=False)
    gf = GGUFFile(path)
    assert gf.tensors["blk.0.attn_q.weight"].ggml_type == wtype
    assert gf.tensors["blk.0.attn_norm.weight"].ggml_type == GGMLType.F32
    assert_zero_copy(gf)
    assert_same_as_reader(gf, gguf.GGUFReader(path), check_all_data=True)


def test_tensor_views_are_read_only_and_survive_close(tmp_path):
    gf = GGUFFile(write_tiny_model(tmp_path / "m.gguf"))
    w = gf.tensors["blk.0.ffn_up.weight"].data
    before = w.copy()
    with pytest.raises(ValueError):
        w[0, 0] = 1
    gf.close()
    assert gf.tensors == {} and gf.raw is None
    assert np.array_equal(w, before)  # the mapping lives as long as a view does


def test_version_2_and_array_kinds(tmp_path):
    """v2 files load; numeric arrays are native numpy arrays, bools bool, nested arrays lists."""
    kvs = [
        ARCH,
        kv_arr("x.i16", VT.INT16, 3, struct.pack("<3h", -1, 2, -3)),
        kv_arr("x.f64", VT.FLOAT64, 2, struct.pack("<2d", 0.5, -2.0)),
        kv_arr("x.b", VT.BOOL, 2, b"\x01\x00"),
        kv_arr(
            "x.nested",
            VT.ARRAY,
            2,
            struct.pack("<IQ", VT.UINT8, 2) + b"\x07\x08" + struct.pack("<IQ", VT.STRING, 1) + s("z"),
        ),
        kv_arr("x.empty", VT.STRING, 0),
    ]
    p = tmp_path / "v2.gguf"
    p.write_bytes(gguf_bytes(kvs=kvs, tensors=[tinfo("w", (4, 3))], data_size=48, version=2))
    gf = GGUFFile(p)
    assert gf.version == 2
    assert gf.metadata["x.i16"].tolist() == [-1, 2, -3] and gf.metadata["x.i16"].dtype == np.int16
    assert gf.metadata["x.f64"].tolist() == [0.5, -2.0]
    assert gf.metadata["x.b"].dtype == bool and gf.metadata["x.b"].tolist() == [True, False]
    assert gf.metadata["x.nested"][0].tolist() == [7, 8] and gf.metadata["x.nested"][1] == ["z"]
    assert gf.metadata["x.empty"] == []
    assert gf.tensors["w"].data.shape == (3, 16)


def test_strings_with_nul_and_invalid_utf8(tmp_path):
    body = s(b"a\x00b") + s(b"\xff") + s("é")
    p = tmp_path / "s.gguf"
    p.write_bytes(gguf_bytes(kvs=[ARCH, kv_arr("tokenizer.ggml.tokens", VT.STRING, 3, body)]))
    toks = GGUFFile(p).metadata["tokenizer.ggml.tokens"]
    assert toks[0] == "a\x00b" and toks[2] == "é"
    assert toks[1].encode("utf-8", "surrogateescape") == b"\xff"
