"""`-hf owner/repo[:QUANT]`: the file llama.cpp would pick, fetched once through huggingface_hub
from a local fake hub (tests/helpers/sources_fake_hub.py), then found in the cache without a request;
every failure is one line."""

import numpy as np
import pytest
from rich.console import Console

from kvchat.cli.sources import hub
from kvchat.cli.sources.models import locate_model
from kvchat.kernels.ggml_types import GGMLType
from kvchat.runtime.errors import KvchatError
from kvchat.runtime.model import Model
from tests.helpers.gguf_factory import split_gguf_file, write_tiny_model
from tests.helpers.sources_fake_hub import FakeHub, dead_endpoint

REPO = "acme/tiny-GGUF"


@pytest.fixture
def env(tmp_path, monkeypatch):
    for var in ("HF_TOKEN", "HF_HUB_OFFLINE", "HF_HUB_CACHE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("KVCHAT_CACHE", str(tmp_path / "kv"))
    fake = FakeHub().start()
    monkeypatch.setenv("HF_ENDPOINT", fake.url)
    yield fake
    fake.stop()


@pytest.fixture
def files(tmp_path):
    q8 = write_tiny_model(tmp_path / "tiny-Q8_0.gguf", weight_type=GGMLType.Q8_0)
    f32 = write_tiny_model(tmp_path / "tiny-F32.gguf")
    return {"tiny-Q8_0.gguf": q8, "tiny-F32.gguf": f32, "README.md": b"# tiny\n"}


def _model_requests(fake):
    return [r for r in fake.requests if r[1].startswith(("/api/models/", f"/{REPO}/"))]


def _quiet():
    return Console(stderr=True, quiet=True)


# ---- which file ------------------------------------------------------------------------------

LISTING = [
    "README.md",
    "M-Q4_K_M.gguf",
    "M-Q4_K_S.gguf",
    "M-Q8_0.gguf",
    "M-f16.gguf",
    "mmproj-M-f16.gguf",
    "M-imatrix.gguf",
]


@pytest.mark.parametrize(
    "quant, want",
    [
        (None, "M-Q4_K_M.gguf"),
        ("q8_0", "M-Q8_0.gguf"),
        ("Q4_K_S", "M-Q4_K_S.gguf"),
        ("F16", "M-f16.gguf"),
    ],
)
def test_quant_picks_the_file_llama_cpp_picks(quant, want):
    assert hub.choose_files(LISTING, hub.HubRef("o/r", quant)) == [want]


def test_default_falls_back_to_q8_0_then_the_first_gguf():
    assert hub.choose_files(["b-Q8_0.gguf", "a-Q5_K_M.gguf"], hub.HubRef("o/r")) == ["b-Q8_0.gguf"]
    assert hub.choose_files(["b-Q6_K.gguf", "a-Q5_K_M.gguf", "mmproj-x.gguf"], hub.HubRef("o/r")) == ["a-Q5_K_M.gguf"]


def test_a_tag_ending_at_a_separator_wins_over_a_longer_one():
    names = ["M-Q8_0.gguf", "M-Q8_0_L.gguf"]
    assert hub.choose_files(names, hub.HubRef("o/r", "Q8_0")) == ["M-Q8_0.gguf"]
    assert hub.choose_files(names, hub.HubRef("o/r", "Q8_0_L")) == ["M-Q8_0_L.gguf"]


def test_ambiguous_quant_lists_the_choices():
    with pytest.raises(KvchatError) as e:
        hub.choose_files(LISTING, hub.HubRef("o/r", "Q4_K"))
    assert str(e.value) == (
        ":Q4_K matches 2 files in o/r: M-Q4_K_M.gguf, M-Q4_K_S.gguf; give a longer :QUANT that names one"
    )


def test_unknown_quant_lists_what_is_there():
    with pytest.raises(KvchatError, match=r"no GGUF in o/r matches :Q2_K; available: F16, Q4_K_M, Q4_K_S, Q8_0$"):
        hub.choose_files(LISTING, hub.HubRef("o/r", "Q2_K"))


def test_repo_without_gguf_says_so():
    with pytest.raises(KvchatError, match="o/r has no GGUF model file"):
        hub.choose_files(["README.md", "model.safetensors", "mmproj-f16.gguf"], hub.HubRef("o/r"))


def test_split_model_is_chosen_whole_in_order():
    names = [
        "Q4_K_M/M-Q4_K_M-00002-of-00003.gguf",
        "Q4_K_M/M-Q4_K_M-00001-of-00003.gguf",
        "Q4_K_M/M-Q4_K_M-00003-of-00003.gguf",
        "M-Q8_0.gguf",
    ]
    assert hub.choose_files(names, hub.HubRef("o/r")) == sorted(names[:3])
    with pytest.raises(KvchatError, match="lists 3 parts but Q4_K_M/M-Q4_K_M-00003-of-00003.gguf is not in the repo"):
        hub.choose_files(names[:2], hub.HubRef("o/r", "Q4_K_M"))


@pytest.mark.parametrize("spec", ["acme", "acme/", "a/b/c", "acme/x:", "acme/x:Q4 K", "/x"])
def test_malformed_repo_is_one_line(spec):
    with pytest.raises(KvchatError, match=r"is not a hub model; write owner/repo\[:QUANT\]"):
        hub.parse_ref(spec)


def test_quant_tag_is_read_as_llama_cpp_reads_it():
    assert hub.quant_of("x/Llama-3.2-1B-Instruct-Q4_K_M.gguf") == "Q4_K_M"
    assert hub.quant_of("M.q8_0-00001-of-00002.gguf") == "Q8_0"


# ---- download and cache ----------------------------------------------------------------------


def test_download_once_then_no_request(env, files):
    env.add_repo(REPO, files)
    src = locate_model(None, _quiet(), hf=f"{REPO}:Q8_0")
    assert src.kind == "hub" and src.label == f"hf:{REPO}:Q8_0"
    assert src.path.read_bytes() == files["tiny-Q8_0.gguf"].read_bytes()
    assert src.path.is_relative_to(hub.hub_cache() / "models--acme--tiny-GGUF" / "snapshots")
    methods = [(m, p.rsplit("/", 1)[-1]) for m, p, _ in _model_requests(env)]
    assert methods == [("GET", "main"), ("HEAD", "tiny-Q8_0.gguf"), ("GET", "tiny-Q8_0.gguf")]
    env.requests.clear()
    assert locate_model(f"hf:{REPO}:q8_0", _quiet()).path == src.path
    assert env.requests == []


def test_interrupted_download_resumes_with_a_range_request(env, files, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 4096)
    env.add_repo(REPO, files)
    env.cut["tiny-Q8_0.gguf"] = 50_000
    path = hub.resolve(hub.HubRef(REPO, "Q8_0"), _quiet())[0]
    assert path.read_bytes() == files["tiny-Q8_0.gguf"].read_bytes()
    gets = env.gets("tiny-Q8_0.gguf")
    assert [r[2] is None for r in gets] == [True, False]
    resumed_at = int(gets[1][2].removeprefix("bytes=").rstrip("-"))
    assert 0 < resumed_at <= 50_000 and resumed_at % 4096 == 0
    assert not list(path.parent.parent.parent.glob("blobs/*.incomplete"))


def test_offline_uses_the_cache_and_says_what_is_missing(env, files, monkeypatch):
    env.add_repo(REPO, files)
    hub.resolve(hub.HubRef(REPO, "Q8_0"), _quiet())
    monkeypatch.setenv("HF_ENDPOINT", dead_endpoint())
    # the default quant is chosen from the recorded listing (Q8_0 is the only default present)
    assert hub.resolve(hub.HubRef(REPO), _quiet())[0].name == "tiny-Q8_0.gguf"
    with pytest.raises(KvchatError) as e:
        hub.resolve(hub.HubRef(REPO, "F32"), _quiet())
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("cannot reach http://127.0.0.1:")
    assert "no network? models already in the cache still work offline" in msg
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert hub.resolve(hub.HubRef(REPO, "Q8_0"), _quiet())[0].name == "tiny-Q8_0.gguf"
    with pytest.raises(KvchatError, match=r"acme/tiny-GGUF:F32 is not in the cache and HF_HUB_OFFLINE is set"):
        hub.resolve(hub.HubRef(REPO, "F32"), _quiet())


def test_pull_refreshes_and_fetches_a_new_revision(env, files):
    env.add_repo(REPO, files)
    first = hub.resolve(hub.HubRef(REPO, "Q8_0"), _quiet())[0]
    env.add_repo(REPO, {**files, "tiny-Q8_0.gguf": files["tiny-F32.gguf"]}, commit="b" * 40)
    assert hub.resolve(hub.HubRef(REPO, "Q8_0"), _quiet())[0] == first  # cache first
    newer = hub.resolve(hub.HubRef(REPO, "Q8_0"), _quiet(), refresh=True)[0]
    assert newer.parent.name == "b" * 40 and newer.read_bytes() == files["tiny-F32.gguf"].read_bytes()
    assert hub.read_record(REPO)["pulled"] == [[first.parent.name, "tiny-Q8_0.gguf"], ["b" * 40, "tiny-Q8_0.gguf"]]


def test_pull_without_network_falls_back_to_the_cache(env, files, monkeypatch):
    env.add_repo(REPO, files)
    path = hub.resolve(hub.HubRef(REPO, "Q8_0"), _quiet())[0]
    monkeypatch.setenv("HF_ENDPOINT", dead_endpoint())
    assert hub.resolve(hub.HubRef(REPO, "Q8_0"), _quiet(), refresh=True)[0] == path


def test_missing_repo_is_one_line(env):
    with pytest.raises(KvchatError) as e:
        hub.resolve(hub.HubRef("acme/nope"), _quiet())
    assert str(e.value) == f"no model repo 'acme/nope' on {env.url}; check the name (a private repo needs HF_TOKEN)"


def test_repo_without_gguf_downloads_nothing(env):
    env.add_repo(REPO, {"model.safetensors": b"\0" * 64})
    with pytest.raises(KvchatError, match="acme/tiny-GGUF has no GGUF model file"):
        hub.resolve(hub.HubRef(REPO), _quiet())
    assert [r[0] for r in _model_requests(env)] == ["GET"]


def test_split_model_from_the_hub_loads_as_one(env, tmp_path):
    src = write_tiny_model(tmp_path / "whole.gguf", weight_type=GGMLType.Q8_0)
    parts = split_gguf_file(src, tmp_path / "tiny-Q8_0", 3)
    env.add_repo(REPO, {f"Q8_0/{p.name}": p for p in parts})
    paths = hub.resolve(hub.HubRef(REPO, "Q8_0"), _quiet())
    assert [p.name for p in paths] == [p.name for p in parts]
    a, b = Model.load(src), Model.load(paths[0])
    assert set(a.gguf.tensors) == set(b.gguf.tensors)
    for name, t in a.gguf.tensors.items():
        assert np.array_equal(b.gguf.tensors[name].data, t.data), name


def test_a_model_another_tool_cached_runs_without_a_request(env, files):
    """llama.cpp and `hf download` use the same cache layout (refs/main -> snapshots/<commit>/file);
    with no record of ours, the cached snapshot itself is the listing."""
    commit = "c" * 40
    snap = hub.hub_cache() / "models--acme--tiny-GGUF" / "snapshots" / commit
    snap.mkdir(parents=True)
    (snap / "tiny-F32.gguf").write_bytes(files["tiny-F32.gguf"].read_bytes())
    (snap.parent.parent / "refs").mkdir()
    (snap.parent.parent / "refs" / "main").write_text(commit)
    assert locate_model(None, _quiet(), hf=REPO).path == snap / "tiny-F32.gguf"  # no Q4_K_M/Q8_0: the first
    assert env.requests == []


def test_a_full_disk_is_not_called_a_network_problem(env, files, monkeypatch):
    import errno

    import huggingface_hub

    env.add_repo(REPO, files)

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", full)
    with pytest.raises(KvchatError, match=r"^no space left for acme/tiny-GGUF:Q8_0 in .*; free some"):
        hub.resolve(hub.HubRef(REPO, "Q8_0"), _quiet())


def test_a_gated_repo_asks_for_hf_token_and_hf_token_opens_it(env, files, monkeypatch):
    env.add_repo("acme/gated-GGUF", {"g-Q8_0.gguf": files["tiny-Q8_0.gguf"]}, token="hf_secret")
    monkeypatch.setenv("HF_TOKEN", "hf_wrong")
    with pytest.raises(KvchatError) as e:
        hub.resolve(hub.HubRef("acme/gated-GGUF"), _quiet())
    assert str(e.value) == f"acme/gated-GGUF is gated on {env.url}: accept its terms there and set HF_TOKEN"
    monkeypatch.setenv("HF_TOKEN", "hf_secret")  # huggingface_hub sends it as a bearer token
    path = hub.resolve(hub.HubRef("acme/gated-GGUF"), _quiet())[0]
    assert path.read_bytes() == files["tiny-Q8_0.gguf"].read_bytes()
