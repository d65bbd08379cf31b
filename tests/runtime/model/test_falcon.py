"""ReLU Falcon across convert, quantize and the runtime, against transformers' FalconForCausalLM."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from safetensors.torch import load_file
from transformers import FalconForCausalLM

from qinfer.formats.activation_files import read_activations
from qinfer.formats.gguf_reader import metadata, open_gguf
from qinfer.prep.convert.convert import convert
from qinfer.prep.convert.quantize import quantize_gguf
from qinfer.prep.predictor.residual_sample import collect_residuals
from qinfer.prep.predictor.training import TrainSettings, train_predictors
from qinfer.prep.profile.activation_profile import profile_activations
from qinfer.prep.profile.corpus_reader import token_windows
from qinfer.prep.profile.relu_model import load_relu_model
from qinfer.prep.synth.corpus import synth_corpus
from qinfer.prep.synth.falcon import FalconShape, build_synth_falcon
from qinfer.runtime.engine.tokenizer import GGUFTokenizer
from qinfer.runtime.model.model_file import open_model
from tests.runtime.kernels.test_decode_layer import assert_native_batch_matches_torch, forward_for
from tests.support.runtime_logits import last_logits, our_logits

SHAPE = FalconShape(layers=2, hidden=64, ffn=256, heads=8, kv_heads=2, vocab=512)
TEXT = "The dog ran fast,\nand the cat  slept. 42 times!"


@pytest.fixture(scope="module")
def falcon(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("falcon")
    model_dir, predictor_dir = build_synth_falcon(out / "synth", SHAPE)
    files = {"model": model_dir, "predictor": predictor_dir}
    for outtype in ("f32", "f16"):
        files[f"pi-{outtype}"] = convert(
            model_dir, out / f"f-{outtype}.powerinfer.gguf", predictor_dir, outtype
        ).outfile
    files["dense-f32"] = convert(model_dir, out / "f-f32.gguf", None, "f32").outfile
    files["pi-q4"] = quantize_gguf(files["pi-f16"], out / "f-q4.powerinfer.gguf", "Q4_0").outfile
    return files


@pytest.fixture(scope="module")
def reference(falcon: dict[str, Path]) -> tuple[list[int], torch.Tensor]:
    ids = GGUFTokenizer(open_model(falcon["pi-f32"]).metadata).encode(TEXT)
    model = FalconForCausalLM.from_pretrained(falcon["model"], dtype=torch.float32).eval()
    with torch.inference_mode():
        return ids, model(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize(("kind", "ffn"), [("pi-f32", "dense"), ("pi-f32", "sparse"), ("dense-f32", "dense")])
def test_logits_match_transformers(
    falcon: dict[str, Path], reference: tuple[list[int], torch.Tensor], kind: str, ffn: str
) -> None:
    ids, expected = reference
    assert len(ids) > 12 and expected.abs().mean() > 0.1
    assert (our_logits(falcon[kind], ids, ffn) - expected).abs().max().item() < 1e-3


def test_a_prompts_last_token_alone_matches_transformers(
    falcon: dict[str, Path], reference: tuple[list[int], torch.Tensor]
) -> None:
    """The parallel block cut to the last token past its attention: both branches and the residual of that row."""
    ids, expected = reference
    logits, queries = last_logits(falcon["pi-f32"], ids, "dense")
    assert (logits - expected[-1]).abs().max().item() < 1e-3
    assert queries == [len(ids)] * (SHAPE.layers - 1) + [1]


def test_file_layout_follows_llama_cpp(falcon: dict[str, Path]) -> None:
    reader = open_gguf(falcon["pi-f32"])
    meta = metadata(reader)
    assert reader.is_powerinfer and meta["general.architecture"] == "falcon"
    assert meta["falcon.tensor_data_layout"] == "jploski"
    assert meta["falcon.attention.layer_norm_epsilon"] == pytest.approx(1e-5)
    assert (meta["falcon.attention.head_count"], meta["falcon.attention.head_count_kv"]) == (8, 2)
    assert "falcon.rope.dimension_count" not in meta and "falcon.attention.layer_norm_rms_epsilon" not in meta
    tensors = {t.name: t for t in reader.tensors}
    assert {n.split(".", 2)[2] for n in tensors if n.startswith("blk.0.")} == {
        "attn_norm.weight", "attn_norm.bias", "attn_norm_2.weight", "attn_norm_2.bias", "attn_qkv.weight",
        "attn_output.weight", "ffn_up.weight", "ffn_down_t.weight", "fc1.weight", "fc2.weight",
    }  # fmt: skip
    hf = load_file(falcon["model"] / "model.safetensors")
    # The fused QKV regrouped by hand: group g holds 4 query heads, then its key head, then its value head.
    fused = hf["transformer.h.1.self_attention.query_key_value.weight"].numpy()
    heads = fused.reshape(2, 6, 8, 64)
    q = [heads[g, j] for g in range(2) for j in range(4)]
    want = np.concatenate(q + [heads[g, 4] for g in range(2)] + [heads[g, 5] for g in range(2)])
    assert np.array_equal(tensors["blk.1.attn_qkv.weight"].data, want)
    assert np.array_equal(tensors["blk.1.attn_norm.weight"].data, hf["transformer.h.1.ln_mlp.weight"].numpy())
    assert np.array_equal(tensors["blk.1.attn_norm_2.bias"].data, hf["transformer.h.1.ln_attn.bias"].numpy())
    assert np.array_equal(tensors["blk.1.ffn_down_t.weight"].data, hf["transformer.h.1.mlp.dense_4h_to_h.weight"].T)


def test_quantized_falcon_runs_close_to_f16(falcon: dict[str, Path], reference: tuple[list[int], torch.Tensor]) -> None:
    types = {t.name: t.tensor_type for t in open_gguf(falcon["pi-q4"]).tensors}
    assert types["output.weight"] == GGMLQuantizationType.Q8_0
    assert types["blk.0.attn_qkv.weight"] == types["blk.0.ffn_down_t.weight"] == GGMLQuantizationType.Q4_0
    assert types["blk.0.attn_norm.bias"] == GGMLQuantizationType.F32
    ids, _ = reference
    diff = (our_logits(falcon["pi-q4"], ids, "sparse") - our_logits(falcon["pi-f16"], ids, "sparse")).abs()
    assert 0 < diff.mean().item() < 0.1 and diff.max().item() < 0.5


def test_profile_counts_relu_up_and_samples_the_layer_input(falcon: dict[str, Path], tmp_path: Path) -> None:
    text = tmp_path / "one.txt"
    text.write_text('Lily found a red ball in the park. "Look, Tom!" she said, and they played until 5 o\'clock.\n')
    profile_activations(falcon["model"], text, tmp_path / "activation", seq_len=64)
    loaded = load_relu_model(falcon["model"], "f32", "cpu")
    [ids] = token_windows(loaded.tokenizer, [text], 64)
    with torch.inference_mode():
        inputs = loaded.model(ids[None], output_hidden_states=True).hidden_states  # inputs[i]: layer i's input
    fired = [
        layer.mlp.dense_h_to_4h(layer.ln_mlp(inputs[i][0])) > 0 for i, layer in enumerate(loaded.model.transformer.h)
    ]
    counts = torch.stack(read_activations(tmp_path / "activation"))
    assert torch.equal(counts, torch.stack([f.sum(0) for f in fired]))
    assert 0 < int(counts.sum()) < counts.numel() * len(ids)
    sample = collect_residuals(loaded, [ids], batch_size=1)
    for i in range(SHAPE.layers):
        assert torch.allclose(sample.residuals[i].float(), inputs[i][0], atol=1e-2)
        assert torch.equal(sample.fired(i), fired[i])
        predictor = torch.load(falcon["predictor"] / f"model_{i}.pt")
        # The synth predictors are exact on the layer input: they flag exactly the neurons that fire.
        scores = torch.relu(inputs[i][0] @ predictor["fc1.weight"].T) @ predictor["fc2.weight"].T
        assert torch.equal(scores > 0, fired[i])


def test_trained_falcon_predictors_convert_and_run(falcon: dict[str, Path], tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(synth_corpus(0, 30000, "train"), encoding="utf-8")
    settings = TrainSettings(rank=64, train_tokens=6000, heldout_tokens=1500, seq_len=128, epochs=4, device="cpu")
    report = train_predictors(falcon["model"], corpus, tmp_path / "predictor", settings)
    assert all(q.recall >= 0.9 and q.true_sparsity > 0.3 for q in report.layers)
    path = convert(falcon["model"], tmp_path / "trained.powerinfer.gguf", tmp_path / "predictor", "f32").outfile
    ids = GGUFTokenizer(open_model(path).metadata).encode(TEXT)
    dense, sparse = our_logits(path, ids, "dense"), our_logits(path, ids, "sparse")
    # Missed neurons change the output a little; the prompt (dense) part is identical.
    assert torch.equal(dense[:5], sparse[:5]) and 0 < (dense - sparse).abs().max().item() < 1.0


@pytest.mark.parametrize(("kind", "ffn"), [("pi-f16", "sparse"), ("pi-f16", "dense"), ("pi-q4", "sparse")])
def test_the_native_step_gives_the_torch_paths_logits(
    falcon: dict[str, Path], monkeypatch: pytest.MonkeyPatch, kind: str, ffn: str
) -> None:
    """The native layer step computes falcon's parallel block (LayerNorms with biases, the fused QKV rows, relu(up)
    without a gate, the predictor reading the layer's input) for three sequences at once, as the torch path does;
    over Q4_0 rows to the rounding of the inputs each path quantizes in its own order."""
    tolerance = 1e-4 if kind != "pi-q4" else 2e-2
    assert_native_batch_matches_torch(forward_for(falcon[kind], ffn), monkeypatch, tolerance)
