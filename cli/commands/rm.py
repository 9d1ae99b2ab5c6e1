"""`kvchat rm NAME`: delete a model kvchat downloaded (never Ollama's files or another tool's), and
its packed weights cached on disk (runtime/weights/cache.py)."""

import typer

from kvchat.cli.sources.catalog import human_size, remove


def register(app: typer.Typer) -> None:
    @app.command("rm")
    def rm(names: list[str] = typer.Argument(..., help="models as `kvchat list` names them")):
        """Delete models kvchat downloaded (registry or hub); Ollama's and other tools' files are left alone."""
        from kvchat.runtime.weights.cache import sweep

        for name in names:
            what, freed = remove(name)
            freed += sweep()  # the packs of files that no longer exist: this model's
            print(f"removed {what} ({human_size(freed)} freed)")
