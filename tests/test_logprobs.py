"""`kvchat logprobs`: JSON layout of the reference files, checked against llama.cpp's own
top-10 on a tiny reference model; the add-special rule; one-line errors."""

import json

import numpy as np
import pytest

from tests.helpers import arch_refs


def run(capsys, *args):
    from kvchat.cli.app import main

    with pytest.raises(SystemExit) as ei:
        main(["logprobs", *map(str, args)])
    return ei.value.code, capsys.readouterr()


def ok(capsys, *args):
    from kvchat.cli.app import main

    main(["logprobs", *map(str, args)])
    return json.loads(capsys.readouterr().out)


REF_FLAGS = ("-c", 2048, "-ctk", "f32", "-ctv", "f32", "-fa", "off")


def test_chat_prompt_matches_the_reference_file(tmp_path, capsys):
    ref = arch_refs.load_ref("llama3rope_s1")
    entry = next(e for e in ref["logits"] if e["name"] == "chat")
    f = tmp_path / "chat.txt"
    f.write_text(entry["prompt"], encoding="utf-8")
    out = ok(capsys, "-m", arch_refs.model_path("llama3rope_s1"), "-f", f, "--parse-special", *REF_FLAGS)
    assert set(out) == {"tokens", "positions"}
    assert out["tokens"] == entry["tokens"] and len(out["positions"]) == len(entry["tokens"])
    for mine, theirs in zip(out["positions"], entry["positions"]):
        assert len(mine["top"]) == 10
        assert [t for t, _ in mine["top"][:1]] == [theirs["top"][0][0]]
        lps = [lp for _, lp in mine["top"]]
        assert lps == sorted(lps, reverse=True)
        np.testing.assert_allclose([lp for _, lp in mine["top"][:3]], [lp for _, lp in theirs["top"][:3]], atol=1e-3)


def test_without_parse_special_the_markers_are_text(tmp_path, capsys):
    f = tmp_path / "t.txt"
    f.write_text("<|im_start|>user", encoding="utf-8")
    path = arch_refs.model_path("llama3rope_s1")
    special = ok(capsys, "-m", path, "-f", f, "--parse-special", "--top", 2, *REF_FLAGS)
    plain = ok(capsys, "-m", path, "-f", f, "--top", 2, *REF_FLAGS)
    assert special["tokens"][0] == 1 and 1 not in plain["tokens"]  # <|im_start|> is id 1
    assert all(len(p["top"]) == 2 for p in plain["positions"])


def test_top_logprobs_are_a_log_softmax():
    from kvchat.cli.commands.logprobs import top_logprobs

    logits = np.array([[0.0, 1.0, 1.0, -2.0], [3.0, 0.0, 0.0, 0.0]], np.float32)
    rows = top_logprobs(logits, 3)
    assert [t for t, _ in rows[0]] == [1, 2, 0]  # ties by id
    z = np.log(np.exp([0.0, 1.0, 1.0, -2.0]).sum())
    assert rows[0][0][1] == pytest.approx(1.0 - z, abs=1e-12)
    assert np.exp([lp for _, lp in top_logprobs(logits, 4)[1]]).sum() == pytest.approx(1.0)


def test_errors_are_one_line(tmp_path, capsys):
    path = arch_refs.model_path("llama3rope_s1")
    code, cap = run(capsys, "-m", path, "-f", tmp_path / "missing.txt")
    assert code == 1 and cap.err.count("\n") == 1 and "not found" in cap.err and cap.out == ""
    long = tmp_path / "long.txt"
    long.write_text("word " * 400, encoding="utf-8")
    code, cap = run(capsys, "-m", path, "-f", long, "-c", 256)
    assert code == 1 and "more than the context of 256" in cap.err and cap.out == ""
