"""A plain `kvchat run` command line parsed without typer (importing typer and building its
command is a few hundredths of a second of a warm start; docs/performance.md "Start-up").

`parse(args, options)` reads a command line made of known flags only — each spelled exactly as
declared (`-n 16`, `--temp 0.7`, `--raw`, `--no-context-shift`), with values converted the way
typer converts them when the result is certain (cli/fast_params.py's rules: a plain decimal, a
known choice, a path, a string) and range-checked by the same checks — and returns every
option's value, defaults included. Anything else returns None and typer parses the line: help,
an unknown or abbreviated flag, `--flag=value`, a stray argument, `--`, a missing value, a value
typer would spell differently or refuse. So a refusal's wording and exit code stay typer's, and
tests/test_startup_pieces.py checks that both parsers give the same values on a corpus of lines.

`invoke(command)` runs the command the way typer's main does for an exception it handles itself
(Ctrl-C: exit 130; end of input: "\\n" on stderr, then kvchat.cli.app's "interrupted"; a closed pipe:
exit 1), so a fast-parsed run ends exactly as a typer-parsed one.
"""

from __future__ import annotations

import errno
import os
import sys
from pathlib import Path

from kvchat.cli.fast_params import _FLOAT, _INT
from kvchat.cli.options import FlashAttn, Option, check_value

_VALUE = object()  # the flag takes the next argument as its value
COMPLETION_VAR = "_KVCHAT_COMPLETE"  # typer's shell completion answers when this is set


def click_module(name: str):
    """A module of click (`exceptions`, `utils`): typer >= 0.22 vendors click as typer._click;
    older releases depend on click itself."""
    import importlib

    try:
        return importlib.import_module(f"typer._click.{name}")
    except ImportError:  # pragma: no cover - depends on the installed typer
        return importlib.import_module(f"click.{name}")


class EndOfInput(Exception):
    """typer's Abort for an EOFError: kvchat.cli.app says "interrupted", exit 130."""


def spellings(options: list[Option]) -> dict:
    """flag spelling -> (option, value it sets, or _VALUE when it takes one)."""
    table = {}
    for o in options:
        for decl in o.flags:
            if o.type is not bool:
                table[decl] = (o, _VALUE)
                continue
            on, _, off = decl.partition("/")
            if off:
                table[on], table[off] = (o, True), (o, False)
            elif o.default is False:  # a lone flag whose default is True means something else to click
                table[on] = (o, True)
    return table


def convert(option: Option, text: str):
    """The value typer gives for `text`, or None when only typer can say (or refuse)."""
    t = option.value_type
    if t is str:
        return text
    if t is int or t is float:
        if not (_INT if t is int else _FLOAT).fullmatch(text):
            return None
        number = t(text)
        lo, hi = option.extra.get("min"), option.extra.get("max")
        if option.extra.get("clamp") or (lo is not None and number < lo) or (hi is not None and number > hi):
            return None
        return number
    if t is Path:
        return Path(text) if text and "\0" not in text else None
    if t is FlashAttn:
        choices = {c.value: c for c in FlashAttn}
        key = text if option.extra.get("case_sensitive", True) else text.lower()
        return choices.get(key) if text.isascii() else None
    return None


def parse(args: list[str], options: list[Option]) -> dict | None:
    """{option name: value} for every option, or None: typer must parse this line (module doc)."""
    if os.environ.get(COMPLETION_VAR):
        return None
    table = spellings(options)
    given = {}
    i = 0
    while i < len(args):
        entry = table.get(args[i])
        if entry is None:
            return None  # help, unknown, --flag=value, an argument, "--": typer's
        option, value = entry
        if value is _VALUE:
            if i + 1 == len(args):
                return None  # missing value: typer's message
            value = convert(option, args[i + 1])
            if value is None:
                return None
            i += 1
        given[option.name] = value  # the last one wins, as with click
        i += 1
    values = {}
    for o in options:
        value = given.get(o.name, o.default)
        try:
            values[o.name] = check_value(o, value)  # typer runs the check on defaults too
        except ValueError:
            return None  # refused: typer words it
    return values


def invoke(command) -> int | None:
    """command()'s return value, with the exceptions typer's main handles handled as it does."""
    try:
        return command()
    except EOFError as e:
        print(file=sys.stderr, flush=True)
        raise EndOfInput() from e
    except KeyboardInterrupt:
        return 130
    except OSError as e:
        if e.errno != errno.EPIPE:
            raise
        PacifyFlushWrapper = click_module("utils").PacifyFlushWrapper
        sys.stdout, sys.stderr = PacifyFlushWrapper(sys.stdout), PacifyFlushWrapper(sys.stderr)
        sys.exit(1)
