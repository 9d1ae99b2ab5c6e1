"""benchmarks/tree_env.py: an old/new benchmark variant imports kvchat.* from its own tree."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import tree_env  # noqa: E402


def _fake_tree(root: Path, mark: str) -> Path:
    for pkg in ("cli", "runtime", "kernels"):
        (root / pkg).mkdir(parents=True)
        (root / pkg / "__init__.py").write_text(f"MARK = {mark!r}\n")
    return root


def test_child_imports_the_named_tree_not_the_installed_one(tmp_path):
    a = _fake_tree(tmp_path / "a", "tree a")
    b = _fake_tree(tmp_path / "b", "tree b")
    for tree, mark in ((a, "tree a"), (b, "tree b")):
        env = tree_env.tree_env(str(tree))
        code = "import kvchat.cli, kvchat.runtime, kvchat.kernels as k; print(kvchat.cli.MARK, k.MARK, k.__file__)"
        out = subprocess.run([sys.executable, "-c", code], env=env, cwd=str(tmp_path), capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        assert out.stdout.split()[:4] == mark.split() * 2
        assert os.path.realpath(out.stdout.split()[-1]) == os.path.realpath(tree / "kernels" / "__init__.py")
        tree_env.check_tree(str(tree), env, str(tmp_path))  # passes: the child runs this tree
    with pytest.raises(SystemExit, match="imports"):
        tree_env.check_tree(str(a), tree_env.tree_env(str(b)), str(tmp_path))


def test_not_a_tree_is_one_clear_line(tmp_path):
    with pytest.raises(SystemExit, match="not a kvchat source tree"):
        tree_env.tree_env(str(tmp_path))
