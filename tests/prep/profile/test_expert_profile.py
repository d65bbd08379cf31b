"""`prep profile` on a model with experts: per layer, how many tokens each expert's router chose, equal to the
routing transformers itself computes, in an activation directory that says its unit is experts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from qinfer.core.errors import UserError
from qinfer.core.spec_readers import spec_from_hf_dir
from qinfer.formats.activation_files import SUMMARY_FILE, count_basis, read_activations
from qinfer.planner.activation_stats import load_activation
from qinfer.prep.profile.activation_profile import STATE_FILE, profile_activations
from qinfer.prep.profile.corpus_reader import batches, token_windows
from qinfer.prep.synth.corpus import synth_corpus
from qinfer.prep.synth.moe import MOE_FAMILIES, build_moe
from tests.support.cli_in_process import run_in_process

SEQ_LEN, BATCH = 64, 2


class Interrupted(Exception):
    pass


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("moe-profile")
    return {family: build_moe(out / family, family) for family in MOE_FAMILIES}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "stories.txt"
    path.write_text(synth_corpus(3, 6_000, "calibrate"), encoding="utf-8")
    return path


def transformers_routing(model_dir: Path, corpus: Path) -> torch.Tensor:
    """[L, N] counts of each token's top-k experts, from the router logits transformers reports for the same
    batches (so that every product has the shapes it has when profiled)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    cfg = model.config
    count = getattr(cfg, "num_local_experts", None) or cfg.num_experts
    counts = torch.zeros(cfg.num_hidden_layers, count, dtype=torch.int64)
    with torch.no_grad():
        for batch in batches(token_windows(tokenizer, [corpus], SEQ_LEN), BATCH):
            logits = model(input_ids=batch, output_router_logits=True, use_cache=False).router_logits
            assert len(logits) == cfg.num_hidden_layers
            for i, layer in enumerate(logits):
                top = torch.topk(torch.softmax(layer.float(), -1), cfg.num_experts_per_tok, -1).indices
                counts[i] += torch.bincount(top.flatten(), minlength=count)
    return counts


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_expert_counts_equal_transformers_routing(
    models: dict[str, Path], corpus: Path, family: str, tmp_path: Path
) -> None:
    experts = spec_from_hf_dir(models[family]).experts
    assert experts is not None
    result = profile_activations(models[family], corpus, tmp_path, seq_len=SEQ_LEN, batch_size=BATCH, device="cpu")
    counts = torch.stack(read_activations(tmp_path))
    assert counts.dtype == torch.int64 and counts.shape == (2, experts.count)
    assert counts.sum(1).tolist() == [result.tokens * experts.used] * 2
    assert torch.equal(counts, transformers_routing(models[family], corpus))
    assert (counts > 0).all() and not (counts == counts[:, :1]).all()  # a router that really varies
    summary = json.loads((tmp_path / SUMMARY_FILE).read_text())
    assert (summary["unit"], summary["expert_count"], summary["expert_used_count"]) == ("expert", experts.count, 2)
    assert count_basis(tmp_path).unit == "expert" and result.unit == "expert"
    assert [layer.sparsity for layer in result.layers] == [1 - experts.used / experts.count] * 2


def test_an_interrupted_expert_profile_resumes_to_the_same_counts(
    models: dict[str, Path], corpus: Path, tmp_path: Path
) -> None:
    args = dict(tokens=1500, seq_len=SEQ_LEN, batch_size=BATCH, checkpoint_every=4, device="cpu")
    whole = profile_activations(models["qwen3moe"], corpus, tmp_path / "whole", **args)

    def stop_after_ten(_tokens: int, _wanted: int | None, windows: int) -> None:
        if windows >= 10:
            raise Interrupted

    with pytest.raises(Interrupted):
        profile_activations(models["qwen3moe"], corpus, tmp_path / "parts", on_progress=stop_after_ten, **args)
    assert (tmp_path / "parts" / STATE_FILE).is_file()
    resumed = profile_activations(models["qwen3moe"], corpus, tmp_path / "parts", **args)
    assert resumed.resumed_from == 8
    parts, whole_counts = (torch.stack(read_activations(tmp_path / name)) for name in ("parts", "whole"))
    assert torch.equal(parts, whole_counts)
    assert resumed.tokens == whole.tokens == 1500


def test_the_cli_profiles_experts(models: dict[str, Path], corpus: Path, tmp_path: Path) -> None:
    out = tmp_path / "activation"
    ran = run_in_process(
        "prep", "profile", str(models["mixtral"]), "--data", str(corpus), "--out", str(out), "--seq-len", "64",
        "--device", "cpu",
    )  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    assert [len(c) for c in read_activations(out)] == [4, 4]
    assert "layer 1: the most-routed 10/20/50% of experts take " in ran.stderr


def test_the_planner_refuses_an_expert_profile(models: dict[str, Path], corpus: Path, tmp_path: Path) -> None:
    profile_activations(models["mixtral"], corpus, tmp_path, tokens=200, seq_len=SEQ_LEN, device="cpu")
    # Layer files as long as the FFN the planner expects: only the unit tells them apart.
    with pytest.raises(UserError, match="counts experts but this model places FFN neurons"):
        load_activation(tmp_path, (4, 4))


def test_a_directory_without_a_unit_counts_neurons(tmp_path: Path) -> None:
    assert count_basis(tmp_path).unit == "neuron"  # no summary.json, as in directories written before experts
    (tmp_path / SUMMARY_FILE).write_text('{"tokens": 3, "layers": []}')
    assert count_basis(tmp_path).unit == "neuron"
    (tmp_path / SUMMARY_FILE).write_text('{"unit": "head"}')
    with pytest.raises(UserError, match="unit 'head' is not one of neuron, expert; re-profile the model"):
        count_basis(tmp_path)
