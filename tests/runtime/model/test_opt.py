"""OPT across convert, convert-dense, quantize, profile, train-predictor, plan and run, against transformers'
OPTForCausalLM, with the tensors and keys the engine's own OPT converter writes."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer, OPTForCausalLM
from typer.testing import CliRunner

from qinfer.cli.main import app
from qinfer.core.errors import UserError
from qinfer.formats.activation_files import read_activations
from qinfer.formats.gguf_reader import metadata, open_gguf
from qinfer.formats.gpuidx import gpuidx_path_for, read_gpuidx
from qinfer.planner.make_plan import PlanOptions, dry_run_account, load_or_make_gpuidx
from qinfer.prep.convert.convert import convert
from qinfer.prep.convert.quantize import quantize_gguf
from qinfer.prep.predictor.residual_sample import collect_residuals
from qinfer.prep.predictor.training import TrainSettings, train_predictors
from qinfer.prep.profile.activation_profile import profile_activations
from qinfer.prep.profile.corpus_reader import token_windows
from qinfer.prep.profile.relu_model import load_relu_model
from qinfer.prep.synth.corpus import synth_corpus
from qinfer.prep.synth.opt import OPTShape, build_synth_opt
from qinfer.runtime.engine.tokenizer import GGUFTokenizer
from qinfer.runtime.model.loader import RuntimeOptions, load_forward
from qinfer.runtime.model.model_file import open_model
from tests.runtime.kernels.test_decode_layer import assert_native_batch_matches_torch, forward_for
from tests.support.fake_activation import write_power_law_activation
from tests.support.runtime_logits import last_logits, our_logits

SHAPE = OPTShape()
TEXT = "The dog ran fast,\nand the cat  slept. 42 times!"
# The engine's OPT converter writes these keys (and the tokenizer's); no kv heads, epsilon or rope keys.
OPT_KEYS = [
    "general.architecture",
    "general.name",
    "opt.context_length",
    "opt.embedding_length",
    "opt.block_count",
    "opt.feed_forward_length",
    "opt.attention.head_count",
    "general.file_type",
]
BLOCK_TENSORS = {
    **{f"{part}.{kind}": [64] for part in ("attn_norm", "ffn_norm") for kind in ("weight", "bias")},
    **{f"attn_{p}.weight": [64, 64] for p in ("q", "k", "v", "output")},
    **{f"attn_{p}.bias": [64] for p in ("q", "k", "v", "output")},
    "ffn_up.weight": [64, 256],
    "ffn_up.bias": [256],
    "ffn_down_t.weight": [64, 256],
    "ffn_down_t.bias": [64],
    "fc1.weight": [64, 128],
    "fc2.weight": [128, 256],
}


@pytest.fixture(scope="module")
def opt(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("opt")
    model_dir, predictor_dir = build_synth_opt(out / "synth", SHAPE)
    biased_dir, _ = build_synth_opt(out / "biased", SHAPE, exact_predictors=False)
    files = {"model": model_dir, "predictor": predictor_dir, "biased": biased_dir}
    for outtype in ("f32", "f16"):
        files[f"pi-{outtype}"] = convert(
            model_dir, out / f"o-{outtype}.powerinfer.gguf", predictor_dir, outtype
        ).outfile
    files["dense-f32"] = convert(model_dir, out / "o-f32.gguf", None, "f32").outfile
    files["biased-pi"] = convert(biased_dir, out / "b-f32.powerinfer.gguf", predictor_dir, "f32").outfile
    files["biased-dense"] = convert(biased_dir, out / "b-f32.gguf", None, "f32").outfile
    files["biased-pi-f16"] = convert(biased_dir, out / "b-f16.powerinfer.gguf", predictor_dir, "f16").outfile
    files["pi-q4"] = quantize_gguf(files["pi-f16"], out / "o-q4.powerinfer.gguf", "Q4_0").outfile
    return files


def reference(model_dir: Path, ids: list[int]) -> torch.Tensor:
    model = OPTForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize(
    ("model", "kind", "ffn"),
    [
        ("model", "pi-f32", "dense"),
        ("model", "pi-f32", "sparse"),  # exact predictors: sparse decode is the dense model
        ("model", "dense-f32", "dense"),
        ("biased", "biased-pi", "dense"),
        ("biased", "biased-pi", "oracle"),  # every bias non-zero: up's bias per neuron, down's once
        ("biased", "biased-dense", "dense"),
    ],
)
def test_logits_match_transformers(opt: dict[str, Path], model: str, kind: str, ffn: str) -> None:
    ids = GGUFTokenizer(open_model(opt[kind]).metadata).encode(TEXT)
    expected = reference(opt[model], ids)
    assert len(ids) > 12 and expected.abs().mean() > 0.1
    assert (our_logits(opt[kind], ids, ffn) - expected).abs().max().item() < 1e-3


@pytest.mark.parametrize(("model", "kind"), [("model", "pi-f32"), ("biased", "biased-pi")])
def test_a_prompts_last_token_alone_matches_transformers(opt: dict[str, Path], model: str, kind: str) -> None:
    """The block cut to the last token past its attention, with down's bias added to that row alone."""
    ids = GGUFTokenizer(open_model(opt[kind]).metadata).encode(TEXT)
    expected = reference(opt[model], ids)[-1]
    logits, queries = last_logits(opt[kind], ids, "dense")
    assert (logits - expected).abs().max().item() < 1e-3
    assert queries == [len(ids)] * (SHAPE.layers - 1) + [1]


def test_tokenizer_ids_equal_transformers(opt: dict[str, Path]) -> None:
    ours = GGUFTokenizer(open_model(opt["pi-f16"]).metadata)
    theirs = AutoTokenizer.from_pretrained(opt["model"])
    for text in (TEXT, " leading space", "tabs\tand\r\nnewlines", "émoji 🙂 and 中文", ""):
        assert ours.encode(text) == theirs(text)["input_ids"]
        assert ours.decode(ours.encode(text)) == theirs.decode(theirs(text)["input_ids"], skip_special_tokens=True)


def test_file_layout_is_the_engines(opt: dict[str, Path]) -> None:
    reader = open_gguf(opt["pi-f32"])
    meta = metadata(reader)
    assert reader.is_powerinfer
    assert [k for k in meta if not k.startswith(("tokenizer.", "powerinfer."))] == OPT_KEYS
    assert meta["general.architecture"] == "opt" and meta["tokenizer.ggml.model"] == "gpt2"
    # The learned position table has two rows before position 0, so the engine's context is the table's height.
    assert meta["opt.context_length"] == SHAPE.context + 2
    tensors = {t.name: t for t in reader.tensors}
    assert {n: list(tensors[n].shape) for n in ("token_embd.weight", "position_embd.weight")} == {
        "token_embd.weight": [64, SHAPE.padded_vocab],
        "position_embd.weight": [64, SHAPE.context + 2],
    }
    assert "output.weight" not in tensors  # the head is the token embedding
    assert {n.split(".", 2)[2]: list(t.shape) for n, t in tensors.items() if n.startswith("blk.1.")} == BLOCK_TENSORS
    hf = load_file(opt["model"] / "model.safetensors")
    assert np.array_equal(tensors["blk.1.ffn_down_t.weight"].data, hf["model.decoder.layers.1.fc2.weight"].T)
    assert np.array_equal(tensors["blk.1.ffn_down_t.bias"].data, hf["model.decoder.layers.1.fc2.bias"])
    assert np.array_equal(tensors["blk.1.attn_q.weight"].data, hf["model.decoder.layers.1.self_attn.q_proj.weight"])
    dense = {t.name for t in open_gguf(opt["dense-f32"]).tensors}
    assert {"blk.0.ffn_down.weight", "blk.0.ffn_down.bias"} <= dense and not any(".fc1." in n for n in dense)


def test_quantized_opt_runs_close_to_f16(opt: dict[str, Path]) -> None:
    types = {t.name: t.tensor_type for t in open_gguf(opt["pi-q4"]).tensors}
    assert types["blk.0.attn_q.weight"] == types["blk.0.ffn_down_t.weight"] == GGMLQuantizationType.Q4_0
    assert types["position_embd.weight"] == GGMLQuantizationType.Q4_0
    assert types["blk.0.ffn_up.bias"] == types["blk.0.attn_norm.bias"] == GGMLQuantizationType.F32
    ids = GGUFTokenizer(open_model(opt["pi-f16"]).metadata).encode(TEXT)
    f16 = our_logits(opt["pi-f16"], ids, "sparse")
    q4 = our_logits(opt["pi-q4"], ids, "sparse")
    # The head is the token embedding, 4-bit here as in the engine's files, so logits move more than a llama's
    # (whose output.weight is 8-bit); the ranking of tokens stays.
    assert 0 < (q4 - f16).abs().mean().item() < 0.2 * f16.abs().mean().item()
    assert (q4.argmax(-1) == f16.argmax(-1)).float().mean() > 0.8


def test_profile_counts_fc1_and_samples_the_residual(opt: dict[str, Path], tmp_path: Path) -> None:
    text = tmp_path / "one.txt"
    text.write_text('Lily found a red ball in the park. "Look, Tom!" she said, and they played until 5 o\'clock.\n')
    profile_activations(opt["model"], text, tmp_path / "activation", seq_len=64)
    loaded = load_relu_model(opt["model"], "f32", "cpu")
    [ids] = token_windows(loaded.tokenizer, [text], 64)
    captured: list[torch.Tensor] = []

    def keep(_module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        captured.append(args[0].reshape(-1, args[0].shape[-1]))  # OPT flattens the batch before the FFN

    layers = loaded.model.model.decoder.layers
    handles = [layer.final_layer_norm.register_forward_pre_hook(keep) for layer in layers]
    with torch.inference_mode():
        loaded.model(ids[None])
    for handle in handles:
        handle.remove()
    fired = [layer.fc1(layer.final_layer_norm(h)) > 0 for layer, h in zip(layers, captured, strict=True)]
    counts = torch.stack(read_activations(tmp_path / "activation"))
    assert torch.equal(counts, torch.stack([f.sum(0) for f in fired]))
    assert 0 < int(counts.sum()) < counts.numel() * len(ids)
    sample = collect_residuals(loaded, [ids], batch_size=1)
    for i in range(SHAPE.layers):
        assert torch.allclose(sample.residuals[i].float(), captured[i], atol=1e-2)
        assert torch.equal(sample.fired(i), fired[i])


def test_trained_opt_predictors_convert_and_run(opt: dict[str, Path], tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(synth_corpus(0, 30000, "train"), encoding="utf-8")
    settings = TrainSettings(rank=64, train_tokens=6000, heldout_tokens=1500, seq_len=128, epochs=4, device="cpu")
    report = train_predictors(opt["model"], corpus, tmp_path / "predictor", settings)
    assert all(q.recall >= 0.9 and q.true_sparsity > 0.3 for q in report.layers)
    path = convert(opt["model"], tmp_path / "trained.powerinfer.gguf", tmp_path / "predictor", "f32").outfile
    ids = GGUFTokenizer(open_model(path).metadata).encode(TEXT)
    dense, sparse = our_logits(path, ids, "dense"), our_logits(path, ids, "sparse")
    assert torch.equal(dense[:5], sparse[:5]) and 0 < (dense - sparse).abs().max().item() < 0.05 * dense.abs().max()


def test_plan_counts_the_up_bias_per_neuron_and_run_generates(opt: dict[str, Path], tmp_path: Path) -> None:
    model = Path(shutil.copy(opt["pi-f16"], tmp_path / "o.powerinfer.gguf"))
    write_power_law_activation(tmp_path / "activation", layers=SHAPE.layers, f=SHAPE.ffn)
    layout, acct = dry_run_account(model, 1 << 40, PlanOptions())
    # Per neuron: a row of up and of down_t in f16, and up's f32 bias.
    assert layout.layers[0].neuron_bytes == 2 * 64 * 2 + 4 and not layout.has_gate
    # The head is the token embedding, so the output head's bytes are its bytes (f16) and the final norm's; the
    # position table is looked up like the token embedding, on the CPU.
    token_embd, positions = SHAPE.padded_vocab * 64 * 2, (SHAPE.context + 2) * 64 * 2
    assert (layout.output_bytes, layout.embedding_bytes) == (token_embd + 2 * 64 * 4, token_embd + positions)
    plan = load_or_make_gpuidx(model, int(acct.dense + acct.ffn_total / 3), options=PlanOptions(), reset=True)
    assert 0 < sum(int(m.sum()) for m in read_gpuidx(gpuidx_path_for(model)).gpu_idx) < SHAPE.layers * SHAPE.ffn
    assert plan.gpuidx_path == gpuidx_path_for(model)
    result = CliRunner().invoke(app, ["run", "-m", str(model), "-p", "Once upon a time", "-n", "8", "--temp", "0"])
    assert result.exit_code == 0, result.output
    assert "tokens/s" in result.output
    # The GPU side (simulated on the CPU) holds FFN rows only: a biased FFN is refused with one line, not run wrong.
    with pytest.raises(UserError, match="biases"):
        load_forward(open_model(model), RuntimeOptions(vram_budget_gib=1.0, reset_gpu_index=True, device="cpu"))


def test_published_checkpoint_names_convert_to_the_same_bytes(opt: dict[str, Path], tmp_path: Path) -> None:
    """facebook/opt-* name tensors `decoder.*` and save no head; transformers' save_pretrained writes
    `model.decoder.*` and a tied `lm_head.weight`. Both give the same file."""
    published = Path(shutil.copytree(opt["model"], tmp_path / "published"))
    tensors = load_file(published / "model.safetensors")
    save_file(
        {k.removeprefix("model."): v.contiguous() for k, v in tensors.items() if k != "lm_head.weight"},
        published / "model.safetensors",
    )
    again = convert(published, tmp_path / "again.powerinfer.gguf", opt["predictor"], "f16").outfile
    # general.name is the directory's name, so the tensors are compared rather than the files' bytes.
    ours, theirs = open_gguf(again), open_gguf(opt["pi-f16"])
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        assert np.array_equal(a.data, b.data), a.name


@pytest.mark.parametrize(
    ("kind", "ffn"),
    [("pi-f16", "sparse"), ("biased-pi-f16", "sparse"), ("biased-pi-f16", "dense"), ("pi-q4", "sparse")],
)
def test_the_native_step_gives_the_torch_paths_logits(
    opt: dict[str, Path], monkeypatch: pytest.MonkeyPatch, kind: str, ffn: str
) -> None:
    """The native layer step computes opt's block (LayerNorms, a bias on every projection, no rope, relu(up + bias)
    and down's bias) for three sequences at once, as the torch path does; over Q4_0 rows to the rounding of the
    inputs each path quantizes in its own order."""
    tolerance = 1e-4 if kind != "pi-q4" else 2e-2
    assert_native_batch_matches_torch(forward_for(opt[kind], ffn), monkeypatch, tolerance)
