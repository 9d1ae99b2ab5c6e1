"""kv-sweep (runtime/kv_sweep*.py, cli/commands/kv_sweep.py) on tiny models: the lockstep numbers
equal the two-pass --kl-divergence route, the configuration grid, KV footprints with sliding
windows, paired intervals, and the JSON / CSV / PNG outputs and one-line flag errors."""

import csv
import json
import re
import sys

import numpy as np
import pytest
from typer.testing import CliRunner

from kvchat.cli.app import app
from kvchat.cli.reports.kv_sweep_report import mark_pareto
from kvchat.runtime.eval.kld import KLDStats
from kvchat.runtime.eval.kv_sweep import SweepConfig, kv_footprint, paired_difference, run_sweep, sweep_configs
from kvchat.runtime.model import Model
from tests.helpers.gguf_factory import write_tiny_model
from tests.helpers.sweep_pairs import sweep_and_two_pass


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("sweep")
    path = write_tiny_model(
        d / "llama.gguf", arch="llama", n_layer=2, n_embd=256, n_head=4, n_head_kv=2, n_ff=96
    )  # head size 64: quantized caches are rotated
    text = d / "t.txt"
    text.write_text(" the hello world and chat of a model" * 80)
    return path, text, d


def test_configurations_are_the_grid_plus_controls_without_duplicates():
    got = [c.label for c in sweep_configs(["q8_0", "q4_0"], ["q4_0"], [True, False])]
    assert got == [
        "q8_0/q4_0",
        "q4_0/q4_0",
        "q8_0/f16",
        "q4_0/f16",
        "f16/q4_0",
        "q8_0/q4_0 rot off",
        "q4_0/q4_0 rot off",
        "q8_0/f16 rot off",
        "q4_0/f16 rot off",
        "f16/q4_0 rot off",
    ]
    full = sweep_configs(["f16", "q8_0", "q4_0"], ["f16", "q8_0", "q4_0"], [True, False])
    assert len(full) == 8 + 8 and SweepConfig("f16", "f16") not in full
    assert [c.label for c in sweep_configs(["f16", "bf16"], ["f16"], [False])] == []  # float: no rotation


def test_kv_footprint_counts_sliding_window_layers_at_their_window(tmp_path):
    path = write_tiny_model(
        tmp_path / "g.gguf", arch="gemma3", n_layer=6, n_embd=128, n_head=4, n_head_kv=1, n_ff=64, n_swa=16
    )
    hp = Model.load(path).hparams
    n_swa_layers = sum(hp.is_swa(il) for il in range(hp.n_layer))
    assert 0 < n_swa_layers < hp.n_layer
    per_tok, at = kv_footprint(hp, "f16", "q8_0", 64)
    k_bytes = hp.n_embd_k_gqa(0) * 2
    v_bytes = hp.n_embd_v_gqa(0) // 32 * 34
    assert per_tok == hp.n_layer * (k_bytes + v_bytes)
    assert at == (k_bytes + v_bytes) * (64 * (hp.n_layer - n_swa_layers) + 16 * n_swa_layers)


def test_lockstep_sweep_equals_the_two_pass_route(tiny, tmp_path):
    path, text, _ = tiny
    model = Model.load(path)
    tokens = model.vocab.tokenize(text.read_text(), add_special=True)
    configs = [SweepConfig("q8_0", "q8_0"), SweepConfig("q4_0", "f16"), SweepConfig("q4_0", "q4_0", False)]
    ref_row, pairs = sweep_and_two_pass(model, tokens, configs, 3, tmp_path)
    assert len(pairs) == len(configs)
    for row, two in pairs:
        assert row.stats.count == two.count == 3 * 31
        assert np.array_equal(row.stats.values("kld"), two.values("kld"))  # bit for bit
        assert row.stats.mean_kld()[0] == pytest.approx(two.mean_kld()[0], abs=1e-12)
        assert row.stats.mean_kld()[0] > 1e-5
    assert abs(ref_row.stats.mean_kld()[0]) < 5e-5  # the reference against its own rows
    assert ref_row.stats.same_top()[0] == 1.0


def test_rotation_off_changes_quantized_results_only(tiny):
    path, text, _ = tiny
    model = Model.load(path)
    tokens = model.vocab.tokenize(text.read_text(), add_special=True)
    _, rows = run_sweep(
        model, tokens, [SweepConfig("q4_0", "q4_0", True), SweepConfig("q4_0", "q4_0", False)], 64, n_chunks=1
    )
    assert not np.array_equal(rows[0].stats.values("kld"), rows[1].stats.values("kld"))


def test_paired_difference_and_pareto_front():
    a, b = KLDStats(), KLDStats()
    rng = np.random.default_rng(0)
    x = rng.random(400).astype(np.float32) * 0.01
    noise = (rng.standard_normal(400) * 0.001).astype(np.float32)
    a.kld, b.kld = [x + 0.002 + noise], [x]
    d = paired_difference(a, b)
    assert d["mean_diff"] == pytest.approx(0.002 + noise.mean(), rel=1e-4) and d["differ"]
    assert d["ci95_lo"] < d["mean_diff"] < d["ci95_hi"]
    assert d["ci95_hi"] - d["ci95_lo"] == pytest.approx(2 * 1.96 * noise.std(ddof=1) / 20, rel=1e-3)
    c = KLDStats()
    c.kld = [x + noise]  # same mean, noise only: not distinguishable
    assert not paired_difference(c, b)["differ"]
    rows = [
        dict(n_ctx=512, kv_bytes_per_token=b_, mean_kld=k)
        for b_, k in ((100, 0.0), (50, 0.01), (50, 0.02), (25, 0.1), (60, 0.05))
    ]
    mark_pareto(rows)
    assert [r["pareto"] for r in rows] == [True, True, False, True, False]


def _sweep(*args):
    return CliRunner().invoke(app, ["kv-sweep", *map(str, args)])


def test_cli_writes_json_csv_and_plot_with_the_documented_fields(tiny, tmp_path):
    path, text, _ = tiny
    js, cs, png = tmp_path / "s.json", tmp_path / "s.csv", tmp_path / "s.png"
    args = [
        "-m",
        path,
        "-f",
        text,
        "--k",
        "q8_0",
        "--v",
        "f16,q4_0",
        "-c",
        "64,128",
        "--chunks",
        1,
        "--pp",
        16,
        "--tg",
        4,
        "--json",
        js,
        "--csv",
        cs,
    ]
    try:
        import matplotlib  # noqa: F401

        args += ["--plot", png]
    except ImportError:
        png = None
    out = _sweep(*args)
    assert out.exit_code == 0, (out.output, out.exception)
    assert "Mean KLD" in out.stdout and "q8_0/q4_0" in out.stdout
    doc = json.loads(js.read_text())
    prov = doc["provenance"]
    assert re.fullmatch(r"[0-9a-f]{64}", prov["model_sha256"]) and re.fullmatch(r"[0-9a-f]{64}", prov["text_sha256"])
    assert prov["kvchat_version"] and prov["flags"]["k"] == ["q8_0"]
    run = prov["run"]  # the sweep's wall and CPU time, and how busy the machine was
    assert 0 < run["cpu_seconds"] and 0 < run["seconds"]
    for when in ("start", "end"):
        la = run["load_average"][when]
        assert la is None or (len(la) == 3 and all(x >= 0 for x in la))
    assert "s of CPU" in out.output
    labels = [(r["type_k"], r["type_v"], r["n_ctx"]) for r in doc["rows"]]
    assert labels == [
        ("f16", "f16", 64),
        ("q8_0", "f16", 64),
        ("q8_0", "q4_0", 64),
        ("f16", "q4_0", 64),
        ("f16", "f16", 128),
        ("q8_0", "f16", 128),
        ("q8_0", "q4_0", 128),
        ("f16", "q4_0", 128),
    ]
    for r in doc["rows"]:
        for key in (
            "mean_kld",
            "same_top_p",
            "rms_dp",
            "ppl_ratio",
            "kv_bytes_per_token",
            "kv_mib_at_ctx",
            "session_bytes",
            "kld_by_depth",
            "pp16",
            "pareto",
            "cpu_seconds",
        ):
            assert key in r, key
        assert r["cpu_seconds"] > 0  # every row decoded its chunk
        assert any(k.startswith("tg4 @ d") for k in r)
    assert doc["rows"][0]["kv_bytes_per_token"] > doc["rows"][2]["kv_bytes_per_token"]
    assert doc["pairs"] and {"a", "b", "mean_diff", "ci95_lo", "ci95_hi"} <= set(doc["pairs"][0])
    with open(cs) as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 8 and float(rows[2]["mean_kld"]) == pytest.approx(doc["rows"][2]["mean_kld"], rel=1e-9)
    assert float(rows[2]["cpu_seconds"]) == pytest.approx(doc["rows"][2]["cpu_seconds"], rel=1e-9)
    if png is not None:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20000


def test_bad_flags_are_one_line_errors(tiny, tmp_path):
    path, text, _ = tiny
    short = tmp_path / "short.txt"
    short.write_text("hello world")
    for args, msg in (
        (["--k", "q4_k"], "invalid cache type 'q4_k'"),
        (["--v", "q8_0", "-fa", "off"], "needs flash attention"),
        (["--rot", "sometimes"], "--rot"),
        (["-c", "512,abc"], "not a comma-separated list of integers"),
    ):
        out = _sweep("-m", path, "-f", text, *args)
        assert out.exit_code != 0 and msg in str(out.exception), (args, out.exception)
        assert "\n" not in str(out.exception)
    out = _sweep("-m", path, "-f", short, "-c", 64)
    assert "fewer than one chunk" in str(out.exception)


def test_plot_without_matplotlib_is_a_one_line_error(tiny, monkeypatch):
    path, text, _ = tiny
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    out = _sweep("-m", path, "-f", text, "--plot", "x.png")
    assert out.exit_code != 0 and "pip install -e '.[plot]'" in str(out.exception)


def test_run_line_reports_cpu_time_and_load_and_omits_an_unknown_load():
    from kvchat.cli.commands.kv_sweep import _run_line

    run = dict(seconds=212.4, cpu_seconds=390.2, load_average=dict(start=[0.42, 1, 1], end=[2.1, 1, 1]))
    assert _run_line(run) == "kv-sweep: 212 s, 390 s of CPU, load average 0.4 -> 2.1"
    run["load_average"] = dict(start=None, end=None)
    assert _run_line(run) == "kv-sweep: 212 s, 390 s of CPU"
