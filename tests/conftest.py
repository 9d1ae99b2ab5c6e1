"""Shared fixtures: tiny models written by tests/helpers/gguf_factory.py (the fast lane), and the two
real models, fetched once into KVCHAT_CACHE (default ~/.cache/kvchat), for agreement with llama.cpp.

`python -m pytest -q -n 2 -m "not real_model"` (README's fast lane) runs without the real models: every test that
asks for
`smollm2_path` / `gemma3_path` is marked `real_model` here, whatever its module says.
"""

import json
import os
import sys
from pathlib import Path

import pytest
from hypothesis import settings

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

REFERENCE_DIR = ROOT.parent / "shared" / "reference"
# The packed-weights cache (runtime/weights/cache.py) is off for the suite, subprocesses included: the tests'
# temporary models would otherwise fill the user's $KVCHAT_CACHE/packed. tests/test_weight_cache.py turns
# it on in a temporary KVCHAT_CACHE.
os.environ.setdefault("KVCHAT_WEIGHT_CACHE", "0")

from kvchat.kernels.numba_start import install  # noqa: E402

install()  # numba as the CLI runs it (kvchat.cli.app.main installs the same before anything else)


# Property tests draw the same examples on every run (the suite gates every landing, so a failure must
# reproduce); KVCHAT_HYPOTHESIS=explore draws fresh ones to hunt for new counterexamples.
settings.register_profile("repeatable", derandomize=True, database=None)
settings.register_profile("explore")
settings.load_profile("explore" if os.environ.get("KVCHAT_HYPOTHESIS") == "explore" else "repeatable")

REAL_MODEL_FIXTURES = {"smollm2_path", "gemma3_path"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if REAL_MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.real_model)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """tiny_model(arch="llama", **opts) -> Path of a tiny random GGUF (ChatML template, the
    factory's vocabulary), written once per session for each distinct (arch, opts)."""
    from tests.helpers.gguf_factory import write_tiny_model

    made = {}
    root = tmp_path_factory.mktemp("tiny_models")

    def make(arch: str = "llama", **opts) -> Path:
        key = json.dumps([arch, sorted(opts.items())], default=repr)
        if key not in made:
            made[key] = write_tiny_model(root / f"{arch}-{len(made)}.gguf", arch=arch, **opts)
        return made[key]

    return make


@pytest.fixture(scope="session")
def tiny_chat(tmp_path_factory) -> Path:
    """A tiny llama with the ChatML template that answers in printable text and never ends its
    turn by itself (tests/helpers/gguf_factory.write_tiny_chat_model): the CLI contract tests' model."""
    from tests.helpers.gguf_factory import write_tiny_chat_model

    return write_tiny_chat_model(tmp_path_factory.mktemp("tiny_chat") / "tiny-chat.gguf")


def _model(name):
    from kvchat.cli.sources.models import resolve_model

    return resolve_model(name)


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    return _model("smollm2")


@pytest.fixture(scope="session")
def gemma3_path() -> Path:
    return _model("gemma3")


@pytest.fixture(scope="session")
def reference_dir() -> Path:
    if not REFERENCE_DIR.is_dir():
        pytest.fail(f"reference data not found at {REFERENCE_DIR}")
    return REFERENCE_DIR
