"""One direction of imports: cli -> runtime -> kernels, and no cycle anywhere.

The imports of every module of cli/, runtime/ and kernels/ are read from its source with `ast`
(module level and inside functions alike: a lazy import is still a dependency), resolved to the
modules of these packages, and checked: kernels imports neither runtime nor cli, runtime does not
import cli, and the module graph has no cycle. A failure names the modules involved.
(runtime/arch/__init__.py imports an architecture's module on first use with a plain import
inside its loader, an edge like any other: the graph is the real one.)
"""

import ast
from pathlib import Path

from tests.conftest import ROOT

PACKAGES = ("cli", "runtime", "kernels")
LAYER = {"kernels": 0, "runtime": 1, "cli": 2}  # a module may import its own layer and below


def module_files() -> dict[str, Path]:
    """Dotted module name -> file, for every .py under the three packages."""
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT).with_suffix("")
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(["kvchat"] + parts)] = path
    return out


def imports_of(path: Path, module: str, files) -> dict[str, int]:
    """{module of the three packages: first line} that the file imports.

    `import a.b` and `from a.b import c` (c a submodule) depend on a.b / a.b.c; `from a.b import
    name` (not a submodule) depends on a.b itself, i.e. its __init__. Relative imports resolved."""
    is_package = path.name == "__init__.py"
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    edges: dict[str, int] = {}

    def add(name, line):
        if name in files and name != module:
            edges.setdefault(name, line)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module
            for alias in node.names:
                sub = f"{prefix}.{alias.name}"
                add(sub if sub in files else prefix, node.lineno)
    return edges


def import_graph() -> dict[str, dict[str, int]]:
    """module -> {imported module: first line}, over cli/, runtime/, kernels/."""
    files = module_files()
    return {m: imports_of(p, m, files) for m, p in files.items()}


def find_cycle(graph):
    """One cycle as a list of modules (first == last), or None."""
    WHITE, GREY, BLACK = 0, 1, 2
    color = {m: WHITE for m in graph}
    stack = []

    def visit(m):
        color[m] = GREY
        stack.append(m)
        for n in sorted(graph[m]):
            if color[n] == GREY:
                return stack[stack.index(n) :] + [n]
            if color[n] == WHITE:
                found = visit(n)
                if found:
                    return found
        stack.pop()
        color[m] = BLACK
        return None

    for m in sorted(graph):
        if color[m] == WHITE:
            found = visit(m)
            if found:
                return found
    return None


def test_the_graph_sees_the_imports_it_should():
    """A guard on the parser itself: known edges of the tree are found."""
    graph = import_graph()
    assert "kvchat.runtime.context" in graph["kvchat.cli.chat.setup"]
    assert "kvchat.runtime.generate" in graph["kvchat.runtime.chat.conversation"]
    assert {"kvchat.runtime.arch.llama", "kvchat.runtime.arch.qwen35"} <= set(graph["kvchat.runtime.arch"])
    assert not any(m.startswith("kvchat.runtime.arch") for m in graph["kvchat.runtime.hparams"])  # a leaf
    assert "kvchat.kernels.ggml_types" in graph["kvchat.cli.session.session"]
    assert len(graph) > 60


def test_no_module_imports_upward():
    graph = import_graph()
    files = module_files()
    wrong = []
    for module, edges in graph.items():
        for target, line in edges.items():
            if LAYER[target.split(".")[1]] > LAYER[module.split(".")[1]]:
                wrong.append(f"{files[module].relative_to(ROOT)}:{line} imports {target}")
    assert not wrong, "upward imports (allowed: cli -> runtime -> kernels):\n" + "\n".join(wrong)


def test_no_import_cycle():
    graph = import_graph()
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b": 1}, "b": {}, "c": {"a": 1}}) is None


def test_lazy_relative_and_package_imports_are_edges(tmp_path):
    src = tmp_path / "m.py"
    src.write_text(
        "def f():\n    from kvchat.runtime.chat import conversation\n    from . import blocks\n"
        "    from kvchat.runtime.memory import create_thing\n    import kvchat.kernels.rope\n",
        encoding="utf-8",
    )
    files = {
        "kvchat.runtime.chat.conversation",
        "kvchat.runtime.arch.blocks",
        "kvchat.runtime.arch.m",
        "kvchat.runtime.memory",
        "kvchat.kernels.rope",
    }
    assert imports_of(src, "kvchat.runtime.arch.m", files) == {
        "kvchat.runtime.chat.conversation": 2,
        "kvchat.runtime.arch.blocks": 3,
        "kvchat.runtime.memory": 4,
        "kvchat.kernels.rope": 5,
    }


def test_pyproject_installs_every_package_folder_under_kvchat():
    """The setuptools package list names each folder with an __init__.py as kvchat.<path>, and nothing else."""
    import tomllib

    meta = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]
    folders = {
        "kvchat." + ".".join(p.parent.relative_to(ROOT).parts)
        for pkg in PACKAGES
        for p in (ROOT / pkg).rglob("__init__.py")
        if "__pycache__" not in p.parts
    }
    assert set(meta["packages"]) == folders
    assert meta["package-dir"] == {f"kvchat.{p}": p for p in PACKAGES}


def test_only_kvchat_is_an_import_name_outside_the_repository(tmp_path):
    """Installed, kvchat adds one top-level name: `kernels` (also a Hugging Face package), `cli` and
    `runtime` are not importable from anywhere but the repository root."""
    import subprocess
    import sys

    code = (
        "import importlib.util as u, sys; sys.path = [p for p in sys.path if p not in ('', '.')];"
        "print([n for n in ('cli', 'runtime', 'kernels') if u.find_spec(n)], bool(u.find_spec('kvchat.kernels')))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["[]", "True"]
