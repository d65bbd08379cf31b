"""`qinfer prep synth --family`: a tiny untrained (or briefly trained) checkpoint of a SwiGLU family or a mixture of
experts, laid out as a ReLU synth build is (`out/model`, `out/synth.json`), so that a user without network can try
the calibration and expert paths that the README shows on real models."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from qinfer.core.errors import UserError
from qinfer.formats.atomic_file import atomic_directory
from qinfer.prep.synth.build import SYNTH_BUILD, check_synth_args
from qinfer.prep.synth.model import SynthShape
from qinfer.prep.synth.moe import MOE_FAMILIES, MoeShape, build_moe
from qinfer.prep.synth.swiglu import FAMILIES, SwigluShape, build_swiglu

RELU_FAMILY = "relu-llama"
SYNTH_FAMILIES = (RELU_FAMILY, *FAMILIES, *MOE_FAMILIES)


def build_family(out: Path, family: str, shape: SynthShape, seed: int = 0, train_steps: int = 0,
                 force: bool = False) -> Path:  # fmt: skip
    """Write `out/model` (a Hugging Face checkpoint of `family` with its tokenizer) and `out/synth.json`; `shape`'s
    ffn is each expert's for a mixture, and its predictor rank is not used. A mixture is not trained."""
    if family not in (*FAMILIES, *MOE_FAMILIES):
        raise UserError(f"unknown family {family!r}; use one of {', '.join(SYNTH_FAMILIES)}")
    check_synth_args(shape, train_steps)
    if family in MOE_FAMILIES and train_steps:
        raise UserError(f"a {family} synth model is built untrained; leave out --train-steps")
    with atomic_directory(out, SYNTH_BUILD, force) as tmp:
        tmp.chmod(0o755)  # a private temporary directory becomes an ordinary output one
        if family in MOE_FAMILIES:
            moe = MoeShape(layers=shape.layers, hidden=shape.hidden, heads=shape.heads, kv_heads=shape.kv_heads,
                           expert_ffn=shape.ffn, vocab=shape.vocab, context=shape.context)  # fmt: skip
            build_moe(tmp / "model", family, moe, seed)
        else:
            swiglu = SwigluShape(layers=shape.layers, hidden=shape.hidden, ffn=shape.ffn, heads=shape.heads,
                                 kv_heads=shape.kv_heads, vocab=shape.vocab, context=shape.context)  # fmt: skip
            build_swiglu(tmp / "model", family, swiglu, seed, train_steps)
        manifest = {"family": family, "seed": seed, "train_steps": train_steps, "shape": asdict(shape)}
        (tmp / "synth.json").write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    return out / "model"
