"""`kvchat list`: the models runnable without a download, with what -m takes to run each."""

import json

import typer

from kvchat.cli.sources.catalog import human_size, installed


def register(app: typer.Typer) -> None:
    @app.command("list")
    def list_models(as_json: bool = typer.Option(False, "--json", help="one JSON object per model, for scripts")):
        """List the models you can run offline: registry downloads, hub downloads, Ollama models."""
        entries = installed()
        if as_json:
            for e in entries:
                print(
                    json.dumps(
                        {
                            "name": e.name,
                            "source": e.source,
                            "path": str(e.path),
                            "ours": e.ours,
                            "architecture": e.arch,
                            "size": e.size,
                            "weights": e.weights,
                            "context_length": e.n_ctx_train,
                            "problem": e.problem,
                        }
                    )
                )
            return
        if not entries:
            print("no models yet: `kvchat pull smollm2`, `kvchat pull hf:owner/repo[:QUANT]`, or `ollama pull NAME`")
            return
        rows = [("NAME", "SOURCE", "ARCH", "SIZE", "WEIGHTS", "CONTEXT")]
        for e in entries:
            source = e.source if e.ours or e.source != "hub" else "hub (other tool)"
            rows.append(
                (
                    e.name,
                    source,
                    e.arch if e.problem is None else f"unreadable: {e.problem}",
                    human_size(e.size),
                    e.weights,
                    str(e.n_ctx_train or "?"),
                )
            )
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        for r in rows:
            print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
