"""The GGUF files `convert` and `convert-dense` write, checked against docs/formats.md field by field."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

from qinfer.formats.gguf_reader import metadata, open_gguf
from qinfer.prep.synth.build import SynthReport
from tests.conftest import TINY

E, F, L, P, V = TINY.hidden, TINY.ffn, TINY.layers, TINY.predictor_rank, TINY.vocab
E_KV = E // TINY.heads * TINY.kv_heads
F32, F16 = gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16

POWERINFER_KEYS = [
    "general.architecture",
    "general.name",
    "llama.context_length",
    "llama.embedding_length",
    "llama.block_count",
    "llama.feed_forward_length",
    "llama.rope.dimension_count",
    "llama.attention.head_count",
    "llama.attention.head_count_kv",
    "llama.attention.layer_norm_rms_epsilon",
    "llama.rope.freq_base",
    "general.file_type",
    "tokenizer.ggml.model",
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.scores",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.unknown_token_id",
    # gguf's SpecialVocab reads these flags from the synth tokenizer.json's post-processor template.
    "tokenizer.ggml.add_bos_token",
    "tokenizer.ggml.add_sep_token",
    "powerinfer.sparse_threshold",
]


def expected_tensors(powerinfer: bool, two_d: gguf.GGMLQuantizationType) -> list[tuple[str, list[int], int]]:
    """(name, ggml ne, type) in file order, spelled out from docs/formats.md#tensors."""
    rows = [("token_embd.weight", [E, V], two_d), ("output_norm.weight", [E], F32), ("output.weight", [E, V], two_d)]
    for i in range(L):
        rows += [
            (f"blk.{i}.attn_norm.weight", [E], F32),
            (f"blk.{i}.attn_q.weight", [E, E], two_d),
            (f"blk.{i}.attn_k.weight", [E, E_KV], two_d),
            (f"blk.{i}.attn_v.weight", [E, E_KV], two_d),
            (f"blk.{i}.attn_output.weight", [E, E], two_d),
            (f"blk.{i}.ffn_norm.weight", [E], F32),
            (f"blk.{i}.ffn_gate.weight", [E, F], two_d),
            (f"blk.{i}.ffn_up.weight", [E, F], two_d),
        ]
        if powerinfer:
            rows += [
                (f"blk.{i}.ffn_down_t.weight", [E, F], two_d),
                (f"blk.{i}.fc1.weight", [E, P], two_d),
                (f"blk.{i}.fc2.weight", [P, F], two_d),
            ]
        else:
            rows.append((f"blk.{i}.ffn_down.weight", [F, E], two_d))
    return rows


def tensor_table(path: Path) -> list[tuple[str, list[int], int]]:
    return [(t.name, [int(d) for d in t.shape], t.tensor_type) for t in open_gguf(path).tensors]


def tensors_by_name(path: Path) -> dict[str, np.ndarray]:
    return {t.name: np.array(t.data) for t in open_gguf(path).tensors}


@pytest.mark.parametrize("outtype", ["f32", "f16"])
def test_powerinfer_file_matches_design(gguf_files: dict[str, Path], tiny: SynthReport, outtype: str) -> None:
    path = gguf_files[f"pi-{outtype}"]
    head = path.read_bytes()[:8]
    assert head[:4] == b"PWRI"
    assert int.from_bytes(head[4:8], "little") == 3
    reader = open_gguf(path)
    assert reader.is_powerinfer
    assert reader.alignment == 32
    assert reader.data_offset % 32 == 0
    meta = metadata(reader)
    assert list(meta) == POWERINFER_KEYS
    assert meta["general.architecture"] == "llama"
    assert meta["general.file_type"] == {"f32": 0, "f16": 1}[outtype]
    assert meta["llama.embedding_length"] == E
    assert meta["llama.feed_forward_length"] == F
    assert meta["llama.block_count"] == L
    assert meta["llama.attention.head_count"] == TINY.heads
    assert meta["llama.attention.head_count_kv"] == TINY.kv_heads
    assert meta["llama.rope.dimension_count"] == E // TINY.heads
    assert meta["llama.context_length"] == TINY.context
    assert meta["tokenizer.ggml.model"] == "llama"
    assert len(meta["tokenizer.ggml.tokens"]) == V
    assert (meta["tokenizer.ggml.bos_token_id"], meta["tokenizer.ggml.eos_token_id"]) == (1, 2)
    assert meta["tokenizer.ggml.add_bos_token"] is True
    threshold = json.loads((tiny.predictor_dir / "config.json").read_text())["sparse_threshold"]
    assert meta["powerinfer.sparse_threshold"] == pytest.approx(threshold, abs=1e-6)
    for field_name in ("powerinfer.sparse_threshold", "llama.attention.layer_norm_rms_epsilon"):
        assert reader.keys[field_name].kind == gguf.GGUFValueType.FLOAT32
    assert tensor_table(path) == expected_tensors(True, F16 if outtype == "f16" else F32)


def test_dense_file_differs_only_where_design_says(gguf_files: dict[str, Path]) -> None:
    pi_path, dense_path = gguf_files["pi-f32"], gguf_files["dense-f32"]
    assert dense_path.read_bytes()[:4] == b"GGUF"
    plain = gguf.GGUFReader(dense_path)  # the gguf package's own reader accepts it as is
    dense_meta = {key: field.contents() for key, field in plain.fields.items() if not key.startswith("GGUF.")}
    pi_meta = metadata(open_gguf(pi_path))
    # A dense llama file is read as llama.cpp reads one (SwiGLU) unless it says otherwise: a ReLU one says so.
    assert dense_meta.pop("qinfer.feed_forward.activation") == "relu"
    assert "qinfer.feed_forward.activation" not in pi_meta  # PowerInfer's own llama files are ReLU
    assert list(dense_meta) == [k for k in POWERINFER_KEYS if k != "powerinfer.sparse_threshold"]
    assert {k: v for k, v in pi_meta.items() if k != "powerinfer.sparse_threshold"} == dense_meta
    assert tensor_table(dense_path) == expected_tensors(False, F32)
    pi, dense = tensors_by_name(pi_path), tensors_by_name(dense_path)
    for name, data in dense.items():
        if ".ffn_down." in name:
            np.testing.assert_array_equal(data, pi[name.replace("ffn_down", "ffn_down_t")].T)
        else:
            np.testing.assert_array_equal(data, pi[name])


def test_gguf_reader_refuses_pwri_but_ours_reads_it(gguf_files: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match="magic"):
        gguf.GGUFReader(gguf_files["pi-f32"])
    assert not open_gguf(gguf_files["dense-f32"]).is_powerinfer


def test_tensor_data_is_the_checkpoint_with_ggml_layout(gguf_files: dict[str, Path], tiny: SynthReport) -> None:
    hf = load_file(tiny.model_dir / "model.safetensors")
    ours = tensors_by_name(gguf_files["pi-f32"])
    # transformers' GGUF loader undoes llama.cpp's q/k permutation: it must give back the HF weights.
    unpermute = LlamaTensorProcessor(config={"num_attention_heads": TINY.heads, "num_key_value_heads": TINY.kv_heads})
    for i in range(L):
        pre = f"model.layers.{i}"
        for gguf_name, hf_name in (("attn_q", "self_attn.q_proj"), ("attn_k", "self_attn.k_proj")):
            name = f"blk.{i}.{gguf_name}.weight"
            assert not np.array_equal(ours[name], hf[f"{pre}.{hf_name}.weight"].numpy())
            restored = unpermute.process(ours[name], name).weights
            np.testing.assert_array_equal(restored, hf[f"{pre}.{hf_name}.weight"].numpy())
        np.testing.assert_array_equal(ours[f"blk.{i}.ffn_down_t.weight"], hf[f"{pre}.mlp.down_proj.weight"].numpy().T)
        np.testing.assert_array_equal(ours[f"blk.{i}.ffn_gate.weight"], hf[f"{pre}.mlp.gate_proj.weight"].numpy())
        np.testing.assert_array_equal(ours[f"blk.{i}.attn_v.weight"], hf[f"{pre}.self_attn.v_proj.weight"].numpy())
        predictor = torch.load(tiny.predictor_dir / f"model_{i}.pt", weights_only=True)
        np.testing.assert_array_equal(ours[f"blk.{i}.fc1.weight"], predictor["fc1.weight"].numpy())
        np.testing.assert_array_equal(ours[f"blk.{i}.fc2.weight"], predictor["fc2.weight"].numpy())
    np.testing.assert_array_equal(ours["token_embd.weight"], hf["model.embed_tokens.weight"].numpy())
    np.testing.assert_array_equal(ours["output.weight"], hf["lm_head.weight"].numpy())


def test_f16_file_holds_the_rounded_weights(gguf_files: dict[str, Path]) -> None:
    f32, f16 = tensors_by_name(gguf_files["pi-f32"]), tensors_by_name(gguf_files["pi-f16"])
    for name, data in f32.items():
        assert f16[name].dtype == (np.float32 if data.ndim == 1 else np.float16)
        np.testing.assert_array_equal(f16[name], data.astype(f16[name].dtype))


def test_vocabulary_matches_the_sentencepiece_model(gguf_files: dict[str, Path], tiny: SynthReport) -> None:
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=str(tiny.model_dir / "tokenizer.model"))
    meta = metadata(open_gguf(gguf_files["pi-f16"]))
    assert meta["tokenizer.ggml.tokens"] == [sp.id_to_piece(i) for i in range(sp.vocab_size())]
    np.testing.assert_allclose(meta["tokenizer.ggml.scores"], [sp.get_score(i) for i in range(sp.vocab_size())])
    types = meta["tokenizer.ggml.token_type"]
    assert types[0] == gguf.TokenType.UNKNOWN and types[1] == types[2] == gguf.TokenType.CONTROL
    assert types.count(gguf.TokenType.BYTE) == 256
