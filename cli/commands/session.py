"""`kvchat session show FILE [--json]`: what a saved session holds, without loading a model.

The file is read and checked like a resume does (structure, checksum, header schema), then its
model identity, cache configuration, sampling settings, token counts and messages are printed —
for people as a short report, for scripts as one JSON object (`--json`; no memory state bytes).
"""

from __future__ import annotations

import json
from pathlib import Path

import typer

session_app = typer.Typer(help="look inside saved session files", no_args_is_help=True)


def describe(path: Path) -> dict:
    from kvchat.cli.session.session import FORMAT_VERSION, read_session

    data = read_session(path)
    return {
        "file": str(path),
        "format_version": FORMAT_VERSION,
        "size": path.stat().st_size,
        "model": data.model,
        "cache": data.cache,
        "sampling": data.sampling,
        "n_tokens": len(data.tokens),
        "n_cached": len(data.tokens) - data.n_dropped,
        "n_dropped": data.n_dropped,
        "n_keep": data.n_keep,
        "state_bytes": len(data.state),
        "messages": data.messages,
        "tokens": data.tokens,
    }


@session_app.command("show")
def show(
    file: Path = typer.Argument(..., help="a session file (--session / /save)"),
    as_json: bool = typer.Option(False, "--json", help="one JSON object on stdout"),
):
    """Print a saved session's model, settings and messages."""
    info = describe(file)
    if as_json:
        print(json.dumps(info, ensure_ascii=False, indent=1))
        return
    m, c = info["model"], info["cache"]
    fa = "on" if c["flash_attn"] else "off"
    print(f"session  {info['file']} ({info['size']} bytes, format {info['format_version']})")
    print(f"model    {m['file']} ({m['size']} bytes, header sha256 {m['header_sha256'][:16]}…)")
    print(
        f"cache    -c {c['n_ctx']} · K {c['type_k']} V {c['type_v']} · flash-attn {fa}"
        f"{' · swa-full' if c['swa_full'] else ''}"
    )
    s = info["sampling"]
    print("sampling " + " · ".join(f"{k.replace('_', '-')} {v}" for k, v in s.items()))
    print(
        f"tokens   {info['n_cached']} cached, {info['n_tokens']} in total, {info['n_dropped']} "
        f"dropped by context shifts · memory state {info['state_bytes']} bytes"
    )
    print(f"messages {len(info['messages'])}")
    for msg in info["messages"]:
        text = msg["content"].replace("\n", "\n" + " " * 11)
        print(f"  {msg['role']:>9}: {text}")


def register(app: typer.Typer) -> None:
    app.add_typer(session_app, name="session")
