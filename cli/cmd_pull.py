"""`kvchat pull NAME`: fetch a known model into the cache (what `-m NAME` does on first use)."""
import typer
from rich.console import Console

from cli.models import KNOWN_MODELS, ensure_model, models_dir
from runtime.errors import KvchatError


def register(app: typer.Typer) -> None:
    @app.command("pull")
    def pull(name: str = typer.Argument(..., help=f"model to fetch: {', '.join(KNOWN_MODELS)}")):
        """Download a known model into the cache (KVCHAT_CACHE, default ~/.cache/kvchat)."""
        model = KNOWN_MODELS.get(name.lower())
        if model is None:
            raise KvchatError(f"unknown model '{name}'; known models: {', '.join(KNOWN_MODELS)}")
        console = Console(stderr=True)
        already = (models_dir() / model.file_name).is_file()
        path = ensure_model(model, console)
        if already:
            console.print(f"{model.name} is already in the cache")
        print(path)
