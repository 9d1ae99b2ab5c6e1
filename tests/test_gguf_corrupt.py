"""Hand-crafted corrupt GGUF files: each must fail fast with a one-line ModelFileError that
names the file and the offending field — never another exception, never a long allocation."""

from __future__ import annotations

import random
import struct
import time

import numpy as np
import pytest
from gguf import GGUFValueType as GVT

from kvchat.kernels.ggml_types import GGMLType
from kvchat.runtime.arch import read_hparams
from kvchat.runtime.errors import ModelFileError
from kvchat.runtime.gguf.file import GGUFFile
from kvchat.runtime.gguf.file import GGUFValueType as VT
from tests.helpers.gguf_factory import write_tiny_model


# ----------------------------------------------------------------------------- raw encoder
def s(text: str | bytes) -> bytes:
    b = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(b)) + b


def kv(key: str, vtype: int, payload: bytes) -> bytes:
    return s(key) + struct.pack("<I", vtype) + payload


def kv_u32(key, v):
    return kv(key, VT.UINT32, struct.pack("<I", v))


def kv_str(key, v):
    return kv(key, VT.STRING, s(v))


def kv_arr(key, etype, n, body=b""):
    return kv(key, VT.ARRAY, struct.pack("<IQ", etype, n) + body)


ARCH = kv_str("general.architecture", "llama")


def tinfo(name, dims, ttype=GGMLType.F32, offset=0, n_dims=None) -> bytes:
    n_dims = len(dims) if n_dims is None else n_dims
    return (
        s(name)
        + struct.pack("<I", n_dims)
        + b"".join(struct.pack("<Q", d) for d in dims)
        + struct.pack("<IQ", ttype, offset)
    )


def gguf_bytes(
    kvs=(ARCH,), tensors=(), data_size=0, magic=b"GGUF", version=3, n_tensors=None, n_kv=None, alignment=32
) -> bytes:
    head = magic + struct.pack(
        "<IQQ", version, len(tensors) if n_tensors is None else n_tensors, len(kvs) if n_kv is None else n_kv
    )
    body = head + b"".join(kvs) + b"".join(tensors)
    body += b"\0" * (-len(body) % alignment)
    return body + b"\0" * data_size


def load(tmp_path, data: bytes, name="bad.gguf"):
    p = tmp_path / name
    p.write_bytes(data)
    return GGUFFile(p)


def expect_error(tmp_path, data: bytes, *words, name="bad.gguf", limit_s=1.0):
    """Load `data`; assert ModelFileError within limit_s, one line, naming file and `words`."""
    t0 = time.perf_counter()
    with pytest.raises(ModelFileError) as ei:
        load(tmp_path, data, name)
    elapsed = time.perf_counter() - t0
    msg = str(ei.value)
    assert elapsed < limit_s, f"took {elapsed:.2f}s: {msg}"
    assert "\n" not in msg
    assert msg.startswith(str(tmp_path / name) + ": ")
    for w in words:
        assert w in msg, f"{w!r} not in {msg!r}"
    return msg


# ----------------------------------------------------------------------------- container
def test_minimal_valid_file_loads(tmp_path):
    data = gguf_bytes(tensors=[tinfo("a", (8, 2)), tinfo("b", (32,), GGMLType.Q8_0, offset=64)], data_size=64 + 34)
    gf = load(tmp_path, data)
    assert gf.arch == "llama" and gf.version == 3 and gf.alignment == 32
    assert gf.tensors["a"].data.shape == (2, 32) and gf.tensors["b"].data.shape == (1, 34)


def test_bad_magic(tmp_path):
    expect_error(tmp_path, gguf_bytes(magic=b"GGML"), "magic", "not a GGUF file")


@pytest.mark.parametrize("version", [0, 1, 4, 0x03000000])
def test_bad_version(tmp_path, version):
    msg = expect_error(tmp_path, gguf_bytes(version=version), "version", str(version))
    if version == 0x03000000:
        assert "big-endian" in msg


@pytest.mark.parametrize("size", [0, 3, 10, 23])
def test_truncated_header(tmp_path, size):
    expect_error(tmp_path, gguf_bytes()[:size], "header", "truncated")


def test_every_truncation_of_a_valid_file_fails_cleanly(tmp_path):
    """Cutting a valid file at any byte gives ModelFileError (and the whole file loads)."""
    data = gguf_bytes(
        kvs=[ARCH, kv_arr("x.arr", VT.UINT16, 3, b"\1\0\2\0\3\0"), kv_arr("x.strs", VT.STRING, 2, s("ab") + s("c"))],
        tensors=[tinfo("t", (4,))],
        data_size=16,
    )
    assert load(tmp_path, data).metadata["x.strs"] == ["ab", "c"]
    for cut in range(len(data)):  # header, padding or tensor data: every cut must be caught
        with pytest.raises(ModelFileError):
            load(tmp_path, data[:cut])


@pytest.mark.parametrize(
    "field,kwargs",
    [
        ("tensor_count", dict(n_tensors=1 << 40)),
        ("kv_count", dict(n_kv=1 << 31)),
        ("tensor_count", dict(n_tensors=1000)),  # under the cap, but not in 1 KB
    ],
)
def test_huge_counts(tmp_path, field, kwargs):
    expect_error(tmp_path, gguf_bytes(**kwargs), field)


def test_key_length_past_end(tmp_path):
    bad_key = struct.pack("<Q", 10_000) + b"general"
    data = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + bad_key
    expect_error(tmp_path, data, "metadata key #0", "10000")


def test_string_value_past_end(tmp_path):
    val = kv("general.name", VT.STRING, struct.pack("<Q", 5000) + b"abc")
    expect_error(tmp_path, gguf_bytes(kvs=[ARCH, val]), "general.name", "5000")


@pytest.mark.parametrize("read_strings", [True, False], ids=["read", "stepped-over"])
def test_string_in_array_past_end(tmp_path, read_strings):
    body = s("ok") + struct.pack("<Q", 1 << 20) + b"xx"
    p = tmp_path / "bad.gguf"
    p.write_bytes(gguf_bytes(kvs=[ARCH, kv_arr("tokenizer.ggml.tokens", VT.STRING, 2, body)]))
    with pytest.raises(ModelFileError, match=r"tokenizer\.ggml\.tokens\[1\]: string runs past the end"):
        GGUFFile(p, read_strings=read_strings)


def test_a_file_opened_without_its_strings_has_their_lengths_and_everything_after_them(tmp_path):
    p = write_tiny_model(tmp_path / "m.gguf", n_vocab=300)
    full, bare = GGUFFile(p), GGUFFile(p, read_strings=False)
    tokens = bare.metadata["tokenizer.ggml.tokens"]
    assert len(tokens) == len(full.metadata["tokenizer.ggml.tokens"]) == 300
    with pytest.raises(LookupError, match="without its strings"):
        tokens[0]
    assert bare.value_types == full.value_types and bare.data_offset == full.data_offset
    for key, value in full.metadata.items():
        if bare.value_types[key] != (VT.ARRAY, VT.STRING):
            np.testing.assert_array_equal(bare.metadata[key], value)
    assert list(bare.tensors) == list(full.tensors)
    for name, ti in full.tensors.items():
        np.testing.assert_array_equal(bare.tensors[name].data, ti.data)


@pytest.mark.parametrize("n", [1 << 40, (1 << 30) - 1])
def test_huge_array_fails_fast(tmp_path, n):
    """A 4 MB file claiming a gigantic array: rejected before allocating or looping."""
    filler = np.zeros(4 << 20, np.uint8).tobytes()
    data = gguf_bytes(kvs=[ARCH, kv_arr("tokenizer.ggml.scores", VT.UINT64, n, filler)])
    expect_error(tmp_path, data, "tokenizer.ggml.scores", str(n), limit_s=0.5)


def test_huge_string_array_fails_fast(tmp_path):
    filler = np.zeros(4 << 20, np.uint8).tobytes()
    data = gguf_bytes(kvs=[ARCH, kv_arr("tokenizer.ggml.tokens", VT.STRING, 1 << 28, filler)])
    expect_error(tmp_path, data, "tokenizer.ggml.tokens", limit_s=0.5)


def test_bad_value_type(tmp_path):
    expect_error(tmp_path, gguf_bytes(kvs=[ARCH, kv("x.y", 13, b"\0" * 8)]), "x.y", "invalid value type 13")


def test_bad_array_element_type(tmp_path):
    expect_error(
        tmp_path, gguf_bytes(kvs=[ARCH, kv_arr("x.y", 99, 1, b"\0" * 8)]), "x.y", "invalid array element type 99"
    )


def test_bad_bool(tmp_path):
    expect_error(tmp_path, gguf_bytes(kvs=[ARCH, kv("x.flag", VT.BOOL, b"\x07")]), "x.flag", "bool")


def test_nested_arrays_bounded(tmp_path):
    inner = struct.pack("<IQ", VT.ARRAY, 1) * 6 + struct.pack("<IQ", VT.UINT8, 0)
    expect_error(tmp_path, gguf_bytes(kvs=[ARCH, kv("x.deep", VT.ARRAY, inner)]), "x.deep", "nested")


def test_invalid_utf8_key(tmp_path):
    expect_error(tmp_path, gguf_bytes(kvs=[ARCH, kv(b"\xff\xfe", VT.UINT8, b"\0")]), "metadata key #1", "UTF-8")


def test_duplicate_key(tmp_path):
    expect_error(tmp_path, gguf_bytes(kvs=[ARCH, kv_u32("x.n", 1), kv_u32("x.n", 2)]), "x.n", "duplicate metadata key")


def test_duplicate_tensor(tmp_path):
    data = gguf_bytes(tensors=[tinfo("w", (8,)), tinfo("w", (8,), offset=32)], data_size=64)
    expect_error(tmp_path, data, "w", "duplicate tensor name")


@pytest.mark.parametrize("align", [0, 3, 48, 1 << 21])
def test_bad_alignment(tmp_path, align):
    data = gguf_bytes(kvs=[ARCH, kv_u32("general.alignment", align)])
    expect_error(tmp_path, data, "general.alignment", "power of two")


def test_alignment_wrong_type(tmp_path):
    expect_error(tmp_path, gguf_bytes(kvs=[ARCH, kv_str("general.alignment", "32")]), "general.alignment", "integer")


def test_custom_alignment_is_honoured(tmp_path):
    data = gguf_bytes(
        kvs=[ARCH, kv_u32("general.alignment", 64)],
        tensors=[tinfo("a", (8,)), tinfo("b", (8,), offset=64)],
        data_size=128,
        alignment=64,
    )
    gf = load(tmp_path, data)
    assert gf.alignment == 64 and gf.data_offset % 64 == 0
    data = gguf_bytes(
        kvs=[ARCH, kv_u32("general.alignment", 64)],
        tensors=[tinfo("a", (8,)), tinfo("b", (8,), offset=32)],
        data_size=128,
        alignment=64,
    )
    expect_error(tmp_path, data, "b", "not a multiple of the alignment 64")


@pytest.mark.parametrize("n_dims", [0, 5])
def test_bad_n_dims(tmp_path, n_dims):
    data = gguf_bytes(tensors=[tinfo("w", (2,) * n_dims)], data_size=256)
    expect_error(tmp_path, data, "w", f"n_dims {n_dims}")


def test_zero_dim(tmp_path):
    expect_error(tmp_path, gguf_bytes(tensors=[tinfo("w", (8, 0))], data_size=64), "w", "size 0")


def test_element_count_overflow(tmp_path):
    data = gguf_bytes(tensors=[tinfo("w", (1 << 32, 1 << 32, 1 << 32))], data_size=64)
    expect_error(tmp_path, data, "w", "overflows")


def test_unknown_tensor_type(tmp_path):
    expect_error(
        tmp_path, gguf_bytes(tensors=[tinfo("w", (32,), ttype=99)], data_size=64), "w", "unknown ggml type id 99"
    )


def test_row_not_multiple_of_block(tmp_path):
    data = gguf_bytes(tensors=[tinfo("w", (33, 2), ttype=GGMLType.Q8_0)], data_size=128)
    expect_error(tmp_path, data, "w", "row length 33", "q8_0 block size 32")


@pytest.mark.parametrize("offset,size", [(0, 16), (64, 64), (1 << 62, 64)])
def test_data_out_of_bounds(tmp_path, offset, size):
    data = gguf_bytes(tensors=[tinfo("w", (16,), offset=offset)], data_size=size)  # needs 64 bytes
    expect_error(tmp_path, data, "w", "outside the data section")


def test_misaligned_offset(tmp_path):
    data = gguf_bytes(tensors=[tinfo("w", (4,), offset=4)], data_size=64)
    expect_error(tmp_path, data, "w", "data offset 4", "alignment 32")


def test_overlapping_tensors(tmp_path):
    data = gguf_bytes(tensors=[tinfo("a", (16,)), tinfo("b", (16,), offset=32)], data_size=128)
    expect_error(tmp_path, data, "b", "overlaps tensor a")


def test_missing_architecture(tmp_path):
    expect_error(tmp_path, gguf_bytes(kvs=[kv_u32("x.n", 1)]), "general.architecture", "missing")


def test_vocab_parallel_array_length_mismatch(tmp_path):
    toks = kv_arr("tokenizer.ggml.tokens", VT.STRING, 3, s("a") + s("b") + s("c"))
    scores = kv_arr("tokenizer.ggml.scores", VT.FLOAT32, 2, b"\0" * 8)
    expect_error(tmp_path, gguf_bytes(kvs=[ARCH, toks, scores]), "tokenizer.ggml.scores", "2 entries", "3")


def test_vocab_wrong_element_type(tmp_path):
    toks = kv_arr("tokenizer.ggml.tokens", VT.STRING, 2, s("a") + s("b"))
    ttype = kv_arr("tokenizer.ggml.token_type", VT.UINT8, 2, b"\1\1")
    expect_error(tmp_path, gguf_bytes(kvs=[ARCH, toks, ttype]), "tokenizer.ggml.token_type", "array of i32")
    merges = kv_arr("tokenizer.ggml.merges", VT.UINT32, 1, b"\0" * 4)
    expect_error(tmp_path, gguf_bytes(kvs=[ARCH, toks, merges]), "tokenizer.ggml.merges", "array of string")


def test_random_header_mutations_only_raise_model_file_error(tmp_path):
    """Flip bytes in a real (tiny) model's header: it either loads or raises ModelFileError."""
    good = write_tiny_model(tmp_path / "good.gguf", arch="llama").read_bytes()
    gf = load(tmp_path, good, "ok.gguf")
    header = gf.data_offset
    gf.close()
    rng = random.Random(1234)
    outcomes = {"ok": 0, "error": 0}
    for i in range(300):
        data = bytearray(good)
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(header)] = rng.randrange(256)
        t0 = time.perf_counter()
        try:
            GGUFFile(_write(tmp_path / f"m{i % 4}.gguf", bytes(data))).close()
            outcomes["ok"] += 1
        except ModelFileError as e:
            assert "\n" not in str(e)
            outcomes["error"] += 1
        assert time.perf_counter() - t0 < 1.0
    assert outcomes["error"] > 50  # most header flips must be caught


def _write(p, data):
    p.write_bytes(data)
    return p


# ----------------------------------------------------------------------------- model level
def hparams_error(tmp_path, *words, **factory_kwargs):
    p = write_tiny_model(tmp_path / "m.gguf", **factory_kwargs)
    gf = GGUFFile(p)
    with pytest.raises(ModelFileError) as ei:
        read_hparams(gf)
    msg = str(ei.value)
    assert "\n" not in msg and msg.startswith(str(p) + ": ")
    for w in words:
        assert w in msg, f"{w!r} not in {msg!r}"
    return msg


@pytest.mark.parametrize(
    "key",
    [
        "llama.block_count",
        "llama.embedding_length",
        "llama.feed_forward_length",
        "llama.attention.head_count",
        "llama.context_length",
        "llama.attention.layer_norm_rms_epsilon",
    ],
)
def test_missing_required_metadata(tmp_path, key):
    hparams_error(tmp_path, key, "missing", metadata={key: None})


def test_missing_vocabulary(tmp_path):
    hparams_error(
        tmp_path,
        "tokenizer.ggml.tokens",
        "missing",
        metadata={"tokenizer.ggml.tokens": None, "tokenizer.ggml.token_type": None, "tokenizer.ggml.merges": None},
    )


def test_head_count_not_multiple_of_kv_heads(tmp_path):
    hparams_error(tmp_path, "llama.attention.head_count_kv", "not a multiple", n_head=4, n_head_kv=3)


@pytest.mark.parametrize(
    "key,value,words",
    [
        ("llama.block_count", 0, ["0 is not in [1, 512]"]),
        ("llama.attention.head_count", 0, ["0 is not in"]),
        ("llama.attention.layer_norm_rms_epsilon", -1.0, ["not in (0, 1)"]),
        ("llama.rope.freq_base", 0.0, ["must be positive"]),
        ("llama.embedding_length", "64", ["must be an integer"]),
        ("llama.rope.dimension_count", 32, ["must equal the head size 16"]),
        ("llama.rope.scaling.type", "yarn", ["rope scaling 'yarn' is not supported"]),
        ("llama.vocab_size", 5, ["differs from the"]),
    ],
)
def test_bad_metadata_values(tmp_path, key, value, words):
    hparams_error(tmp_path, key, *words, metadata={key: value})


def test_wrong_tensor_shape_from_metadata(tmp_path):
    # the file's tensors are 64 wide; claim 128
    hparams_error(tmp_path, "token_embd.weight", "does not match", "[128, ", metadata={"llama.embedding_length": 128})


def test_missing_required_tensor(tmp_path):
    hparams_error(
        tmp_path, "blk.1.ffn_up.weight", "missing (required for llama)", drop_tensors=("blk.1.ffn_up.weight",)
    )
    hparams_error(
        tmp_path, "blk.0.attn_q_norm.weight", "missing", arch="qwen3", drop_tensors=("blk.0.attn_q_norm.weight",)
    )


def test_unsupported_arch_is_still_readable(tmp_path):
    p = write_tiny_model(tmp_path / "m.gguf", metadata={"general.architecture": "rwkv6"})
    gf = GGUFFile(p)  # the container is fine: `kvchat info` can describe it
    assert gf.arch == "rwkv6" and len(gf.tensors) == 20
    with pytest.raises(
        ModelFileError, match="architecture 'rwkv6' is not supported; supported: llama, qwen2, qwen3, gemma3"
    ):
        read_hparams(gf)


def test_vocab_size_mismatch_with_embedding(tmp_path):
    # 10 extra tokens in the vocabulary, but token_embd still has the factory's rows
    p = write_tiny_model(tmp_path / "a.gguf", n_vocab=300)
    q = write_tiny_model(tmp_path / "b.gguf", n_vocab=310)
    a, b = GGUFFile(p), GGUFFile(q)
    assert a.tensors["token_embd.weight"].shape == (64, 300)
    # splice: b's vocabulary arrays with a's tensors is what a bad converter produces
    msg = hparams_error(
        tmp_path,
        "token_embd.weight",
        "[64, 300]",
        "[64, 310]",
        n_vocab=300,
        metadata={
            "tokenizer.ggml.tokens": list(b.metadata["tokenizer.ggml.tokens"]),
            "tokenizer.ggml.token_type": (list(map(int, b.metadata["tokenizer.ggml.token_type"])), GVT.INT32),
        },
    )
    assert "does not match" in msg
