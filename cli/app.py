"""The `kvchat` console script: one typer app, one module per command.

Each `cli/cmd_*.py` exposes `register(app)`; this file only wires them together and turns
user-facing errors (kvchat.runtime.errors.KvchatError) into one line on stderr and exit code 1.
A plain `kvchat run` line (known flags, values typer would read the same way) is parsed by
cli/fast_args.py and typer is not imported at all; every other line goes through typer.
"""

import importlib
import logging
import os
import sys

from kvchat.runtime.errors import KvchatError

# command name -> the module whose register(app) adds it, in `kvchat --help` order
COMMANDS = {
    "chat": "kvchat.cli.commands.chat",
    "run": "kvchat.cli.commands.run",
    "pull": "kvchat.cli.commands.pull",
    "list": "kvchat.cli.commands.list",
    "rm": "kvchat.cli.commands.rm",
    "info": "kvchat.cli.commands.info",
    "tokenize": "kvchat.cli.commands.tokenize",
    "perplexity": "kvchat.cli.commands.perplexity",
    "bench": "kvchat.cli.commands.bench",
    "bench-batched": "kvchat.cli.commands.bench_batched",
    "session": "kvchat.cli.commands.session",
    "kv-sweep": "kvchat.cli.commands.kv_sweep",
    "logprobs": "kvchat.cli.commands.logprobs",
}


def make_app(only: str | None = None):
    """The typer app with every command, or with command `only` alone: `kvchat run ...` then
    imports run's module and what it needs, not every other command's (the inference engine,
    the hub client, ...). A callback keeps a one-command app a group, so `run` stays its name.
    Values are converted without pydantic where typer's result is known (cli/fast_params.py)."""
    import typer

    from kvchat.cli import fast_params

    if not startup_piece_skipped("fast_params"):
        fast_params.install()
    application = typer.Typer(
        name="kvchat",
        help="Chat with local GGUF models in the terminal (a llama.cpp-style engine on numba).",
        no_args_is_help=False,
        add_completion=False,
        pretty_exceptions_enable=False,
        context_settings={"help_option_names": ["-h", "--help"]},
    )
    if only is not None:
        application.callback()(lambda: None)
    for name, module in COMMANDS.items():
        if only is None or name == only:
            importlib.import_module(module).register(application)
    return application


def __getattr__(name: str):
    """`kvchat.cli.app.app`: the app with every command (built on first use; tests drive it)."""
    if name == "app":
        globals()["app"] = application = make_app()
        return application
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def quiet_engine_logs() -> None:
    """The engine logs what llama.cpp logs (decode aborted, state refused, ...); the CLI says
    what matters in its own words, so those records stay hidden unless KVCHAT_DEBUG is set.
    Without a handler Python would print every warning through its last-resort handler."""
    if os.environ.get("KVCHAT_DEBUG"):
        logging.basicConfig(level=logging.DEBUG, format="%(name)s: %(message)s")
        return
    for name in ("runtime", "kernels", "cli"):
        logger = logging.getLogger(name)
        if not logger.handlers:
            logger.addHandler(logging.NullHandler())
        logger.propagate = False


def single_threaded_blas() -> None:
    """numpy's OpenBLAS starts a thread per core and sizes its buffers when numpy is imported
    (~0.05 s CPU of every start here); kvchat's engine never calls numpy's BLAS (its products
    are numba kernels), so its one thread is enough. A user's setting wins; set before the
    command's modules import numpy."""
    if "numpy" not in sys.modules:
        os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")


def startup_piece_skipped(name: str) -> bool:
    """True when KVCHAT_STARTUP_SKIP names this piece (benchmarks/startup.py measures its worth)."""
    from kvchat.kernels.numba_start import SKIP_ENV

    return name in os.environ.get(SKIP_ENV, "").replace(" ", "").split(",")


def run_without_typer(args: list[str]):
    """`kvchat run ...` parsed by cli/fast_args.py and run; NotImplemented when typer must parse it."""
    if args[0] != "run" or startup_piece_skipped("fast_args"):
        return NotImplemented
    from kvchat.cli import fast_args
    from kvchat.cli.commands import run as cmd_run
    from kvchat.cli.options import OPTIONS, settings_from

    values = fast_args.parse(args[1:], cmd_run.RUN_OPTIONS + OPTIONS)
    if values is None:
        return NotImplemented
    own = {o.name: values.pop(o.name) for o in cmd_run.RUN_OPTIONS}
    return fast_args.invoke(lambda: cmd_run.run_command(settings_from(values), **own))


def run_with_typer(args: list[str]):
    """The typer app's answer to `kvchat ARGS`; usage errors become one line (exit 2)."""
    import typer

    from kvchat.cli.fast_args import click_module

    click_exc = click_module("exceptions")
    application = make_app(args[0]) if args[0] in COMMANDS else globals().get("app") or __getattr__("app")
    try:
        return application(args=args, prog_name="kvchat", standalone_mode=False)
    except click_exc.UsageError as e:
        command = e.ctx.command_path if e.ctx is not None else "kvchat"
        print(f"error: {e.format_message()} (see `{command} --help`)", file=sys.stderr)
        sys.exit(2)
    except click_exc.ClickException as e:
        print(f"error: {e.format_message()}", file=sys.stderr)
        sys.exit(e.exit_code)
    except typer.Abort:
        print("interrupted", file=sys.stderr)
        sys.exit(130)


def main(argv=None) -> None:
    """Entry point: `kvchat` alone (or with only options) means `kvchat chat`.

    Usage errors (unknown option, bad value) and KvchatError both become one `error:` line on
    stderr — exit 2 and 1 respectively, as click and llama.cpp's tools do."""
    quiet_engine_logs()
    single_threaded_blas()
    from kvchat.kernels.numba_start import install

    install()  # kvchat's changes to numba, before anything imports it (kernels/numba_start.py)
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or (args[0].startswith("-") and args[0] not in ("-h", "--help")):
        args = ["chat", *args]
    from kvchat.cli.fast_args import EndOfInput

    try:
        rc = run_without_typer(args)
        if rc is NotImplemented:
            rc = run_with_typer(args)
    except KvchatError as e:
        from kvchat.cli.wording import error_text

        print(f"error: {error_text(e)}", file=sys.stderr)
        sys.exit(getattr(e, "exit_code", 1))  # 2 for a usage error found after parsing (GrammarError)
    except (EndOfInput, KeyboardInterrupt):
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    if isinstance(rc, int) and rc:
        sys.exit(rc)
