"""`kvchat info`: the numbers it prints (KV bytes per token per cache type, weight formats) and
its behaviour on unsupported and broken files."""

from __future__ import annotations

import re

import pytest
from rich.console import Console

from kvchat.cli.commands.info import kv_bytes_per_token, show_info, weight_types
from kvchat.kernels.ggml_types import GGMLType
from kvchat.runtime.arch import read_hparams
from kvchat.runtime.errors import ModelFileError
from kvchat.runtime.gguf.file import GGUFFile
from tests.helpers.gguf_factory import write_tiny_model


def render(gf) -> tuple[str, Exception | None]:
    console = Console(record=True, width=200, file=open("/dev/null", "w"))
    err = None
    try:
        show_info(gf, console)
    except ModelFileError as e:
        err = e
    return console.export_text(), err


def row(text: str, field: str, value: str) -> bool:
    """Whether the overview table has `field │ value...` (column widths vary)."""
    return re.search(rf"│ {re.escape(field)}\s+│ {re.escape(value)}", text) is not None


@pytest.mark.real_model
def test_kv_bytes_real_models(smollm2_path, gemma3_path):
    sm = read_hparams(GGUFFile(smollm2_path))
    # 30 layers x (K 192 + V 192 values)
    assert kv_bytes_per_token(sm, "f16") == 30 * 2 * 192 * 2 == 23040
    assert kv_bytes_per_token(sm, "f32") == 46080
    assert kv_bytes_per_token(sm, "q8_0") == 30 * 2 * (192 // 32 * 34) == 12240
    assert kv_bytes_per_token(sm, "q4_0") == 30 * 2 * (6 * 18)
    ge = read_hparams(GGUFFile(gemma3_path))
    glob = [il for il in range(18) if not ge.is_swa(il)]
    swa = [il for il in range(18) if ge.is_swa(il)]
    assert kv_bytes_per_token(ge, "f16", glob) == 3 * 2 * 256 * 2 == 3072
    assert kv_bytes_per_token(ge, "q5_1", swa) == 15 * 2 * (8 * 24)


@pytest.mark.real_model
def test_info_smollm2_text(smollm2_path):
    text, err = render(GGUFFile(smollm2_path))
    assert err is None
    for field, value in (
        ("architecture", "llama"),
        ("layers", "30"),
        ("attention heads", "9 (kv heads 3, 3 per group)"),
        ("head dims", "k 64, v 64, rope 64"),
        ("rope", "norm, base 100000"),
        ("vocabulary", "49152 tokens, tokenizer gpt2 (pre: smollm)"),
        ("chat template", "yes"),
        ("sliding window", "none"),
    ):
        assert row(text, field, value), (field, value)
    assert re.search(r"q4_1\s+│\s+210\s+│", text)
    assert re.search(r"f16\s+│\s+22\.50 KiB\s+│\s+22\.50 MiB", text)


def test_info_tiny_gemma3(tmp_path):
    gf = GGUFFile(
        write_tiny_model(
            tmp_path / "g.gguf", arch="gemma3", n_layer=6, n_head_kv=1, weight_type=GGMLType.Q8_0, chat_template=None
        )
    )
    text, err = render(gf)
    assert err is None
    assert row(text, "sliding window", "16 tokens on 5 of 6 layers (every 6th layer global)")
    assert row(text, "rope", "neox, base 10000 (sliding layers 10000)")
    assert row(text, "chat template", "no (ChatML fallback)")
    # 1 global layer: K and V rows of 16 f32 values -> 128 bytes; 5 sliding layers -> 640
    assert re.search(r"f32\s+│\s+128 B\s+│\s+640 B\s+│\s+10\.00 KiB", text)
    assert dict((n, c) for n, c, _ in weight_types(gf)) == {"q8_0": 6 * 7 + 1, "f32": 6 * 6 + 1}


def test_info_unsupported_arch_describes_then_fails(tmp_path):
    gf = GGUFFile(write_tiny_model(tmp_path / "m.gguf", metadata={"general.architecture": "rwkv6"}))
    text, err = render(gf)
    assert row(text, "architecture", "rwkv6") and row(text, "parameters", "92.42 K")
    assert "layers" not in text
    assert isinstance(err, ModelFileError) and "'rwkv6' is not supported" in str(err)


def test_info_cli_errors_are_one_line(tmp_path, capsys):
    from kvchat.cli.app import main

    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF\x03\0\0\0" + b"\xff" * 16)
    with pytest.raises(SystemExit) as ei:
        main(["info", "-m", str(bad)])
    assert ei.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: {bad}: tensor_count: count ") and err.count("\n") == 1
