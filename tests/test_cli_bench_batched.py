"""`kvchat bench-batched` on a tiny random model: llama-batched-bench's grid, table and skips."""

import json

from typer.testing import CliRunner

from kvchat.cli.app import app
from kvchat.cli.commands.bench_batched import n_kv_required
from tests.helpers.gguf_factory import write_tiny_model


def _run(*args):
    r = CliRunner().invoke(app, ["bench-batched", *map(str, args)])
    assert r.exit_code == 0, r.output
    return r


def test_jsonl_rows_cover_the_grid_with_llama_batched_bench_arithmetic(tmp_path):
    path = write_tiny_model(tmp_path / "tiny.gguf", arch="llama")
    r = _run("-m", path, "-npp", "8,16", "-ntg", "4", "-npl", "1,3", "--output-format", "jsonl", "-t", "1")
    rows = [json.loads(l) for l in r.stdout.splitlines() if l.startswith("{")]
    assert [(x["pp"], x["tg"], x["pl"]) for x in rows] == [(8, 4, 1), (8, 4, 3), (16, 4, 1), (16, 4, 3)]
    for x in rows:
        assert x["n_kv"] == x["pl"] * (x["pp"] + x["tg"]) and x["is_pp_shared"] == 0
        assert abs(x["speed_pp"] - x["pl"] * x["pp"] / x["t_pp"]) < 1e-6 * x["speed_pp"]
        assert abs(x["speed_tg"] - x["pl"] * x["tg"] / x["t_tg"]) < 1e-6 * x["speed_tg"]
        assert abs(x["t"] - x["t_pp"] - x["t_tg"]) < 1e-9
    # the context was sized for the largest test: 3 * (16 + 4) cells, padded to 256
    assert rows[0]["n_kv_max"] == 256


def test_shared_prompt_table_and_a_test_too_big_for_the_context_is_skipped(tmp_path):
    path = write_tiny_model(tmp_path / "tiny.gguf", arch="qwen3")
    r = _run("-m", path, "-npp", "200", "-ntg", "4", "-npl", "1,2,16", "-pps", "-c", "256")
    lines = [l for l in r.stdout.splitlines() if l.startswith("|")]
    assert [c.strip() for c in lines[0].split("|")[1:-1]] == [
        "PP",
        "TG",
        "B",
        "N_KV",
        "T_PP s",
        "S_PP t/s",
        "T_TG s",
        "S_TG t/s",
        "T s",
        "S t/s",
    ]
    body = [[c.strip() for c in l.split("|")[1:-1]] for l in lines[2:]]
    assert [(b[0], b[1], b[2], b[3]) for b in body] == [("200", "4", "1", "204"), ("200", "4", "2", "208")]
    assert n_kv_required(200, 4, 16, True) == 264  # > 256 cells: skipped, and said so
    assert "skipping PP=200 TG=4 B=16" in r.stderr


def test_separate_streams_per_sequence(tmp_path):
    path = write_tiny_model(tmp_path / "tiny.gguf", arch="llama")
    r = _run("-m", path, "-npp", "8", "-ntg", "3", "-npl", "2", "--no-kv-unified", "-pps", "--output-format", "jsonl")
    rows = [json.loads(l) for l in r.stdout.splitlines() if l.startswith("{")]
    assert len(rows) == 1 and rows[0]["n_kv"] == 8 + 2 * 3


def test_bad_list_is_one_line_error(tmp_path):
    path = write_tiny_model(tmp_path / "tiny.gguf", arch="llama")
    r = CliRunner().invoke(app, ["bench-batched", "-m", str(path), "-npl", "1,x"])
    assert r.exit_code != 0 and "-npl: expected comma-separated integers" in str(r.exception)
