"""`kvchat run` parsed without typer (cli/fast_args.py): the same values or the same refusal as
typer on a corpus of command lines, the usual lines never import typer, and a run ends the same
way whichever parser read its line."""

import os
import subprocess
import sys

import pytest

FAST_VALUES = [
    "0",
    "-1",
    "1",
    "16",
    "007",
    "+3",
    " 3",
    "1_0",
    "1.5",
    "-2.25",
    ".5",
    "1e3",
    "nan",
    "inf",
    "",
    "abc",
    "on",
    "OFF",
    "Auto",
    "oﬀ",
    "q8_0",
    "/tmp/x.txt",
    "rel/p",
    "-",
    "--help",
    "-p",
    "=x",
    "99999999999999999999999",
    "0.95",
    "2048",
    "65",
]


def _run_lines():
    """Command lines for `run`: every flag with every value, the bool spellings, and odd shapes."""
    from kvchat.cli.commands.run import RUN_OPTIONS
    from kvchat.cli.options import OPTIONS

    lines = [
        [],
        ["-p", "hi", "-n", "16"],
        ["-m", "smollm2", "-p", "hi", "-n", "16", "--seed", "1", "--temp", "0.7"],
        ["-p", "a", "-p", "b"],
        ["-n", "3", "-n", "4"],
        ["--temp=0.5"],
        ["-n=5"],
        ["-pfoo"],
        ["-h"],
        ["--help"],
        ["-p", "hi", "--"],
        ["-p", "hi", "extra"],
        ["-p"],
        ["--tem", "1"],
        ["-m", "a", "-hf", "b/c"],
        ["-hf", "o/r:Q4_0", "-p", "x"],
        ["--no-context-shift", "--context-shift"],
        ["-kvu", "-no-kvu"],
        ["-s", "-1"],
        ["-s", "18446744073709551616"],
        ["-np", "0"],
        ["--prompt-cache-max", "0"],
        ["-fa", "ON", "-ctk", "q8_0", "-ctv", "q8_0"],
        ["-p", "-n", "-n", "2"],
    ]
    for o in RUN_OPTIONS + OPTIONS:
        for flag in o.flags:
            for spelling in flag.split("/"):
                if o.type is bool:
                    lines.append([spelling])
                else:
                    lines.extend([spelling, v] for v in FAST_VALUES)
    return lines


def _outcome(call):
    try:
        return ("ok", call())
    except SystemExit as e:
        return ("exit", e.code)
    except Exception as e:  # noqa: BLE001 - compared between the two parsers
        return ("error", type(e).__name__, str(e))


@pytest.mark.slow  # over 10 s: left out of the fast lane (README), run by CI
def test_a_plain_run_line_gets_the_values_typer_gives_and_anything_else_goes_to_typer(monkeypatch):
    import kvchat.cli.commands.run as cmd_run
    from kvchat.cli.app import make_app
    from kvchat.cli.fast_args import parse
    from kvchat.cli.options import OPTIONS, settings_from

    monkeypatch.setenv("COLUMNS", "80")
    monkeypatch.setattr(sys, "stderr", sys.stdout)
    seen = []
    monkeypatch.setattr(cmd_run, "run_command", lambda settings, **own: seen.append((settings, own)))
    app = make_app("run")
    fast_lines = 0
    for line in _run_lines():
        seen.clear()
        typer_said = _outcome(lambda: app(args=["run", *line], prog_name="kvchat", standalone_mode=False))
        values = parse(line, cmd_run.RUN_OPTIONS + OPTIONS)
        if values is None:
            continue  # typer parses it (typer_said is whatever it says, errors included)
        fast_lines += 1
        own = {o.name: values.pop(o.name) for o in cmd_run.RUN_OPTIONS}
        fast_said = _outcome(lambda: settings_from(values))
        if typer_said[0] == "ok":
            assert fast_said == ("ok", seen[0][0]) and own == seen[0][1], line
            assert [type(v) for v in own.values()] == [type(v) for v in seen[0][1].values()], line
        else:
            assert fast_said[0] == "error" and typer_said[2:] == fast_said[2:], (line, typer_said, fast_said)
    assert fast_lines > 200


def test_the_usual_run_lines_are_parsed_without_typer():
    from kvchat.cli.commands.run import RUN_OPTIONS
    from kvchat.cli.fast_args import parse
    from kvchat.cli.options import OPTIONS

    for line in (
        ["-m", "smollm2", "-p", "hi", "-n", "16"],
        ["-f", "q.txt", "--temp", "0", "-c", "2048"],
        ["-p", "hi", "-ctk", "q8_0", "-ctv", "q8_0", "-fa", "on", "-t", "2", "-s", "-1"],
        ["-np", "4", "--jsonl", "--no-prompt-cache", "--no-context-shift", "--session", "s.kvs"],
    ):
        assert parse(line, RUN_OPTIONS + OPTIONS) is not None, line
    for line in (["--help"], ["-p", "hi", "--temp=1"], ["-np", "0"], ["-p", "a", "b"], ["--top-p", "2"]):
        assert parse(line, RUN_OPTIONS + OPTIONS) is None, line


TYPERLESS_RUN = (
    "import atexit, sys\n"
    "atexit.register(lambda: sys.stderr.write('MODULES %r\\n' % sorted(m for m in "
    "('typer', 'click', 'typer._click', 'pydantic') if m in sys.modules)))\n"
    "from kvchat.cli.app import main\nmain()\n"
)


def test_kvchat_run_answers_without_importing_typer_and_says_the_same_as_typer(tiny_chat, tmp_path):
    """The same answer bytes and exit code whether the line is parsed by cli/fast_args.py (typer
    never imported) or by typer (an `=` spelling sends it there); errors keep typer's words."""
    from tests.conftest import ROOT

    env = dict(os.environ, PYTHONPATH=str(ROOT))

    def kvchat(*args):
        p = subprocess.run(
            [sys.executable, "-c", TYPERLESS_RUN, "run", *args],
            env=env,
            capture_output=True,
            text=True,
            cwd=tmp_path,
            timeout=600,
        )
        *said, modules = p.stderr.strip().splitlines() or [""]
        return p.returncode, p.stdout, said, modules

    common = ["-m", str(tiny_chat), "-p", "hi", "-n", "6", "-c", "256", "--temp", "0.9"]
    fast = kvchat(*common, "--seed", "3")
    slow = kvchat(*common, "--seed=3")
    assert fast[3] == "MODULES []" and "'typer'" in slow[3]
    assert fast[:3] == slow[:3] and fast[0] == 0 and len(fast[1].strip()) > 0
    refused = kvchat("-m", str(tiny_chat), "-p", "hi", "--top-p", "2")
    assert refused[0] == 2 and refused[2] == [
        "error: Invalid value for '--top-p': must be within 0.0..1.0 (got 2.0) (see `kvchat run --help`)"
    ]
    both = kvchat("-m", str(tiny_chat), "-hf", "o/r", "-p", "hi")
    assert both[:3] == (1, "", [f"error: give -m {tiny_chat} or -hf o/r, not both"]) and both[3] == "MODULES []"


@pytest.mark.parametrize(
    "raised", [EOFError(), KeyboardInterrupt(), BrokenPipeError(32, "Broken pipe"), SystemExit(130)]
)
def test_a_run_without_typer_ends_as_a_typer_run_when_the_command_raises(monkeypatch, raised):
    import kvchat.cli.commands.run as cmd_run
    from tests.helpers.cli_inproc import kvchat

    def command(settings, **own):
        raise raised

    monkeypatch.setattr(cmd_run, "run_command", command)
    fast, typer_parsed = kvchat("run", "-p", "hi"), kvchat("run", "--prompt=hi")
    assert (fast.returncode, fast.stdout, fast.stderr) == (
        typer_parsed.returncode,
        typer_parsed.stdout,
        typer_parsed.stderr,
    )
    assert fast.returncode in (1, 130)
