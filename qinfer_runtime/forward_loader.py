"""Choose and build a model's runtime: its forward class, the FFN runner (dense, sparse, hybrid) and the device."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from qinfer_runtime.errors import RunError
from qinfer_runtime.ffn_runners import DenseRunner, SparseRunner
from qinfer_runtime.llama_forward import LlamaForward, ffn_weights
from qinfer_runtime.model_file import ModelFile
from qinfer_runtime.model_forward import FFNRunner, TransformerForward
from qinfer_runtime.sparse_ffn import FFNWeights

FFN_MODES = ("auto", "sparse", "dense", "oracle")
SCHEDULES = ("auto", "static", "dynamic")

# arch -> (forward class taking (model, ffn runner, device), per-layer FFN weights reader)
ForwardFactory = Callable[[ModelFile, FFNRunner, torch.device], TransformerForward]
FORWARDS: dict[str, tuple[ForwardFactory, Callable[[ModelFile, int], FFNWeights]]] = {
    "llama": (LlamaForward, ffn_weights),
    "bamboo": (LlamaForward, ffn_weights),
}


@dataclass(frozen=True)
class RuntimeOptions:
    """ffn: auto (sparse when the file has predictors), sparse, dense, or oracle (true active set; testing).
    vram_budget_gib: None runs without a GPU split. device: the GPU side ("cuda", or "cpu" to simulate one);
    None picks CUDA when available."""

    ffn: str = "auto"
    vram_budget_gib: float | None = None
    schedule: str = "auto"
    reset_gpu_index: bool = False
    disable_gpu_index: bool = False
    device: str | None = None


@dataclass
class LoadedRuntime:
    forward: TransformerForward
    ffn_mode: str
    schedule: str
    notes: list[str] = field(default_factory=list)


def ffn_mode(model: ModelFile, requested: str, layers: list[FFNWeights]) -> str:
    if requested not in FFN_MODES:
        raise RunError(f"unknown FFN mode {requested!r}; use one of {', '.join(FFN_MODES)}")
    has_predictors = all(w.has_predictor for w in layers)
    if requested == "sparse" and not has_predictors:
        raise RunError(f"{model.path} has no predictors (fc1/fc2); sparse decoding needs a PowerInfer GGUF")
    if requested == "auto":
        return "sparse" if has_predictors else "dense"
    return requested


def load_forward(model: ModelFile, options: RuntimeOptions, slots: int = 1, ctx_size: int = 512) -> LoadedRuntime:
    if options.schedule not in SCHEDULES:
        raise RunError(f"unknown schedule {options.schedule!r}; use static or dynamic")
    make_forward, read_ffn = FORWARDS.get(model.config.arch, (None, None))
    if make_forward is None or read_ffn is None:
        raise RunError(f"{model.path}: no forward for architecture {model.config.arch!r}")
    layers = [read_ffn(model, i) for i in range(model.config.layers)]
    mode = ffn_mode(model, options.ffn, layers)
    cpu = torch.device("cpu")
    if mode == "dense":
        return LoadedRuntime(make_forward(model, DenseRunner(layers), cpu), mode, "static")
    selector = "oracle" if mode == "oracle" else "predictor"
    runner = SparseRunner(layers, model.config.sparse_threshold, selector)
    return LoadedRuntime(make_forward(model, runner, cpu), mode, "static")
