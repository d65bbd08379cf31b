"""Where qinfer keeps what it makes for the user outside the user's own files: `$XDG_CACHE_HOME/qinfer` (by
default `~/.cache/qinfer`), one directory per kind (built kernels, plans of read-only models)."""

from __future__ import annotations

import os
from pathlib import Path


def user_cache(kind: str) -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "qinfer" / kind
