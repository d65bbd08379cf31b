"""Output paths a hostile environment prepares: a pipe or a device where a file goes is refused and left as it was,
never renamed over; a directory output is swapped in whole and replaces only a directory of its own kind."""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path

import pytest

from qinfer.core.errors import UserError
from qinfer.formats import activation_files
from qinfer.formats.atomic_file import atomic_directory, atomic_output, check_output_file, check_replaceable
from qinfer.prep.hub.download import _place
from qinfer.prep.profile import gate_calibration
from qinfer.prep.profile.activation_profile import profile_activations
from qinfer.prep.profile.gate_calibration import calibrate_gate
from qinfer.prep.synth.build import SynthReport
from qinfer.prep.synth.corpus import synth_corpus
from tests.cli.test_output_guards import assert_one_line_error, snapshot
from tests.support.cli_in_process import run_in_process

SIZES = {"tokens": 400, "seq_len": 50}


class Killed(Exception):
    """Stands for a kill that lands while an output is being written."""


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    path = tmp_path / "corpus.txt"
    path.write_text(synth_corpus(3, 8_000, "calibrate"), encoding="utf-8")
    return path


@pytest.fixture
def fifo(tmp_path: Path) -> Path:
    path = tmp_path / "pipe"
    os.mkfifo(path)
    return path


def assert_still_a_pipe(path: Path) -> None:
    assert stat.S_ISFIFO(path.lstat().st_mode), f"{path} was replaced"
    assert [p.name for p in path.parent.iterdir() if p.name.startswith(".")] == []  # no temporary left beside it


@pytest.mark.parametrize("command", ["corpus", "convert-dense", "quantize"])
def test_file_outputs_refuse_a_named_pipe(
    command: str, fifo: Path, tiny: SynthReport, gguf_files: dict[str, Path]
) -> None:
    args = {
        "corpus": ["prep", "corpus", "--out", str(fifo), "--chars", "100"],
        "convert-dense": ["prep", "convert-dense", str(tiny.model_dir), "--outfile", str(fifo)],
        "quantize": ["prep", "quantize", str(gguf_files["pi-f32"]), str(fifo), "Q8_0"],
    }[command]
    assert_one_line_error(run_in_process(*args), f"{fifo}: it is a named pipe, not a regular file; pick another path")
    assert_still_a_pipe(fifo)


def test_dev_null_is_refused_as_any_output_and_stays_the_device() -> None:
    # Only the checks run here, never a write: before them, root's write would have replaced the machine's /dev/null.
    null = Path("/dev/null")
    before = null.lstat()
    assert stat.S_ISCHR(before.st_mode)
    with pytest.raises(UserError, match="it is a character device, not a regular file"):
        check_output_file(null)
    with pytest.raises(UserError, match="it is a character device, not a directory"):
        check_replaceable(null, None, force=True)
    after = null.lstat()
    assert stat.S_ISCHR(after.st_mode) and (after.st_rdev, after.st_ino) == (before.st_rdev, before.st_ino)


def test_a_pipe_made_while_the_output_is_written_is_not_renamed_over(tmp_path: Path) -> None:
    target = tmp_path / "out.txt"
    with pytest.raises(UserError, match="named pipe"), atomic_output(target) as tmp:
        tmp.write_text("done")
        os.mkfifo(target)
    assert_still_a_pipe(target)


def test_directory_outputs_refuse_a_pipe_even_when_forced(fifo: Path) -> None:
    with pytest.raises(UserError, match="it is a named pipe, not a directory"), atomic_directory(fifo, force=True):
        pass
    assert_still_a_pipe(fifo)


def test_calibrate_refuses_a_pipe_as_its_output_directory(fifo: Path, corpus: Path, tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    result = run_in_process("prep", "calibrate", str(model), "--data", str(corpus), "--out", str(fifo))
    assert_one_line_error(result, "it is a named pipe, not a directory")
    assert_still_a_pipe(fifo)


def test_download_refuses_a_pipe_where_a_file_goes(fifo: Path, tmp_path: Path) -> None:
    cached = tmp_path / "blob"
    cached.write_bytes(b"weights")
    with pytest.raises(UserError, match="named pipe"):
        _place(cached, fifo)
    assert_still_a_pipe(fifo)


@pytest.mark.parametrize("command", ["profile", "calibrate"])
def test_activation_outputs_refuse_a_directory_of_other_files(
    command: str, tiny: SynthReport, corpus: Path, tmp_path: Path
) -> None:
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    (out / "activation_0.pt").write_bytes(b"not written by us")
    before = snapshot(out)
    result = run_in_process("prep", command, str(tiny.model_dir), "--data", str(corpus), "--out", str(out))
    assert_one_line_error(result, "pass --force to replace it")
    assert snapshot(out) == before


def test_profile_and_calibrate_take_each_others_outputs_as_their_own_kind(
    tiny: SynthReport, corpus: Path, tmp_path: Path
) -> None:
    out = tmp_path / "activation"
    profile_activations(tiny.model_dir, corpus, out, device="cpu", **SIZES)
    calibrated = calibrate_gate(tiny.model_dir, corpus, 0.5, out, device="cpu", **SIZES)
    assert sorted(p.name for p in out.iterdir()) == [
        "activation_0.pt", "activation_1.pt", "gate_thresholds.json", "summary.json"
    ]  # fmt: skip
    assert calibrated.calibration.tokens == SIZES["tokens"]
    with pytest.raises(UserError, match="not an earlier activation directory"):
        profile_activations(tiny.model_dir, corpus, out, device="cpu", **SIZES)  # the thresholds would be lost


def _profile(model: Path, corpus: Path, out: Path, tokens: int) -> None:
    profile_activations(model, corpus, out, device="cpu", tokens=tokens, seq_len=50)


def _calibrate(model: Path, corpus: Path, out: Path, tokens: int) -> None:
    calibrate_gate(model, corpus, 0.5, out, device="cpu", tokens=tokens, seq_len=50)


def _killed(*_args: object, **_kwargs: object) -> None:
    raise Killed


def _bytes(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in directory.iterdir()}


@pytest.mark.parametrize(
    ("write", "module", "step"),
    [
        (_profile, activation_files, "summarise"),  # killed after the layer files, before summary.json
        (_calibrate, gate_calibration, "write_calibration"),  # killed after the counts, before the thresholds
    ],
    ids=["profile", "calibrate"],
)
def test_a_run_killed_while_writing_leaves_the_earlier_directory_whole(
    write: Callable[[Path, Path, Path, int], None],
    module: object,
    step: str,
    tiny: SynthReport,
    corpus: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    out = tmp_path / "out"
    write(tiny.model_dir, corpus, out, 200)
    earlier = _bytes(out)
    monkeypatch.setattr(module, step, _killed)
    with pytest.raises(Killed):
        write(tiny.model_dir, corpus, out, 400)  # other counts than the earlier run's
    assert _bytes(out) == earlier  # no new layer file beside an old summary or old thresholds
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.txt", "out"]
    monkeypatch.undo()
    write(tiny.model_dir, corpus, out, 400)
    assert _bytes(out).keys() == earlier.keys() and _bytes(out) != earlier
