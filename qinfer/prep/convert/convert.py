"""Convert a Hugging Face checkpoint (any family of qinfer.core.architectures) to a PowerInfer or dense GGUF.

A PowerInfer GGUF holds FFN neurons as rows (ffn_down_t) and either predictors or a calibration's gate thresholds
(or both); a dense GGUF is laid out as llama.cpp lays it out."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import torch
from gguf import GGUFWriter

from qinfer.core.architectures import Architecture, Shapes, architecture, expert_source
from qinfer.core.errors import UserError
from qinfer.core.model_spec import ModelSpec
from qinfer.core.names import PREDICTOR, ROUTERS, Key, Tensor, split_tensor_name, tensor_name
from qinfer.core.spec_readers import spec_from_hf_dir
from qinfer.formats.atomic_file import check_apart
from qinfer.formats.calibration_dir import Calibration, read_calibration
from qinfer.formats.gguf_layout import starts_as_gguf
from qinfer.formats.gguf_writer import TensorPlan, write_gguf
from qinfer.formats.predictor_dir import FC1, FC2, PredictorDir, load_layer, open_predictors
from qinfer.prep.convert.hf_checkpoint import TensorRef, index_checkpoint, load_tensor
from qinfer.prep.convert.rope_factors import llama3_rope_factors
from qinfer.prep.convert.tokenizer_vocab import add_vocab

OUTTYPES = {"f32": (np.dtype(np.float32), 0), "f16": (np.dtype(np.float16), 1)}
TORCH_DTYPES = {np.dtype(np.float32): torch.float32, np.dtype(np.float16): torch.float16}


@dataclass(frozen=True)
class ConvertResult:
    outfile: Path
    arch: str
    tensor_count: int
    nbytes: int


Sources = dict[str, tuple[str, ...]]  # GGUF name -> its HF tensor, or every expert's, stacked in this order


def _map_sources(arch: Architecture, spec: ModelSpec, refs: dict[str, TensorRef], expected: Shapes) -> Sources:
    """GGUF name -> HF names for the checkpoint's tensors; refuses tensors this architecture does not have."""
    gguf_name = arch.hf_names(spec)
    # A dense file's down and a PowerInfer file's down_t come from the same HF tensor.
    known = {name.replace(f".{Tensor.FFN_DOWN_T}.", f".{Tensor.FFN_DOWN}."): shape for name, shape in expected.items()}
    sources: dict[str, str] = {}
    stacks: dict[str, dict[int, str]] = {}
    for hf_name in refs:
        if hf_name.endswith("rotary_emb.inv_freq"):
            continue
        expert = expert_source(hf_name)
        name = gguf_name(hf_name if expert is None else expert[0])
        if name == tensor_name(Tensor.OUTPUT) and name not in known:
            continue  # a tied head saved anyway: this family's file has no output tensor
        if name is None or name not in known or (expert is not None) != (len(known[name]) == 3):
            raise UserError(
                f"unexpected tensor {hf_name!r} for a {spec.arch} model; is config.json from this checkpoint?"
            )
        if expert is None:
            sources[name] = hf_name
        else:
            stacks.setdefault(name, {})[expert[1]] = hf_name
    mapped = {name: (hf_name,) for name, hf_name in sources.items()}
    for name, stack in stacks.items():
        count = known[name][0]
        if sorted(stack) != list(range(count)):
            odd = sorted(set(stack).symmetric_difference(range(count)))[0]
            where = "lacks" if odd < count else "has an extra"
            raise UserError(
                f"the checkpoint {where} expert {odd} of {name} (config.json implies {count}); is config.json from "
                "this checkpoint?"
            )
        mapped[name] = tuple(stack[j] for j in range(len(stack)))
    output, embedding = tensor_name(Tensor.OUTPUT), tensor_name(Tensor.TOKEN_EMBD)
    if output in known and output not in mapped and spec.tie_word_embeddings and embedding in mapped:
        mapped[output] = mapped[embedding]
    return mapped


def _load_weight(
    hf_names: tuple[str, ...],
    refs: dict[str, TensorRef],
    dtype: np.dtype,
    regroup: Callable[[torch.Tensor], torch.Tensor] | None,
    transpose: bool,
    stacked: bool,
) -> np.ndarray:
    """One tensor of the GGUF; `stacked`: the experts' tensors `hf_names`, in order, as one [N, ...] tensor, each
    copied into it as it is read (a list of them, then a stack, would hold the layer's experts twice)."""
    # Cast in torch, which knows bf16, straight to the output type: no float32 copy of a large tensor.
    if stacked:
        tensor = torch.empty((len(hf_names), *refs[hf_names[0]].shape), dtype=TORCH_DTYPES[dtype])
        for j, hf_name in enumerate(hf_names):
            tensor[j] = load_tensor(hf_name, refs[hf_name])
    else:
        (hf_name,) = hf_names
        tensor = load_tensor(hf_name, refs[hf_name]).to(TORCH_DTYPES[dtype])
    if regroup is not None:
        tensor = regroup(tensor)
    if transpose:
        tensor = tensor.T
    return tensor.numpy()


def _load_predictor(path: Path, key: str, dtype: np.dtype) -> np.ndarray:
    return load_layer(path)[key].to(TORCH_DTYPES[dtype]).numpy()


def _dtype_for(shape: tuple[int, ...], part: str, outtype: np.dtype) -> np.dtype:
    # Norms stay f32 in every GGUF: the engine reads 1-D tensors only as f32.
    return np.dtype(np.float32) if len(shape) == 1 or part in ROUTERS else outtype


def plan_tensors(
    arch: Architecture,
    spec: ModelSpec,
    refs: dict[str, TensorRef],
    predictors: PredictorDir | None,
    outtype: np.dtype,
    row_layout: bool = False,
) -> list[TensorPlan]:
    shapes = arch.tensors(spec, None if predictors is None else predictors.ranks, row_layout)
    sources = _map_sources(arch, spec, refs, shapes)
    plans: list[TensorPlan] = []
    for name, shape in shapes.items():
        layer, part, kind = split_tensor_name(name) or (None, "", "")
        dtype = _dtype_for(shape, part, outtype)
        if part == Tensor.ROPE_FREQS:
            plans.append(TensorPlan(name, shape, dtype, partial(llama3_rope_factors, spec)))
            continue
        if part in PREDICTOR:
            assert predictors is not None and layer is not None
            key = FC1 if part == Tensor.FC1 else FC2
            plans.append(
                TensorPlan(name, shape, dtype, partial(_load_predictor, predictors.layer_file(layer), key, dtype))
            )
            continue
        # down_t is down transposed (its bias, a vector, stays as it is).
        transpose = part == Tensor.FFN_DOWN_T and len(shape) == 2
        source_name = tensor_name(Tensor.FFN_DOWN, layer, kind) if part == Tensor.FFN_DOWN_T else name
        hf_names = sources.get(source_name)
        if hf_names is None:
            raise UserError(f"the checkpoint has no tensor for {source_name}; is the download complete?")
        want = shape[::-1] if transpose else shape
        stacked = len(shape) == 3  # the experts' tensors, one per expert in the checkpoint
        for hf_name in hf_names:
            source_shape = refs[hf_name].shape
            if source_shape != (want[1:] if stacked else want):
                raise UserError(f"{hf_name} has shape {list(source_shape)} but config.json implies {list(want)}")
        load = partial(_load_weight, hf_names, refs, dtype, arch.transforms(spec, name), transpose, stacked)
        plans.append(TensorPlan(name, shape, dtype, load))
    return plans


def _metadata_writer(
    arch: Architecture,
    spec: ModelSpec,
    model_dir: Path,
    file_type: int,
    threshold: float | None,
    calibration: Calibration | None,
    row_layout: bool,
) -> Callable[[GGUFWriter], None]:
    def add(writer: GGUFWriter) -> None:
        writer.add_name(spec.name)
        writer.add_context_length(spec.context_length + arch.position_offset)
        writer.add_embedding_length(spec.hidden)
        writer.add_block_count(spec.layers)
        writer.add_feed_forward_length(spec.ffn)
        arch.add_metadata(writer, spec)
        writer.add_file_type(file_type)
        add_vocab(writer, model_dir, spec.vocab_size)
        if threshold is not None:
            writer.add_float32(Key.SPARSE_THRESHOLD, threshold)
        activation = arch.stated_activation(spec.activation, row_layout)
        if activation is not None:
            writer.add_string(Key.FFN_ACTIVATION, activation)
        if calibration is not None:
            writer.add_array(Key.GATE_THRESHOLDS, calibration.thresholds)

    return add


def convert(
    model_dir: Path,
    outfile: Path,
    predictor_dir: Path | None = None,
    outtype: str = "f16",
    calibration_dir: Path | None = None,
    dense: bool = False,
    on_plan: Callable[[list[TensorPlan]], None] | None = None,
    on_tensor: Callable[[TensorPlan], None] | None = None,
) -> ConvertResult:
    """Write a PowerInfer GGUF when `predictor_dir` or `calibration_dir` is given, else a dense GGUF; `dense`
    keeps llama.cpp's layout for a calibrated model too (its thresholds ride along, for our runtime).

    Everything that can be checked (config, tensor names and shapes, predictors, vocabulary) is
    checked before the first byte is written; tensors are then streamed one at a time.
    """
    if outtype not in OUTTYPES:
        raise UserError(
            f"unknown --outtype {outtype!r}; use one of {', '.join(OUTTYPES)} (quantize the file with `qinfer prep "
            "quantize` after)"
        )
    if not model_dir.is_dir():
        raise UserError(f"model directory not found: {model_dir}")
    inputs = {"model directory": model_dir, "predictor directory": predictor_dir, "calibration": calibration_dir}
    check_apart(outfile, inputs, earlier=starts_as_gguf)
    dtype, file_type = OUTTYPES[outtype]
    spec = spec_from_hf_dir(model_dir)
    arch = architecture(spec.arch)
    if spec.hidden % spec.heads or (spec.rope_dim and spec.head_dim % 2):
        raise UserError(f"hidden_size {spec.hidden} does not split into {spec.heads} heads of even size")
    if spec.experts is not None and (predictor_dir is not None or calibration_dir is not None):
        fix = "leave out --calibration" if dense else "convert it with convert-dense"
        raise UserError(f"{model_dir} has experts, which are not made sparse yet; {fix}")
    predictors = None
    if predictor_dir is not None:
        predictors = open_predictors(predictor_dir, spec.layers, spec.hidden, spec.ffn)
    calibration = None
    if calibration_dir is not None:
        calibration = read_calibration(calibration_dir, spec)
    if dense and predictors is not None:
        raise UserError("a dense file has no predictors; convert with the predictor directory to a PowerInfer file")
    row_layout = predictors is not None or (calibration is not None and not dense)
    plans = plan_tensors(arch, spec, index_checkpoint(model_dir), predictors, dtype, row_layout)
    if on_plan is not None:
        on_plan(plans)
    threshold = predictors.sparse_threshold if predictors is not None else None
    add_metadata = _metadata_writer(arch, spec, model_dir, file_type, threshold, calibration, row_layout)
    write_gguf(outfile, spec.arch, add_metadata, plans, powerinfer=row_layout, on_tensor=on_tensor)
    return ConvertResult(outfile, spec.arch, len(plans), sum(plan.nbytes for plan in plans))
