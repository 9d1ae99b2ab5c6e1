"""The shared flags (cli/options.py: OPTIONS) as typer parameters: `with_settings` gives a command
all of them or a subset with its own defaults and hands it one ChatSettings; `hf_option` is -hf
for a command with its own -m. typer is imported by a command's registration, not with this
module (`kvchat run` on the fast path never imports it)."""

from __future__ import annotations

import functools
import inspect
from dataclasses import replace
from typing import Annotated

from kvchat.cli.options import BY_NAME, HF_HELP, FlashAttn, Option, check_value, settings_from


def hf_option(panel: str | None = None):
    """`-hf owner/repo[:QUANT]` for a command declaring its own -m (same as -m hf:owner/repo[:QUANT])."""
    import typer

    return typer.Option(None, *BY_NAME["hf_repo"].flags, help=HF_HELP, rich_help_panel=panel)


def _callback(option: Option):
    def callback(value):
        try:
            return check_value(option, value)
        except ValueError as e:
            import typer

            raise typer.BadParameter(str(e)) from None

    return callback


def parameter(option: Option) -> inspect.Parameter:
    import typer

    default = option.default
    if option.type is FlashAttn and default is not None:
        default = FlashAttn(default)
    extra = {"show_default": default is not None, **option.extra}
    cb = _callback(option) if option.check is not None else None
    text = getattr(option.check, "text", None)
    help_ = f"{option.help} \\[{text}]" if text else option.help  # a literal "[", not rich markup
    opt = typer.Option(*option.flags, help=help_, rich_help_panel=option.panel, callback=cb, **extra)
    return inspect.Parameter(
        option.name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=Annotated[option.type, opt]
    )


def with_settings(func=None, *, names=None, overrides=None):
    """Give a typer command the shared flags; it receives them as `settings: ChatSettings`.

    names: which flags (default: all of OPTIONS). overrides: {field: {"default"|"help"|"check"|
    "panel": ...}} for a command whose flag means something narrower (perplexity's -c is the
    chunk size). Flags not taken keep ChatSettings' defaults in `settings`."""
    if func is None:
        return functools.partial(with_settings, names=names, overrides=overrides)
    chosen = [BY_NAME[n] for n in (names or BY_NAME)]
    over = overrides or {}
    chosen = [replace(o, **over.get(o.name, {})) for o in chosen]
    own = [p for p in inspect.signature(func, eval_str=True).parameters.values() if p.name != "settings"]
    shared = [parameter(o) for o in chosen]
    taken = [o.name for o in chosen]
    fixed = {n: o["default"] for n, o in over.items() if n not in taken and "default" in o}

    @functools.wraps(func)
    def command(**kwargs):
        values = {n: kwargs.pop(n) for n in taken}
        return func(settings=settings_from(values, fixed), **kwargs)

    del command.__wrapped__  # typer must see the new signature, not the wrapped one
    params = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own] + shared
    command.__signature__ = inspect.Signature(params)
    command.__annotations__ = {p.name: p.annotation for p in params}
    return command
