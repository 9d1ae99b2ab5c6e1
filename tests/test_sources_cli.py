"""The user's view, as subprocesses: `kvchat run -hf` against the local fake hub downloads once with
a byte progress bar and then runs without any request; split and Ollama models answer exactly as
the single file they hold; `list`, `rm`, `pull`; every error is one line."""

import os
import subprocess
import sys

import pytest

from kvchat.kernels.ggml_types import GGMLType
from tests.conftest import ROOT
from tests.helpers.gguf_factory import split_gguf_file, write_tiny_model
from tests.helpers.sources_fake_hub import FakeHub, dead_endpoint
from tests.test_sources_ollama import write_ollama_model

TIMEOUT = 600
RUN = ("-p", "hello world", "-n", "6", "--temp", "0", "--ignore-eos", "-c", "256")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    d = tmp_path_factory.mktemp("sources_cli")
    q8 = write_tiny_model(d / "tiny-Q8_0.gguf", weight_type=GGMLType.Q8_0)
    f32 = write_tiny_model(d / "tiny-F32.gguf")
    parts = split_gguf_file(q8, d / "tiny-Q8_0", 3)
    fake = FakeHub().start()
    fake.add_repo("acme/tiny-GGUF", {"tiny-Q8_0.gguf": q8, "tiny-F32.gguf": f32, "README.md": b"# tiny\n"})
    fake.add_repo("acme/split-GGUF", {p.name: p for p in parts})
    write_ollama_model(d / "ollama", "tiny", q8)
    env = {
        "HF_ENDPOINT": fake.url,
        "HF_HOME": str(d / "hf"),
        "KVCHAT_CACHE": str(d / "kv"),
        "OLLAMA_MODELS": str(d / "ollama"),
    }
    yield d, fake, env, q8
    fake.stop()


@pytest.fixture(scope="module")
def local_answer(world):
    """What the Q8_0 file answers when run from its own path."""
    d, fake, env, q8 = world
    r = kvchat("run", "-m", q8, *RUN, env=env)
    assert r.returncode == 0 and r.stdout.strip(), r.stderr
    return r.stdout


def kvchat(*args, env):
    e = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "OLLAMA_"))}
    e.update(PYTHONPATH=str(ROOT), COLUMNS="100", **env)
    return subprocess.run(
        [sys.executable, "-c", "from kvchat.cli.app import main; main()", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        cwd=ROOT,
        env=e,
    )


def _model_requests(fake):
    return [r for r in fake.requests if not r[1].startswith("/api/agent-harnesses")]


def test_run_hf_downloads_once_then_runs_without_any_request(world, local_answer):
    d, fake, env, q8 = world
    first = kvchat("run", "-hf", "acme/tiny-GGUF:Q8_0", *RUN, env=env)
    assert first.returncode == 0, first.stderr
    assert first.stdout == local_answer
    assert "downloading Q8_0" in first.stderr and "105.8/105.8 kB" in first.stderr
    assert "✓ acme/tiny-GGUF:Q8_0 downloaded" in first.stderr
    assert [(m, p.rsplit("/", 1)[-1]) for m, p, _ in _model_requests(fake)] == [
        ("GET", "main"),
        ("HEAD", "tiny-Q8_0.gguf"),
        ("GET", "tiny-Q8_0.gguf"),
    ]
    fake.requests.clear()
    second = kvchat("run", "-hf", "acme/tiny-GGUF:Q8_0", *RUN, env=env)
    assert second.returncode == 0, second.stderr
    assert second.stdout == first.stdout and "downloading" not in second.stderr
    assert fake.requests == []
    offline = kvchat("run", "-m", "hf:acme/tiny-GGUF:q8_0", *RUN, env={**env, "HF_ENDPOINT": dead_endpoint()})
    assert offline.returncode == 0 and offline.stdout == first.stdout, offline.stderr


def test_split_model_from_the_hub_answers_as_the_single_file(world, local_answer):
    d, fake, env, q8 = world
    split = kvchat("run", "-hf", "acme/split-GGUF", *RUN, env=env)
    assert split.returncode == 0, split.stderr
    assert "part 3/3" in split.stderr and split.stdout == local_answer
    info = kvchat("info", "-hf", "acme/split-GGUF:Q8_0", env=env)
    assert info.returncode == 0, info.stderr
    assert "in 3 split parts" in info.stdout
    assert "note: Hugging Face hub model acme/split-GGUF at commit " in info.stdout


def test_ollama_model_runs_in_place_and_info_says_what_is_ignored(world, local_answer):
    d, fake, env, q8 = world
    r = kvchat("run", "-m", "ollama:tiny", *RUN, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout == local_answer
    info = kvchat("info", "-m", "ollama:tiny", env=env)
    assert info.returncode == 0, info.stderr
    cells = "".join(c for c in info.stdout if not c.isspace() and c != "│")  # the table's folded path, joined
    assert "/ollama/blobs/sha256-" in cells
    assert "note: Ollama model tiny:latest: its GGUF blob is used in place" in " ".join(info.stdout.split())


@pytest.mark.parametrize(
    "args, message",
    [
        (("-hf", "acme/nope"), "error: no model repo 'acme/nope' on http://127.0.0.1:"),
        (("-hf", "acme/tiny-GGUF:Q5_K"), "error: no GGUF in acme/tiny-GGUF matches :Q5_K; available: F32, Q8_0"),
        (
            ("-hf", "acme/tiny-GGUF:tiny"),
            "error: :tiny matches 2 files in acme/tiny-GGUF: tiny-F32.gguf, tiny-Q8_0.gguf",
        ),
        (("-hf", "acme"), "error: 'acme' is not a hub model; write owner/repo[:QUANT]"),
        (("-m", "smollm2", "-hf", "acme/tiny-GGUF"), "error: give -m smollm2 or -hf acme/tiny-GGUF, not both"),
        (("-m", "ollama:llama3.2:1b"), "error: no Ollama model llama3.2:1b in"),
        (("-hf", "acme/other-GGUF", "DEAD"), "error: cannot reach http://127.0.0.1:"),
    ],
)
def test_every_source_error_is_one_line(world, args, message, monkeypatch, capsys):
    """In-process (main() as the console script runs it): the error comes before any model loads."""
    from kvchat.cli.app import main

    d, fake, env, q8 = world
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    if args[-1] == "DEAD":
        args = args[:-1]
        monkeypatch.setenv("HF_ENDPOINT", dead_endpoint())
    with pytest.raises(SystemExit) as e:
        main(["run", *args, "-p", "hi"])
    out, err = capsys.readouterr()
    assert e.value.code == 1 and out == ""
    assert err.count("\n") == 1 and err.startswith(message), err
    if "cannot reach" in message:
        assert "models already in the cache still work offline" in err


def test_list_pull_and_rm(world):
    d, fake, env, q8 = world
    pulled = kvchat("pull", "hf:acme/tiny-GGUF:F32", env=env)
    assert pulled.returncode == 0, pulled.stderr
    assert pulled.stdout.strip().endswith("tiny-F32.gguf") and "downloading F32" in pulled.stderr
    again = kvchat("pull", "hf:acme/tiny-GGUF:F32", env=env)
    assert again.returncode == 0 and "is up to date in the cache" in again.stderr
    listed = kvchat("list", env=env)
    assert listed.returncode == 0, listed.stderr
    lines = listed.stdout.splitlines()
    assert lines[0].split() == ["NAME", "SOURCE", "ARCH", "SIZE", "WEIGHTS", "CONTEXT"]
    names = {line.split()[0]: line.split()[1] for line in lines[1:]}
    assert names["hf:acme/tiny-GGUF:F32"] == "hub" and names["ollama:tiny:latest"] == "ollama"
    assert all(line.split()[2] == "llama" and line.split()[-1] == "512" for line in lines[1:])
    gone = kvchat("rm", "hf:acme/tiny-GGUF:F32", env=env)
    assert gone.returncode == 0 and gone.stdout.startswith("removed hf:acme/tiny-GGUF:F32 (376.3 KB freed)")
    kept = kvchat("rm", "ollama:tiny", env=env)
    assert kept.returncode == 1 and kept.stderr.startswith("error: ollama:tiny is Ollama's")
    after = kvchat("list", env=env).stdout
    assert "hf:acme/tiny-GGUF:F32" not in after and "ollama:tiny:latest" in after
    assert (d / "ollama" / "manifests/registry.ollama.ai/library/tiny/latest").is_file()


def test_every_command_taking_m_takes_hf(world, monkeypatch, capsys):
    """Every command with -m has -hf, and -hf resolves like -m hf:…"""
    from kvchat.cli.app import main

    d, fake, env, q8 = world
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    main(["tokenize", "-hf", "acme/tiny-GGUF:F32", "hello"])  # downloads if an earlier test has not
    via_hf = capsys.readouterr().out
    main(["tokenize", "-m", "hf:acme/tiny-GGUF:F32", "hello"])
    assert capsys.readouterr().out == via_hf and via_hf.startswith("[")
    for command in ("chat", "run", "info", "tokenize", "perplexity", "bench", "bench-batched", "kv-sweep", "logprobs"):
        try:
            main([command, "--help"])
        except SystemExit as e:
            assert e.code in (0, None)
        assert "--hf-repo" in capsys.readouterr().out, command
