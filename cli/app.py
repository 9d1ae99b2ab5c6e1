"""The `kvchat` console script: one typer app, one module per command.

Each `cli/cmd_*.py` exposes `register(app)`; this file only wires them together and turns
user-facing errors (runtime.errors.KvchatError) into one line on stderr and exit code 1.
"""
import sys

import typer

from runtime.errors import KvchatError

app = typer.Typer(
    name="kvchat",
    help="Chat with local GGUF models in the terminal (a llama.cpp-style engine on numba).",
    no_args_is_help=False,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

from cli import cmd_pull, cmd_info, cmd_tokenize, cmd_chat, cmd_perplexity, cmd_bench  # noqa: E402

for _module in (cmd_chat, cmd_pull, cmd_info, cmd_tokenize, cmd_perplexity, cmd_bench):
    _module.register(app)


def main(argv=None) -> None:
    """Entry point: `kvchat` alone means `kvchat chat`."""
    args = list(sys.argv[1:] if argv is None else argv)
    commands = {c.name or c.callback.__name__.replace("_", "-") for c in app.registered_commands}
    if not args or (args[0].startswith("-") and args[0] not in ("-h", "--help")):
        args = ["chat", *args]
    elif args[0] not in commands and args[0] not in ("-h", "--help"):
        pass  # typer reports the unknown command itself
    try:
        app(args=args, prog_name="kvchat", standalone_mode=True)
    except KvchatError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
