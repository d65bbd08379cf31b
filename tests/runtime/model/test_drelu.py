"""dReLU on a Mistral shape (as TurboSparse-Mistral): relu on gate and up, declared by the config, profiled,
given trained predictors, converted and run sparse, against transformers' Mistral with the same activation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, MistralForCausalLM

from qinfer.formats.activation_files import read_activations
from qinfer.prep.convert.convert import convert
from qinfer.prep.predictor.training import TrainSettings, train_predictors
from qinfer.prep.profile.activation_profile import profile_activations
from qinfer.prep.synth.corpus import synth_corpus
from qinfer.prep.synth.swiglu import build_swiglu
from qinfer.runtime.model.model_file import open_model
from tests.support.runtime_logits import our_logits

TEXT = "Once upon a time, Lily found a red ball in the park. She was happy and played with it all day long."


@pytest.fixture(scope="module")
def drelu(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("drelu")
    model = build_swiglu(out / "model", "mistral", activation="drelu", init_std=0.1)
    corpus = out / "corpus.txt"
    corpus.write_text(synth_corpus(0, 30000, "train"), encoding="utf-8")
    profile_activations(model, corpus, out / "activation", seq_len=64, tokens=4000, device="cpu")
    settings = TrainSettings(rank=64, train_tokens=6000, heldout_tokens=1500, seq_len=64, epochs=4, device="cpu")
    train_predictors(model, corpus, out / "predictor", settings)
    pi = convert(model, out / "m.powerinfer.gguf", out / "predictor", "f32").outfile
    return {"model": model, "pi": pi, "activation": out / "activation"}


def reference_logits(model_dir: Path, ids: list[int]) -> torch.Tensor:
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["MistralForCausalLM"] and config["hidden_act"] == "drelu"
    model = MistralForCausalLM.from_pretrained(model_dir, dtype=torch.float32, hidden_act="relu").eval()
    for layer in model.model.layers:
        mlp = layer.mlp
        mlp.forward = lambda x, mlp=mlp: mlp.down_proj(torch.relu(mlp.gate_proj(x)) * torch.relu(mlp.up_proj(x)))
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0]


def test_drelu_mistral_runs_sparse_with_its_predictors(drelu: dict[str, Path]) -> None:
    model = open_model(drelu["pi"])
    assert (model.config.arch, model.config.activation, model.config.sliding_window) == ("llama", "drelu", 16)
    assert model.metadata["qinfer.feed_forward.activation"] == "drelu"
    ids = AutoTokenizer.from_pretrained(drelu["model"])(TEXT)["input_ids"]
    expected = reference_logits(drelu["model"], ids)
    assert (our_logits(drelu["pi"], ids, "dense") - expected).abs().max().item() < 1e-3
    assert (our_logits(drelu["pi"], ids, "oracle") - expected).abs().max().item() < 1e-3
    sparse = our_logits(drelu["pi"], ids, "sparse")
    # The predictors miss a few neurons: close to the model, not equal to it.
    assert 0 < (sparse - expected).abs().mean().item() < 0.1
    # Both relus count: a neuron fires only where gate and up are both positive, about a quarter of them.
    counts = torch.stack(read_activations(drelu["activation"])).float()
    assert 0.1 < counts.sum().item() / (counts.numel() * 4000) < 0.4
