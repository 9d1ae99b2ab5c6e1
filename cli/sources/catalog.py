"""Every model runnable without a download, and removing the ones we downloaded.

Three places hold models: our registry cache ($KVCHAT_CACHE/models: smollm2, gemma3), the
Hugging Face cache (shared with llama.cpp and `hf download`; what `-hf` resolves offline) and
Ollama's store. `kvchat rm` deletes only what kvchat itself downloaded: registry files, and hub
files recorded in $KVCHAT_CACHE/hub/ as pulled by us. Ollama's files and hub files another tool
fetched are never touched.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from kvchat.cli.sources import hub, ollama_store
from kvchat.cli.sources.models import KNOWN_MODELS, models_dir
from kvchat.runtime.errors import KvchatError, ModelFileError


@dataclass
class Entry:
    name: str  # what -m takes
    source: str  # registry | hub | ollama
    path: Path  # the GGUF (first part)
    ours: bool  # downloaded by kvchat (so `kvchat rm` may delete it)
    arch: str = "?"
    size: int = 0  # bytes over all parts
    weights: str = "?"  # general.file_type as llama.cpp names it
    n_ctx_train: int | None = None
    problem: str | None = None


def installed() -> list[Entry]:
    entries = [
        Entry(name, "registry", models_dir() / m.file_name, True)
        for name, m in KNOWN_MODELS.items()
        if (models_dir() / m.file_name).is_file()
    ]
    entries += hub_entries()
    entries += [Entry(ollama_store.PREFIX + m.name, "ollama", m.blob, False) for m in ollama_store.list_models()]
    for e in entries:
        _describe(e)
    return entries


def hub_entries() -> list[Entry]:
    """One entry per model in the hub cache that `-hf` finds without a request."""
    root = hub.hub_cache()
    out = []
    for folder in sorted(root.glob("models--*--*")) if root.is_dir() else []:
        repo = folder.name[len("models--") :].replace("--", "/", 1)
        rec = hub.read_record(repo) or {}
        pulled = {tuple(p) for p in rec.get("pulled", [])}
        commits = dict.fromkeys(c for c in (rec.get("commit"), hub.cached_commit(repo)) if c)
        seen = set()
        for commit in commits:
            snap = hub.snapshot(repo, commit)
            names = [p.relative_to(snap).as_posix() for p in snap.rglob("*.gguf")] if snap.is_dir() else []
            for first in hub.first_parts(names):
                label = _hub_label(repo, first, names)
                if label is None or label in seen:
                    continue
                files = hub.choose_files(names, hub.parse_ref(label))
                seen.add(label)
                out.append(Entry(label, "hub", snap / files[0], all((commit, f) in pulled for f in files)))
    return out


def _hub_label(repo: str, first: str, names: list[str]) -> str | None:
    """The shortest `hf:repo:QUANT` that resolves to `first` (its quant tag, else its file stem)."""
    base = first.rsplit("/", 1)[-1]
    for quant in (hub.quant_of(first), base[:-5]):
        try:
            if hub.choose_files(names, hub.HubRef(repo, quant))[0] == first:
                return f"{hub.PREFIX}{repo}:{quant}"
        except KvchatError:
            continue
    return None


def _describe(e: Entry) -> None:
    from kvchat.runtime.gguf.split import open_gguf
    from kvchat.runtime.model import LLAMA_FTYPE_NAMES

    try:
        with open_gguf(e.path) as gf:
            e.arch = gf.arch
            e.size = gf.file_size
            ft = gf.get("general.file_type")
            e.weights = LLAMA_FTYPE_NAMES.get(ft, "?") if isinstance(ft, int) else "?"
            ctx = gf.get(f"{gf.arch}.context_length")
            e.n_ctx_train = ctx if isinstance(ctx, int) else None
    except (ModelFileError, OSError) as err:
        e.problem = str(err).rsplit(": ", 1)[-1]
        try:
            e.size = e.path.stat().st_size
        except OSError:
            pass


# ---- rm ------------------------------------------------------------------------------------


def remove(name: str) -> tuple[str, int]:
    """Delete the model `name` (as `kvchat list` shows it) if kvchat downloaded it; (what, bytes freed)."""
    key = name.lower()
    if key in KNOWN_MODELS:
        path = models_dir() / KNOWN_MODELS[key].file_name
        if not path.is_file():
            raise KvchatError(f"{key} is not in the cache ({path}); nothing to remove")
        size = path.stat().st_size
        path.unlink()
        return key, size
    if key.startswith(ollama_store.PREFIX):
        om = ollama_store.resolve(name)
        raise KvchatError(f"{name} is Ollama's; kvchat never deletes Ollama's files (`ollama rm {om.name}` does)")
    if key.startswith(hub.PREFIX) or ("/" in name and not Path(name).exists()):
        return _remove_hub(hub.parse_ref(name))
    if Path(name).expanduser().exists():
        raise KvchatError(
            f"{name} is a file of yours, not a model kvchat downloaded; delete it yourself if you mean to"
        )
    raise KvchatError(f"no model '{name}' to remove; `kvchat list` shows the models and their names")


def _remove_hub(ref: hub.HubRef) -> tuple[str, int]:
    paths = hub.find_cached(ref)
    if not paths:
        raise KvchatError(f"{hub.PREFIX}{ref} is not in the hub cache ({hub.hub_cache()}); nothing to remove")
    rec = hub.read_record(ref.repo) or {}
    pulled = [tuple(p) for p in rec.get("pulled", [])]
    keys = [(_commit_of(p), _rel(p)) for p in paths]
    if not all(k in pulled for k in keys):
        raise KvchatError(
            f"{hub.PREFIX}{ref} was put in the shared hub cache by another tool (llama.cpp, `hf download`), "
            f"not by kvchat, so kvchat leaves it; `hf cache rm` removes it"
        )
    folder = hub.repo_folder(ref.repo)
    freed = sum(_unlink_with_blob(p, folder) for p in paths)
    rec["pulled"] = [list(k) for k in pulled if k not in keys]
    _prune(folder, ref.repo, rec)
    return f"{hub.PREFIX}{ref}", freed


def _commit_of(path: Path) -> str:
    return next(p.name for p in path.parents if p.parent.name == "snapshots")


def _rel(path: Path) -> str:
    snap = next(p for p in path.parents if p.parent.name == "snapshots")
    return path.relative_to(snap).as_posix()


def _unlink_with_blob(pointer: Path, folder: Path) -> int:
    """Remove a snapshot entry and, unless another snapshot entry still links to it, its blob;
    the bytes freed."""
    was_link = pointer.is_symlink()
    blob = pointer.resolve()
    size = blob.stat().st_size if blob.is_file() else 0
    pointer.unlink()
    if not was_link:  # HF_HUB_DISABLE_SYMLINKS: the snapshot holds the file itself
        return size
    if any(p.is_symlink() and p.resolve() == blob for p in (folder / "snapshots").rglob("*")):
        return 0
    if blob.is_relative_to(folder.resolve() / "blobs"):
        blob.unlink(missing_ok=True)
        return size
    return 0


def _prune(folder: Path, repo: str, rec: dict) -> None:
    """Drop empty snapshot folders; a repo folder with no file left goes entirely, with our record."""
    snaps = folder / "snapshots"
    for d in sorted((p for p in snaps.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
        if not any(d.iterdir()):
            d.rmdir()
    if not any(p.is_file() or p.is_symlink() for p in snaps.rglob("*")):
        shutil.rmtree(folder, ignore_errors=True)
        hub.record_path(repo).unlink(missing_ok=True)
    elif rec:
        hub.write_record(rec)


def human_size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"
