"""Calibrate and predictor training refuse a mixture-of-experts checkpoint in one line, before loading it: its
experts are SwiGLU and not calibrated, and what they would hook is no neuron's gate or up. (`prep profile` counts
its routing: test_expert_profile.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from qinfer.prep.synth.moe import MOE_FAMILIES
from tests.support.cli_in_process import run_in_process


@pytest.mark.parametrize("command", ["calibrate", "train-predictor"])
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_experts_are_refused(moe: dict[str, dict[str, Path]], family: str, command: str, tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("Once upon a time there was a ball.\n" * 8, encoding="utf-8")
    model = moe[family]["model"]
    ran = run_in_process("prep", command, str(model), "--data", str(corpus), "--out", str(tmp_path / "out"))
    assert ran.returncode == 2, ran.stderr
    assert ran.stderr.strip().splitlines() == [
        f"error: {model} has experts, which are not calibrated or given predictors yet; count their routing with "
        "`qinfer prep profile`, or convert it with `qinfer prep convert-dense` and run it dense"
    ]
    assert not (tmp_path / "out").exists()
