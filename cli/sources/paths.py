"""Where kvchat keeps its own files: $KVCHAT_CACHE, default ~/.cache/kvchat (models/, hub/, history)."""

import os
from pathlib import Path


def cache_dir() -> Path:
    """KVCHAT_CACHE, else ~/.cache/kvchat."""
    return Path(os.environ.get("KVCHAT_CACHE") or Path.home() / ".cache" / "kvchat")
