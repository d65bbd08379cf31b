"""Fetch a supported model from the Hugging Face hub and lay it out as the PowerInfer GGUF repos do.

Files go through huggingface_hub's standard cache (so HF_TOKEN, HF_HUB_CACHE, HF_ENDPOINT and HF_HUB_OFFLINE apply
and an interrupted download resumes from its `.incomplete` blob) and are then hard-linked into the target directory,
which therefore costs no second copy. Layout:

    gguf source:      DIR/<name>.powerinfer.gguf, DIR/activation/activation_{i}.pt
    original source:  DIR/model/ (HF checkpoint), DIR/predictor/ (model_{i}.pt), DIR/activation/activation_{i}.pt
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from huggingface_hub import HfApi, constants, hf_hub_download, snapshot_download
from huggingface_hub.errors import (
    EntryNotFoundError,
    GatedRepoError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
)

from qinfer.core.errors import UserError
from qinfer.formats.atomic_file import check_not_special
from qinfer.prep.hub.model_profiles import ModelProfile

Source = Literal["gguf", "original"]
Variant = Literal["f16", "q4"]
# Called before each file or repository is fetched: (done, total, what).
OnFile = Callable[[int, int, str], None]

# Everything convert needs from an original checkpoint besides the weights themselves.
CHECKPOINT_EXTRAS = ["*.json", "tokenizer.model"]


@dataclass(frozen=True)
class DownloadResult:
    dir: Path
    files: list[Path]
    model_file: Path | None
    model_dir: Path | None
    predictor_dir: Path | None


def download(
    profile: ModelProfile,
    dest: Path,
    source: Source = "gguf",
    variant: Variant | None = None,
    on_file: OnFile | None = None,
) -> DownloadResult:
    """Download `profile` from `source` into `dest`; files already complete in the cache are not fetched again."""
    notify = on_file or (lambda done, total, what: None)
    if source == "gguf":
        return _download_gguf(profile, dest, variant or ("f16" if profile.gguf_f16 else "q4"), notify)
    if source == "original":
        return _download_original(profile, dest, notify)
    raise UserError(f"unknown source {source!r}; use gguf or original")


def _download_gguf(profile: ModelProfile, dest: Path, variant: Variant, notify: OnFile) -> DownloadResult:
    if variant not in ("f16", "q4"):
        raise UserError(f"unknown variant {variant!r}; use f16 or q4")
    model_name = profile.gguf_file(variant)
    if model_name is None:
        raise UserError(
            f"{profile.name} has no {variant} PowerInfer GGUF on the hub; "
            f"use --source original (then convert) or the other variant"
        )
    names = [model_name, *profile.activation_files]
    _require_directory(dest)
    for name in names:
        _require_file_target(dest / name)
    files = _fetch_files(profile.gguf_repo, names, dest, notify, 0, len(names))
    return DownloadResult(dest, files, files[0], None, None)


def _download_original(profile: ModelProfile, dest: Path, notify: OnFile) -> DownloadResult:
    total = 2 + len(profile.activation_files)
    for part in ("model", "predictor"):
        _require_directory(dest / part)
    for name in profile.activation_files:
        _require_file_target(dest / name)
    notify(0, total, profile.original_repo)
    model_files = _fetch_repo(profile.original_repo, _weight_patterns(profile.original_repo), dest / "model")
    notify(1, total, profile.predictor_repo)
    predictor_files = _fetch_repo(profile.predictor_repo, ["*.pt", "*.json"], dest / "predictor")
    activations = _fetch_files(profile.gguf_repo, profile.activation_files, dest, notify, 2, total)
    return DownloadResult(dest, model_files + predictor_files + activations, None, dest / "model", dest / "predictor")


def _fetch_files(repo: str, names: list[str], dest: Path, notify: OnFile, done: int, total: int) -> list[Path]:
    placed = []
    for i, name in enumerate(names):
        notify(done + i, total, f"{repo}/{name}")
        with _hub_errors(repo, name):
            cached = Path(hf_hub_download(repo, name))
        placed.append(_place(cached, dest / name))
    return placed


def _fetch_repo(repo: str, patterns: list[str], dest: Path) -> list[Path]:
    with _hub_errors(repo, None):
        snapshot = Path(snapshot_download(repo, allow_patterns=patterns))
    files = sorted(p for p in snapshot.rglob("*") if p.is_file())
    if not files:
        raise UserError(f"{repo} has no files matching {', '.join(patterns)}")
    return [_place(p, dest / p.relative_to(snapshot)) for p in files]


def _weight_patterns(repo: str) -> list[str]:
    """Safetensors when the repo has them, else the .bin shards: fetching both would double a multi-GB download."""
    if constants.is_offline_mode():
        # The cache holds whichever kind was fetched online.
        return [*CHECKPOINT_EXTRAS, "*.safetensors", "*.bin"]
    with _hub_errors(repo, None):
        names = HfApi().list_repo_files(repo)
    kind = "*.safetensors" if any(n.endswith(".safetensors") for n in names) else "*.bin"
    return [*CHECKPOINT_EXTRAS, kind]


def _require_directory(path: Path) -> None:
    """Make the directory `path` (and its parents), or refuse it in one line: checked before anything is fetched,
    since a file can be gigabytes."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot use {path} as a directory ({exc.strerror}); name another --dir") from None


def _require_file_target(path: Path) -> None:
    """Refuse a file's place in the layout that holds something a file cannot replace (a directory, a pipe), before
    anything is fetched."""
    if path.is_dir():
        raise UserError(f"{path} is a directory where the download puts a file; move it or name another --dir")
    check_not_special(path, "regular file")
    parent = path.parent
    if parent.exists() and not parent.is_dir():
        raise UserError(f"{parent} is a file where the download puts a directory; move it or name another --dir")


def _place(cached: Path, target: Path) -> Path:
    """Hard-link the cached blob to `target` (a symlink across file systems), swapped in atomically."""
    blob = cached.resolve()
    check_not_special(target, "regular file")
    if target.exists() and os.path.samefile(target, blob):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.partial")
    tmp.unlink(missing_ok=True)
    try:
        os.link(blob, tmp)
    except OSError:
        tmp.symlink_to(blob)
    try:
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


@contextlib.contextmanager
def _hub_errors(repo: str, name: str | None) -> Iterator[None]:
    """The hub's exceptions as one-line UserErrors saying what the user can do."""
    what = f"{repo}/{name}" if name else repo
    try:
        yield
    except GatedRepoError as exc:
        raise UserError(
            f"{repo} is gated: accept its terms on the hub page, then set HF_TOKEN to a token of that account"
        ) from exc
    except RepositoryNotFoundError as exc:
        raise UserError(
            f"{repo} was not found on {constants.ENDPOINT}, or it is private and HF_TOKEN is missing or lacks access"
        ) from exc
    except LocalEntryNotFoundError as exc:  # before EntryNotFoundError, its base class
        if constants.is_offline_mode():
            raise UserError(
                f"HF_HUB_OFFLINE is set and {what} is not in the cache {constants.HF_HUB_CACHE}; "
                f"download it once with network access"
            ) from exc
        raise UserError(
            f"cannot reach {constants.ENDPOINT} and {what} is not in the cache {constants.HF_HUB_CACHE}; "
            f"check the network connection"
        ) from exc
    except EntryNotFoundError as exc:
        raise UserError(f"{repo} has no file {name}") from exc
    except HfHubHTTPError as exc:
        raise UserError(f"the hub refused {what}: {str(exc).splitlines()[0]}") from exc
