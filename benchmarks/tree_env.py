"""Run a benchmark's child process on another kvchat source tree (old / new side by side).

Since the packages install as `kvchat.cli`, `kvchat.runtime`, `kvchat.kernels` over the folders
cli/, runtime/, kernels/, a tree's root on PYTHONPATH no longer provides `kvchat`: the child would
import whatever tree the venv has installed (editable), and an old/new comparison would time one
tree twice. tree_env() writes a one-file shim package, `SHIM/kvchat/__init__.py` with
`__path__ = [TREE]`, and puts SHIM first on PYTHONPATH: `kvchat.cli` is then TREE/cli, found by the
ordinary path finder (ahead of setuptools' editable finder, which comes last on sys.meta_path), and
the modules' __file__ are the tree's own files (numba's cache sits beside them, as in a normal run).

check_tree() asks the child which files it imported, so a variant that silently ran another
tree fails the benchmark instead of reporting a ratio of 1.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile

ENTRY = "from kvchat.cli.app import main; main()"

_SHIM = '''"""kvchat shim written by benchmarks/tree_env.py: kvchat.* is the tree {tree}."""
__path__ = [{tree!r}]
'''


def shim_dir(tree: str) -> str:
    """A folder holding `kvchat/__init__.py` that maps kvchat.* onto `tree` (made once per tree)."""
    tree = os.path.realpath(tree)
    if not is_tree(tree):
        raise SystemExit(f"tree_env: {tree} is not a kvchat source tree (no cli/ and kernels/ folders)")
    key = hashlib.sha1(tree.encode()).hexdigest()[:12]
    root = os.path.join(tempfile.gettempdir(), f"kvchat-tree-shim-{os.getuid()}", key)
    pkg = os.path.join(root, "kvchat")
    os.makedirs(pkg, exist_ok=True)
    text = _SHIM.format(tree=tree)
    init = os.path.join(pkg, "__init__.py")
    try:
        with open(init) as f:
            same = f.read() == text
    except OSError:
        same = False
    if not same:
        tmp = f"{init}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, init)
    return root


def tree_env(tree: str | None, env: dict | None = None) -> dict:
    """`env` (default os.environ) with kvchat.* taken from `tree`; tree None leaves PYTHONPATH alone."""
    env = dict(os.environ if env is None else env)
    if tree is None:
        return env
    rest = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != tree]
    env["PYTHONPATH"] = os.pathsep.join([shim_dir(tree), *rest])
    return env


def imported_tree(env: dict, cwd: str | None = None) -> str:
    """The tree whose kvchat.cli / kvchat.runtime / kvchat.kernels a child with `env` imports."""
    code = (
        "import os, kvchat.cli, kvchat.runtime, kvchat.kernels as k;"
        "ds = {os.path.dirname(os.path.dirname(os.path.realpath(m.__file__)))"
        " for m in (kvchat.cli, kvchat.runtime, k)};"
        "print(ds.pop() if len(ds) == 1 else 'mixed: ' + ' '.join(sorted(ds)))"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=cwd, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"tree_env: the child cannot import kvchat: {out.stderr.strip().splitlines()[-1:]}")
    return out.stdout.strip()


def check_tree(tree: str, env: dict, cwd: str | None = None) -> None:
    """Stop the benchmark unless a child with `env` imports kvchat from `tree`."""
    got = imported_tree(env, cwd)
    if got != os.path.realpath(tree):
        raise SystemExit(f"tree_env: a child meant to run {os.path.realpath(tree)} imports {got}")


def is_tree(path: str) -> bool:
    return os.path.isdir(os.path.join(path, "cli")) and os.path.isdir(os.path.join(path, "kernels"))


def use_tree(default_tree: str) -> str:
    """For a script that imports kvchat in-process: kvchat.* from the first PYTHONPATH entry when it
    is a kvchat tree (`PYTHONPATH=TREE python benchmarks/x.py` measures TREE), else `default_tree`
    (the script's own). Returns the tree; a PYTHONPATH that already holds a shim is left alone."""
    first = os.environ.get("PYTHONPATH", "").split(os.pathsep)[0]
    if first and os.path.isfile(os.path.join(first, "kvchat", "__init__.py")):
        import kvchat

        return os.path.realpath(kvchat.__path__[0])
    tree = first if first and is_tree(first) else default_tree
    sys.path.insert(0, shim_dir(tree))
    return os.path.realpath(tree)
