"""`-m ollama:NAME[:TAG]`: the GGUF blob of a model in Ollama's store, opened in place (no copy),
in a fake store the tests write; `kvchat list` shows every source, `kvchat rm` deletes only ours."""

import hashlib
import json
import os

import pytest
from rich.console import Console

from kvchat.cli.sources import catalog, hub, ollama_store
from kvchat.cli.sources.models import locate_model
from kvchat.kernels.ggml_types import GGMLType
from kvchat.runtime.errors import KvchatError
from kvchat.runtime.model import Model
from tests.helpers.gguf_factory import write_tiny_model
from tests.helpers.sources_fake_hub import FakeHub


def write_ollama_model(root, name, gguf_path, tag="latest", namespace="library"):
    """A model in an Ollama store as `ollama pull` leaves it: blobs by sha256, one manifest."""

    def blob(data: bytes) -> str:
        digest = hashlib.sha256(data).hexdigest()
        (root / "blobs").mkdir(parents=True, exist_ok=True)
        (root / "blobs" / f"sha256-{digest}").write_bytes(data)
        return f"sha256:{digest}"

    layers = [
        {
            "mediaType": "application/vnd.ollama.image.model",
            "digest": blob(gguf_path.read_bytes()),
            "size": gguf_path.stat().st_size,
        },
        {"mediaType": "application/vnd.ollama.image.template", "digest": blob(b"{{ .Prompt }}"), "size": 13},
        {"mediaType": "application/vnd.ollama.image.params", "digest": blob(b'{"temperature": 0.1}'), "size": 20},
    ]
    manifest = root / "manifests" / "registry.ollama.ai" / namespace / name / tag
    manifest.parent.mkdir(parents=True, exist_ok=True)
    manifest.write_text(
        json.dumps(
            {
                "schemaVersion": 2,
                "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
                "config": {
                    "mediaType": "application/vnd.docker.container.image.v1+json",
                    "digest": blob(b"{}"),
                    "size": 2,
                },
                "layers": layers,
            }
        )
    )
    return root / "blobs" / ("sha256-" + layers[0]["digest"][7:])


@pytest.fixture
def store(tmp_path, monkeypatch):
    root = tmp_path / "ollama"
    monkeypatch.setenv("OLLAMA_MODELS", str(root))
    monkeypatch.setenv("KVCHAT_CACHE", str(tmp_path / "kv"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    model = write_tiny_model(tmp_path / "tiny.gguf", weight_type=GGMLType.Q8_0)
    blob = write_ollama_model(root, "tiny", model)
    write_ollama_model(root, "tiny", write_tiny_model(tmp_path / "f32.gguf"), tag="f32", namespace="someone")
    return root, blob


def test_ollama_name_maps_to_the_model_blob_in_place(store):
    root, blob = store
    before = os.stat(blob)
    src = locate_model("ollama:tiny")
    assert src.path == blob and src.kind == "ollama" and src.label == "ollama:tiny:latest"
    m = Model.load(src.path)
    assert m.hparams.n_layer == 2 and m.path == blob  # mmapped from Ollama's blob, nothing copied
    after = os.stat(blob)
    assert (after.st_ino, after.st_nlink, after.st_mtime_ns) == (before.st_ino, before.st_nlink, before.st_mtime_ns)
    assert not (root.parent / "kv").exists()
    assert locate_model("ollama:someone/tiny:f32").path.name.startswith("sha256-")


def test_info_note_says_the_template_and_params_layers_are_ignored(store):
    note = locate_model("ollama:tiny:latest").notes[0]
    assert note == (
        "Ollama model tiny:latest: its GGUF blob is used in place; the manifest's other layers "
        "(params, template) are ignored: the chat template is the GGUF's own and sampling uses "
        "kvchat's defaults"
    )


@pytest.mark.parametrize(
    "spec, message",
    [
        (
            "ollama:nope",
            r"^no Ollama model nope:latest in .*ollama \(`ollama pull nope:latest` fetches it; set "
            r"OLLAMA_MODELS if the store is elsewhere\); Ollama models here: someone/tiny:f32, tiny:latest$",
        ),
        ("ollama:tiny:7b", r"^no Ollama model tiny:7b in"),
        ("ollama:bad name", r"is not an Ollama model name; write ollama:NAME\[:TAG\]"),
    ],
)
def test_unknown_or_malformed_ollama_names_are_one_line(store, spec, message):
    with pytest.raises(KvchatError, match=message):
        locate_model(spec)


def test_broken_store_entries_are_one_line(store):
    root, blob = store
    blob.unlink()
    with pytest.raises(KvchatError, match=r"the GGUF blob of Ollama model tiny:latest is missing; `ollama pull"):
        locate_model("ollama:tiny")
    (root / "manifests/registry.ollama.ai/library/tiny/latest").write_text("{not json")
    with pytest.raises(KvchatError, match="not a readable Ollama manifest"):
        locate_model("ollama:tiny")
    assert [m.name for m in ollama_store.list_models()] == ["someone/tiny:f32"]  # listing skips broken ones


def test_list_shows_all_three_sources_and_rm_removes_only_ours(store, tmp_path, monkeypatch):
    root, blob = store
    fake = FakeHub().start()
    try:
        monkeypatch.setenv("HF_ENDPOINT", fake.url)
        fake.add_repo(
            "acme/tiny-GGUF", {"tiny-Q8_0.gguf": tmp_path / "tiny.gguf", "tiny-F32.gguf": tmp_path / "f32.gguf"}
        )
        hub.resolve(hub.HubRef("acme/tiny-GGUF", "Q8_0"), Console(quiet=True))
    finally:
        fake.stop()
    # a file another tool (llama.cpp) put in the shared hub cache: listed, never removed by us
    other = hub.snapshot("acme/tiny-GGUF", hub.read_record("acme/tiny-GGUF")["commit"]) / "tiny-F32.gguf"
    other.write_bytes((tmp_path / "f32.gguf").read_bytes())
    registry = tmp_path / "kv" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    registry.parent.mkdir(parents=True)
    registry.write_bytes((tmp_path / "tiny.gguf").read_bytes())  # stands in for the registry download

    rows = {e.name: e for e in catalog.installed()}
    assert set(rows) == {
        "smollm2",
        "hf:acme/tiny-GGUF:Q8_0",
        "hf:acme/tiny-GGUF:F32",
        "ollama:tiny:latest",
        "ollama:someone/tiny:f32",
    }
    q8 = rows["hf:acme/tiny-GGUF:Q8_0"]
    assert (q8.source, q8.ours, q8.arch, q8.weights, q8.n_ctx_train) == ("hub", True, "llama", "?", 512)
    assert q8.size == (tmp_path / "tiny.gguf").stat().st_size
    assert [rows[n].ours for n in ("smollm2", "hf:acme/tiny-GGUF:F32", "ollama:tiny:latest")] == [True, False, False]

    with pytest.raises(KvchatError, match="is Ollama's; kvchat never deletes Ollama's files"):
        catalog.remove("ollama:tiny")
    with pytest.raises(KvchatError, match="by another tool .* so kvchat leaves it"):
        catalog.remove("hf:acme/tiny-GGUF:F32")
    assert catalog.remove("hf:acme/tiny-GGUF:Q8_0") == ("hf:acme/tiny-GGUF:Q8_0", q8.size)
    assert catalog.remove("smollm2")[0] == "smollm2" and not registry.exists()
    assert {e.name for e in catalog.installed()} == {
        "hf:acme/tiny-GGUF:F32",
        "ollama:tiny:latest",
        "ollama:someone/tiny:f32",
    }
    assert blob.is_file() and other.is_file()
    assert not list((hub.repo_folder("acme/tiny-GGUF") / "blobs").iterdir())  # the Q8_0 blob went with it
    with pytest.raises(KvchatError, match="no model 'nothing' to remove; `kvchat list` shows"):
        catalog.remove("nothing")


def test_rm_of_the_last_hub_file_removes_the_repo_folder_and_record(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCHAT_CACHE", str(tmp_path / "kv"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    fake = FakeHub().start()
    try:
        monkeypatch.setenv("HF_ENDPOINT", fake.url)
        fake.add_repo("acme/one-GGUF", {"one-Q8_0.gguf": write_tiny_model(tmp_path / "one.gguf")})
        hub.resolve(hub.HubRef("acme/one-GGUF"), Console(quiet=True))
    finally:
        fake.stop()
    catalog.remove("acme/one-GGUF:Q8_0")
    assert not hub.repo_folder("acme/one-GGUF").exists() and not hub.record_path("acme/one-GGUF").exists()
