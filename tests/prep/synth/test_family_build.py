"""`qinfer prep synth --family`: a SwiGLU family's or a mixture's tiny checkpoint from the command line, laid out as a
ReLU build is, replaced by a later build without --force, and refused predictor options."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.support.cli_in_process import run_in_process

SHAPE = ["--layers", "2", "--hidden", "64", "--ffn", "48", "--vocab", "640"]


@pytest.mark.parametrize(("family", "model_type"), [("llama3", "llama"), ("qwen2moe", "qwen2_moe")])
def test_a_family_builds_from_the_command_line(tmp_path: Path, family: str, model_type: str) -> None:
    out = tmp_path / "build"
    args = ["prep", "synth", "--out", str(out), "--family", family, *SHAPE]
    done = run_in_process(*args)
    assert done.returncode == 0, done.stderr
    assert done.stderr == f"model: {out / 'model'}\n"
    config = json.loads((out / "model" / "config.json").read_text())
    assert config["model_type"] == model_type and config["num_hidden_layers"] == 2 and config["hidden_size"] == 64
    ffn = config["moe_intermediate_size"] if family == "qwen2moe" else config["intermediate_size"]
    assert ffn == 48
    assert json.loads((out / "synth.json").read_text())["family"] == family
    first = load_file(out / "model" / "model.safetensors")
    # An earlier build is replaced without --force, and another seed gives other weights.
    assert run_in_process(*args, "--seed", "1").returncode == 0
    second = load_file(out / "model" / "model.safetensors")
    assert first.keys() == second.keys() and any(not first[k].equal(second[k]) for k in first)


def test_predictor_options_and_unknown_families_are_refused(tmp_path: Path) -> None:
    out = tmp_path / "build"
    for extra, words in (
        (["--family", "mistral", "--sparsity", "0.9"], "only relu-llama has predictors (--sparsity)"),
        (["--family", "qwen2", "--predictor-rank", "64"], "only relu-llama has predictors (--predictor-rank)"),
        (["--family", "mixtral", "--train-steps", "5"], "built untrained; leave out --train-steps"),
        (["--family", "gpt2"], "unknown family 'gpt2'; use one of relu-llama, llama3, mistral, qwen2, mixtral"),
    ):
        done = run_in_process("prep", "synth", "--out", str(out), *SHAPE, *extra)
        assert done.returncode == 2 and words in done.stderr and done.stderr.count("\n") <= 2, done.stderr
        assert not out.exists()
