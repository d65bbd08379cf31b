"""A full or read-only disk under an output ends in one line naming the output and the cause, exit code 2, and
leaves nothing half-written: on small tmpfs mounts, where the test may mount one."""

from __future__ import annotations

import gc
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from qinfer.prep.synth.build import SynthReport
from qinfer.prep.synth.corpus import synth_corpus
from tests.support.cli_in_process import run_in_process
from tests.support.fake_activation import write_power_law_activation


def _mount(where: Path, options: str) -> None:
    where.mkdir(exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.decode().strip() or 'mount failed'})")


def _unmount(where: Path) -> None:
    # A model a failed in-process run opened stays mapped until its last reference goes, which on some Pythons is
    # after the test: collect first, and detach lazily rather than fail on a mount still busy.
    gc.collect()
    subprocess.run(["umount", "--lazy", str(where)], check=True)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 64 KiB file system: smaller than any model file, larger than a metadata write."""
    where = tmp_path / "small"
    _mount(where, "size=64k")
    yield where
    _unmount(where)


@pytest.fixture
def read_only_disk(tmp_path: Path, gguf_files: dict[str, Path]) -> Iterator[Path]:
    """A read-only file system holding a copy of the tiny PowerInfer and dense files."""
    where = tmp_path / "ro"
    _mount(where, "size=16m")
    for name in ("pi-f16", "dense-f16"):
        shutil.copy(gguf_files[name], where / gguf_files[name].name)
    write_power_law_activation(where / "activation")
    subprocess.run(["mount", "-o", "remount,ro", str(where)], check=True)
    yield where
    _unmount(where)


def _one_line(result: subprocess.CompletedProcess[str], cause: str) -> None:
    """Exit code 2 and the error as the last line, with no traceback (a progress bar drawn before the disk filled
    may stand above it)."""
    assert result.returncode == 2, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: cannot write") and cause in last and "Traceback" not in result.stderr


def test_a_full_disk(small_disk: Path, gguf_files: dict[str, Path], tiny: SynthReport) -> None:
    _one_line(run_in_process("prep", "convert-dense", str(tiny.model_dir), "--outfile", str(small_disk / "d.gguf")),
              "disk is full")  # fmt: skip
    _one_line(run_in_process("prep", "quantize", str(gguf_files["pi-f16"]), str(small_disk / "q.gguf"), "Q4_0"),
              "disk is full")  # fmt: skip
    _one_line(run_in_process("prep", "corpus", "--out", str(small_disk / "c.txt"), "--chars", "200000"),
              "disk is full")  # fmt: skip
    # torch.save to a path reports a short write as a RuntimeError of its archive writer, not an OSError.
    corpus = small_disk.parent / "corpus.txt"
    corpus.write_text(synth_corpus(3, 20_000, "calibrate"), encoding="utf-8")
    train = ["prep", "train-predictor", str(tiny.model_dir), "--data", str(corpus), "--out", str(small_disk / "p")]
    _one_line(run_in_process(*train, "--rank", "32", "--train-tokens", "600", "--heldout-tokens", "300", "--epochs",
                             "1", "--seq-len", "100"), "disk is full")  # fmt: skip
    assert not list(small_disk.iterdir())


def test_a_plan_beside_a_model_on_a_full_disk(tmp_path: Path, gguf_files: dict[str, Path]) -> None:
    """The .gpuidx is written beside the model: on a disk the model (and a filler) fill, plan and run --vram-budget
    cannot write it."""
    where = tmp_path / "full"
    _mount(where, "size=16m")
    try:
        model = Path(shutil.copy(gguf_files["pi-f16"], where / gguf_files["pi-f16"].name))
        write_power_law_activation(where / "activation")
        filler = os.open(where / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            while os.write(filler, bytes(4096)):
                pass
        except OSError:  # the disk is full: what the test wants
            pass
        finally:
            os.close(filler)
        before = sorted(p.name for p in where.iterdir())
        _one_line(run_in_process("plan", "-m", str(model), "--vram-budget", "8"), "disk is full")
        run = run_in_process("run", "-m", str(model), "-p", "Once", "-n", "2", "--vram-budget", "8")
        _one_line(run, "disk is full")
        assert sorted(p.name for p in where.iterdir()) == before
    finally:
        _unmount(where)


@pytest.mark.parametrize("left_kib", [2, 4])
def test_a_plan_that_just_misses_the_room_left(tmp_path: Path, gguf_files: dict[str, Path], left_kib: int) -> None:
    """With a few KiB left the .gpuidx's last bytes are lost at numpy's final flush while every write reports
    success: the short file is found and said to be a full disk, not a damaged GGUF under its temporary name."""
    where = tmp_path / "nearly"
    _mount(where, "size=16m")
    try:
        model = Path(shutil.copy(gguf_files["pi-f16"], where / gguf_files["pi-f16"].name))
        write_power_law_activation(where / "activation")
        disk = os.statvfs(where)
        (where / "filler").write_bytes(bytes(disk.f_bavail * disk.f_frsize - left_kib * 1024))
        before = sorted(p.name for p in where.iterdir())
        _one_line(run_in_process("plan", "-m", str(model), "--vram-budget", "8"), "disk is full")
        assert sorted(p.name for p in where.iterdir()) == before
    finally:
        _unmount(where)


def test_profile_onto_a_read_only_disk(read_only_disk: Path, tiny: SynthReport, tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("Once upon a time there was a fox. " * 200)
    out = read_only_disk / "activation-new"
    result = run_in_process("prep", "profile", str(tiny.model_dir), "--data", str(corpus), "--out", str(out))
    _one_line(result, "read-only")
    assert not out.exists()


def test_a_read_only_disk(read_only_disk: Path, tmp_path: Path) -> None:
    before = sorted(p.name for p in read_only_disk.iterdir())
    model = read_only_disk / next(p for p in before if p.endswith(".powerinfer.gguf"))
    for args in (
        ("prep", "corpus", "--out", str(read_only_disk / "c.txt"), "--chars", "1000"),
        ("prep", "quantize", str(model), str(read_only_disk / "q.gguf"), "Q4_0"),
    ):
        result = run_in_process(*args)
        _one_line(result, "read-only")
        assert result.stderr.strip().count("\n") == 0  # refused before any work: the error is the only output
    assert sorted(p.name for p in read_only_disk.iterdir()) == before


def test_the_plan_of_a_read_only_model_goes_to_the_users_cache(
    read_only_disk: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model store mounted read-only (a container's `-v /models:/models:ro`) takes no .gpuidx beside its model:
    a plan made there before is read, and a new one goes to the user's cache, where run finds it."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    model = next(read_only_disk.glob("*.powerinfer.gguf"))
    beside = model.with_name(model.name + ".generated.gpuidx")
    subprocess.run(["mount", "-o", "remount,rw", str(read_only_disk)], check=True)
    assert run_in_process("plan", "-m", str(model), "--vram-budget", "8").returncode == 0
    subprocess.run(["mount", "-o", "remount,ro", str(read_only_disk)], check=True)
    before = snapshot(read_only_disk)

    def said(result: subprocess.CompletedProcess[str], words: str) -> None:
        assert result.returncode == 0, result.stderr
        assert words in " ".join(result.stderr.split()), result.stderr

    said(run_in_process("run", "-m", str(model), "-p", "Once", "-n", "2", "--vram-budget", "8"), f"reused {beside}")
    planned = run_in_process("plan", "-m", str(model), "--vram-budget", "4")
    [plan] = (tmp_path / "cache" / "qinfer" / "plans").iterdir()
    assert plan.name.startswith(model.name) and plan.name.endswith(".generated.gpuidx")
    said(planned, f"wrote {plan}")
    said(run_in_process("run", "-m", str(model), "-p", "Once", "-n", "2", "--vram-budget", "4"), f"reused {plan}")
    assert snapshot(read_only_disk) == before


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    return {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in root.iterdir() if p.is_file()}
