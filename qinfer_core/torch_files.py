"""Load torch files from the internet (predictors, activation counts, checkpoints) safely: tensors only, and one
line that says what is wrong when a file is not what it claims."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from qinfer_core.errors import UserError


def load_torch_file(path: Path, what: str, fix: str, mmap: bool = False) -> Any:
    """`torch.load` with `weights_only`, so no pickled code runs; any failure is a UserError naming the fix.

    torch's own message runs over several lines and advises `weights_only=False`, which must never be followed for
    a downloaded file, so only its first line is kept.
    """
    try:
        return torch.load(path, map_location="cpu", mmap=mmap, weights_only=True)
    except Exception as exc:
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise UserError(f"cannot read {path} as {what} ({reason}); {fix}") from None
