"""Load a checkpoint of any family in qinfer.core.architectures with transformers, for profiling, calibration and
predictor training, on CPU or CUDA."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import transformers
from safetensors import SafetensorError
from torch import nn
from transformers import AutoTokenizer, LlamaConfig, PreTrainedModel, PreTrainedTokenizerBase
from transformers import logging as hf_logging

from qinfer.core.architectures import Architecture, FfnForm, architecture
from qinfer.core.errors import UserError
from qinfer.core.model_spec import ModelSpec
from qinfer.core.spec_readers import spec_from_hf_dir
from qinfer.prep.profile.ffn_taps import submodule

DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
DEVICES = ("auto", "cpu", "cuda")


@dataclass
class ReluModel:
    model: PreTrainedModel
    spec: ModelSpec
    arch: Architecture
    form: FfnForm
    tokenizer: PreTrainedTokenizerBase
    device: torch.device
    dtype: torch.dtype
    fell_back: bool  # CUDA was asked for but is not available, so the model runs on the CPU
    # A calibrated model's per-layer thresholds on |act(gate)|: where a neuron fires (qinfer.formats.calibration_dir).
    gate_thresholds: list[float] | None = None

    @property
    def layers(self) -> list[nn.Module]:
        return list(submodule(self.model, self.arch.hf.layers))


def resolve_device(device: str) -> tuple[torch.device, bool]:
    if device not in DEVICES:
        raise UserError(f"device must be one of {', '.join(DEVICES)}, not {device!r}")
    cuda = torch.cuda.is_available()
    if device == "cpu" or not cuda:
        return torch.device("cpu"), device == "cuda"
    return torch.device("cuda"), False


def resolve_dtype(dtype: str | None, device: torch.device) -> torch.dtype:
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise UserError(f"dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
    return DTYPES[dtype]


def _llama_config(cfg: dict[str, Any]) -> LlamaConfig:
    # A Bamboo config names a model_type transformers does not know; its keys are LLaMA's. dReLU is relu on gate
    # (the class's activation) and on up (a hook).
    cfg = {**cfg, "architectures": ["LlamaForCausalLM"]}
    cfg.pop("model_type", None)
    if cfg.get("hidden_act") == "drelu":
        cfg["hidden_act"] = "relu"
    return LlamaConfig(**cfg)


def _model_class(arch: Architecture, cfg: dict[str, Any]) -> tuple[type[PreTrainedModel], LlamaConfig | None]:
    """The checkpoint's own transformers class where it is one of the family's (MistralForCausalLM keeps Mistral's
    sliding window), else the family's, with the config read as LLaMA's where the family says so."""
    named = (cfg.get("architectures") or [None])[0]
    if named in arch.hf_classes and hasattr(transformers, named) and cfg.get("hidden_act") != "drelu":
        return getattr(transformers, named), None
    model_class: type[PreTrainedModel] = getattr(transformers, arch.hf.model_class)
    return model_class, _llama_config(cfg) if arch.hf.llama_config else None


def load_relu_model(
    model_dir: Path, dtype: str | None = None, device: str = "auto", *, experts: bool = False
) -> ReluModel:
    """The model in eval mode, without gradients. A model whose transformers class lacks its ReLU on up (dReLU:
    Bamboo, loaded as LLaMA) gets a hook that adds it. A model with experts is refused, before it loads, unless
    `experts` (the profiler counts their routing; nothing else reads them yet)."""
    spec = spec_from_hf_dir(model_dir)
    if spec.experts is not None and not experts:
        raise UserError(
            f"{model_dir} has experts, which are not calibrated or given predictors yet; count their routing with "
            "`qinfer prep profile`, or convert it with `qinfer prep convert-dense` and run it dense"
        )
    arch = architecture(spec.arch)
    where, fell_back = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, where)
    model_class, config = _model_class(arch, json.loads((model_dir / "config.json").read_text(encoding="utf-8")))
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # unused-weight notices for tied or extra tensors are not the user's concern
    hf_logging.disable_progress_bar()  # the commands draw their own progress
    try:
        model = model_class.from_pretrained(
            model_dir, config=config, dtype=torch_dtype, local_files_only=True, low_cpu_mem_usage=True
        )
        tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except SafetensorError as exc:
        raise UserError(f"cannot load the model in {model_dir} ({exc}); the download may be incomplete") from exc
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot load the model in {model_dir} ({exc})") from exc
    finally:
        hf_logging.set_verbosity(verbosity)
        hf_logging.enable_progress_bar()
    # Documents are tokenised whole and then cut into windows, so their length is no concern of the tokenizer's.
    tokenizer.model_max_length = 1 << 60
    model.to(where).eval().requires_grad_(False)
    form = arch.form(spec.activation)
    loaded = ReluModel(model, spec, arch, form, tokenizer, where, torch_dtype, fell_back)
    if form.gated and form.relu_up:
        for layer in loaded.layers:
            submodule(layer, arch.hf.up).register_forward_hook(lambda _m, _a, out: torch.relu(out))
    return loaded


def fires(
    layer: nn.Module, residual: torch.Tensor, arch: Architecture, form: FfnForm, threshold: float = 0.0
) -> torch.Tensor:
    """Which FFN neurons of `layer` fire for the predictor's input (the input of the norm before the FFN):
    [..., E] -> bool [..., F]. A gated neuron fires where |act(gate)| exceeds the layer's threshold (0 for ReLU:
    where the gate is positive)."""
    x = submodule(layer, arch.hf.ffn_norm)(residual)
    if arch.hf.gate is None:
        return submodule(layer, arch.hf.up)(x) > 0
    gate = submodule(layer, arch.hf.gate)(x)
    active = (F.silu(gate).abs() if form.act == "silu" else gate) > threshold
    if form.relu_up:
        active &= submodule(layer, arch.hf.up)(x) != 0  # up carries the ReLU hook, so "fires" means positive
    return active
