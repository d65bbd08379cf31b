"""Load a ReLU LLaMA-family or Falcon checkpoint with transformers for profiling and predictor training, on CPU or
CUDA."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import (
    AutoTokenizer,
    FalconForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.utils import logging as hf_logging

from qinfer_core.errors import UserError
from qinfer_prep.hf_config import ModelParams, read_hf_config

DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
DEVICES = ("auto", "cpu", "cuda")


@dataclass
class ReluModel:
    model: LlamaForCausalLM | FalconForCausalLM
    params: ModelParams
    tokenizer: PreTrainedTokenizerBase
    device: torch.device
    dtype: torch.dtype
    fell_back: bool  # CUDA was asked for but is not available, so the model runs on the CPU

    @property
    def layers(self) -> list[nn.Module]:
        if self.params.arch == "falcon":
            return list(self.model.transformer.h)
        return list(self.model.model.layers)


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


def load_relu_model(model_dir: Path, dtype: str | None = None, device: str = "auto") -> ReluModel:
    """The model in eval mode, without gradients. Bamboo checkpoints share LLaMA's tensor names, so they load as
    LlamaForCausalLM, with a hook that adds the ReLU Bamboo applies to up_proj as well."""
    params = read_hf_config(model_dir)
    where, fell_back = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, where)
    model_class: type[PreTrainedModel] = FalconForCausalLM
    config = None
    if params.arch != "falcon":
        cfg = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
        # A Bamboo config names a model_type transformers does not know; its keys are LLaMA's.
        cfg.pop("model_type", None)
        cfg["architectures"] = ["LlamaForCausalLM"]
        config = LlamaConfig(**cfg)
        model_class = LlamaForCausalLM
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # unused-weight notices for tied or extra tensors are not the user's concern
    hf_logging.disable_progress_bar()  # the commands draw their own progress
    try:
        model = model_class.from_pretrained(
            model_dir, config=config, dtype=torch_dtype, local_files_only=True, low_cpu_mem_usage=True
        )
        tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot load the model in {model_dir} ({exc})") from exc
    finally:
        hf_logging.set_verbosity(verbosity)
        hf_logging.enable_progress_bar()
    # Documents are tokenised whole and then cut into windows, so their length is no concern of the tokenizer's.
    tokenizer.model_max_length = 1 << 60
    model.to(where).eval().requires_grad_(False)
    if params.arch == "bamboo":
        for layer in model.model.layers:
            layer.mlp.up_proj.register_forward_hook(lambda _m, _a, out: torch.relu(out))
    return ReluModel(model, params, tokenizer, where, torch_dtype, fell_back)


def fires(layer: nn.Module, residual: torch.Tensor, arch: str) -> torch.Tensor:
    """Which FFN neurons of `layer` fire for the predictor's input (the residual stream before ffn_norm; falcon:
    the layer input): [..., E] -> bool [..., F]."""
    if arch == "falcon":
        return layer.mlp.dense_h_to_4h(layer.ln_mlp(residual)) > 0
    x = layer.post_attention_layernorm(residual)
    active = layer.mlp.gate_proj(x) > 0
    if arch == "bamboo":
        active &= layer.mlp.up_proj(x) != 0  # up_proj carries the ReLU hook, so "fires" means positive
    return active
