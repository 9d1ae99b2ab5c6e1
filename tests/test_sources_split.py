"""Split GGUF models (llama.cpp's gguf-split layout) load as one model, bit-identical to the file
they were split from; every broken split is one ModelFileError line."""

import os

import numpy as np
import pytest

from kvchat.kernels.ggml_types import GGMLType
from kvchat.runtime.batch import Batch
from kvchat.runtime.context import Context
from kvchat.runtime.cparams import ContextParams
from kvchat.runtime.errors import ModelFileError
from kvchat.runtime.gguf.file import GGUFFile
from kvchat.runtime.gguf.split import SplitGGUF, open_gguf, parse_split_name, part_paths, split_path
from kvchat.runtime.model import Model
from tests.helpers.gguf_factory import split_gguf_file, write_tiny_model


@pytest.fixture
def single_and_split(tmp_path):
    src = write_tiny_model(tmp_path / "single.gguf", weight_type=GGMLType.Q8_0)
    parts = split_gguf_file(src, tmp_path / "tiny-Q8_0", 3)
    return src, parts


def _logits(model, tokens):
    ctx = Context(model, ContextParams(n_ctx=256, n_batch=len(tokens), n_ubatch=len(tokens)))
    assert ctx.decode(Batch.one_seq(tokens, 0, all_logits=True)) == 0, ctx.last_error
    return ctx.get_logits().copy()


def test_split_names_follow_llama_split_path():
    assert split_path("m-Q4_K_M", 0, 3) == "m-Q4_K_M-00001-of-00003.gguf"
    assert parse_split_name("m-Q4_K_M-00002-of-00003.gguf") == ("m-Q4_K_M", 1, 3)
    assert parse_split_name("M-00001-OF-00002.GGUF") == ("M", 0, 2)
    assert parse_split_name("m-Q4_K_M.gguf") is None
    assert parse_split_name("m-00004-of-00003.gguf") is None
    assert [p.name for p in part_paths("/x/a-00001-of-00002.gguf")] == [
        "a-00001-of-00002.gguf",
        "a-00002-of-00002.gguf",
    ]


def test_split_model_has_every_tensor_of_the_original_as_a_view_on_its_part(single_and_split):
    src, parts = single_and_split
    one, split = GGUFFile(src), open_gguf(parts[0])
    assert isinstance(split, SplitGGUF) and split.part_paths == parts
    assert split.file_size == sum(os.path.getsize(p) for p in parts)
    assert split.tensors.keys() == one.tensors.keys()
    owners = {}
    for name, t in one.tensors.items():
        u = split.tensors[name]
        assert (u.shape, u.ggml_type, u.nbytes) == (t.shape, t.ggml_type, t.nbytes)
        assert np.array_equal(u.data, t.data), name
        owners[name] = [i for i, p in enumerate(split.parts) if np.shares_memory(u.data, p.raw)]
    assert {tuple(v) for v in owners.values()} == {(0,), (1,), (2,)}  # every part holds some
    assert set(split.metadata) - set(one.metadata) == {"split.no", "split.count", "split.tensors.count"}
    assert split.arch == "llama" and split.get("general.name") == one.get("general.name")
    split.close()
    assert split.tensors == {} and all(p.tensors == {} for p in split.parts)


def test_plain_file_opens_as_a_plain_gguf_file(single_and_split):
    src, _ = single_and_split
    gf = open_gguf(src)
    assert type(gf) is GGUFFile


def test_split_model_logits_are_bit_identical_to_the_single_file(single_and_split):
    src, parts = single_and_split
    tokens = list(range(3, 40))
    a, b = Model.load(src), Model.load(parts[0])
    assert b.size_bytes == a.size_bytes and b.n_params == a.n_params
    np.testing.assert_array_equal(_logits(b, tokens), _logits(a, tokens))


def test_opening_a_later_part_names_the_first(single_and_split):
    _, parts = single_and_split
    with pytest.raises(ModelFileError, match=r"part 2 of 3 .* open tiny-Q8_0-00001-of-00003\.gguf"):
        open_gguf(parts[1])


def test_missing_part_is_one_line_naming_it(single_and_split):
    _, parts = single_and_split
    parts[2].unlink()
    with pytest.raises(ModelFileError) as e:
        open_gguf(parts[0])
    msg = str(e.value)
    assert "\n" not in msg and "tiny-Q8_0-00003-of-00003.gguf" in msg and "part 3 of 3" in msg


def test_parts_in_the_wrong_order_are_refused(single_and_split):
    _, parts = single_and_split
    tmp = parts[1].with_name("swap")
    parts[1].rename(tmp)
    parts[2].rename(parts[1])
    tmp.rename(parts[2])
    with pytest.raises(ModelFileError, match=r"split\.no: is 2, expected 1"):
        open_gguf(parts[0])


def test_tensor_count_mismatch_is_refused(tmp_path):
    """A part from another split of the same model (fewer tensors in total) is caught by the
    split.tensors.count check, as llama-model-loader does ("corrupted model")."""
    src = write_tiny_model(tmp_path / "s.gguf")
    names = list(GGUFFile(src).tensors)
    parts = split_gguf_file(src, tmp_path / "a", 2)
    # the same model without its last tensor: its first part holds the same tensors, one fewer in the second
    other = write_tiny_model(tmp_path / "o.gguf", drop_tensors=(names[-1],))
    assert list(GGUFFile(other).tensors) == names[:-1]
    other_parts = split_gguf_file(other, tmp_path / "b", 2)
    os.replace(other_parts[1], parts[1])
    with pytest.raises(ModelFileError, match=r"split\.tensors\.count: says \d+ tensors, the 2 parts hold \d+"):
        open_gguf(parts[0])


def test_renamed_first_part_cannot_find_its_siblings(single_and_split, tmp_path):
    _, parts = single_and_split
    lone = tmp_path / "renamed.gguf"
    parts[0].rename(lone)
    with pytest.raises(ModelFileError, match="cannot be found"):
        open_gguf(lone)
