"""Outputs replace only what they wrote themselves, never create a missing directory for a file, and clean up
the temporary files of killed writers."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from qinfer.core.errors import UserError
from qinfer.formats.atomic_file import atomic_directory, atomic_output, check_replaceable
from qinfer.prep.convert import convert as convert_module
from qinfer.prep.predictor.training import PREDICTOR_OUTPUT
from qinfer.prep.synth.build import SynthReport, SynthShape, build_synth
from qinfer.prep.synth.corpus import synth_corpus
from tests.support.cli_in_process import run_in_process

QUICK_TRAINING = ["--train-tokens", "600", "--heldout-tokens", "300", "--epochs", "1", "--seq-len", "100"]


run_cli = run_in_process


def assert_one_line_error(result: subprocess.CompletedProcess[str], expect: str) -> None:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert lines[0].startswith("error: ") and expect in lines[0], lines[0]


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """Every file under `root` with its size and modification time: what must stay untouched."""
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*") if p.is_file()}


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    path = tmp_path / "corpus.txt"
    path.write_text(synth_corpus(3, 20_000, "calibrate"), encoding="utf-8")
    return path


@pytest.fixture
def model_copy(tiny: SynthReport, tmp_path: Path) -> Path:
    return shutil.copytree(tiny.model_dir, tmp_path / "model")


def train_predictor(
    model: Path, corpus: Path, out: str, *extra: str, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    args = ["prep", "train-predictor", str(model), "--data", str(corpus), "--out", out, "--rank", "32"]
    return run_cli(*args, *QUICK_TRAINING, *extra, cwd=cwd)


@pytest.mark.parametrize("force", [False, True])
def test_train_predictor_refuses_a_model_directory(model_copy: Path, corpus: Path, force: bool) -> None:
    before = snapshot(model_copy)
    result = train_predictor(model_copy, corpus, str(model_copy), *(["--force"] if force else []))
    assert_one_line_error(result, f"it is the model directory {model_copy}, which this command reads")
    assert "--force" not in result.stderr  # which, followed, would have replaced the model with the predictors
    assert snapshot(model_copy) == before


@pytest.mark.parametrize("out", ["model", ".", "corpus.txt"])
def test_directory_outputs_never_replace_their_inputs_even_forced(
    model_copy: Path, corpus: Path, tmp_path: Path, out: str
) -> None:
    before = snapshot(tmp_path)
    for command in ("profile", "calibrate"):
        args = ["prep", command, str(model_copy), "--data", str(corpus), "--out", str(tmp_path / out), "--force"]
        relation = "holds the model directory" if out == "." else "is the " + ("corpus" if "." in out else "model")
        assert_one_line_error(run_cli(*args), f"it {relation}")
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("name", ["model.safetensors", "config.json", "tokenizer.json"])
def test_convert_never_writes_over_a_file_it_reads(tiny: SynthReport, tmp_path: Path, name: str) -> None:
    model = shutil.copytree(tiny.model_dir, tmp_path / "model")
    before = snapshot(model)
    for command in ("convert", "convert-dense"):
        predictors = [str(tiny.predictor_dir)] if command == "convert" else []
        result = run_cli("prep", command, str(model), *predictors, "--outfile", str(model / name))
        assert_one_line_error(result, f"it is a file of the model directory {model}, which this command reads")
    assert snapshot(model) == before
    # An earlier output beside the weights is replaced, as any earlier output is.
    for _ in range(2):
        result = run_cli("prep", "convert-dense", str(model), "--outfile", str(model / "model.gguf"))
        assert result.returncode == 0, result.stderr


def test_a_linked_weight_file_is_an_input_too(tiny: SynthReport, tmp_path: Path) -> None:
    """A Hugging Face snapshot's files are links into its blobs: writing over one would replace the link."""
    model = shutil.copytree(tiny.model_dir, tmp_path / "model")
    blob = tmp_path / "blobs" / "abc123"
    blob.parent.mkdir()
    (model / "model.safetensors").rename(blob)
    (model / "model.safetensors").symlink_to(blob)
    result = run_cli("prep", "convert-dense", str(model), "--outfile", str(model / "model.safetensors"))
    assert_one_line_error(result, f"it is a file of the model directory {model}")
    assert (model / "model.safetensors").is_symlink()


def test_a_loop_of_links_is_one_line(gguf_files: dict[str, Path], tmp_path: Path) -> None:
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    for args in ((tmp_path / "a", tmp_path / "y.gguf"), (gguf_files["pi-f32"], tmp_path / "a")):
        assert_one_line_error(run_cli("prep", "quantize", *map(str, args)), "cannot be followed")


@pytest.mark.parametrize("force", [False, True])
def test_train_predictor_never_replaces_the_working_directory(
    model_copy: Path, corpus: Path, tmp_path: Path, force: bool
) -> None:
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text("keep me")
    (work / "sub").mkdir()
    (work / "sub" / "data.bin").write_bytes(b"\0" * 100)
    before = snapshot(work)
    result = train_predictor(model_copy, corpus, ".", *(["--force"] if force else []), cwd=work)
    assert_one_line_error(result, "holds the working directory")
    assert snapshot(work) == before
    assert sorted(p.name for p in work.iterdir()) == ["notes.txt", "sub"]


def test_force_replaces_and_an_earlier_output_needs_no_force(model_copy: Path, corpus: Path, tmp_path: Path) -> None:
    out = tmp_path / "taken"
    out.mkdir()
    (out / "notes.txt").write_text("not a predictor")
    assert_one_line_error(train_predictor(model_copy, corpus, str(out)), "is not an earlier predictor directory")
    forced = train_predictor(model_copy, corpus, str(out), "--force")
    assert forced.returncode == 0, forced.stderr
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model_0.pt", "model_1.pt"]
    again = train_predictor(model_copy, corpus, str(out))
    assert again.returncode == 0, again.stderr
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary left beside it


def test_a_predictor_directory_is_recognised_by_its_files_alone(tmp_path: Path) -> None:
    (tmp_path / "model_0.pt").write_bytes(b"")
    (tmp_path / "config.json").write_text("{}")
    check_replaceable(tmp_path, PREDICTOR_OUTPUT, force=False)
    (tmp_path / "README.md").write_text("downloaded")
    with pytest.raises(UserError, match="not an earlier predictor directory"):
        check_replaceable(tmp_path, PREDICTOR_OUTPUT, force=False)
    config_only = tmp_path / "config-only"
    config_only.mkdir()
    (config_only / "config.json").write_text("{}")  # as a model directory begins
    with pytest.raises(UserError):
        check_replaceable(config_only, PREDICTOR_OUTPUT, force=False)


def test_synth_refuses_other_directories_unless_forced(tmp_path: Path) -> None:
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me")
    result = run_cli("prep", "synth", "--out", str(precious), "--train-steps", "0")
    assert_one_line_error(result, "is not an earlier synth build")
    assert [p.name for p in precious.iterdir()] == ["notes.txt"]
    shape = SynthShape(layers=1, hidden=64, ffn=128, heads=4, kv_heads=2, vocab=512, predictor_rank=32)
    build_synth(precious, shape, train_steps=0, force=True)
    assert sorted(p.name for p in precious.iterdir()) == ["model", "predictor", "synth.json"]


def test_a_file_is_not_a_replaceable_directory(tmp_path: Path) -> None:
    target = tmp_path / "file"
    target.write_text("keep me")
    with pytest.raises(UserError, match="pass --force"), atomic_directory(target):
        pass
    assert target.read_text() == "keep me"
    with atomic_directory(target, force=True) as tmp:
        (tmp / "new").write_text("x")
    assert (target / "new").is_file()


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_stale_partials_of_dead_writers_go_and_live_ones_stay(tmp_path: Path) -> None:
    out = tmp_path / "corpus.txt"
    dead = tmp_path / f".corpus.txt.{dead_pid()}-abcd1234.partial"
    live = tmp_path / f".corpus.txt.{os.getppid()}-abcd1234.partial"
    # This process's own pid on a leftover older than the process: a dead writer's that came round again, as in a
    # container's every run. A newer one may be another container's live writer's, on a shared volume.
    reused = tmp_path / f".corpus.txt.{os.getpid()}-abcd1234.partial"
    shared = tmp_path / f".corpus.txt.{os.getpid()}-efgh5678.partial"
    legacy = tmp_path / ".corpus.txt.abcd1234.partial"  # named before writers put their pid in
    other = tmp_path / f".other.txt.{dead_pid()}-abcd1234.partial"  # another target's
    for path in (dead, live, reused, shared, legacy, other):
        path.write_bytes(b"\0" * 1000)
    an_hour_ago = time.time() - 3600
    for path in (legacy, reused):
        os.utime(path, (an_hour_ago, an_hour_ago))
    result = run_cli("prep", "corpus", "--out", str(out), "--chars", "1000")
    assert result.returncode == 0, result.stderr
    assert out.is_file() and not dead.exists() and not reused.exists() and not legacy.exists()
    assert live.exists() and shared.exists() and other.exists()


def test_sigterm_mid_write_removes_the_partial_output(
    tiny: SynthReport, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGTERM ends Python without a `finally`; a prep command stops as Ctrl-C stops it, leaving no temporary file
    behind (a real model's is gigabytes)."""
    write = convert_module.write_gguf

    def stopped_after_one_tensor(*args: object, **kwargs: object) -> None:
        def send(_plan: object) -> None:
            assert [p.name for p in tmp_path.iterdir()][0].endswith(".partial")
            os.kill(os.getpid(), signal.SIGTERM)

        write(*args, **{**kwargs, "on_tensor": send})  # type: ignore[arg-type]

    monkeypatch.setattr(convert_module, "write_gguf", stopped_after_one_tensor)

    def unhandled(_signum: int, _frame: object) -> None:
        raise AssertionError("SIGTERM reached the test's own handler: the command did not take it")

    out, before = tmp_path / "tiny.gguf", signal.signal(signal.SIGTERM, unhandled)
    try:
        result = run_cli("prep", "convert-dense", str(tiny.model_dir), "--outfile", str(out))
        assert signal.getsignal(signal.SIGTERM) == unhandled  # restored once the command ended
    finally:
        signal.signal(signal.SIGTERM, before)
    assert result.returncode == 128 + signal.SIGTERM
    assert (
        result.stderr.strip().splitlines()[-1]
        == "error: stopped by SIGTERM before it finished; run the command again to finish"
    )
    assert list(tmp_path.iterdir()) == []


def test_partial_names_carry_the_writer_pid(tmp_path: Path) -> None:
    with atomic_output(tmp_path / "out.bin") as tmp:
        assert tmp.name.startswith(f".out.bin.{os.getpid()}-") and tmp.name.endswith(".partial")
    with atomic_directory(tmp_path / "out.d") as tmp:
        assert tmp.name.startswith(f".out.d.{os.getpid()}-")


def test_stale_partial_directories_go_too(tmp_path: Path) -> None:
    stale = tmp_path / f".pred.{dead_pid()}-abcd1234.partial"
    stale.mkdir()
    (stale / "model_0.pt").write_bytes(b"\0" * 1000)
    with atomic_directory(tmp_path / "pred") as tmp:
        (tmp / "config.json").write_text("{}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pred"]


def test_quantize_into_a_missing_directory_creates_nothing(gguf_files: dict[str, Path], tmp_path: Path) -> None:
    target = tmp_path / "missing" / "deeper" / "tiny.q4.powerinfer.gguf"
    result = run_cli("prep", "quantize", str(gguf_files["pi-f32"]), str(target), "Q4_0")
    assert_one_line_error(result, "does not exist")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", ["convert", "convert-dense", "corpus"])
def test_file_outputs_refuse_a_missing_directory(tiny: SynthReport, tmp_path: Path, command: str) -> None:
    target = str(tmp_path / "missing" / "out")
    args = {
        "convert": ["prep", "convert", str(tiny.model_dir), str(tiny.predictor_dir), "--outfile", target],
        "convert-dense": ["prep", "convert-dense", str(tiny.model_dir), "--outfile", target],
        "corpus": ["prep", "corpus", "--out", target, "--chars", "100"],
    }[command]
    assert_one_line_error(run_cli(*args), "does not exist")
    assert list(tmp_path.iterdir()) == []


def test_a_file_output_that_names_a_directory_is_refused(gguf_files: dict[str, Path], tmp_path: Path) -> None:
    result = run_cli("prep", "quantize", str(gguf_files["pi-f32"]), str(tmp_path), "Q8_0")
    assert_one_line_error(result, "is a directory")


def test_profile_makes_its_own_output_directory(tiny: SynthReport, corpus: Path, tmp_path: Path) -> None:
    profile = ["prep", "profile", str(tiny.model_dir), "--data", str(corpus), "--device", "cpu", "--out"]
    out = tmp_path / "runs" / "activation"
    # A checkpoint after every window is written into the directory before anything else.
    result = run_cli(*profile, str(out), "--tokens", "300", "--seq-len", "50", "--checkpoint-every", "1")
    assert result.returncode == 0, result.stderr
    assert (out / "summary.json").is_file()
    blocked = tmp_path / "file"
    blocked.write_text("keep me")
    assert_one_line_error(run_cli(*profile, str(blocked)), "is not an earlier activation directory")
    assert blocked.read_text() == "keep me"
