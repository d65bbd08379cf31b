"""Load torch files from the internet (predictors, activation counts, checkpoints) safely: tensors only, and one
line that says what is wrong when a file is not what it claims; and save ours so that a full disk is an OSError."""

from __future__ import annotations

import io
import pickle
import re
from pathlib import Path
from typing import Any

import torch

from qinfer.core.errors import UserError

_NOT_TENSORS = "not a file of plain tensors: it is damaged, or holds objects whose loading could run code"


def load_torch_file(path: Path, what: str, fix: str, mmap: bool = False) -> Any:
    """`torch.load` with `weights_only`, so no pickled code runs; any failure is a UserError naming the fix.

    torch's own message runs over several lines and advises `weights_only=False`, which must never be followed for
    a downloaded file: that advice is replaced by what it means, and of any other message only its first line,
    without terminal colour codes, is kept.
    """
    try:
        return torch.load(path, map_location="cpu", mmap=mmap, weights_only=True)
    except Exception as exc:
        reason = re.sub(r"\x1b\[[0-9;]*m", "", (str(exc).strip().splitlines() or [type(exc).__name__])[0])
        if isinstance(exc, pickle.UnpicklingError) or "weights_only" in reason or "Weights only" in reason:
            reason = _NOT_TENSORS
        raise UserError(f"cannot read {path} as {what} ({reason}); {fix}") from None


def save_torch_file(obj: Any, path: Path) -> None:
    """`torch.save` into memory, then the bytes to `path`: a full disk is then the write's own OSError (torch's
    archive writer turns it into a RuntimeError, to a path or a file object alike), and the archive inside is named
    "archive" rather than after the file, so equal contents give equal bytes whatever the file's (temporary) name.
    What is saved here is small: counts and predictors of a layer, a profile's state."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    path.write_bytes(buffer.getbuffer())
