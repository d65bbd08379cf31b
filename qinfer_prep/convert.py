"""Convert a Hugging Face ReLU LLaMA/Bamboo/Falcon checkpoint to a PowerInfer GGUF (with predictors) or a dense GGUF."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import torch
from gguf import MODEL_ARCH, GGUFWriter, get_tensor_name_map

from qinfer_core.errors import UserError
from qinfer_core.gguf_writer import TensorPlan, write_gguf
from qinfer_core.predictor_dir import FC1, FC2, PredictorDir, load_layer, open_predictors
from qinfer_prep.hf_checkpoint import TensorRef, index_checkpoint, load_tensor
from qinfer_prep.hf_config import ModelParams, read_hf_config
from qinfer_prep.tokenizer_vocab import add_vocab

SPARSE_THRESHOLD_KEY = "powerinfer.sparse_threshold"
OUTTYPES = {"f32": (np.dtype(np.float32), 0), "f16": (np.dtype(np.float16), 1)}
TORCH_DTYPES = {np.dtype(np.float32): torch.float32, np.dtype(np.float16): torch.float16}


@dataclass(frozen=True)
class ConvertResult:
    outfile: Path
    arch: str
    tensor_count: int
    nbytes: int


def permute_rotary(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """Reorder q/k rows as llama.cpp's converter does.

    HF rotates the two halves of each head's dimensions against each other; ggml's rope rotates
    adjacent pairs, so each head's rows are interleaved half by half.
    """
    rows = weight.shape[0]
    return weight.reshape(n_head, 2, rows // n_head // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def jploski_qkv(weight: torch.Tensor, n_head: int, n_head_kv: int) -> torch.Tensor:
    """Falcon's fused QKV rows regrouped as llama.cpp's converter does ("jploski" layout).

    HF stores n_head_kv groups, each n_head/n_head_kv query heads then one key and one value head; ggml wants
    all query heads, then all key heads, then all value heads.
    """
    head_dim = weight.shape[0] // (n_head + 2 * n_head_kv)
    qkv = weight.reshape(n_head_kv, n_head // n_head_kv + 2, head_dim, -1)
    q = qkv[:, :-2].reshape(n_head * head_dim, -1)
    k = qkv[:, -2].reshape(n_head_kv * head_dim, -1)
    v = qkv[:, -1].reshape(n_head_kv * head_dim, -1)
    return torch.cat((q, k, v))


def _falcon_shapes(p: ModelParams, predictors: PredictorDir | None) -> dict[str, tuple[int, ...]]:
    """Falcon's tensors: LayerNorms with biases, fused QKV, and an FFN of up and down only, relu(up(x))."""
    e, f, v, kv = p.embedding_length, p.feed_forward_length, p.vocab_size, p.kv_length
    shapes: dict[str, tuple[int, ...]] = {
        "token_embd.weight": (v, e),
        "output_norm.weight": (e,),
        "output_norm.bias": (e,),
        "output.weight": (v, e),
    }
    for i in range(p.block_count):
        b = f"blk.{i}"
        shapes |= {
            f"{b}.attn_norm.weight": (e,),
            f"{b}.attn_norm.bias": (e,),
            f"{b}.attn_norm_2.weight": (e,),
            f"{b}.attn_norm_2.bias": (e,),
            f"{b}.attn_qkv.weight": (e + 2 * kv, e),
            f"{b}.attn_output.weight": (e, e),
            f"{b}.ffn_up.weight": (f, e),
        }
        shapes |= _ffn_down_and_predictor(b, e, f, predictors, i)
    return shapes


def expected_shapes(p: ModelParams, predictors: PredictorDir | None) -> dict[str, tuple[int, ...]]:
    """Every output tensor in file order, with its numpy shape (ggml's ne reversed)."""
    e, f, v, kv = p.embedding_length, p.feed_forward_length, p.vocab_size, p.kv_length
    if p.arch == "falcon":
        return _falcon_shapes(p, predictors)
    shapes: dict[str, tuple[int, ...]] = {
        "token_embd.weight": (v, e),
        "output_norm.weight": (e,),
        "output.weight": (v, e),
    }
    for i in range(p.block_count):
        b = f"blk.{i}"
        shapes |= {
            f"{b}.attn_norm.weight": (e,),
            f"{b}.attn_q.weight": (e, e),
            f"{b}.attn_k.weight": (kv, e),
            f"{b}.attn_v.weight": (kv, e),
            f"{b}.attn_output.weight": (e, e),
            f"{b}.ffn_norm.weight": (e,),
            f"{b}.ffn_gate.weight": (f, e),
            f"{b}.ffn_up.weight": (f, e),
        }
        shapes |= _ffn_down_and_predictor(b, e, f, predictors, i)
    return shapes


def _ffn_down_and_predictor(
    b: str, e: int, f: int, predictors: PredictorDir | None, i: int
) -> dict[str, tuple[int, ...]]:
    if predictors is None:
        return {f"{b}.ffn_down.weight": (e, f)}
    rank = predictors.ranks[i]
    return {f"{b}.ffn_down_t.weight": (f, e), f"{b}.fc1.weight": (rank, e), f"{b}.fc2.weight": (f, rank)}


def _map_sources(p: ModelParams, refs: dict[str, TensorRef]) -> dict[str, str]:
    """GGUF name -> HF name for the checkpoint's tensors; refuses tensors this architecture does not have."""
    name_map = get_tensor_name_map(MODEL_ARCH.FALCON if p.arch == "falcon" else MODEL_ARCH.LLAMA, p.block_count)
    # Falcon's LayerNorms have biases; the LLaMA family has none.
    suffixes = (".weight", ".bias") if p.arch == "falcon" else (".weight",)
    sources: dict[str, str] = {}
    for hf_name in refs:
        if hf_name.endswith("rotary_emb.inv_freq"):
            continue
        gguf_name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None or not gguf_name.endswith(suffixes):
            raise UserError(f"unexpected tensor {hf_name!r} for a {p.arch} model; is config.json from this checkpoint?")
        sources[gguf_name] = hf_name
    if "output.weight" not in sources and p.tie_word_embeddings and "token_embd.weight" in sources:
        sources["output.weight"] = sources["token_embd.weight"]
    return sources


def _load_weight(
    hf_name: str,
    ref: TensorRef,
    dtype: np.dtype,
    regroup: Callable[[torch.Tensor], torch.Tensor] | None,
    transpose: bool,
) -> np.ndarray:
    # Cast in torch, which knows bf16, straight to the output type: no float32 copy of a large tensor.
    tensor = load_tensor(hf_name, ref).to(TORCH_DTYPES[dtype])
    if regroup is not None:
        tensor = regroup(tensor)
    if transpose:
        tensor = tensor.T
    return tensor.numpy()


def _load_predictor(path: Path, key: str, dtype: np.dtype) -> np.ndarray:
    return load_layer(path)[key].to(TORCH_DTYPES[dtype]).numpy()


def _dtype_for(shape: tuple[int, ...], outtype: np.dtype) -> np.dtype:
    # Norms stay f32 in every GGUF: the engine reads 1-D tensors only as f32.
    return np.dtype(np.float32) if len(shape) == 1 else outtype


def _regroup(p: ModelParams, name: str) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The row reordering llama.cpp's converter applies to this tensor, if any.

    LLaMA's q/k go from HF's rotate-half rope to ggml's adjacent pairs; Falcon keeps rotate-half (ggml's NeoX
    rope) and only regroups its fused QKV.
    """
    kind = name.split(".")[-2]
    if p.arch == "falcon":
        return partial(jploski_qkv, n_head=p.head_count, n_head_kv=p.head_count_kv) if kind == "attn_qkv" else None
    n_head = {"attn_q": p.head_count, "attn_k": p.head_count_kv}.get(kind)
    return None if n_head is None else partial(permute_rotary, n_head=n_head)


def plan_tensors(
    p: ModelParams, refs: dict[str, TensorRef], predictors: PredictorDir | None, outtype: np.dtype
) -> list[TensorPlan]:
    sources = _map_sources(p, refs)
    shapes = expected_shapes(p, predictors)
    plans: list[TensorPlan] = []
    for name, shape in shapes.items():
        dtype = _dtype_for(shape, outtype)
        if name.endswith((".fc1.weight", ".fc2.weight")):
            assert predictors is not None
            layer = int(name.split(".")[1])
            key = FC1 if ".fc1." in name else FC2
            plans.append(
                TensorPlan(name, shape, dtype, partial(_load_predictor, predictors.layer_file(layer), key, dtype))
            )
            continue
        transpose = name.endswith(".ffn_down_t.weight")
        source_name = name.replace(".ffn_down_t.", ".ffn_down.")
        hf_name = sources.get(source_name)
        if hf_name is None:
            raise UserError(f"the checkpoint has no tensor for {source_name}; is the download complete?")
        source_shape = refs[hf_name].shape
        want = shape[::-1] if transpose else shape
        if source_shape != want:
            raise UserError(f"{hf_name} has shape {list(source_shape)} but config.json implies {list(want)}")
        load = partial(_load_weight, hf_name, refs[hf_name], dtype, _regroup(p, name), transpose)
        plans.append(TensorPlan(name, shape, dtype, load))
    return plans


def _metadata_writer(
    p: ModelParams, model_dir: Path, file_type: int, threshold: float | None
) -> Callable[[GGUFWriter], None]:
    def add(writer: GGUFWriter) -> None:
        writer.add_name(p.name)
        writer.add_context_length(p.context_length)
        writer.add_embedding_length(p.embedding_length)
        writer.add_block_count(p.block_count)
        writer.add_feed_forward_length(p.feed_forward_length)
        # As llama.cpp's falcon converter: the QKV layout tag instead of a rope dimension, LayerNorm epsilon.
        falcon = p.arch == "falcon"
        if falcon:
            writer.add_tensor_data_layout("jploski")
        else:
            writer.add_rope_dimension_count(p.head_dim)
        writer.add_head_count(p.head_count)
        writer.add_head_count_kv(p.head_count_kv)
        if falcon:
            writer.add_layer_norm_eps(p.rms_norm_eps)
        else:
            writer.add_layer_norm_rms_eps(p.rms_norm_eps)
        if p.rope_theta is not None:
            writer.add_rope_freq_base(p.rope_theta)
        writer.add_file_type(file_type)
        add_vocab(writer, model_dir, p.vocab_size)
        if threshold is not None:
            writer.add_float32(SPARSE_THRESHOLD_KEY, threshold)

    return add


def convert(
    model_dir: Path,
    outfile: Path,
    predictor_dir: Path | None = None,
    outtype: str = "f16",
    on_plan: Callable[[list[TensorPlan]], None] | None = None,
    on_tensor: Callable[[TensorPlan], None] | None = None,
) -> ConvertResult:
    """Write a PowerInfer GGUF when `predictor_dir` is given, else a dense GGUF.

    Everything that can be checked (config, tensor names and shapes, predictors, vocabulary) is
    checked before the first byte is written; tensors are then streamed one at a time.
    """
    if outtype not in OUTTYPES:
        raise UserError(f"unknown --outtype {outtype!r}; use one of {', '.join(OUTTYPES)}")
    if not model_dir.is_dir():
        raise UserError(f"model directory not found: {model_dir}")
    dtype, file_type = OUTTYPES[outtype]
    p = read_hf_config(model_dir)
    if p.embedding_length % p.head_count or p.head_dim % 2:
        raise UserError(f"hidden_size {p.embedding_length} does not split into {p.head_count} heads of even size")
    predictors = None
    if predictor_dir is not None:
        predictors = open_predictors(predictor_dir, p.block_count, p.embedding_length, p.feed_forward_length)
    plans = plan_tensors(p, index_checkpoint(model_dir), predictors, dtype)
    if on_plan is not None:
        on_plan(plans)
    threshold = predictors.sparse_threshold if predictors is not None else None
    add_metadata = _metadata_writer(p, model_dir, file_type, threshold)
    write_gguf(outfile, p.arch, add_metadata, plans, powerinfer=predictors is not None, on_tensor=on_tensor)
    return ConvertResult(outfile, p.arch, len(plans), sum(plan.nbytes for plan in plans))
