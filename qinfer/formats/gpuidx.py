"""`.gpuidx` files: the FFN neurons the engine keeps on the GPU, and our provenance (docs/formats.md#gpu-index-gpuidx).

The engine reads the three required metadata keys and the tensors by position; our `qinfer.plan.*` keys come after
them so that its reader is unaffected, and a file without them (made by the engine) reads as unknown provenance.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter

from qinfer.core.errors import UserError
from qinfer.core.kv_policy import KV_POLICIES
from qinfer.core.names import PLAN_KEYS, Key, Tensor, tensor_name
from qinfer.core.user_cache import user_cache
from qinfer.formats.gguf_layout import Value
from qinfer.formats.gguf_reader import check_layout
from qinfer.formats.gguf_writer import TensorPlan, write_gguf

# Written only for a plan whose KV policy is not `full`, so that a `full` plan keeps the bytes it had before KV
# policies existed, and a file without them (older, or `full`) reads as `full`.
KV_POLICY_KEYS = ("kv_policy", "kv_rows")


@dataclass(frozen=True)
class Provenance:
    """What a plan was made from, and where it put attention and the output; a plan is reused only while all of it
    still holds. One field per key of qinfer.core.names.PLAN_KEYS, in its order."""

    model_size: int
    model_mtime_ns: int
    vram_budget: int
    activation_sha256: str
    group_size: int
    objective: str
    ctx_size: int
    batch: int
    gpu: str
    cpu: str
    dense: str
    attention_on_gpu: tuple[bool, ...]
    output_on_gpu: bool
    kv_policy: str = "full"
    kv_rows: int = 0  # KV rows a window keeps per layer, sequence and kv head; 0 under `full`, which keeps them all


@dataclass(frozen=True)
class GpuIndex:
    """`gpu_idx[i]`: int32 0/1 per neuron of layer i; `vram_capacity`: bytes the FFN split (neurons, predictors)
    uses on the GPU; `provenance` is None for files made by the reference engine."""

    vram_capacity: int
    gpu_idx: tuple[np.ndarray, ...]
    provenance: Provenance | None = None

    @property
    def buckets(self) -> tuple[np.ndarray, ...]:
        return tuple(np.flatnonzero(mask).astype(np.int32) for mask in self.gpu_idx)


def gpuidx_write_path(model_path: Path) -> Path:
    """Where a plan of the model is written: beside it, `<model>.generated.gpuidx`, where the PowerInfer engine looks
    for it; where the model's directory takes no new file (a model store mounted read-only), in the user's cache,
    named by the model's name and resolved path."""
    directory = model_path.parent
    if not directory.is_dir() or os.access(directory, os.W_OK):
        return _beside(model_path)
    digest = hashlib.sha256(str(model_path.resolve()).encode()).hexdigest()[:16]
    return user_cache("plans") / f"{model_path.name}.{digest}.generated.gpuidx"


def gpuidx_path_for(model_path: Path) -> Path:
    """Where the model's plan is read: where it is written, but that a read-only model's own plan, made there before
    it was mounted so, is read until one of the user's replaces it."""
    written, beside = gpuidx_write_path(model_path), _beside(model_path)
    return beside if written != beside and beside.exists() and not written.exists() else written


def _beside(model_path: Path) -> Path:
    return model_path.with_name(model_path.name + ".generated.gpuidx")


def write_gpuidx(path: Path, index: GpuIndex) -> None:
    """Write atomically, PWRI magic, keys and tensors in the engine's order."""
    masks = [np.ascontiguousarray(m, dtype=np.int32) for m in index.gpu_idx]
    if any(m.ndim != 1 or not np.isin(m, (0, 1)).all() for m in masks):
        raise ValueError("gpu_idx masks must be 1-D arrays of 0 and 1")

    def add_metadata(writer: GGUFWriter) -> None:
        writer.add_uint32(Key.GPU_INDEX_BLOCK_COUNT, len(masks))
        writer.add_uint64(Key.VRAM_CAPACITY, int(index.vram_capacity))
        p = index.provenance
        if p is None:
            return
        for name, (kind, _) in PLAN_KEYS.items():
            if name not in KV_POLICY_KEYS or p.kv_policy != "full":
                writer.add_key_value(Key.PLAN_PREFIX + name, _encode(getattr(p, name)), kind)

    tensors = []
    for i, (mask, bucket) in enumerate(zip(masks, index.buckets, strict=True)):
        for part, data in ((Tensor.GPU_IDX, mask), (Tensor.GPU_BUCKET, bucket)):
            tensors.append(TensorPlan(tensor_name(part, i, ""), data.shape, np.dtype(np.int32), lambda d=data: d))
    write_gguf(path, Key.GPU_INDEX_ARCH, add_metadata, tensors, powerinfer=True)


def read_gpuidx(path: Path) -> GpuIndex:
    """Read ours or the engine's, its integer tensors under either type code (formats.gguf_layout); anything that is
    not a consistent GPU index is a user error naming the fix. Read from the checked layout rather than with gguf's
    reader, which takes the engine's I32 code for today's IQ3_XXS."""
    fix = "delete it or rerun `qinfer plan --reset-gpu-index`"
    layout = check_layout(path, fix)

    def value(key: str) -> Any:
        found = layout.keys.get(key)
        return None if found is None else found.value

    if value(Key.ARCHITECTURE) != Key.GPU_INDEX_ARCH:
        raise UserError(f"{path} is not a GPU index (general.architecture is not {Key.GPU_INDEX_ARCH!r}); {fix}")
    layers, capacity = value(Key.GPU_INDEX_BLOCK_COUNT), value(Key.VRAM_CAPACITY)
    if layers is None or capacity is None:
        raise UserError(f"{path} lacks {Key.GPU_INDEX_BLOCK_COUNT} or {Key.VRAM_CAPACITY}; {fix}")
    tensors = layout.tensors
    if len(tensors) != 2 * int(layers):
        raise UserError(f"{path} has {len(tensors)} tensors for {layers} layers (expected {2 * int(layers)}); {fix}")
    for tensor in tensors:
        if tensor.qtype != GGMLQuantizationType.I32 or len(tensor.ne) != 1:
            raise UserError(f"{path}: {tensor.name} is not a vector of I32; {fix}")
    data = np.fromfile(path, dtype=np.uint8)
    masks = []
    for i in range(int(layers)):
        idx, bucket = (
            data[layout.data_start + t.offset : layout.data_start + t.offset + t.nbytes].view(np.int32)
            for t in tensors[2 * i : 2 * i + 2]
        )
        if not np.isin(idx, (0, 1)).all() or not np.array_equal(np.flatnonzero(idx), bucket):
            raise UserError(f"{path}: layer {i} gpu_idx and gpu_bucket disagree; {fix}")
        masks.append(idx.copy())
    provenance = _provenance(layout.keys, int(layers), path, fix)
    return GpuIndex(vram_capacity=int(capacity), gpu_idx=tuple(masks), provenance=provenance)


def _provenance(keys: dict[str, Value], layers: int, path: Path, fix: str) -> Provenance | None:
    """Ours, or None for a file made by the engine, which has no qinfer.plan.* keys at all. A partial set is a
    damaged file, not an engine's: taking it for one would silently turn off the staleness check."""

    def get(name: str) -> Any:
        found = keys.get(Key.PLAN_PREFIX + name)
        return None if found is None else found.value

    present = {key for key in keys if key.startswith(Key.PLAN_PREFIX)}
    if not present:
        return None
    kv_keys = {Key.PLAN_PREFIX + name for name in KV_POLICY_KEYS}
    wanted = {Key.PLAN_PREFIX + name for name in PLAN_KEYS} - kv_keys
    if present & kv_keys:
        wanted |= kv_keys
    attention = str(get("attention_on_gpu") or "")
    kv_policy = str(get("kv_policy") or "full")
    if present != wanted or len(attention) != layers or set(attention) - {"0", "1"} or kv_policy not in KV_POLICIES:
        raise UserError(f"{path} has damaged {Key.PLAN_PREFIX}* provenance keys; {fix}")
    # The KV keys are absent from a `full` plan, which the dataclass's defaults stand for.
    values = {name: _decode(get(name), kind) for name, (kind, _) in PLAN_KEYS.items() if get(name) is not None}
    return Provenance(**{**values, "attention_on_gpu": tuple(c == "1" for c in attention)})


def _encode(value: object) -> object:
    """A provenance value as its key holds it: a tuple of flags as a string of 0 and 1."""
    return "".join("1" if flag else "0" for flag in value) if isinstance(value, tuple) else value


def _decode(value: Any, kind: GGUFValueType) -> object:
    if kind == GGUFValueType.STRING:
        return str(value)
    return bool(value) if kind == GGUFValueType.BOOL else int(value)
