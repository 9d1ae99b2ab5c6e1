"""Every change kvchat makes to numba and llvmlite still applies on the installed versions, and
those versions are the range pyproject.toml pins (kernels/numba_start.py's install()).

A piece that finds numba different leaves it alone and reports False: kvchat still runs, only
slower or (cache_writes) unsafe with two writers. This test turns that silent fallback into a
failure, so a numba upgrade inside or outside the pinned range cannot drop a piece unnoticed."""

import json
import re
import subprocess
import sys

from tests.conftest import ROOT


def test_every_piece_applies_in_a_fresh_process_as_the_cli_installs_them():
    code = "import json; from kvchat.kernels.numba_start import install; print(json.dumps(install()))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    applied = json.loads(out.stdout)
    from kvchat.kernels.numba_start import pieces

    assert list(applied) == [name for name, _ in pieces()]
    assert [n for n, ok in applied.items() if not ok] == []


def test_a_skipped_piece_is_left_out_and_named_false(monkeypatch):
    code = "import json; from kvchat.kernels.numba_start import install; print(json.dumps(install()))"
    env = {"KVCHAT_STARTUP_SKIP": "dispatchers_made_cheaply"}
    import os

    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True, env={**os.environ, **env}
    )
    applied = json.loads(out.stdout)
    assert applied["dispatchers_made_cheaply"] is False
    assert all(ok for n, ok in applied.items() if n != "dispatchers_made_cheaply")


def _pinned(name: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    text = (ROOT / "pyproject.toml").read_text()
    m = re.search(rf'"{name}>=([\d.]+),<([\d.]+)"', text)
    assert m, f"pyproject.toml pins no range for {name}"
    return tuple(map(int, m.group(1).split("."))), tuple(map(int, m.group(2).split(".")))


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", text)[:3])


def test_the_installed_numba_and_llvmlite_are_inside_the_pinned_range():
    import llvmlite
    import numba

    for name, module in (("numba", numba), ("llvmlite", llvmlite)):
        lo, hi = _pinned(name)
        assert lo <= _version(module.__version__) < hi, (name, module.__version__, lo, hi)
