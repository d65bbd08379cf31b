"""Write outputs beside their final name and rename them into place only once complete.

A temporary output is named `.{name}.{pid}-{random}.partial`: the writer's pid lets a later write of the same target
remove what a killed writer left behind while keeping the file of a writer that is still running.

An output path that names a pipe, a device or a socket is refused rather than written through: renaming over it
would replace the node itself (as root, `--outfile /dev/null` would replace the machine's /dev/null), and writing
into it in place would give up the guarantee that a reader never sees a half-written output.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import stat
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from qinfer.core.errors import UserError

_PARTIAL_SUFFIX = ".partial"
# What sits between `.{name}.` and the suffix: the writer's pid and a dash (absent in older versions' names),
# then the eight random characters of mkstemp or mkdtemp.
_PARTIAL_MIDDLE = re.compile(r"(?:(\d+)-)?[a-z0-9_]{8}")
_STARTED = time.time()  # the import, early in the run, stands for the process's start
# Errors of the disk that an output is written to, which a user fixes there rather than in the command: the cause,
# and what to do about it.
_DISK_ERRORS = {
    errno.ENOSPC: "the disk is full; free some space or pick another directory",
    errno.EDQUOT: "the disk quota is used up; free some space or pick another directory",
    errno.EROFS: "the file system is read-only; pick another directory",
}


# What an output path may already be besides a regular file, a directory or a symbolic link (which a rename replaces,
# leaving its target alone), by the test of os.stat's mode that tells it.
_SPECIAL_FILES = {
    "named pipe": stat.S_ISFIFO,
    "character device": stat.S_ISCHR,
    "block device": stat.S_ISBLK,
    "socket": stat.S_ISSOCK,
}


@dataclass(frozen=True)
class OutputKind:
    """A kind of output directory: its name in messages and how to recognise one written earlier, which alone
    (besides an empty directory) may be replaced without `force`."""

    name: str
    recognise: Callable[[Path], bool]


def check_output_file(path: Path) -> None:
    """Refuse a file output whose directory is missing (creating it would hide a typo) or that names a directory."""
    parent = path.parent
    if not parent.is_dir():
        problem = "is not a directory" if parent.exists() else "does not exist"
        raise UserError(f"cannot write {path}: {parent} {problem}; create the directory first or pick another path")
    if path.is_dir() and not path.is_symlink():
        raise UserError(f"cannot write {path}: it is a directory; name the output file")
    check_not_special(path, "regular file")
    check_writable(path)


def check_not_special(path: Path, expected: str) -> None:
    """Refuse an output `path` that is a pipe, a device or a socket (see above); `expected` is what the output is:
    "regular file" or "directory"."""
    try:
        mode = path.lstat().st_mode
    except (FileNotFoundError, NotADirectoryError):
        return
    for name, test in _SPECIAL_FILES.items():
        if test(mode):
            raise UserError(f"cannot write {path}: it is a {name}, not a {expected}; pick another path for the output")


def check_writable(path: Path) -> None:
    """Refuse an output whose nearest existing directory takes no new entries (a read-only file system, or a
    directory of another user's), before any work that would be lost."""
    existing = path.parent
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not os.access(existing, os.W_OK):
        read_only = os.statvfs(existing).f_flag & os.ST_RDONLY
        problem = _DISK_ERRORS[errno.EROFS] if read_only else f"{existing} is not writable; pick another directory"
        raise UserError(f"cannot write {path}: {problem}")


@contextlib.contextmanager
def atomic_output(path: Path) -> Iterator[Path]:
    """Yield a temporary path in the target's directory; on success it replaces `path`, on error it is removed.

    Renaming within one directory is atomic, so an interrupted run leaves either the old file or none,
    never a truncated file under the real name.
    """
    check_output_file(path)
    with disk_errors(path):
        _remove_stale_partials(path)
        fd, tmp_name = tempfile.mkstemp(prefix=_partial_prefix(path), suffix=_PARTIAL_SUFFIX, dir=path.parent)
        os.close(fd)
        tmp = Path(tmp_name)
        try:
            yield tmp
            # mkstemp makes the file private (0600); the output gets the mode any new file of the user's would.
            os.chmod(tmp, 0o666 & ~_umask())
            check_not_special(path, "regular file")  # again: one may have been made there while the output was written
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise


@contextlib.contextmanager
def disk_errors(path: Path) -> Iterator[None]:
    """A full or read-only disk under an output, met anywhere while it is written, as one line naming the output."""
    try:
        yield
    except OSError as exc:
        # numpy's tofile (the gguf writer's) reports a short write without an errno: the disk filled up.
        short_write = exc.errno is None and " requested and " in str(exc) and str(exc).endswith(" written")
        cause = _DISK_ERRORS.get(errno.ENOSPC if short_write else exc.errno)
        if cause is None:
            raise
        raise UserError(f"cannot write {path}: {cause}") from exc


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def check_replaceable(path: Path, kind: OutputKind | None, force: bool) -> None:
    """Refuse to replace `path` unless it is missing, an empty directory, an earlier output of `kind`, or `force`
    is given; never replace the working directory or one above it, whose removal would pull the ground from under
    the run. Commands that work long before writing call this first, so that a refusal costs nothing."""
    check_not_special(path, "directory")
    check_writable(path)
    if not path.exists() and not path.is_symlink():
        return
    is_dir = path.is_dir() and not path.is_symlink()
    if is_dir and _holds_working_directory(path):
        raise UserError(f"refusing to replace {path}: it holds the working directory; pick a new output directory")
    if is_dir and (not any(path.iterdir()) or (kind is not None and kind.recognise(path))):
        return
    if force:
        return
    expected = f"an earlier {kind.name}" if kind is not None else "an empty directory"
    raise UserError(
        f"{path} exists and is not {expected}; pick a new or empty directory, or pass --force to replace it"
    )


def check_apart(output: Path, inputs: dict[str, Path | None], earlier: Callable[[Path], bool] | None = None) -> None:
    """Refuse an output that would destroy what the command reads, --force or not: one that is an input (by `inputs`'
    names for them), or a directory holding one, or an existing entry of an input directory (its weights, config or
    tokenizer, or a link to them, as a Hugging Face snapshot holds) unless `earlier` recognises it as an earlier
    output."""
    out = resolved(output)
    # What a rename onto `output` replaces: the entry itself, not what a link there points to.
    entry = resolved(output.parent) / output.name
    for name, given in inputs.items():
        if given is None:
            continue
        source = resolved(given)
        if out == source or out in source.parents:
            relation = "is" if out == source else "holds"
            raise UserError(
                f"cannot write {output}: it {relation} the {name} {given}, which this command reads; pick another path"
            )
        taken = entry.is_symlink() or entry.is_file()
        if source in entry.parents and taken and not (earlier is not None and earlier(entry)):
            raise UserError(f"cannot write {output}: it is a file of the {name} {given}, which this command reads; "
                            "pick another path")  # fmt: skip


def resolved(path: Path) -> Path:
    """`path` with its links followed; a loop of symbolic links is one line."""
    try:
        os.stat(path)  # Path.resolve raises on a loop only before Python 3.13; stat's ELOOP tells it on every one
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UserError(f"{path} cannot be followed (a loop of symbolic links); fix the link") from None
    return path.resolve()


@contextlib.contextmanager
def atomic_directory(path: Path, kind: OutputKind | None = None, force: bool = False) -> Iterator[Path]:
    """Like `atomic_output` for a directory: fill the yielded one, and it replaces `path` when complete, provided
    `check_replaceable` allows it. Unlike a file's, a missing parent is created, as `mkdir -p` would."""
    check_replaceable(path, kind, force)
    with disk_errors(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale_partials(path)
        tmp = Path(tempfile.mkdtemp(prefix=_partial_prefix(path), suffix=_PARTIAL_SUFFIX, dir=path.parent))
        try:
            yield tmp
            os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp's 0700, as for files above
            check_not_special(path, "directory")
            _swap_in(tmp, path)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise


def _swap_in(new: Path, path: Path) -> None:
    """Rename the directory `new` to `path`. A directory there is first renamed aside, to a temporary output of this
    writer that a later write removes should this one be killed meanwhile, and deleted only once `new` is in place:
    deleted first, a kill would leave it half gone, the layer files of one run beside those of none."""
    if not path.is_dir() or path.is_symlink():
        _remove(path)  # nothing, or a file or link that --force replaces
        os.replace(new, path)
        return
    old = Path(tempfile.mkdtemp(prefix=_partial_prefix(path), suffix=_PARTIAL_SUFFIX, dir=path.parent))
    os.replace(path, old)  # a directory may replace an empty one
    os.replace(new, path)
    shutil.rmtree(old, ignore_errors=True)  # the output is in place; a leftover goes with the next write


def _remove_stale_partials(path: Path) -> None:
    """Remove the temporary outputs of `path` whose writer has died (killed mid-write); a live writer's stay."""
    prefix = f".{path.name}."
    for entry in path.parent.iterdir():
        name = entry.name
        if name.startswith(prefix) and name.endswith(_PARTIAL_SUFFIX):
            # Best effort: a leftover may vanish meanwhile or be another user's, and the write goes on regardless.
            with contextlib.suppress(OSError):
                if _is_stale(entry, name[len(prefix) : -len(_PARTIAL_SUFFIX)]):
                    _remove(entry)


def _is_stale(entry: Path, middle: str) -> bool:
    match = _PARTIAL_MIDDLE.fullmatch(middle)
    if match is None:
        return False
    if match.group(1) is not None:
        # A leftover under this process's own pid, last written before it started, is a dead writer's whose pid came
        # round again (a container's first processes get the same pids each run); a newer one may be a live writer's
        # of another container on the same volume.
        pid = int(match.group(1))
        if pid == os.getpid():
            return entry.lstat().st_mtime < _STARTED
        return not _pid_alive(pid)
    # Named before writers put their pid in, so no writer of this version made it: stale once older than us.
    return entry.lstat().st_mtime < _STARTED


def _partial_prefix(path: Path) -> str:
    return f".{path.name}.{os.getpid()}-"


def _pid_alive(pid: int) -> bool:
    if os.name != "posix":
        return True  # signal 0 probes only on POSIX; elsewhere os.kill would terminate the process
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True  # another user's process, or no pid at all: not provably a dead writer of ours
    return True


def _holds_working_directory(path: Path) -> bool:
    target, cwd = resolved(path), Path.cwd().resolve()
    return target == cwd or target in cwd.parents


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()
