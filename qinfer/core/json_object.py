"""A JSON file a user gives (a checkpoint's config.json, a predictor directory's) read as the one object it must
hold, or refused in one line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from qinfer.core.errors import UserError


def read_json_object(path: Path, fix: str) -> dict[str, Any]:
    """The object in `path`; a file that is not UTF-8 JSON, or holds something else, is refused with `fix`."""
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"{path} is not valid JSON ({exc}); {fix}") from exc
    if not isinstance(raw, dict):
        raise UserError(f"{path} is not a JSON object; {fix}")
    return raw
