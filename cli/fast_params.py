"""Command-line values converted without pydantic, with typer's own conversion for the rest.

typer (0.2x) converts every parameter's value through a pydantic TypeAdapter, built on first
use; importing pydantic and building the adapters is a tenth of a second of a warm `kvchat run`
start (docs/performance.md "Start-up"). `install()` gives typer's parameters a converter that
handles the values kvchat's flags take in practice itself — a value already of the flag's type
(the defaults), a plain decimal integer or number, a known choice, a path — producing exactly
the value typer's adapter produces, and hands everything else (a malformed or out-of-range
number, an unknown choice, an odd spelling such as "1_000" or " 3") to typer's adapter, so that
every accepted value, error message and exit code stays typer's. tests/test_fast_params.py
compares the two on every flag of `run` and `chat`.

Nothing changes with a typer that has no such layer (older releases convert with click types).
"""

from __future__ import annotations

import re
from enum import Enum
from pathlib import Path

_INT = re.compile(r"-?(?:0|[1-9][0-9]{0,17})")  # what int() and pydantic agree on
_FLOAT = re.compile(r"-?(?:0|[1-9][0-9]{0,17})(?:\.[0-9]{1,17})?")  # correctly rounded by both
_MISS = object()


def _fast_value(descriptor, value, ctx):
    """The converted value, or _MISS when typer's adapter must decide (or refuse)."""
    from typer._param_types import coerce_cli_choice, lenient_issubclass, routes_to_path
    from typer._typing import get_origin

    annotation, info = descriptor.annotation, descriptor.parameter_info
    if info.parser is not None or get_origin(annotation) is not None:
        return _MISS  # parsers, lists, tuples, Literal, Annotated: as typer does it
    if lenient_issubclass(annotation, Enum):
        try:
            return coerce_cli_choice(value, choices=list(annotation), case_sensitive=info.case_sensitive, ctx=ctx)
        except Exception:  # not a choice: typer's adapter words the error
            return _MISS
    if annotation is int or annotation is float:
        if annotation is int and type(value) is str and _INT.fullmatch(value):
            number = int(value)
        elif annotation is float and type(value) is str and _FLOAT.fullmatch(value):
            number = float(value)
        elif type(value) is annotation:
            number = value
        else:
            return _MISS
        if (
            number != number
            or info.clamp
            or (info.min is not None and number < info.min)
            or (info.max is not None and number > info.max)
        ):
            return _MISS  # clamped or out of range: typer's message
        return number
    if annotation is str:
        return value if type(value) is str else _MISS
    if annotation is bool:
        return _MISS  # typer skips converting flags that are already bools
    if lenient_issubclass(annotation, Path) and routes_to_path(annotation, info) and info.path_type is None:
        if isinstance(value, str) and value and "\0" not in value:
            value = annotation(value)
        if not isinstance(value, annotation):
            return _MISS
        from typer._param_types import coerce_cli_path

        try:
            return coerce_cli_path(value, info, path_type=annotation, ctx=ctx)
        except Exception:  # does not exist, not readable, ...: typer's own check says so
            return _MISS
    return _MISS


class FastRuntimeParam:
    """typer's RuntimeParam contract (coerce) with the fast conversion in front of typer's own."""

    def __init__(self, descriptor, build_typer_param):
        self.descriptor = descriptor
        self._build = build_typer_param
        self._typer_param = None

    def typer_param(self):
        if self._typer_param is None:
            self._typer_param = self._build(self.descriptor)
        return self._typer_param

    def coerce(self, value, param, ctx):
        multi = param.multiple or param.nargs == -1
        if value is None:  # as typer's RuntimeParam.coerce
            return () if multi else None
        if not multi and self.descriptor.file_annotation is None:
            fast = _fast_value(self.descriptor, value, ctx)
            if fast is not _MISS:
                return fast
        return self.typer_param().coerce(value, param=param, ctx=ctx)


def install() -> bool:
    """Put FastRuntimeParam in front of typer's conversion; False when this typer has none."""
    try:
        from typer import _coercion, core
    except ImportError:
        return False
    cls = getattr(core, "_TyperParameter", None)
    build = getattr(_coercion, "build_runtime_param", None)
    if cls is None or build is None or not hasattr(cls, "get_runtime_param"):
        return False
    if getattr(cls.get_runtime_param, "_kvchat_fast", False):
        return True

    def get_runtime_param(self):
        if self._runtime_param is None:
            self._runtime_param = FastRuntimeParam(self.type_descriptor, build)
        return self._runtime_param

    get_runtime_param._kvchat_fast = True
    cls.get_runtime_param = get_runtime_param
    return True
