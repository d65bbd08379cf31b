"""`make all` end to end on a tiny synth model (no network), and make's own rules skipping up-to-date stages."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from qinfer.formats.gpuidx import read_gpuidx

ROOT = Path(__file__).resolve().parents[2]
VENV = Path(sys.executable).parent.parent
SHAPE = "--layers 2 --hidden 64 --ffn 256 --heads 4 --kv-heads 2 --vocab 512 --predictor-rank 32 --train-steps 0"
# The minimum for this shape (dense parts plus the 256 MiB scratch reserve) and room for about a quarter of its FFN.
VRAM = "0.25035"


def _make(work: Path, *args: str) -> subprocess.CompletedProcess[str]:
    command = [
        "make",
        "-C",
        str(ROOT),
        # The venv running the tests is set up already; never reinstall it from here.
        "-o",
        str(VENV / "bin" / ".installed"),
        f"VENV={VENV}",
        f"WORK={work}",
        f"SYNTH_ARGS={SHAPE}",
        "CORPUS_CHARS=20000",
        "PROFILE_TOKENS=2000",
        f"TINY_VRAM={VRAM}",
        "N_PREDICT=8",
        *args,
    ]
    return subprocess.run(command, capture_output=True, text=True, timeout=600)


@pytest.mark.skipif(shutil.which("make") is None, reason="needs GNU make")
def test_make_all_runs_the_tiny_pipeline_and_skips_what_is_up_to_date(tmp_path: Path) -> None:
    work = tmp_path / "tiny"
    first = _make(work, "all")
    assert first.returncode == 0, first.stdout + first.stderr
    model = work / "tiny.powerinfer.gguf"
    assert model.read_bytes()[:4] == b"PWRI"
    assert sorted(p.name for p in (work / "activation").glob("activation_*.pt")) == [
        "activation_0.pt",
        "activation_1.pt",
    ]
    index = read_gpuidx(Path(f"{model}.generated.gpuidx"))
    on_gpu = sum(int(layer.sum()) for layer in index.gpu_idx)
    assert 0 < on_gpu < 2 * 256, "the budget leaves room for some neurons, not all"
    assert first.stdout.count("Once upon a time") >= 1 and "decode: 8 tokens" in first.stderr

    # Make echoes each recipe it runs: a second `make all` only runs the model; a changed corpus re-profiles and
    # re-plans, but keeps the model. A dry run shows that much (the stages it lists are the ones a real run
    # would run), though not the first case: its plan-settings rule always runs, so a dry run lists the plan too.
    again = _make(work, "all")
    assert "qinfer prep" not in again.stdout and "qinfer plan" not in again.stdout and "qinfer run" in again.stdout
    # A plan made by hand with other settings (as the README's step-by-step section shows) is planned again with
    # make's, where the run would refuse it as stale.
    by_hand = [str(VENV / "bin" / "qinfer"), "plan", "-m", str(model), "--vram-budget", "0.3", "--batch", "2"]
    assert subprocess.run([*by_hand, "--reset-gpu-index"], capture_output=True, timeout=300).returncode == 0
    replanned = _make(work, "all")
    assert replanned.returncode == 0, replanned.stdout + replanned.stderr
    assert "qinfer prep" not in replanned.stdout and "qinfer plan" in replanned.stdout
    (work / "corpus.txt").touch()
    changed = _make(work, "-n", "all")
    assert "prep profile" in changed.stdout and "qinfer plan" in changed.stdout
    assert "prep synth" not in changed.stdout and "prep convert" not in changed.stdout


def _stages(output: str) -> list[str]:
    """The qinfer commands a dry run would execute, in order, as 'prep download', 'plan', 'run', ..."""
    stages = []
    for line in output.splitlines():
        words = line.split("qinfer ", 1)[1].split() if "/qinfer " in line else []
        if words:
            stages.append(" ".join(words[:2]) if words[0] == "prep" else words[0])
    return stages


@pytest.mark.skipif(shutil.which("make") is None, reason="needs GNU make")
def test_make_all_with_a_model_chains_download_convert_quantize_plan_run(tmp_path: Path) -> None:
    models = f"MODELS_DIR={tmp_path}"
    gguf = _make(tmp_path / "w", "-n", "all", "MODEL=ReluLLaMA-7B", "VRAM=6", models)
    assert gguf.returncode == 0, gguf.stderr
    assert _stages(gguf.stdout) == ["prep download", "plan", "run"]
    assert f"download ReluLLaMA-7B --source gguf --dir {tmp_path}/ReluLLaMA-7B" in gguf.stdout
    assert "--vram-budget 6" in gguf.stdout

    original = _make(tmp_path / "w", "-n", "all", "MODEL=ReluFalcon-40B", "SOURCE=original", "QUANT=Q4_0", models)
    assert original.returncode == 0, original.stderr
    assert _stages(original.stdout) == ["prep download", "prep convert", "prep quantize", "plan", "run"]
    assert f"--outfile {tmp_path}/ReluFalcon-40B/ReluFalcon-40B.powerinfer.gguf" in original.stdout
