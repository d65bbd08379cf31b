"""convert-dense of Mixtral, Qwen2-MoE and Qwen3-MoE writes llama.cpp's layout: its architecture names, tensor names
and ggml shapes (what llama.cpp's loader asks for), its metadata keys, every expert stacked in order."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from gguf import MODEL_ARCH, MODEL_ARCH_NAMES, MODEL_TENSORS, TENSOR_NAMES, GGMLQuantizationType, GGUFReader, Keys
from safetensors.torch import load_file

from qinfer.core.architectures import ARCHITECTURES
from qinfer.core.errors import UserError
from qinfer.prep.convert.quant_blocks import quantize_q4_0
from qinfer.prep.synth.moe import MOE_FAMILIES
from tests.support.cli_in_process import run_in_process

LLAMA_CPP_ARCH = {"mixtral": MODEL_ARCH.LLAMA, "qwen2moe": MODEL_ARCH.QWEN2MOE, "qwen3moe": MODEL_ARCH.QWEN3MOE}
# Each family's checkpoint name of expert j's matrices (gate, up, down) in layer i.
HF_EXPERT = {
    "mixtral": "model.layers.{i}.block_sparse_moe.experts.{j}.{w}.weight",
    "qwen2moe": "model.layers.{i}.mlp.experts.{j}.{w}.weight",
    "qwen3moe": "model.layers.{i}.mlp.experts.{j}.{w}.weight",
}
HF_MATRICES = {"mixtral": ("w1", "w3", "w2"), "qwen2moe": ("gate_proj", "up_proj", "down_proj")}


def llama_cpp_shapes(config: dict, family: str) -> dict[str, tuple[int, ...]]:
    """The ggml shapes (ne) llama.cpp's loader creates a layer's MoE tensors with (llama-model.cpp)."""
    e, n = config["hidden_size"], config.get("num_local_experts", config.get("num_experts"))
    f = config.get("moe_intermediate_size", config["intermediate_size"])
    shapes = {
        "ffn_gate_inp": (e, n),
        "ffn_gate_exps": (e, f, n),
        "ffn_up_exps": (e, f, n),
        "ffn_down_exps": (f, e, n),
    }
    if family == "qwen2moe":
        s = config["shared_expert_intermediate_size"]
        shapes |= {"ffn_gate_inp_shexp": (e, 1), "ffn_gate_shexp": (e, s), "ffn_up_shexp": (e, s),
                   "ffn_down_shexp": (s, e)}  # fmt: skip
    if family == "qwen3moe":
        head, heads, kv_heads = config["head_dim"], config["num_attention_heads"], config["num_key_value_heads"]
        assert head != e // heads  # Qwen3-MoE's heads are their own size
        shapes |= {"attn_q_norm": (head,), "attn_k_norm": (head,), "attn_q": (e, heads * head),
                   "attn_k": (e, kv_heads * head), "attn_output": (heads * head, e)}  # fmt: skip
    return shapes


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_convert_dense_writes_llama_cpps_moe_layout(
    moe: dict[str, dict[str, Path]], family: str, tmp_path: Path
) -> None:
    model = moe[family]["model"]
    out = tmp_path / f"{family}.gguf"
    ran = run_in_process("prep", "convert-dense", str(model), "--outfile", str(out), "--outtype", "f16")
    assert ran.returncode == 0, ran.stderr
    config = json.loads((model / "config.json").read_text())
    reader = GGUFReader(out)
    meta = {name: field.contents() for name, field in reader.fields.items()}
    arch = MODEL_ARCH_NAMES[LLAMA_CPP_ARCH[family]]
    assert meta["general.architecture"] == arch
    experts = config.get("num_local_experts", config.get("num_experts"))
    assert meta[Keys.LLM.EXPERT_COUNT.format(arch=arch)] == experts
    assert meta[Keys.LLM.EXPERT_USED_COUNT.format(arch=arch)] == config["num_experts_per_tok"]
    expert_ffn = config.get("moe_intermediate_size", config["intermediate_size"])
    assert meta[Keys.LLM.EXPERT_FEED_FORWARD_LENGTH.format(arch=arch)] == expert_ffn
    shared = Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH.format(arch=arch)
    assert meta.get(shared) == config.get("shared_expert_intermediate_size")
    # llama.cpp's converter writes a head's size where config.json gives one; ours where it is not hidden / heads.
    head = config.get("head_dim") if family == "qwen3moe" else None
    for template in (Keys.Attention.KEY_LENGTH, Keys.Attention.VALUE_LENGTH):
        assert meta.get(template.format(arch=arch)) == head
    tensors = {t.name: t for t in reader.tensors}
    # Only names llama.cpp's table has for this architecture.
    known = {TENSOR_NAMES[t].format(bid=i) for t in MODEL_TENSORS[LLAMA_CPP_ARCH[family]] for i in range(2)}
    assert {name.rsplit(".", 1)[0] for name in tensors} <= known
    state = load_file(model / "model.safetensors")
    for i in range(config["num_hidden_layers"]):
        for part, ne in llama_cpp_shapes(config, family).items():
            tensor = tensors[f"blk.{i}.{part}.weight"]
            assert tuple(int(d) for d in tensor.shape) == ne, part
            # A router rounded to f16 could choose other experts: llama.cpp's converter keeps it f32, and so do we.
            if part.startswith("ffn_gate_inp") or len(ne) == 1:
                assert tensor.tensor_type == GGMLQuantizationType.F32, part
        stacked = {part: np.asarray(tensors[f"blk.{i}.ffn_{part}_exps.weight"].data) for part in ("gate", "up", "down")}
        for j in range(experts):
            for part, w in zip(("gate", "up", "down"), HF_MATRICES.get(family, HF_MATRICES["qwen2moe"]), strict=True):
                expected = state[HF_EXPERT[family].format(i=i, j=j, w=w)].numpy()
                np.testing.assert_allclose(stacked[part][j], expected, rtol=1e-3, atol=1e-4)


def test_moe_config_refusals(moe: dict[str, dict[str, Path]]) -> None:
    where = moe["qwen2moe"]["model"] / "config.json"
    config = json.loads(where.read_text())
    for keys, message in (
        ({"mlp_only_layers": [1]}, "dense FFNs between the expert layers"),
        ({"decoder_sparse_step": 2}, "dense FFNs between the expert layers"),
        ({"num_experts_per_tok": 5}, "num_experts_per_tok 5 is not between 1 and the 4 experts"),
        ({"num_experts": None}, "has no num_experts"),
    ):
        with pytest.raises(UserError, match=message):
            ARCHITECTURES["qwen2moe"].read_config({**config, **keys}, where)


def test_heads_of_their_own_size_need_experts(moe: dict[str, dict[str, Path]]) -> None:
    """The native step and the planner take heads of hidden / heads; only the families with experts use neither."""
    where = moe["mixtral"]["model"] / "config.json"
    config = json.loads(where.read_text())
    with pytest.raises(UserError, match="head_dim 32 is not hidden_size / num_attention_heads"):
        ARCHITECTURES["llama"].read_config({**config, "head_dim": 32}, where)


def test_experts_are_not_made_sparse_yet(moe: dict[str, dict[str, Path]], tmp_path: Path) -> None:
    calibration = tmp_path / "calibration"
    calibration.mkdir()
    model = moe["mixtral"]["model"]
    for command, fix in (("convert", "convert it with convert-dense"), ("convert-dense", "leave out --calibration")):
        ran = run_in_process(
            "prep", command, str(model), "--calibration", str(calibration), "--outfile", str(tmp_path / "x.gguf")
        )
        assert ran.returncode == 2, ran.stderr
        assert ran.stderr.strip().splitlines() == [f"error: {model} has experts, which are not made sparse yet; {fix}"]


@pytest.mark.parametrize("family", ["mixtral", "qwen2moe"])
def test_experts_quantize_row_by_row_as_llama_cpp_does(
    moe: dict[str, dict[str, Path]], family: str, tmp_path: Path
) -> None:
    """Each row of each expert becomes the Q4_0 blocks the reference quantizer makes of that row alone; the routers
    and norms stay F32, as llama.cpp's llama-quantize leaves them."""
    path = moe[family]["dense-f32"]
    out = tmp_path / "q4.gguf"
    ran = run_in_process("prep", "quantize", str(path), str(out), "Q4_0")
    assert ran.returncode == 0, ran.stderr
    source = {t.name: t for t in GGUFReader(path).tensors}
    quantized = {t.name: t for t in GGUFReader(out).tensors}
    for name in ("blk.1.ffn_gate_exps.weight", "blk.0.ffn_up_exps.weight", "blk.1.ffn_down_exps.weight"):
        assert quantized[name].tensor_type == GGMLQuantizationType.Q4_0
        rows, blocks = np.asarray(source[name].data), np.asarray(quantized[name].data)
        assert blocks.shape == (*rows.shape[:2], rows.shape[2] // 32 * 18)
        for expert, row in ((0, 0), (3, 5), (rows.shape[0] - 1, rows.shape[1] - 1)):
            assert np.array_equal(blocks[expert, row], quantize_q4_0(rows[expert, row])), (name, expert, row)
    kept = ["blk.0.ffn_gate_inp.weight", "blk.1.ffn_norm.weight"]
    if family == "qwen2moe":
        kept.append("blk.0.ffn_gate_inp_shexp.weight")
        assert quantized["blk.0.ffn_up_shexp.weight"].tensor_type == GGMLQuantizationType.Q4_0
    for name in kept:
        assert quantized[name].tensor_type == GGMLQuantizationType.F32
        assert np.array_equal(np.asarray(quantized[name].data), np.asarray(source[name].data)), name
