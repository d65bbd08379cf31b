"""User mistakes in `qinfer prep convert`: one clear line, exit code 2, and no output file left behind."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from qinfer.prep.convert.convert import convert
from qinfer.prep.synth.build import SynthReport


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "qinfer", *args], capture_output=True, text=True, timeout=300)


def assert_clean_failure(result: subprocess.CompletedProcess[str], out_dir: Path, expect: str) -> None:
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert expect in lines[0]
    assert list(out_dir.iterdir()) == []


@pytest.fixture
def copies(tiny: SynthReport, tmp_path: Path) -> tuple[Path, Path, Path]:
    model = shutil.copytree(tiny.model_dir, tmp_path / "model")
    predictor = shutil.copytree(tiny.predictor_dir, tmp_path / "predictor")
    out = tmp_path / "out"
    out.mkdir()
    return model, predictor, out


def test_missing_predictor_layer(copies: tuple[Path, Path, Path]) -> None:
    model, predictor, out = copies
    (predictor / "model_1.pt").unlink()
    result = run_cli("prep", "convert", str(model), str(predictor), "--outfile", str(out / "x.powerinfer.gguf"))
    assert_clean_failure(result, out, "model_1.pt")


def test_predictor_of_wrong_shape(copies: tuple[Path, Path, Path]) -> None:
    model, predictor, out = copies
    torch.save({"fc1.weight": torch.zeros(32, 7), "fc2.weight": torch.zeros(9, 32)}, predictor / "model_0.pt")
    result = run_cli("prep", "convert", str(model), str(predictor), "--outfile", str(out / "x.powerinfer.gguf"))
    assert_clean_failure(result, out, "do not fit this model")


def test_checkpoint_shape_disagrees_with_config(copies: tuple[Path, Path, Path]) -> None:
    model, _, out = copies
    config = json.loads((model / "config.json").read_text())
    config["intermediate_size"] += 32
    (model / "config.json").write_text(json.dumps(config))
    result = run_cli("prep", "convert-dense", str(model), "--outfile", str(out / "x.gguf"))
    assert_clean_failure(result, out, "config.json implies")


def test_unknown_architecture(copies: tuple[Path, Path, Path]) -> None:
    model, predictor, out = copies
    config = json.loads((model / "config.json").read_text())
    config["architectures"] = ["GPTNeoXForCausalLM"]
    (model / "config.json").write_text(json.dumps(config))
    result = run_cli("prep", "convert", str(model), str(predictor), "--outfile", str(out / "x.powerinfer.gguf"))
    assert_clean_failure(result, out, "unsupported architecture")


def test_missing_model_directory(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    result = run_cli("prep", "convert-dense", str(tmp_path / "nope"), "--outfile", str(out / "x.gguf"))
    assert_clean_failure(result, out, "not found")


def test_failure_while_writing_leaves_no_file(copies: tuple[Path, Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    model, predictor, out = copies
    target = out / "x.powerinfer.gguf"
    calls = 0

    def fail_on_third(plan: object) -> None:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        convert(model, target, predictor, "f16", on_tensor=fail_on_third)
    assert list(out.iterdir()) == []


def test_pytorch_bin_checkpoint_converts_to_the_same_bytes(tiny: SynthReport, tmp_path: Path) -> None:
    # Same directory name as the original, since general.name is taken from it.
    bin_dir = tmp_path / "bin" / tiny.model_dir.name
    bin_dir.mkdir(parents=True)
    torch.save(load_file(tiny.model_dir / "model.safetensors"), bin_dir / "pytorch_model.bin")
    for source in tiny.model_dir.iterdir():
        if source.suffix != ".safetensors":
            shutil.copy(source, bin_dir / source.name)
    assert not list(bin_dir.glob("*.safetensors")) and list(bin_dir.glob("pytorch_model*.bin"))
    a = convert(tiny.model_dir, tmp_path / "a.gguf", None, "f16").outfile
    b = convert(bin_dir, tmp_path / "b.gguf", None, "f16").outfile
    assert a.read_bytes() == b.read_bytes()
