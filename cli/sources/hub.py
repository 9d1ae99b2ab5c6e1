"""GGUF models from the Hugging Face hub: `-hf owner/repo[:QUANT]`, `kvchat pull hf:owner/repo[:QUANT]`.

Downloads go through huggingface_hub (its cache layout, locking, HF_TOKEN, HF_ENDPOINT,
HF_HUB_OFFLINE, HF_HOME / HF_HUB_CACHE), so files fetched by kvchat, llama.cpp or `hf download`
are shared. The file is chosen as llama.cpp's `-hf` chooses it (common/download.cpp):
`:QUANT` matches GGUF names containing it, case-insensitively (`q8_0` finds `M-Q8_0.gguf`);
without one, Q4_K_M, else Q8_0, else the first GGUF. mmproj / imatrix files are not models.
Where llama.cpp silently takes the first of several matches, we prefer the one where the tag
ends at `.` or `-` and otherwise refuse and list the choices. A split model
(`-00001-of-00003.gguf`) is fetched whole.

Cache first: once a model is in the cache, `-hf` resolves it without any request (we keep the
repo's GGUF listing in $KVCHAT_CACHE/hub/), so it also works offline. `kvchat pull hf:…` always
asks the hub and fetches a newer revision if there is one.
"""

from __future__ import annotations

import errno
import json
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvchat.cli.sources.paths import cache_dir
from kvchat.runtime.errors import KvchatError
from kvchat.runtime.gguf.split import parse_split_name

if TYPE_CHECKING:  # rich is imported when a download shows its progress
    from rich.console import Console
    from rich.progress import Progress


def _stderr_console() -> Console:
    from rich.console import Console

    return Console(stderr=True)


PREFIX = "hf:"
DEFAULT_QUANTS = ("Q4_K_M", "Q8_0")  # llama.cpp's order when no :QUANT is given
NOT_MODELS = ("mmproj", "imatrix", "mtp-", "eagle3-", "dflash-", "dspark-")
_REPO = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
_QUANT = re.compile(r"^[A-Za-z0-9_.+-]+$")
_TAG = re.compile(r"[-.]([A-Za-z0-9_]+)$")
EXAMPLE = "bartowski/SmolLM2-135M-Instruct-GGUF:Q8_0"


@dataclass(frozen=True)
class HubRef:
    repo: str
    quant: str | None = None  # None: llama.cpp's default choice
    revision: str = "main"

    def __str__(self) -> str:
        return self.repo + (f":{self.quant}" if self.quant else "")


def parse_ref(spec: str) -> HubRef:
    """`owner/repo[:QUANT]` (an `hf:` prefix is accepted) -> HubRef; one-line error otherwise."""
    text = spec[len(PREFIX) :] if spec.lower().startswith(PREFIX) else spec
    repo, _, quant = text.partition(":")
    if not _REPO.match(repo) or (quant and not _QUANT.match(quant)) or text.endswith(":"):
        raise KvchatError(f"'{text}' is not a hub model; write owner/repo[:QUANT], e.g. {EXAMPLE}")
    return HubRef(repo, quant or None)


# ---- choosing the file ----------------------------------------------------------------------


def is_model_gguf(name: str) -> bool:
    base = name.rsplit("/", 1)[-1]
    return base.lower().endswith(".gguf") and not any(k in base for k in NOT_MODELS)


def quant_of(name: str) -> str:
    """The quantization tag in a GGUF name, as llama.cpp reads it: `M-Q4_K_M-00001-of-00002.gguf` -> Q4_K_M."""
    base = name.rsplit("/", 1)[-1]
    parsed = parse_split_name(base)
    stem = parsed[0] if parsed else base[:-5]
    m = _TAG.search(stem)
    return m[1].upper() if m else stem


def first_parts(names) -> list[str]:
    """Model GGUFs, one entry per model: a plain file, or the first part of a split model."""
    out = []
    for n in sorted(n for n in names if is_model_gguf(n)):
        parsed = parse_split_name(n.rsplit("/", 1)[-1])
        if parsed is None or parsed[1] == 0:
            out.append(n)
    return out


def _ends_at_tag(name: str, tag: str) -> bool:
    return re.search(re.escape(tag) + r"[.-]", name, re.IGNORECASE) is not None


def choose_files(names, ref: HubRef) -> list[str]:
    """The repo files (all parts, in order) of the model `ref` picks from the repo listing `names`."""
    names = list(names)
    models = first_parts(names)
    if not models:
        raise KvchatError(
            f"{ref.repo} has no GGUF model file; kvchat runs GGUF models (look for a repo whose name ends in -GGUF)"
        )
    if ref.quant:
        hits = [n for n in models if ref.quant.lower() in n.rsplit("/", 1)[-1].lower()]
        if len(hits) > 1:
            exact = [n for n in hits if _ends_at_tag(n.rsplit("/", 1)[-1], ref.quant)]
            hits = exact if len(exact) == 1 else hits
        if not hits:
            raise KvchatError(f"no GGUF in {ref.repo} matches :{ref.quant}; available: {', '.join(_choices(models))}")
        if len(hits) > 1:
            raise KvchatError(
                f":{ref.quant} matches {len(hits)} files in {ref.repo}: {', '.join(hits)}; "
                f"give a longer :QUANT that names one"
            )
        primary = hits[0]
    else:
        primary = next((n for t in DEFAULT_QUANTS for n in models if _ends_at_tag(n, t)), models[0])
    return _parts_of(primary, names, ref)


def _choices(models: list[str]) -> list[str]:
    return sorted({quant_of(m) for m in models})


def _parts_of(primary: str, names: list[str], ref: HubRef) -> list[str]:
    folder, _, base = primary.rpartition("/")
    parsed = parse_split_name(base)
    if parsed is None or parsed[2] == 1:
        return [primary]
    prefix, _, count = parsed
    want = [(folder + "/" if folder else "") + f"{prefix}-{i + 1:05d}-of-{count:05d}.gguf" for i in range(count)]
    have = {n.lower(): n for n in names}
    missing = [w for w in want if w.lower() not in have]
    if missing:
        raise KvchatError(
            f"{ref.repo}: the split model {base} lists {count} parts but {', '.join(missing)} is not in the repo"
        )
    return [have[w.lower()] for w in want]


# ---- where things are -----------------------------------------------------------------------


def hub_cache() -> Path:
    """huggingface_hub's cache (HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub)."""
    env = os.environ
    if env.get("HF_HUB_CACHE"):
        return Path(env["HF_HUB_CACHE"]).expanduser()
    if env.get("HF_HOME"):
        return Path(env["HF_HOME"]).expanduser() / "hub"
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def endpoint() -> str:
    from huggingface_hub import constants

    return (os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")


def repo_folder(repo: str) -> Path:
    return hub_cache() / ("models--" + repo.replace("/", "--"))


def records_dir() -> Path:
    return cache_dir() / "hub"


def record_path(repo: str) -> Path:
    return records_dir() / (repo.replace("/", "--") + ".json")


def read_record(repo: str) -> dict | None:
    try:
        rec = json.loads(record_path(repo).read_text())
        return rec if isinstance(rec, dict) and isinstance(rec.get("files"), list) else None
    except (OSError, ValueError):
        return None


def write_record(rec: dict) -> None:
    """Atomically: a reader never sees half a record."""
    path = record_path(rec["repo"])
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".rec-", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        json.dump(rec, f, indent=1)
    os.replace(tmp, path)


def snapshot(repo: str, commit: str) -> Path:
    return repo_folder(repo) / "snapshots" / commit


def cached_commit(repo: str, revision: str = "main") -> str | None:
    try:
        return (repo_folder(repo) / "refs" / revision).read_text().strip() or None
    except OSError:
        return None


# ---- resolving -------------------------------------------------------------------------------


def resolve(ref: HubRef, console: Console | None = None, *, refresh: bool = False) -> list[Path]:
    """The local paths of `ref`'s files (first part first), downloading what is missing.

    Without `refresh`, a model already in the cache is found without any request."""
    if not refresh:
        local = find_cached(ref)
        if local:
            return local
    if offline():
        raise KvchatError(
            f"{ref} is not in the cache and HF_HUB_OFFLINE is set; unset it to download "
            f"(`kvchat list` shows the models you can run offline)"
        )
    try:
        return download(ref, console or _stderr_console())
    except KvchatError as e:
        if refresh and getattr(e, "network", False):
            local = find_cached(ref)
            if local:
                (console or _stderr_console()).print(f"[yellow]{e}[/]")
                return local
        raise


def describe(ref: HubRef, paths: list[Path]) -> str:
    """The `kvchat info` note of a hub model: which repo, revision and files."""
    commit = next((p.name for p in paths[0].parents if p.parent.name == "snapshots"), "?")
    files = f"{len(paths)} split parts" if len(paths) > 1 else paths[0].name
    return f"Hugging Face hub model {ref.repo} at commit {commit[:12]} ({files}), cached in {hub_cache()}"


def find_cached(ref: HubRef) -> list[Path] | None:
    """`ref`'s files if all are in the cache: chosen from our record of the repo listing when
    there is one, else from the cached snapshot itself (e.g. a model llama.cpp downloaded)."""
    rec = read_record(ref.repo)
    candidates = []
    if rec and rec.get("revision") == ref.revision and rec.get("commit"):
        candidates.append((rec["commit"], rec["files"]))
    commit = cached_commit(ref.repo, ref.revision)
    if commit:
        snap = snapshot(ref.repo, commit)
        if snap.is_dir():
            candidates.append((commit, [p.relative_to(snap).as_posix() for p in snap.rglob("*.gguf")]))
    for commit, names in candidates:
        try:
            files = choose_files(names, ref)
        except KvchatError:
            continue
        paths = [snapshot(ref.repo, commit) / f for f in files]
        if all(p.is_file() for p in paths):
            return paths
    return None


def download(ref: HubRef, console: Console) -> list[Path]:
    from huggingface_hub import HfApi, hf_hub_download

    ep = endpoint()
    with _hub_errors(ref, ep):
        info = HfApi(endpoint=ep).model_info(ref.repo, revision=ref.revision, files_metadata=True)
    names = [s.rfilename for s in info.siblings or []]
    sizes = {s.rfilename: s.size for s in info.siblings or []}
    files = choose_files(names, ref)
    commit = info.sha
    ggufs = sorted(n for n in names if n.lower().endswith(".gguf"))
    rec = {
        "repo": ref.repo,
        "revision": ref.revision,
        "commit": commit,
        "endpoint": ep,
        "files": ggufs,
        "sizes": {n: sizes[n] for n in ggufs},
        "pulled": (read_record(ref.repo) or {}).get("pulled", []),
    }
    write_record(rec)  # the listing first: an interrupted download still resolves offline later
    todo = [f for f in files if not (snapshot(ref.repo, commit) / f).is_file()]
    paths = []
    with _Bars(console) as bars:
        for i, f in enumerate(files, 1):
            bars.label = f"{quant_of(f)}" + (f" part {i}/{len(files)}" if len(files) > 1 else "")
            with _hub_errors(ref, ep):
                paths.append(
                    Path(
                        hf_hub_download(
                            ref.repo, f, revision=commit, cache_dir=hub_cache(), endpoint=ep, tqdm_class=bars
                        )
                    )
                )
    # what we downloaded (not what another tool had already put in the shared cache): `kvchat rm` deletes only these
    rec["pulled"] = rec["pulled"] + [[commit, f] for f in todo if [commit, f] not in rec["pulled"]]
    write_record(rec)
    if todo:
        console.print(
            f"[green]✓[/] {ref} downloaded ({len(files)} file{'s' if len(files) > 1 else ''})", highlight=False
        )
    return paths


class _hub_errors:
    """huggingface_hub's exceptions -> one KvchatError line (what, where, what to do)."""

    def __init__(self, ref: HubRef, ep: str):
        self.ref, self.ep = ref, ep

    def __enter__(self):
        return self

    def __exit__(self, typ, exc, tb):
        if exc is None or isinstance(exc, (KvchatError, KeyboardInterrupt)):
            return False
        from huggingface_hub import errors as E

        ref, ep = self.ref, self.ep
        if isinstance(exc, E.GatedRepoError):
            msg = f"{ref.repo} is gated on {ep}: accept its terms there and set HF_TOKEN"
        elif isinstance(exc, E.RepositoryNotFoundError):
            msg = f"no model repo '{ref.repo}' on {ep}; check the name (a private repo needs HF_TOKEN)"
        elif isinstance(exc, E.RevisionNotFoundError):
            msg = f"{ref.repo} has no revision '{ref.revision}' on {ep}"
        elif isinstance(exc, getattr(E, "RemoteEntryNotFoundError", E.EntryNotFoundError)):
            msg = f"{ref.repo}: a listed file is missing on {ep}; retry later"
        elif isinstance(exc, E.OfflineModeIsEnabled):
            msg = f"{ref} is not in the cache and HF_HUB_OFFLINE is set; unset it to download"
        elif (
            isinstance(exc, E.HfHubHTTPError)
            and getattr(exc, "response", None) is not None
            and exc.response.status_code < 500
        ):
            msg = f"{ep} refused {ref.repo} (HTTP {exc.response.status_code}); check the name and HF_TOKEN"
        elif isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
            msg = f"no space left for {ref} in {hub_cache()}; free some (or set HF_HOME to a bigger disk) and retry"
        elif isinstance(exc, OSError) and "Consistency check failed" in str(exc):
            msg = f"{ref}: the download came out the wrong size (a flaky connection?); run the command again"
        elif _is_network_error(exc):
            reason = str(exc).strip().splitlines()[0][:120] if str(exc).strip() else type(exc).__name__
            err = KvchatError(
                f"cannot reach {ep} ({reason}); no network? models already in the cache "
                f"still work offline (`kvchat list` shows them)"
            )
            err.network = True
            raise err from None
        else:
            return False
        raise KvchatError(msg) from None


def _is_network_error(exc: BaseException) -> bool:
    from huggingface_hub import errors as E

    if isinstance(exc, E.HfHubHTTPError):  # 5xx: the hub (or a proxy) is down
        return True
    import socket  # the network's errors: imported with the hub client, not by every -m

    if isinstance(exc, (ConnectionError, TimeoutError, socket.gaierror)):
        return True
    return type(exc).__module__.split(".")[0] in ("httpx", "httpx2", "httpcore", "httpcore2", "h11")


class _Bars:
    """A tqdm stand-in for huggingface_hub's `tqdm_class`: one rich byte bar per file."""

    def __init__(self, console: Console):
        self.label = ""
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        self.progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
            console=console,
        )

    def __enter__(self):
        self.progress.start()
        return self

    def __exit__(self, *exc):
        self.progress.stop()

    def __call__(self, *, total=None, initial=0, desc="", **_):
        return _Bar(self.progress, self.label or desc, total, initial)


class _Bar:
    def __init__(self, progress: Progress, desc: str, total, initial):
        self.progress = progress
        self.task = progress.add_task(f"downloading {desc}", total=total, completed=initial or 0)

    def update(self, n=1):
        self.progress.advance(self.task, n)

    def close(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
