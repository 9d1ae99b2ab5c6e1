"""cli/fast_params.py converts command-line values as typer's pydantic adapters do, without pydantic."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import typer

from kvchat.cli import fast_params
from kvchat.cli.app import COMMANDS, make_app

VALUES = [
    "0",
    "-0",
    "1",
    "-1",
    "7",
    "007",
    "+3",
    " 3",
    "3 ",
    "3_0",
    "1.5",
    "1.0",
    "-2.25",
    ".5",
    "5.",
    "1e3",
    "1e400",
    "nan",
    "inf",
    "-inf",
    "abc",
    "",
    "０",
    "99999999999999999999999",
    "123456789012345678",
    "on",
    "OFF",
    "Auto",
    "f16",
    "q8_0",
    "/etc/passwd",
    "/nonexistent/x",
    "relative/file.txt",
    "-",
    "~",
    0,
    1,
    -1,
    2048,
    0.8,
    1.0,
    float("nan"),
    True,
    False,
]


def _params(name):
    command = typer.main.get_command(make_app(name)).commands[name]
    return command, [p for p in command.params if hasattr(p, "type_descriptor")]


def _context(command):
    try:
        from typer._click import Context
    except ImportError:  # older typer: click itself
        from click import Context
    return Context(command)


def _outcome(fn):
    try:
        value = fn()
    except Exception as e:  # the error a user would see: its type and message
        return ("error", type(e).__name__, getattr(e, "message", str(e)))
    return ("value", type(value).__name__, repr(value))


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_flag_converts_every_value_exactly_as_typer_does(name):
    from typer._coercion import build_runtime_param

    command, params = _params(name)
    ctx = _context(command)
    checked = 0
    for param in params:
        fast = fast_params.FastRuntimeParam(param.type_descriptor, build_runtime_param)
        reference = build_runtime_param(param.type_descriptor)
        for value in VALUES + [param.default]:
            got = _outcome(lambda: fast.coerce(value, param=param, ctx=ctx))
            want = _outcome(lambda: reference.coerce(value, param=param, ctx=ctx))
            assert got == want, (param.name, value)
            checked += 1
    assert checked >= len(params) * len(VALUES)


def test_fast_values_skip_typer_adapter_and_odd_ones_use_it():
    from typer._coercion import build_runtime_param

    command, params = _params("run")
    by_name = {p.name: p for p in params}
    ctx = _context(command)
    built = []

    def build(descriptor):
        built.append(descriptor)
        return build_runtime_param(descriptor)

    n_predict = fast_params.FastRuntimeParam(by_name["n_predict"].type_descriptor, build)
    assert n_predict.coerce("16", param=by_name["n_predict"], ctx=ctx) == 16
    assert n_predict.coerce(-1, param=by_name["n_predict"], ctx=ctx) == -1
    assert built == []
    assert n_predict.coerce("1_6", param=by_name["n_predict"], ctx=ctx) == 16  # pydantic's spelling
    assert len(built) == 1
    parallel = fast_params.FastRuntimeParam(by_name["parallel"].type_descriptor, build)
    with pytest.raises(typer.BadParameter, match="greater than or equal to 1"):
        parallel.coerce("0", param=by_name["parallel"], ctx=ctx)


def test_kvchat_run_parses_its_flags_without_importing_pydantic(tmp_path):
    """A whole `kvchat run` with typed flags (ints, floats, a choice, a path) up to its first
    user error never imports pydantic; the error line and exit code are the usual ones."""
    code = (
        "import sys\nfrom kvchat.cli.app import main\n"
        "try:\n    main(sys.argv[1:])\nexcept SystemExit as e:\n"
        "    print('exit', e.code, 'pydantic' in sys.modules)\n"
    )
    prompt = tmp_path / "p.txt"
    prompt.write_text("hi")
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            code,
            "run",
            "-m",
            str(tmp_path / "none.gguf"),
            "-f",
            str(prompt),
            "-n",
            "16",
            "--temp",
            "0.5",
            "-fa",
            "ON",
            "-c",
            "512",
            "-s",
            "3",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert out.stdout.strip() == "exit 1 False"
    assert out.stderr.startswith(f"error: model '{tmp_path / 'none.gguf'}' not found")
    bad = subprocess.run(
        [sys.executable, "-c", code, "run", "-m", "x", "-p", "hi", "-np", "0"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert bad.stdout.strip() == "exit 2 True"  # typer's own conversion words the refusal
    assert "Input should be greater than or equal to 1" in bad.stderr


def test_commands_table_builds_with_the_fast_conversion_installed():
    assert fast_params.install() is True
    assert fast_params.install() is True  # idempotent
    assert set(COMMANDS) >= {"run", "chat"}
