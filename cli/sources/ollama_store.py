"""Models in Ollama's store, used in place: `-m ollama:NAME[:TAG]`.

Ollama keeps a model as an OCI-style manifest plus content-addressed blobs:

    $OLLAMA_MODELS (default ~/.ollama/models)
      manifests/registry.ollama.ai/library/NAME/TAG    JSON: {"layers": [{"mediaType", "digest", "size"}, ...]}
      blobs/sha256-<hex>                               one file per layer; the model layer is a GGUF

The layer of mediaType application/vnd.ollama.image.model is the GGUF; we open that blob
directly (mmap, no copy). The other layers (template, params, system, license) are Ollama's
own Go-template and sampling defaults; kvchat ignores them in favour of the GGUF's
tokenizer.chat_template and its own defaults, and says so in `kvchat info`.
`NAME` may carry a namespace (`user/model`) or a registry host (`host/user/model`).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from kvchat.runtime.errors import KvchatError

PREFIX = "ollama:"
DEFAULT_HOST, DEFAULT_NAMESPACE, DEFAULT_TAG = "registry.ollama.ai", "library", "latest"
MODEL_MEDIA_TYPE = "application/vnd.ollama.image.model"
_PART = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_DIGEST = re.compile(r"^sha256[:-]([0-9a-f]{64})$")


@dataclass(frozen=True)
class OllamaModel:
    name: str  # as `ollama list` shows it: NAME:TAG (library), user/NAME:TAG, host/user/NAME:TAG
    blob: Path  # the GGUF, inside Ollama's store
    manifest: Path
    ignored: tuple  # media types of the layers we do not use (template, params, ...)

    @property
    def note(self) -> str:
        kinds = ", ".join(sorted({t.rsplit(".", 1)[-1] for t in self.ignored})) or "none"
        return (
            f"Ollama model {self.name}: its GGUF blob is used in place; the manifest's other layers "
            f"({kinds}) are ignored: the chat template is the GGUF's own and sampling uses kvchat's "
            f"defaults"
        )


def store_dir() -> Path:
    return Path(os.environ.get("OLLAMA_MODELS") or Path.home() / ".ollama" / "models").expanduser()


def parse_name(spec: str) -> tuple[str, str, str, str]:
    """`[host/][namespace/]model[:tag]` -> (host, namespace, model, tag)."""
    text = spec[len(PREFIX) :] if spec.lower().startswith(PREFIX) else spec
    path, _, tag = text.rpartition(":") if ":" in text.rsplit("/", 1)[-1] else (text, "", DEFAULT_TAG)
    parts = path.split("/")
    if not 1 <= len(parts) <= 3 or not all(_PART.match(p) for p in parts) or not _PART.match(tag or ""):
        raise KvchatError(f"'{spec}' is not an Ollama model name; write ollama:NAME[:TAG], e.g. ollama:llama3.2:1b")
    host, ns = DEFAULT_HOST, DEFAULT_NAMESPACE
    if len(parts) == 3:
        host, ns, model = parts
    elif len(parts) == 2:
        ns, model = parts
    else:
        model = parts[0]
    return host, ns, model, tag


def display_name(host: str, ns: str, model: str, tag: str) -> str:
    if host == DEFAULT_HOST:
        return (model if ns == DEFAULT_NAMESPACE else f"{ns}/{model}") + f":{tag}"
    return f"{host}/{ns}/{model}:{tag}"


def resolve(spec: str) -> OllamaModel:
    """The GGUF blob of Ollama model `spec`; one-line KvchatError if it is not in the store."""
    host, ns, model, tag = parse_name(spec)
    root = store_dir()
    name = display_name(host, ns, model, tag)
    manifest = root / "manifests" / host / ns / model / tag
    if not manifest.is_file():
        known = [m.name for m in list_models()]
        hint = f"; Ollama models here: {', '.join(known)}" if known else ""
        raise KvchatError(
            f"no Ollama model {name} in {root} (`ollama pull {name}` fetches it; set "
            f"OLLAMA_MODELS if the store is elsewhere){hint}"
        )
    return _read(manifest, name, root)


def _read(manifest: Path, name: str, root: Path) -> OllamaModel:
    try:
        layers = json.loads(manifest.read_text())["layers"]
        media = [(layer["mediaType"], layer["digest"]) for layer in layers]
    except (OSError, ValueError, KeyError, TypeError):
        raise KvchatError(f"{manifest}: not a readable Ollama manifest; `ollama pull {name}` rewrites it") from None
    models = [d for t, d in media if t == MODEL_MEDIA_TYPE]
    if not models:
        raise KvchatError(f"{manifest}: Ollama model {name} has no {MODEL_MEDIA_TYPE} layer, so no GGUF to run")
    m = _DIGEST.match(str(models[0]))
    if m is None:
        raise KvchatError(f"{manifest}: model layer digest {models[0]!r} is not sha256:<64 hex digits>")
    blob = next(
        (p for p in (root / "blobs" / f"sha256-{m[1]}", root / "blobs" / f"sha256:{m[1]}") if p.is_file()), None
    )
    if blob is None:
        raise KvchatError(
            f"{root / 'blobs' / ('sha256-' + m[1])}: the GGUF blob of Ollama model {name} is "
            f"missing; `ollama pull {name}` restores it"
        )
    return OllamaModel(name, blob, manifest, tuple(t for t, d in media if t != MODEL_MEDIA_TYPE))


def list_models() -> list[OllamaModel]:
    """Every model in the store whose manifest and GGUF blob are readable (others are skipped)."""
    base = store_dir() / "manifests"
    out = []
    if not base.is_dir():
        return out
    for manifest in sorted(p for p in base.glob("*/*/*/*") if p.is_file()):
        host, ns, model, tag = manifest.relative_to(base).parts
        try:
            out.append(_read(manifest, display_name(host, ns, model, tag), store_dir()))
        except KvchatError:
            continue
    return sorted(out, key=lambda m: m.name)
