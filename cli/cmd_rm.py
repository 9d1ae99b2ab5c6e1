"""`kvchat rm NAME`: delete a model kvchat downloaded (never Ollama's files or another tool's)."""
import typer

from cli.catalog import human_size, remove


def register(app: typer.Typer) -> None:
    @app.command("rm")
    def rm(names: list[str] = typer.Argument(..., help="models as `kvchat list` names them")):
        """Delete models kvchat downloaded (registry or hub); Ollama's and other tools' files are left alone."""
        for name in names:
            what, freed = remove(name)
            print(f"removed {what} ({human_size(freed)} freed)")
