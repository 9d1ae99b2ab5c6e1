"""`kvchat ARGS` run in the test process: kvchat.cli.app.main with its stdin, stdout, stderr, environment
and working directory swapped for the call, and the exit handlers it registers (the session
locks' release) run when it returns, as at the end of a process. The kernels are compiled once
for the whole test session, which is what makes the CLI contract tests cheap; the tests about
processes themselves (signals, closed descriptors, a lock held by another process, the
interpreter's start-up locale) run a real one instead."""

from __future__ import annotations

import atexit
import io
import os
import sys
from types import SimpleNamespace


def _stream(data=b"", errors="surrogateescape") -> io.TextIOWrapper:
    """A text stream over bytes with a .buffer, as a pipe's sys.stdin/stdout is (not a tty)."""
    return io.TextIOWrapper(io.BytesIO(data), encoding="utf-8", errors=errors, write_through=True)


def kvchat(*args, input=None, env=None, cwd=None, text=True, stdin_errors="surrogateescape"):
    """The result of `kvchat ARGS` as subprocess.run gives it (.returncode, .stdout, .stderr).
    Arguments may be bytes (decoded the way Python decodes argv); `input` (str or bytes) is stdin,
    whose text layer decodes with
    stdin_errors ("strict" is what PYTHONIOENCODING=utf-8:strict gives a process); `env` entries
    are set for the call; text=False gives stdout/stderr as bytes, as subprocess.run does."""
    from kvchat.cli.app import main

    argv = [os.fsdecode(a) if isinstance(a, bytes) else str(a) for a in args]
    data = input.encode("utf-8", "surrogateescape") if isinstance(input, str) else (input or b"")
    stdin, stdout, stderr = _stream(data, stdin_errors), _stream(), _stream()
    saved = sys.stdin, sys.stdout, sys.stderr, dict(os.environ), os.getcwd()
    os.environ.update({k: str(v) for k, v in (env or {}).items()})
    os.environ.pop("KVCHAT_DEBUG", None)
    if cwd is not None:
        os.chdir(cwd)
    sys.stdin, sys.stdout, sys.stderr = stdin, stdout, stderr
    at_exit = []
    register = atexit.register
    atexit.register = lambda fn, *a, **kw: (at_exit.append((fn, a, kw)), fn)[1]
    code = 0
    try:
        main(argv)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        atexit.register = register
        for fn, a, kw in reversed(at_exit):
            fn(*a, **kw)
        sys.stdin, sys.stdout, sys.stderr = saved[:3]
        os.environ.clear()
        os.environ.update(saved[3])
        os.chdir(saved[4])
    out, err = stdout.buffer.getvalue(), stderr.buffer.getvalue()
    if text:
        out, err = out.decode("utf-8", "replace"), err.decode("utf-8", "replace")
    return SimpleNamespace(returncode=code, stdout=out, stderr=err)
