"""Turn a text corpus (plain text or jsonl with a `text` field, one file or a directory) into token windows."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

import torch

from qinfer.core.errors import UserError

SUFFIXES = (".txt", ".jsonl", ".json")


class Tokenizer(Protocol):
    bos_token_id: int | None

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


def corpus_files(path: Path) -> list[Path]:
    """The corpus files in a fixed order: the file itself, or every text/jsonl file under a directory, sorted."""
    if not path.exists():
        raise UserError(f"corpus not found: {path}")
    if path.is_file():
        return [path]
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in SUFFIXES)
    if not files:
        raise UserError(f"{path} holds no corpus files ({', '.join('*' + s for s in SUFFIXES)})")
    return files


def documents(files: list[Path]) -> Iterator[str]:
    """Plain text: each blank-line separated block is a document. jsonl/json lines: each record's `text`."""
    for path in files:
        if path.suffix in (".jsonl", ".json"):
            yield from _json_lines(path)
        else:
            text = path.read_text(encoding="utf-8", errors="replace")
            yield from (block.strip() for block in text.split("\n\n") if block.strip())


def _json_lines(path: Path) -> Iterator[str]:
    # Undecodable bytes become U+FFFD, as in plain text: one rule for every corpus format.
    with path.open(encoding="utf-8", errors="replace") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise UserError(f"{path}:{number} is not a JSON line ({exc.msg})") from exc
            except RecursionError:
                raise UserError(f"{path}:{number} nests deeper than a JSON line with a text field can") from None
            text = record.get("text") if isinstance(record, dict) else None
            if not isinstance(text, str):
                raise UserError(f"{path}:{number} has no string field 'text'; each JSON line needs one")
            if text.strip():
                yield text


def token_windows(
    tokenizer: Tokenizer, files: list[Path], seq_len: int, max_tokens: int | None = None
) -> Iterator[torch.Tensor]:
    """1-D windows of `seq_len` tokens (the last one may be shorter) over the documents, each begun with BOS and
    concatenated, up to `max_tokens` tokens in all. The same inputs always give the same windows."""
    if seq_len < 1:
        raise UserError(f"seq-len must be positive, not {seq_len}")
    if max_tokens is not None and max_tokens < 1:
        raise UserError(f"tokens must be positive, not {max_tokens}")
    bos = [] if tokenizer.bos_token_id is None else [tokenizer.bos_token_id]
    buffer: list[int] = []
    produced = 0
    for doc in documents(files):
        buffer += bos + tokenizer.encode(doc, add_special_tokens=False)
        if max_tokens is not None:
            buffer = buffer[: max_tokens - produced]
        while len(buffer) >= seq_len:
            yield torch.tensor(buffer[:seq_len], dtype=torch.long)
            produced += seq_len
            buffer = buffer[seq_len:]
        if max_tokens is not None and produced + len(buffer) >= max_tokens:
            break
    if buffer:
        produced += len(buffer)
        yield torch.tensor(buffer, dtype=torch.long)
    if produced == 0:
        raise UserError(f"the corpus ({', '.join(map(str, files[:3]))}{' ...' if len(files) > 3 else ''}) is empty")


def batches(windows: Iterator[torch.Tensor], batch_size: int) -> Iterator[torch.Tensor]:
    """[B, S] batches of equal-length windows; a shorter final window goes alone, so nothing is ever padded."""
    pending: list[torch.Tensor] = []
    for window in windows:
        if pending and len(window) != len(pending[0]):
            yield torch.stack(pending)
            pending = []
        pending.append(window)
        if len(pending) == batch_size:
            yield torch.stack(pending)
            pending = []
    if pending:
        yield torch.stack(pending)
