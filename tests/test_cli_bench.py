"""`kvchat bench` on a tiny random model: llama-bench's tests, table and JSON."""

import json

import pytest
from typer.testing import CliRunner

from kvchat.cli.app import app
from kvchat.kernels.ggml_types import GGMLType
from tests.helpers.gguf_factory import write_tiny_model


def _bench(*args):
    r = CliRunner().invoke(app, ["bench", *map(str, args)])
    assert r.exit_code == 0, r.output
    return r


@pytest.mark.slow  # over 10 s: left out of the fast lane (README), run by CI
def test_bench_json_has_pp_and_tg_rows_with_depth(tmp_path):
    path = write_tiny_model(tmp_path / "tiny.gguf", arch="llama", weight_type=GGMLType.Q8_0, n_head=2, n_head_kv=1)
    r = _bench(
        "-m",
        path,
        "-p",
        "16",
        "-n",
        "4",
        "-r",
        "2",
        "-d",
        "8",
        "-ctk",
        "q8_0",
        "-ctv",
        "q8_0",
        "-fa",
        "on",
        "-t",
        "1",
        "--json",
    )
    rows = json.loads(r.stdout[r.stdout.index("[") :])
    assert [row["test"] for row in rows] == ["pp16 @ d8", "tg4 @ d8"]
    for row in rows:
        assert len(row["samples_ts"]) == 2 and all(s > 0 for s in row["samples_ts"])
        assert abs(row["avg_ts"] - sum(row["samples_ts"]) / 2) < 1e-9 * row["avg_ts"]
        assert (row["type_k"], row["type_v"], row["flash_attn"], row["n_threads"]) == ("q8_0", "q8_0", True, 1)
        assert row["n_depth"] == 8 and row["model"].startswith("llama ")
    assert (rows[0]["n_prompt"], rows[0]["n_gen"], rows[1]["n_prompt"], rows[1]["n_gen"]) == (16, 0, 0, 4)


def test_bench_table_in_llama_bench_form(tmp_path):
    path = write_tiny_model(tmp_path / "tiny.gguf", arch="llama")
    r = _bench("-m", path, "-p", "8", "-n", "2", "-r", "2")
    lines = [l for l in r.stdout.splitlines() if l.startswith("|")]
    assert lines[0] == "| model | size | params | backend | threads | type_k | type_v | fa | test | t/s |"
    assert len(lines) == 4
    assert lines[2].split("|")[9].strip() == "pp8" and lines[3].split("|")[9].strip() == "tg2"
    assert "±" in lines[2] and "±" in lines[3]


def test_model_label_uses_the_files_ftype_name(smollm2_path, gemma3_path):
    from kvchat.runtime.model import Model

    assert Model.load(smollm2_path).ftype_name == "Q4_1"
    assert Model.load(gemma3_path).ftype_name == "Q4_K - Medium"
