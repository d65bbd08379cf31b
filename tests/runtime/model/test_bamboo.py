"""Bamboo (LLaMA tensors, relu(gate) * relu(up)) across convert, quantize, the sparse runtime and perplexity."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from qinfer.core.kv_policy import F32_KV
from qinfer.prep.convert.convert import convert
from qinfer.prep.convert.quantize import quantize_gguf
from qinfer.prep.synth.build import SynthReport
from qinfer.prep.synth.corpus import synth_corpus
from qinfer.runtime.engine.perplexity import perplexity
from qinfer.runtime.engine.tokenizer import GGUFTokenizer
from qinfer.runtime.kv.batch import TokenBatch
from qinfer.runtime.kv.cache import KVCache
from qinfer.runtime.model.loader import RuntimeOptions, load_forward
from qinfer.runtime.model.model_file import open_model

TEXT = "The dog ran fast,\nand the cat  slept. 42 times!"


@pytest.fixture(scope="module")
def bamboo(tiny: SynthReport, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny synth checkpoint declared a Bamboo model: same tensors, relu on up as well."""
    out = tmp_path_factory.mktemp("bamboo")
    model_dir = shutil.copytree(tiny.model_dir, out / "model")
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "architectures": ["BambooForCausalLM"]}))
    files = {"model": model_dir}
    for outtype in ("f32", "f16"):
        files[f"pi-{outtype}"] = convert(
            model_dir, out / f"b-{outtype}.powerinfer.gguf", tiny.predictor_dir, outtype
        ).outfile
    files["q4"] = quantize_gguf(files["pi-f16"], out / "b-q4.powerinfer.gguf", "Q4_0").outfile
    return files


def reference_logits(model_dir: Path, ids: list[int]) -> torch.Tensor:
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for layer in model.model.layers:
        mlp = layer.mlp
        mlp.forward = lambda x, mlp=mlp: mlp.down_proj(torch.relu(mlp.gate_proj(x)) * torch.relu(mlp.up_proj(x)))
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0]


def decode_logits(path: Path, ids: list[int], ffn: str) -> torch.Tensor:
    forward = load_forward(open_model(path), RuntimeOptions(ffn=ffn)).forward
    cache = KVCache(forward.cfg, 64, types=F32_KV)
    with torch.inference_mode():
        return torch.cat([forward.forward(TokenBatch.decode([t], [j], [0]), cache) for j, t in enumerate(ids)])


@pytest.mark.parametrize("ffn", ["dense", "sparse"])
def test_logits_match_transformers(bamboo: dict[str, Path], ffn: str) -> None:
    model = open_model(bamboo["pi-f32"])
    assert model.config.arch == "bamboo"
    ids = GGUFTokenizer(model.metadata).encode(TEXT)
    expected = reference_logits(bamboo["model"], ids)
    assert (decode_logits(bamboo["pi-f32"], ids, ffn) - expected).abs().max().item() < 1e-3


def test_q4_bamboo_stays_close_to_f16(bamboo: dict[str, Path]) -> None:
    model = open_model(bamboo["q4"])
    tokenizer = GGUFTokenizer(model.metadata)
    ids = tokenizer.encode(synth_corpus(0, 2000, "heldout"))
    diff = (decode_logits(bamboo["q4"], ids[:64], "sparse") - decode_logits(bamboo["pi-f16"], ids[:64], "sparse")).abs()
    assert 0 < diff.mean().item() < 0.25 and diff.max().item() < 2.0
    ppl = {
        name: perplexity(load_forward(open_model(bamboo[name]), RuntimeOptions()).forward, ids, 128, tokenizer.bos_id)
        for name in ("pi-f16", "q4")
    }
    assert abs(ppl["q4"].perplexity / ppl["pi-f16"].perplexity - 1) < 0.05
