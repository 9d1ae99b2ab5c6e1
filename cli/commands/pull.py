"""`kvchat pull NAME`: fetch a model into the cache (what -m / -hf do on first use).

NAME is a known model (smollm2, gemma3) or hf:owner/repo[:QUANT]. For the hub, pull always asks
the hub (a newer revision is fetched), where -hf uses a cached model without any request.
After the download pull compiles the kernels the model needs (compile_kernels), so the first
chat or run after a pull starts warm."""

import typer
from rich.console import Console

from kvchat.cli.sources import hub
from kvchat.cli.sources.models import KNOWN_MODELS, ensure_model, models_dir
from kvchat.runtime.errors import KvchatError


def register(app: typer.Typer) -> None:
    @app.command("pull")
    def pull(
        name: str = typer.Argument(..., help=f"model to fetch: {', '.join(KNOWN_MODELS)} or hf:owner/repo[:QUANT]"),
    ):
        """Download a model into the cache (KVCHAT_CACHE, default ~/.cache/kvchat; hub models go to
        the Hugging Face cache, HF_HOME)."""
        console = Console(stderr=True)
        if name.lower().startswith(hub.PREFIX):
            ref = hub.parse_ref(name)
            before = hub.find_cached(ref)
            paths = hub.resolve(ref, console, refresh=True)
            if before == paths:
                console.print(f"{hub.PREFIX}{ref} is up to date in the cache", highlight=False)
            compile_kernels(paths[0])
            print(paths[0])
            return
        model = KNOWN_MODELS.get(name.lower())
        if model is None:
            raise KvchatError(
                f"unknown model '{name}'; known models: {', '.join(KNOWN_MODELS)}, "
                f"or hf:owner/repo[:QUANT] from the Hugging Face hub"
            )
        already = (models_dir() / model.file_name).is_file()
        path = ensure_model(model, console)
        if already:
            console.print(f"{model.name} is already in the cache")
        compile_kernels(path)
        print(path)


def compile_kernels(path) -> None:
    """Open the model as `kvchat` and `kvchat run` open it with their default flags: the kernels
    either needs compile in worker processes (progress on stderr) and each one's warm-up is
    recorded (kernels/warm_set.py), so neither compiles nor plans at its first start."""
    import threading

    from kvchat.cli.chat.render import Renderer
    from kvchat.cli.chat.setup import open_engine
    from kvchat.cli.options import ChatSettings

    for n_seq_max in (0, 1):  # the chat's default (0: auto), run's
        renderer = Renderer()
        open_engine(ChatSettings(model=str(path)), renderer, threading.Event(), n_seq_max=n_seq_max).kernels_finished(
            renderer
        )
