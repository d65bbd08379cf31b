"""A full-depth model from a slice: the slice's layers repeated to `layers` (layer j is the slice's layer j % n), as a
GGUF of each kind and an activation directory, so that the GPU bench times a 7B's depth (32 layers: its plan, its
per-layer work, its memory) without building or profiling a 7B. The weights are the slice's, so a step reads and
computes what a model of that shape and depth would; the text it writes means nothing, and transformers has no
checkpoint of it."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import numpy as np
import torch
from decode import BenchModel
from gguf import GGUFWriter

from qinfer.core.names import Key, Tensor, split_tensor_name, tensor_name
from qinfer.formats.activation_files import SUMMARY_FILE, count_basis, read_activations, write_activations
from qinfer.formats.gguf_reader import metadata, open_gguf
from qinfer.formats.gguf_writer import TensorPlan, copy_metadata, write_gguf


def _read(path: Path, offset: int, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    # A read, not the reader's memory map: a 13 GB file's pages would otherwise stay resident.
    count = int(np.prod(shape, dtype=np.int64))
    return np.fromfile(path, dtype=dtype, count=count, offset=offset).reshape(shape)


def deepen_gguf(src: Path, dst: Path, layers: int) -> None:
    """`src` with its layers repeated to `layers`, written to `dst` a tensor at a time (PWRI magic kept)."""
    reader = open_gguf(src)
    arch = str(metadata(reader)[Key.ARCHITECTURE])
    block_count = Key.BLOCK_COUNT.format(arch=arch)
    shared: list[TensorPlan] = []
    by_layer: dict[int, list[tuple[str, str, TensorPlan]]] = {}
    for t in reader.tensors:
        # The reader's view gives each type's numpy form: elements for float and integer types, bytes for blocks.
        dtype, shape = t.data.dtype, tuple(int(n) for n in t.data.shape)
        raw = t.tensor_type if dtype == np.uint8 else None
        plan = TensorPlan(t.name, shape, dtype, partial(_read, src, t.data_offset, dtype, shape), raw)
        parts = split_tensor_name(t.name)
        if parts is None or parts[0] is None:
            shared.append(plan)
        else:
            by_layer.setdefault(parts[0], []).append((parts[1], parts[2], plan))
    plans = list(shared)
    for j in range(layers):
        for part, kind, plan in by_layer[j % len(by_layer)]:
            name = tensor_name(Tensor(part), j, kind)
            plans.append(TensorPlan(name, plan.shape, plan.dtype, plan.load, plan.raw_type))

    def add_metadata(writer: GGUFWriter) -> None:
        copy_metadata(reader, writer, (block_count,))
        writer.add_uint32(block_count, layers)

    write_gguf(dst, arch, add_metadata, plans, powerinfer=reader.is_powerinfer)


def deepen_activations(src: Path, dst: Path, layers: int) -> None:
    """The activation directory of the deepened model: layer j counts as the slice's layer j % n did."""
    counts = read_activations(src)
    repeated = torch.stack([counts[j % len(counts)] for j in range(layers)])
    summary = json.loads((src / SUMMARY_FILE).read_text(encoding="utf-8"))
    meta = {k: v for k, v in summary.items() if k not in ("tokens", "layers")}
    write_activations(dst, repeated, count_basis(src).tokens or 0, meta)


def deep_model(model: BenchModel, root: Path, name: str, layers: int) -> BenchModel:
    """`model` (a slice, profiled) repeated to `layers` layers under root/name (made on first use); the checkpoint
    stays the slice's."""
    deep = BenchModel(name, model.model_dir, root / f"{name}.powerinfer.gguf", root / f"{name}.gguf")
    root.mkdir(parents=True, exist_ok=True)
    for source, target in ((model.powerinfer, deep.powerinfer), (model.dense, deep.dense)):
        if not target.exists():
            deepen_gguf(source, target, layers)
    if not (root / "activation" / SUMMARY_FILE).exists():
        deepen_activations(model.powerinfer.parent / "activation", root / "activation", layers)
    return deep
