"""`prep train-predictor`: recall on unseen text, a predictor directory the converter accepts, rank sizing."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from qinfer.cli.main import app
from qinfer.core.errors import UserError
from qinfer.formats.predictor_dir import FC1, FC2, load_layer, open_predictors
from qinfer.prep.convert.convert import convert
from qinfer.prep.predictor.quality import layer_quality, mean_nll, predictor_logits, predictor_sparse_ffn
from qinfer.prep.predictor.rank import auto_ranks
from qinfer.prep.predictor.residual_sample import collect_residuals
from qinfer.prep.predictor.training import TrainingReport, TrainSettings, share_threshold, train_predictors
from qinfer.prep.profile.corpus_reader import token_windows
from qinfer.prep.profile.relu_model import load_relu_model
from qinfer.prep.synth.build import SynthReport
from qinfer.prep.synth.corpus import synth_corpus

SETTINGS = TrainSettings(train_tokens=6000, heldout_tokens=2000, seq_len=128, epochs=12)


@pytest.fixture(scope="module")
def texts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("texts")
    paths = {}
    for split, chars in (("calibrate", 60_000), ("heldout", 20_000)):
        paths[split] = root / f"{split}.txt"
        paths[split].write_text(synth_corpus(5, chars, split), encoding="utf-8")
    return paths


@pytest.fixture(scope="module")
def trained(tiny: SynthReport, texts: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> TrainingReport:
    return train_predictors(tiny.model_dir, texts["calibrate"], tmp_path_factory.mktemp("pred") / "predictor", SETTINGS)


def _load(report: TrainingReport, layers: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    states = [load_layer(report.out / f"model_{i}.pt") for i in range(layers)]
    return [(s[FC1], s[FC2]) for s in states]


def test_recall_target_holds_on_unseen_text(tiny: SynthReport, trained: TrainingReport, texts: dict[str, Path]) -> None:
    assert [q.recall for q in trained.layers] == [pytest.approx(0.95, abs=0.005)] * 2  # the threshold's own data
    loaded = load_relu_model(tiny.model_dir, "f32", "cpu")
    windows = list(token_windows(loaded.tokenizer, [texts["heldout"]], 128, 3000))
    sample = collect_residuals(loaded, windows, batch_size=4)
    for i, predictor in enumerate(_load(trained, 2)):
        predicted = predictor_logits(predictor, sample.residuals[i].float()) >= trained.sparse_threshold
        q = layer_quality(i, predictor, predicted, sample.fired(i))
        assert q.recall >= 0.93, q
        assert q.predicted_sparsity >= q.true_sparsity - 0.10, q
        assert q.precision > 0.5, q


def test_predictor_directory_is_accepted_by_convert(tiny: SynthReport, trained: TrainingReport, tmp_path: Path) -> None:
    found = open_predictors(trained.out, layers=2, hidden=64, ffn=256)
    assert found.ranks == [32, 32]  # auto-rank: the 10% budget is below rank 32 at E=64, so the minimum
    assert found.sparse_threshold == pytest.approx(trained.sparse_threshold)
    config = json.loads((trained.out / "config.json").read_text())
    assert config["ranks"] == [32, 32] and config["train_tokens"] == 6000 and config["heldout_tokens"] == 2000
    assert not trained.within_budget and trained.params == 2 * 32 * (64 + 256)
    result = convert(tiny.model_dir, tmp_path / "t.powerinfer.gguf", trained.out, "f32")
    assert result.outfile.read_bytes()[:4] == b"PWRI"


def test_masked_ffn_matches_dense_when_all_neurons_kept_and_stays_close_when_predicted(
    tiny: SynthReport, trained: TrainingReport, texts: dict[str, Path]
) -> None:
    loaded = load_relu_model(tiny.model_dir, "f32", "cpu")
    windows = list(token_windows(loaded.tokenizer, [texts["heldout"]], 128, 2048))
    predictors = _load(trained, 2)
    dense = mean_nll(loaded.model, windows, 4, loaded.device)
    with predictor_sparse_ffn(loaded.layers, loaded.arch, predictors, -math.inf):
        assert mean_nll(loaded.model, windows, 4, loaded.device) == pytest.approx(dense, rel=1e-6)
    with predictor_sparse_ffn(loaded.layers, loaded.arch, predictors, math.inf):
        nothing = mean_nll(loaded.model, windows, 4, loaded.device)
    with predictor_sparse_ffn(loaded.layers, loaded.arch, predictors, trained.sparse_threshold):
        sparse = mean_nll(loaded.model, windows, 4, loaded.device)
    assert nothing > dense * 1.05  # the FFN matters, so masking it is a real test
    assert sparse < dense * 1.02


def test_shared_threshold_keeps_each_layers_cut() -> None:
    gen = torch.Generator().manual_seed(1)
    predictors = [(torch.randn(32, 8, generator=gen), torch.randn(16, 32, generator=gen)) for _ in range(3)]
    h = torch.randn(100, 8, generator=gen)
    own = [-0.5, -2.0, -1.0]
    shared, scaled = share_threshold(predictors, own)
    assert shared == -1.0
    for p, q, t in zip(predictors, scaled, own, strict=True):
        assert torch.equal(predictor_logits(p, h) >= t, predictor_logits(q, h) >= shared)
    lowest, same = share_threshold(predictors, [0.5, -2.0, math.inf])
    assert lowest == -2.0 and same is predictors


def test_auto_rank_sizes_by_density_within_budget() -> None:
    plan = auto_ranks([0.3, 0.1, 0.1, 0.05], [0.4, 0.6, 0.6, 0.8], hidden=512, ffn=2048)
    assert plan.within_budget and plan.budget == int(0.1 * 3 * 512 * 2048 * 4)
    assert all(r % 32 == 0 and r >= 32 for r in plan.ranks)
    assert plan.ranks[0] > plan.ranks[1] >= plan.ranks[3]
    assert plan.budget - plan.params < 32 * (512 + 2048)  # the spare budget is handed out
    tiny = auto_ranks([0.1, 0.1], [0.7, 0.7], hidden=64, ffn=256)
    assert tiny.ranks == [32, 32] and not tiny.within_budget


def test_train_predictor_command(tiny: SynthReport, texts: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "predictor"
    args = ["prep", "train-predictor", str(tiny.model_dir), "--data", str(texts["calibrate"]), "--out", str(out)]
    small = ["--train-tokens", "1000", "--heldout-tokens", "500", "--epochs", "2", "--seq-len", "100"]
    result = CliRunner().invoke(app, [*args, *small, "--rank", "64", "--recall", "0.9"])
    assert result.exit_code == 0, result.output
    assert "layer 1: rank 64" in result.output
    assert open_predictors(out, 2, 64, 256).ranks == [64, 64]
    both = CliRunner().invoke(app, [*args, *small, "--rank", "64", "--auto-rank"])
    assert isinstance(both.exception, UserError)
    with pytest.raises(UserError, match="multiple of 32"):
        train_predictors(tiny.model_dir, texts["calibrate"], out, TrainSettings(rank=40))
