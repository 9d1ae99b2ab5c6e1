"""Base files exchanged with llama-perplexity itself (SmolLM2, 2 chunks of GPL-3): a file it
writes is read by `kvchat perplexity --kl-divergence`, a file we write is read by its
`--kl-divergence`. Skipped when no llama.cpp build is at hand (KVCHAT_LLAMA_PERPLEXITY or a
llama-perplexity binary under /work/llamacpp) or when none of them can run on this CPU (a native
build with AMX tiles dies with SIGILL where the kernel does not grant them: the next build found is
tried; KVCHAT_LLAMA_LIB can name a folder with a libggml-cpu.so built without them)."""

import os
import re
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvchat.cli.app import app


def _candidates() -> list[Path]:
    """KVCHAT_LLAMA_PERPLEXITY, else every llama-perplexity build under /work/llamacpp."""
    exe = os.environ.get("KVCHAT_LLAMA_PERPLEXITY")
    if exe and Path(exe).is_file():
        return [Path(exe)]
    root = Path("/work/llamacpp")
    if not root.is_dir():
        return []
    return [p for p in sorted(root.rglob("llama-perplexity")) if p.is_file() and os.access(p, os.X_OK)]


LLAMAS = _candidates()
pytestmark = [
    pytest.mark.real_model,
    pytest.mark.slow,
    pytest.mark.skipif(not LLAMAS, reason="no llama-perplexity build found"),
]


def _llama(args, **kw):
    """Run llama-perplexity; a build killed by a signal (a native build with AMX tiles the kernel
    does not grant dies with SIGILL at its first matmul) is dropped and the next one tried."""
    env = dict(os.environ)
    if os.environ.get("KVCHAT_LLAMA_LIB"):
        env["LD_LIBRARY_PATH"] = os.environ["KVCHAT_LLAMA_LIB"]
    while LLAMAS:
        r = subprocess.run([str(LLAMAS[0]), *args], capture_output=True, text=True, timeout=900, env=env, **kw)
        if 0 <= r.returncode < 128:
            assert r.returncode == 0, r.stderr[-2000:]
            return r
        LLAMAS.pop(0)  # killed by a signal: the build, not the file
    pytest.skip("no llama-perplexity build runs on this CPU")


def _mean_kld(text):
    return float(re.search(r"Mean    KLD:\s+(\S+)", text).group(1))


def test_files_from_each_tool_are_read_by_the_other(smollm2_path, reference_dir, tmp_path):
    text = reference_dir / "texts" / "GPL-3.txt"
    theirs, ours = tmp_path / "llama.kld", tmp_path / "kvchat.kld"
    common = ["-m", str(smollm2_path), "-c", "512", "--chunks", "2", "-t", "2", "-fa", "on"]
    _llama([*common, "-f", str(text), "--kl-divergence-base", str(theirs)])
    out = CliRunner().invoke(
        app, ["perplexity", "-m", str(smollm2_path), "--kl-divergence-base", str(theirs), "--kl-divergence"]
    )
    assert out.exit_code == 0, out.output
    assert 0 < _mean_kld(out.stdout) < 0.01  # measured 0.003: two engines, same model
    assert float(re.search(r"Same top p:\s+(\S+)", out.stdout).group(1)) > 90

    out = CliRunner().invoke(
        app,
        ["perplexity", "-m", str(smollm2_path), "-f", str(text), "--chunks", "2", "--kl-divergence-base", str(ours)],
    )
    assert out.exit_code == 0, out.output
    r = _llama([*common, "--kl-divergence-base", str(ours), "--kl-divergence"])
    assert 0 < _mean_kld(r.stdout + r.stderr) < 0.01
