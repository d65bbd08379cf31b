"""The synth model builder: a real tokenizer and LLaMA checkpoint, measured sparsity and skew, exact predictors.

Sparsity, skew and recall are recomputed here from the files on disk with forward hooks on a freshly loaded
model and text the builder never saw, rather than taken from its report.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import pytest
import sentencepiece as spm
import torch
from gguf.vocab import SentencePieceVocab
from safetensors.torch import load_file
from transformers import AutoTokenizer, LlamaForCausalLM

import qinfer.prep.synth.build as synth
import qinfer.prep.synth.model as synth_model
from qinfer.core.errors import UserError
from qinfer.formats.predictor_dir import open_predictors
from qinfer.prep.synth.build import SynthReport, SynthShape, build_synth
from qinfer.prep.synth.corpus import paragraphs, synth_corpus
from tests.conftest import TINY, TINY_STEPS

SMALL, STEPS = TINY, TINY_STEPS
SEQ = 128


@pytest.fixture
def built(tiny: SynthReport) -> SynthReport:
    return tiny


@dataclass(frozen=True)
class Seen:
    inputs: list[torch.Tensor]  # per layer [tokens, E]: the residual entering post_attention_layernorm
    fired: list[torch.Tensor]  # per layer bool [tokens, F]: gate_proj output > 0
    loss: float


def load(model_dir: Path) -> tuple[LlamaForCausalLM, AutoTokenizer]:
    model = LlamaForCausalLM.from_pretrained(model_dir, local_files_only=True).eval()
    return model, AutoTokenizer.from_pretrained(model_dir, local_files_only=True)


def heldout_batch(tokenizer: AutoTokenizer, rows: int, seed: int = 1234) -> torch.Tensor:
    ids: list[int] = []
    for story in paragraphs(synth_corpus(seed, rows * SEQ * 8, "heldout")):
        ids += tokenizer(story).input_ids + [tokenizer.eos_token_id]
    assert len(ids) >= rows * SEQ
    return torch.tensor(ids[: rows * SEQ]).view(rows, SEQ)


def run_with_hooks(model: LlamaForCausalLM, batch: torch.Tensor) -> Seen:
    layers = list(model.model.layers)
    inputs: list[torch.Tensor] = [torch.empty(0)] * len(layers)
    fired: list[torch.Tensor] = [torch.empty(0)] * len(layers)
    handles = []
    for i, layer in enumerate(layers):

        def keep_input(_m: torch.nn.Module, args: tuple[torch.Tensor, ...], i: int = i) -> None:
            inputs[i] = args[0].reshape(-1, args[0].shape[-1])

        def keep_fired(_m: torch.nn.Module, _a: tuple[torch.Tensor, ...], out: torch.Tensor, i: int = i) -> None:
            fired[i] = (out > 0).reshape(-1, out.shape[-1])

        handles.append(layer.post_attention_layernorm.register_forward_pre_hook(keep_input))
        handles.append(layer.mlp.gate_proj.register_forward_hook(keep_fired))
    with torch.no_grad():
        loss = float(model(input_ids=batch, labels=batch).loss)
    for handle in handles:
        handle.remove()
    return Seen(inputs, fired, loss)


def hot_share(fired: torch.Tensor) -> float:
    counts = fired.sum(dim=0).sort(descending=True).values
    return float(counts[: int(0.2 * len(counts))].sum() / counts.sum())


def test_layout(built: SynthReport) -> None:
    out = built.model_dir.parent
    assert built.predictor_dir == out / "predictor"
    wanted = {"config.json", "model.safetensors", "tokenizer.model", "tokenizer.json", "tokenizer_config.json"}
    assert wanted <= {p.name for p in built.model_dir.iterdir()}
    assert sorted(p.name for p in built.predictor_dir.iterdir()) == ["config.json", "model_0.pt", "model_1.pt"]
    assert [p.name for p in out.parent.iterdir()] == [out.name]  # no temporary directory left beside it
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    assert size < 3_000_000
    manifest = json.loads((out / "synth.json").read_text())
    assert manifest["shape"] == asdict(SMALL) and manifest["seed"] == 0 and manifest["train_steps"] == STEPS


def test_loads_offline_as_llama(built: SynthReport) -> None:
    model, tokenizer = load(built.model_dir)
    cfg = model.config
    assert (cfg.hidden_act, cfg.tie_word_embeddings, cfg.num_key_value_heads, cfg.vocab_size) == ("relu", False, 2, 512)
    assert (cfg.bos_token_id, cfg.eos_token_id) == (1, 2)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    ids = tokenizer("Once upon a time").input_ids
    assert ids[0] == 1 and len(ids) > 2
    assert tokenizer.decode(ids, skip_special_tokens=True) == "Once upon a time"
    logits = model(input_ids=torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), 512) and bool(torch.isfinite(logits).all())


def test_tokenizer_matches_sentencepiece_and_gguf_reads_it(built: SynthReport) -> None:
    sp = spm.SentencePieceProcessor(model_file=str(built.model_dir / "tokenizer.model"))
    _, tokenizer = load(built.model_dir)
    text = 'Lily had 12 apples. "Can I have some?" asked Tom.\n\nZed, a new name, and é.'
    assert tokenizer(text).input_ids == [1, *sp.encode(text)]
    vocab = SentencePieceVocab(built.model_dir)
    assert vocab.vocab_size == 512
    assert [t for t, _, _ in list(vocab.all_tokens())[:3]] == [b"<unk>", b"<s>", b"</s>"]


def test_learned_language(built: SynthReport) -> None:
    model, tokenizer = load(built.model_dir)
    loss = run_with_hooks(model, heldout_batch(tokenizer, 4)).loss
    assert loss < math.log(512) - 2.0
    assert abs(loss - built.heldout_loss) < 0.3


def test_sparse_and_skewed_on_heldout_text(built: SynthReport) -> None:
    model, tokenizer = load(built.model_dir)
    seen = run_with_hooks(model, heldout_batch(tokenizer, 16))
    sparsity = [1.0 - float(f.float().mean()) for f in seen.fired]
    shares = [hot_share(f) for f in seen.fired]
    assert all(s >= 0.85 for s in sparsity), sparsity
    assert all(s >= 0.65 for s in shares), shares
    assert built.sparsity == pytest.approx(sum(sparsity) / len(sparsity), abs=0.02)
    assert built.top20_share == pytest.approx(sum(shares) / len(shares), abs=0.05)
    assert built.per_layer_sparsity == pytest.approx(sparsity, abs=0.02)


def test_predictors_flag_the_firing_neurons(built: SynthReport) -> None:
    found = open_predictors(built.predictor_dir, SMALL.layers, SMALL.hidden, SMALL.ffn)
    assert found.ranks == [32, 32]
    threshold = json.loads((built.predictor_dir / "config.json").read_text())["sparse_threshold"]
    assert isinstance(threshold, float) and threshold == found.sparse_threshold == built.sparse_threshold
    model, tokenizer = load(built.model_dir)
    seen = run_with_hooks(model, heldout_batch(tokenizer, 16))
    for i, (h, fired) in enumerate(zip(seen.inputs, seen.fired, strict=True)):
        state = torch.load(built.predictor_dir / f"model_{i}.pt", weights_only=True)
        assert sorted(state) == ["fc1.weight", "fc2.weight"]
        fc1, fc2 = state["fc1.weight"], state["fc2.weight"]
        assert (fc1.shape, fc2.shape, fc1.dtype, fc2.dtype) == ((32, 64), (256, 32), torch.float32, torch.float32)
        flagged = torch.relu(h @ fc1.T) @ fc2.T >= threshold
        recall = float((flagged & fired).sum() / fired.sum())
        assert recall >= 0.99, (i, recall)
        assert 1.0 - float(flagged.float().mean()) >= 0.85  # not just "everything fires"
    assert built.predictor_recall >= 0.99


def test_same_seed_same_bytes_other_seed_other_weights(built: SynthReport, tmp_path: Path) -> None:
    again = build_synth(tmp_path / "again", SMALL, seed=0, train_steps=STEPS)
    other = build_synth(tmp_path / "other", SMALL, seed=1, train_steps=2)
    for name in ("model/model.safetensors", "model/tokenizer.model", "model/tokenizer.json", "predictor/config.json"):
        assert (again.model_dir.parent / name).read_bytes() == (built.model_dir.parent / name).read_bytes(), name
    mine = torch.load(built.predictor_dir / "model_1.pt", weights_only=True)
    assert torch.equal(
        mine["fc2.weight"], torch.load(again.predictor_dir / "model_1.pt", weights_only=True)["fc2.weight"]
    )
    base = load_file(built.model_dir / "model.safetensors")
    changed = load_file(other.model_dir / "model.safetensors")
    assert base.keys() == changed.keys()
    assert not torch.equal(base["model.layers.0.mlp.up_proj.weight"], changed["model.layers.0.mlp.up_proj.weight"])


def test_untrained_wider_shape_is_still_sparse(tmp_path: Path) -> None:
    shape = SynthShape(layers=1, hidden=512, ffn=1376, heads=8, kv_heads=8, vocab=512, context=128)
    report = build_synth(tmp_path / "wide", shape, seed=3, train_steps=0)
    model, tokenizer = load(report.model_dir)
    seen = run_with_hooks(model, heldout_batch(tokenizer, 4))
    sparsity = 1.0 - float(seen.fired[0].float().mean())
    assert sparsity >= 0.8
    assert hot_share(seen.fired[0]) >= 0.6
    assert report.sparsity == pytest.approx(0.9, abs=0.02)


def test_zero_steps_leave_the_seeded_init_but_the_bias_channel(tmp_path: Path) -> None:
    shape = SynthShape(layers=1, hidden=64, ffn=256, heads=4, kv_heads=2, vocab=512, context=128, predictor_rank=32)
    report = build_synth(tmp_path / "untrained", shape, seed=3, train_steps=0, target_sparsity=0.8)
    gen = torch.Generator().manual_seed(3)
    synth_model.firing_rates(shape.layers, shape.ffn, 1.0 - 0.8, gen)  # the builder draws the rates first
    untrained, _ = synth_model.init_model(shape, gen)
    saved = load_file(report.model_dir / "model.safetensors")
    assert saved.keys() == untrained.state_dict().keys()
    for name, weight in untrained.state_dict().items():
        assert torch.equal(uncalibrated(name, saved[name]), uncalibrated(name, weight)), name


def uncalibrated(name: str, weight: torch.Tensor) -> torch.Tensor:
    """The part calibration leaves alone: it writes the gate biases (column 0) and shrinks them into channel 0 of
    post_attention_layernorm and up_proj."""
    if "gate_proj" in name or "up_proj" in name:
        return weight[:, 1:]
    return weight[1:] if "post_attention_layernorm" in name else weight


def test_reports_progress_and_follows_the_target(tmp_path: Path) -> None:
    calls: list[tuple[str, int, int]] = []
    report = build_synth(
        tmp_path / "out", SMALL, train_steps=3, target_sparsity=0.8, progress=lambda *c: calls.append(c)
    )
    assert [c for c in calls if c[0] == "train"] == [("train", 1, 3), ("train", 2, 3), ("train", 3, 3)]
    finished = [stage for stage, done, total in calls if done == total]
    assert finished == ["tokenizer", "train", "calibrate", "measure", "save"]
    assert report.sparsity == pytest.approx(0.8, abs=0.02)


def test_failed_build_leaves_nothing_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*_args: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(synth, "save_predictors", broken)
    with pytest.raises(OSError, match="disk full"):
        build_synth(tmp_path / "out", SMALL, train_steps=0)
    assert list(tmp_path.iterdir()) == []


def test_replaces_an_earlier_build_but_not_other_directories(tmp_path: Path) -> None:
    first = build_synth(tmp_path / "out", SMALL, seed=0, train_steps=0)
    build_synth(tmp_path / "out", SMALL, seed=5, train_steps=0)
    assert json.loads((first.model_dir.parent / "synth.json").read_text())["seed"] == 5
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me")
    with pytest.raises(UserError, match="not an earlier synth build"):
        build_synth(precious, SMALL, train_steps=0)
    assert [p.name for p in precious.iterdir()] == ["notes.txt"]


@pytest.mark.parametrize(
    ("shape", "problem"),
    [
        (SynthShape(predictor_rank=48), "multiple of 32"),
        (SynthShape(heads=3), "heads"),
        (SynthShape(heads=4, kv_heads=3), "kv_heads"),
        (SynthShape(vocab=300), "vocab"),
    ],
)
def test_rejects_bad_shapes(shape: SynthShape, problem: str, tmp_path: Path) -> None:
    with pytest.raises(UserError, match=problem):
        build_synth(tmp_path / "out", shape, train_steps=0)


def test_rejects_training_windows_longer_than_the_context(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="train_seq_len=512 must lie between 128 and the context 256"):
        build_synth(tmp_path / "out", SynthShape(context=256), train_steps=1, train_seq_len=512)


def test_long_context_model_trains_on_windows_of_its_length(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shapes: list[tuple[int, ...]] = []
    real_train = synth.train

    def spy(model: torch.nn.Module, *args: object) -> None:
        hook = model.register_forward_pre_hook(
            lambda _m, _a, kw: shapes.append(tuple(kw["input_ids"].shape)), with_kwargs=True
        )
        real_train(model, *args)
        hook.remove()

    monkeypatch.setattr(synth, "train", spy)
    shape = SynthShape(layers=1, hidden=64, ffn=128, heads=2, kv_heads=2, vocab=512, context=512, predictor_rank=32)
    report = build_synth(tmp_path / "long", shape, train_steps=2, train_seq_len=512)
    # The same tokens per step as the default 16 x 128, in windows of 512.
    assert shapes == [(4, 512), (4, 512)]
    assert json.loads((report.model_dir / "config.json").read_text())["max_position_embeddings"] == 512
    assert json.loads((tmp_path / "long" / "synth.json").read_text())["train_seq_len"] == 512


def test_corpus_is_deterministic_plain_paragraphs() -> None:
    text = synth_corpus(7, 5000)
    assert text == synth_corpus(7, 5000)
    assert text != synth_corpus(8, 5000)
    assert text[:2000] != synth_corpus(7, 5000, "heldout")[:2000]
    stories = paragraphs(text)
    assert len(text) >= 5000 and len(stories) >= 5
    assert text == "\n\n".join(stories)
    assert all(s.isascii() and s[0].isupper() and s.endswith((".", '"', "!")) for s in stories)
    words = {w.strip(".,!?\"'").lower() for w in synth_corpus(0, 200_000).split()}
    assert 250 <= len(words) <= 600
