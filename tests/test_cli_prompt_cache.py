"""`kvchat run`'s persistent prefix cache through the CLI (tiny model): the second run of a long
prompt restores all but its last tokens and prints the same answer; a damaged entry is one
warning; --no-prompt-cache leaves the directory alone; the size limit holds."""

import pytest
from typer.testing import CliRunner

from kvchat.cli.app import app
from tests.helpers.gguf_factory import write_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("cli_pc") / "l.gguf", arch="llama", n_ctx_train=2048)


def run(*args):
    r = CliRunner().invoke(app, ["run", *map(str, args)])
    assert r.exit_code == 0, (r.output, r.exception)
    return r


def reused(r):
    line = next(l for l in r.stderr.splitlines() if l.startswith("prompt cache: reused "))
    n, m = line.split()[3].split("/")
    return int(n), int(m)


def test_second_run_reuses_the_prefix_and_answers_the_same(tiny, tmp_path):
    doc = tmp_path / "doc.txt"
    doc.write_text("lorem ipsum dolor sit amet " * 60)
    d = tmp_path / "pc"
    args = ("-m", tiny, "-f", doc, "--temp", "0", "-n", "8", "-c", "2048", "--prompt-cache", d)
    first, second = run(*args), run(*args)
    n0, m = reused(first)
    n1, m1 = reused(second)
    assert n0 == 0 and m1 == m and m > 300
    assert m - n1 <= 128 and (m - n1) <= 0.1 * m + 128  # only the last partial block is decoded
    assert second.stdout == first.stdout
    assert (
        run("-m", tiny, "-f", doc, "--temp", "0", "-n", "8", "-c", "2048", "--no-prompt-cache").stdout == first.stdout
    )


def test_damaged_entry_warns_once_and_no_prompt_cache_touches_nothing(tiny, tmp_path):
    doc = tmp_path / "doc.txt"
    doc.write_text("the quick brown fox jumps over the lazy dog " * 40)
    d = tmp_path / "pc"
    args = ("-m", tiny, "-f", doc, "--temp", "0", "-n", "4", "-c", "2048", "--prompt-cache", d)
    good = run(*args)
    files = sorted(d.glob("*.kvpc"))
    assert files
    for f in files:
        f.write_bytes(f.read_bytes()[:-7])
    again = run(*args)
    assert again.stdout == good.stdout and reused(again)[0] == 0
    warn = [l for l in again.stderr.splitlines() if l.startswith("prompt cache: ignoring")]
    assert len(warn) == 1 and "checksum mismatch" in warn[0] and warn[0].endswith("deleted")
    other = tmp_path / "other"
    r = run("-m", tiny, "-f", doc, "-n", "2", "-c", "2048", "--prompt-cache", other, "--no-prompt-cache")
    assert not other.exists() and "prompt cache" not in r.stderr


def test_size_limit_holds(tiny, tmp_path):
    d = tmp_path / "pc"
    for i in range(3):
        doc = tmp_path / f"doc{i}.txt"
        doc.write_text(f"document {i} " + "words and more words " * 60)
        run("-m", tiny, "-f", doc, "-n", "1", "-c", "2048", "--prompt-cache", d, "--prompt-cache-max", "1")
        assert sum(f.stat().st_size for f in d.glob("*.kvpc")) <= 1 << 20
