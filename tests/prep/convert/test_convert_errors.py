"""User mistakes in `qinfer prep convert`: one clear line, exit code 2, and no output file left behind."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from qinfer.prep.convert.convert import convert
from qinfer.prep.synth.build import SynthReport
from tests.support.cli_in_process import run_in_process


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
    result = run_in_process("prep", "convert", str(model), str(predictor), "--outfile", str(out / "x.powerinfer.gguf"))
    assert_clean_failure(result, out, "do not fit this model")


def test_checkpoint_shape_disagrees_with_config(copies: tuple[Path, Path, Path]) -> None:
    model, _, out = copies
    config = json.loads((model / "config.json").read_text())
    config["intermediate_size"] += 32
    (model / "config.json").write_text(json.dumps(config))
    result = run_in_process("prep", "convert-dense", str(model), "--outfile", str(out / "x.gguf"))
    assert_clean_failure(result, out, "config.json implies")


def test_unknown_architecture(copies: tuple[Path, Path, Path]) -> None:
    model, predictor, out = copies
    config = json.loads((model / "config.json").read_text())
    config["architectures"] = ["GPTNeoXForCausalLM"]
    (model / "config.json").write_text(json.dumps(config))
    result = run_in_process("prep", "convert", str(model), str(predictor), "--outfile", str(out / "x.powerinfer.gguf"))
    assert_clean_failure(result, out, "unsupported architecture")


def test_missing_model_directory(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    result = run_in_process("prep", "convert-dense", str(tmp_path / "nope"), "--outfile", str(out / "x.gguf"))
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


# A Llama-3.1 config.json of the tiny shape, as transformers before 5 writes it (rope_scaling beside rope_theta).
LLAMA3_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 192,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 640,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
}
DROP = object()  # a key the config leaves out


def _refused(tmp_path: Path, config: object, expect: str) -> None:
    """convert-dense on a directory holding only `config`: refused in one line that begins with the config's path
    and `expect` and says to fix it, before any weight is read."""
    (tmp_path / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    out.mkdir()
    result = run_in_process("prep", "convert-dense", str(tmp_path), "--outfile", str(out / "x.gguf"))
    assert_clean_failure(result, out, f"error: {tmp_path / 'config.json'}{expect}")
    assert result.stderr.rstrip().endswith("; fix config.json")


@pytest.mark.parametrize(
    ("field", "value", "expect"),
    [
        ("factor", 0, "rope_scaling.factor is 0, not a number in [1, 1e+06]"),
        ("factor", -8.0, "rope_scaling.factor is -8.0, not a number in [1, 1e+06]"),
        ("factor", math.nan, "rope_scaling.factor is nan"),
        ("factor", "8", "rope_scaling.factor is '8'"),
        ("factor", DROP, "llama3 rope scaling lacks rope_scaling.factor"),
        ("low_freq_factor", 0.0, "rope_scaling.low_freq_factor is 0.0, not a number in (0, 1e+06]"),
        ("high_freq_factor", math.inf, "rope_scaling.high_freq_factor is inf"),
        ("low_freq_factor", 4.0, "rope_scaling.low_freq_factor 4 is not below high_freq_factor 4"),
        ("low_freq_factor", 5.0, "rope_scaling.low_freq_factor 5 is not below high_freq_factor 4"),
        ("original_max_position_embeddings", 0, "rope_scaling.original_max_position_embeddings is 0, not a positive"),
        ("original_max_position_embeddings", -64, "rope_scaling.original_max_position_embeddings is -64"),
        ("original_max_position_embeddings", 64.5, "rope_scaling.original_max_position_embeddings is 64.5"),
        ("original_max_position_embeddings", DROP, "llama3 rope scaling lacks rope_scaling.original_max_position_"),
    ],
)
def test_broken_llama3_rope_scaling_is_refused(tmp_path: Path, field: str, value: object, expect: str) -> None:
    scaling = {k: v for k, v in {**LLAMA3_CONFIG["rope_scaling"], field: value}.items() if v is not DROP}
    _refused(tmp_path, {**LLAMA3_CONFIG, "rope_scaling": scaling}, f": {expect}")


@pytest.mark.parametrize(
    ("key", "value", "expect"),
    [
        ("num_attention_heads", 0, "num_attention_heads is 0, not a positive whole number"),
        ("hidden_size", "64", "hidden_size is '64', not a positive whole number"),
        ("num_hidden_layers", True, "num_hidden_layers is True"),
        ("vocab_size", 1 << 40, f"vocab_size is {1 << 40}"),
        ("max_position_embeddings", -1, "max_position_embeddings is -1"),
        ("num_key_value_heads", 3, "64 embedding dimensions, 4 heads and 3 kv heads do not divide evenly"),
        ("rms_norm_eps", math.nan, "rms_norm_eps is nan, not a number in [1e-12, 1]"),
        ("rms_norm_eps", -1e-5, "rms_norm_eps is -1e-05"),
        ("rope_theta", 0, "rope_theta is 0, not a number in [1e-06, 1e+12]"),
        ("rope_scaling", [8.0], "rope_scaling is [8.0], not an object"),
    ],
)
def test_meaningless_config_numbers_are_refused(tmp_path: Path, key: str, value: object, expect: str) -> None:
    _refused(tmp_path, {**LLAMA3_CONFIG, key: value}, f": {expect}")


def test_a_config_that_is_not_an_object(tmp_path: Path) -> None:
    _refused(tmp_path, [LLAMA3_CONFIG], " is not a JSON object")


@pytest.mark.parametrize("threshold", ["abc", math.nan, 1e300, [0.5]])
def test_a_predictor_threshold_that_is_not_a_finite_float32(copies: tuple[Path, Path, Path], threshold: object) -> None:
    """NaN was written into the file, which then refused to run; the others ended in a traceback."""
    model, predictor, out = copies
    (predictor / "config.json").write_text(json.dumps({"sparse_threshold": threshold}))
    result = run_in_process("prep", "convert", str(model), str(predictor), "--outfile", str(out / "x.powerinfer.gguf"))
    expect = f"error: {predictor / 'config.json'}: sparse_threshold is {threshold!r}, not a number in [-3.40282e+38"
    assert_clean_failure(result, out, expect)
    assert result.stderr.rstrip().endswith("; fix it or train the predictors again")
