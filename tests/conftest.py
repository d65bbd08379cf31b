"""Shared tiny models: built once per test session from the synth builder, converted with our converter."""

from __future__ import annotations

from pathlib import Path

import pytest

from qinfer_prep.convert import convert
from qinfer_prep.synth import SynthReport, SynthShape, build_synth

TINY = SynthShape(layers=2, hidden=64, ffn=256, heads=4, kv_heads=2, vocab=512, context=256, predictor_rank=32)
TINY_STEPS = 60


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> SynthReport:
    return build_synth(tmp_path_factory.mktemp("synth") / "tiny", TINY, seed=0, train_steps=TINY_STEPS)


@pytest.fixture(scope="session")
def gguf_files(tiny: SynthReport, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny model as PowerInfer and dense GGUF, in f32 and f16."""
    out = tmp_path_factory.mktemp("gguf")
    files = {}
    for outtype in ("f32", "f16"):
        files[f"pi-{outtype}"] = convert(
            tiny.model_dir, out / f"tiny-{outtype}.powerinfer.gguf", tiny.predictor_dir, outtype
        ).outfile
        files[f"dense-{outtype}"] = convert(tiny.model_dir, out / f"tiny-{outtype}.gguf", None, outtype).outfile
    return files
