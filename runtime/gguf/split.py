"""Split GGUF models (llama.cpp's gguf-split format) opened as one file.

Big models are published as `NAME-00001-of-00003.gguf`, `NAME-00002-of-00003.gguf`, ... Each part
is a complete GGUF container. The first holds every metadata key; the others hold only the split
keys. Each part holds a contiguous share of the tensors, with offsets relative to its own data
section:

    split.no             u16  this part's index, 0-based (the file name counts from 1)
    split.count          u16  number of parts
    split.tensors.count  i32  tensors over all parts

`open_gguf(path)` is what loaders call instead of `GGUFFile(path)`. A plain file comes back as it
is. The first part of a split model comes back as a `SplitGGUF`: the first part's metadata, and
the tensors of all parts, each a view on its own part's mmap, so nothing is copied or
concatenated. Checked as llama-model-loader checks: the model is opened from its first part,
every part exists and carries its own index, no tensor appears twice, and the total tensor count
matches split.tensors.count. Any failure is one ModelFileError line naming the file.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from kvchat.runtime.errors import ModelFileError
from kvchat.runtime.gguf.file import GGUFFile

KEY_NO, KEY_COUNT, KEY_TENSORS = "split.no", "split.count", "split.tensors.count"
_SPLIT_NAME = re.compile(r"^(?P<prefix>.+)-(?P<no>[0-9]{5})-of-(?P<count>[0-9]{5})\.gguf$", re.IGNORECASE)


def split_path(prefix: str, split_no: int, split_count: int) -> str:
    """The file name of part `split_no` (0-based), as llama_split_path writes it."""
    return f"{prefix}-{split_no + 1:05d}-of-{split_count:05d}.gguf"


def parse_split_name(name: str) -> tuple[str, int, int] | None:
    """`M-00002-of-00003.gguf` -> ("M", 1, 3): prefix, 0-based index, count; None if not a part."""
    m = _SPLIT_NAME.match(name)
    if m is None or int(m["count"]) < 1 or not 1 <= int(m["no"]) <= int(m["count"]):
        return None
    return m["prefix"], int(m["no"]) - 1, int(m["count"])


def part_paths(first: str | os.PathLike) -> list[Path]:
    """Every part's path of a split model, from its first part's (or the file alone)."""
    first = Path(first)
    parsed = parse_split_name(first.name)
    if parsed is None or parsed[2] == 1:
        return [first]
    prefix, _, count = parsed
    return [first.with_name(split_path(prefix, i, count)) for i in range(count)]


class SplitGGUF(GGUFFile):
    """The parts of one split model seen as one GGUFFile.

    Metadata, version, alignment, data_offset and raw come from the first part (the one that
    holds the model's keys); `tensors` has every part's tensors; `file_size` is the sum over the
    parts; `parts` lists the open GGUFFiles. `close()` closes them all."""

    def __init__(self, parts: list[GGUFFile]):  # super().__init__ would parse a file: not called
        first = parts[0]
        self.__dict__.update(first.__dict__)
        self.parts = parts
        self.part_paths = [p.path for p in parts]
        self.file_size = sum(p.file_size for p in parts)
        self.tensors = {}
        for p in parts:
            for name, ti in p.tensors.items():
                if name in self.tensors:
                    p.fail(f"tensor {name}", "appears in more than one part of the split model")
                self.tensors[name] = ti

    def close(self) -> None:
        for p in self.parts:
            p.close()
        self.tensors, self.raw, self._mm = {}, None, None


def open_gguf(path: str | os.PathLike, read_strings: bool = True) -> GGUFFile:
    """`GGUFFile(path)`, or a SplitGGUF over all parts when `path` is the first part of a split
    model. ModelFileError (one line) when a part is missing, out of order or inconsistent.
    read_strings: GGUFFile's (False: the vocabulary's texts stepped over, not read)."""
    first = GGUFFile(
        path, split_part=True, read_strings=read_strings
    )  # a later part has no architecture: say which it is
    try:
        n_split = first.get_int(KEY_COUNT, 0)
        idx = first.get_int(KEY_NO, 0) if n_split > 1 else 0
        if idx != 0:
            parsed = parse_split_name(first.path.name)
            hint = f"; open {split_path(parsed[0], 0, n_split)}" if parsed else ""
            first.fail(
                KEY_NO,
                f"this is part {idx + 1} of {n_split} of a split model; "
                f"a split model is opened from its first part{hint}",
            )
        if "general.architecture" not in first.metadata:
            first.fail("general.architecture", "missing (required)")
        if n_split <= 1:
            return first
        parts = [first]
        try:
            for i, p in enumerate(_sibling_paths(first.path, n_split)[1:], start=1):
                parts.append(_open_part(p, i, n_split, first.path))
            expected = first.get_int(KEY_TENSORS, min_value=0)
            model = SplitGGUF(parts)
            if len(model.tensors) != expected:
                first.fail(KEY_TENSORS, f"says {expected} tensors, the {n_split} parts hold {len(model.tensors)}")
            return model
        except BaseException:
            for p in parts[1:]:
                p.close()
            raise
    except BaseException:
        first.close()
        raise


def _sibling_paths(first: Path, n_split: int) -> list[Path]:
    parsed = parse_split_name(first.name)
    if parsed is None:
        raise ModelFileError(
            f"{first}: {KEY_COUNT} is {n_split} but the file name does not end in "
            f"-00001-of-{n_split:05d}.gguf, so its other parts cannot be found"
        )
    prefix, _, count = parsed
    if count != n_split:
        raise ModelFileError(f"{first}: {KEY_COUNT} is {n_split} but the file name says {count} parts")
    return [first.with_name(split_path(prefix, i, n_split)) for i in range(n_split)]


def _open_part(path: Path, idx: int, n_split: int, first: Path) -> GGUFFile:
    if not path.is_file():
        raise ModelFileError(
            f"{path}: part {idx + 1} of {n_split} of the split model {first.name} "
            f"is missing; put all parts in one directory"
        )
    part = GGUFFile(path, split_part=True)
    try:
        got = part.get_int(KEY_NO)
        if got != idx:
            part.fail(KEY_NO, f"is {got}, expected {idx} (part {idx + 1} of {n_split})")
        count = part.get_int(KEY_COUNT, n_split)
        if count != n_split:
            part.fail(KEY_COUNT, f"is {count}, the first part says {n_split}")
    except BaseException:
        part.close()
        raise
    return part
