"""The chat's commands for what an answer looks like: `/set format ...` (structured output) and
`/think` (a thinking model's thinking shown or collapsed). Mixed into the Repl (cli/chat/repl.py),
whose `conv`, `branches`, `engine` and renderer `r` they use."""

from __future__ import annotations

import os
import shlex
from pathlib import Path

from kvchat.runtime.errors import KvchatError

FORMAT_COMMANDS = {
    "/think": "show or hide a thinking model's thinking (collapsed to one line when hidden)",
}


def _one_path(arg: str, command: str) -> Path:
    """The FILE of `/set format schema|grammar FILE`, quoted as a shell would, ~ expanded."""
    try:
        parts = shlex.split(arg)
    except ValueError as e:
        raise KvchatError(f"{command}: {e}") from None
    if len(parts) != 1:
        raise KvchatError(f"usage: {command} FILE (quote a name with spaces)")
    return Path(os.path.expanduser(parts[0]))


class FormatCommands:
    def _set_format(self, arg: str) -> None:
        """/set format json | schema FILE | grammar FILE | off: what every later answer must match
        (all branches); the schema or grammar is checked before it replaces the current one."""
        from kvchat.runtime.errors import GrammarError
        from kvchat.runtime.grammar.matcher import Constraint
        from kvchat.runtime.grammar.spec import spec_from_flags

        words = arg.split(None, 1)
        kind = words[0].lower() if words else ""
        try:
            if kind == "off" and len(words) == 1:
                spec = None
            elif kind == "json" and len(words) == 1:
                spec = spec_from_flags(any_json=True)
            elif kind in ("schema", "grammar") and len(words) == 2:
                path = _one_path(words[1], f"/set format {kind}")
                spec = spec_from_flags(**{"json_schema_file" if kind == "schema" else "grammar_file": path})
            else:
                raise KvchatError("usage: /set format json | schema FILE | grammar FILE | off")
            constraint = Constraint(spec, self.engine.vocab) if spec is not None else None
        except GrammarError as e:
            raise KvchatError(f"/set format: {e}") from None
        for conv in self.branches.items.values():
            conv.constraint = constraint
        self.r.notice(f"format = {spec.describe() if spec else 'free text'} (from the next answer)")

    def cmd_think(self, arg: str) -> None:
        view = self.r.thinking_view
        view.show = not view.show
        if self.conv.reasoning_format is None:
            self.r.notice("this model has no thinking markers: nothing to show")
            return
        self.r.notice("thinking is shown" if view.show else "thinking is collapsed to one line")
