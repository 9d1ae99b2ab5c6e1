"""Shared fixtures: the two real models, fetched once into KVCHAT_CACHE (default ~/.cache/kvchat)."""
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

REFERENCE_DIR = ROOT.parent / "shared" / "reference"


def _model(name):
    from cli.models import resolve_model
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
