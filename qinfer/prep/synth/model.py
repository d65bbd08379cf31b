"""The synth LLaMA itself: its shape and weights, training under exact sparsity, and a look inside a forward pass.

How the sparsity is made exact: hidden channel 0 of the residual stream is held at a constant (the embedding
sets it, and o_proj and down_proj never write to it), so column 0 of each gate_proj acts as a per-neuron bias.
RMSNorm only rescales, so neuron j fires iff (gate_proj * norm weight) @ h > 0 for the un-normalised residual
h, and setting its bias to a quantile of the rest of that sum makes it fire at a chosen rate. The rates follow
a power law, which gives the hot/cold skew. While training, every batch re-derives the biases before the MLP
runs, so the model learns under the sparsity it will have; then one pass over calibration text fixes them,
layer by layer.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM, PretrainedConfig, PreTrainedModel
from transformers import logging as hf_logging

from qinfer.prep.profile.ffn_taps import forward_hooks, hooked
from qinfer.prep.synth.tokenizer import BOS, EOS, SEQ_LEN, save_tokenizer

Progress = Callable[[str, int, int], None]
M = TypeVar("M", bound=PreTrainedModel)
BIAS_VALUE = 1.0  # residual channel 0; the embedding std is 1 too, so after RMSNorm the channel is ordinary-sized
BATCH = 16
LR = 3e-3
TRAIN_CALIBRATION_STRIDE = 4
RATE_POWER = 1.3  # neuron firing rate ~ rank ** -RATE_POWER: the hottest 20% get about 75% of all firings
MAX_RATE = 0.9


@dataclass(frozen=True)
class SynthShape:
    layers: int = 4
    hidden: int = 128
    ffn: int = 512
    heads: int = 4
    kv_heads: int = 2
    vocab: int = 1024  # sentencepiece vocab size
    context: int = 256  # max_position_embeddings
    predictor_rank: int = 64  # P, the predictor hidden width; a multiple of 32

    @property
    def predictor_width(self) -> int:
        """P as written: never wider than the 2 * hidden (rounded up to 32) at which it is exact anyway."""
        return min(self.predictor_rank, 32 * math.ceil(2 * self.hidden / 32))

    @property
    def gate_rank(self) -> int:
        """Rank of gate_proj without its bias column, so that with it the predictor is exact."""
        return min(self.predictor_width // 2, self.hidden) - 1


def llama_config(shape: SynthShape) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.ffn,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        hidden_act="relu",
        max_position_embeddings=shape.context,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=BOS,
        eos_token_id=EOS,
        dtype="float32",
    )


def blank_model(model_class: type[M], config: PretrainedConfig) -> M:
    """A model of `config` whose weights the caller then draws from its own generator. transformers' own init draws
    from the global generator, which is left as it was, so a build's output depends on its seed alone."""
    with torch.random.fork_rng():
        return model_class(config)


def init_model(shape: SynthShape, gen: torch.Generator) -> tuple[LlamaForCausalLM, list[torch.Tensor]]:
    """The model with every weight drawn from `gen`, and per layer the basis [hidden - 1, gate_rank] that the
    rows of gate_proj (bias column aside) stay in."""
    model = blank_model(LlamaForCausalLM, llama_config(shape))
    residual_scale = 1.0 / math.sqrt(2 * shape.layers)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith("embed_tokens.weight"):
                param.normal_(0.0, 1.0, generator=gen)
            else:
                std = 1.0 / math.sqrt(param.shape[1])
                if name.endswith(("o_proj.weight", "down_proj.weight")):
                    std *= residual_scale
                param.normal_(0.0, std, generator=gen)
        bases = []
        for layer in model.model.layers:
            basis = torch.linalg.qr(torch.randn(shape.hidden - 1, shape.gate_rank, generator=gen)).Q
            # Unit-variance coordinates in the basis give the gate unit-variance pre-activations.
            coords = torch.randn(shape.ffn, shape.gate_rank, generator=gen) / math.sqrt(shape.gate_rank)
            layer.mlp.gate_proj.weight[:, 1:] = coords @ basis.T
            bases.append(basis)
    restore_structure(model, bases)
    return model, bases


def restore_structure(model: LlamaForCausalLM, bases: list[torch.Tensor]) -> None:
    """Re-impose what an optimizer step may disturb: the constant channel 0 and the gate's low rank."""
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = BIAS_VALUE
        for layer, basis in zip(model.model.layers, bases, strict=True):
            layer.self_attn.o_proj.weight[0] = 0.0
            layer.mlp.down_proj.weight[0] = 0.0
            layer.post_attention_layernorm.weight[0] = 1.0
            gate = layer.mlp.gate_proj.weight
            gate[:, 1:] = (gate[:, 1:] @ basis) @ basis.T


def firing_rates(layers: int, ffn: int, mean_rate: float, gen: torch.Generator) -> torch.Tensor:
    """[layers, ffn] target firing rates: a capped power law of the neuron's rank with mean `mean_rate`,
    dealt out to the neurons of each layer in a random order."""
    profile = torch.arange(1, ffn + 1, dtype=torch.float64) ** -RATE_POWER
    lo, hi = 0.0, float(ffn) ** RATE_POWER
    for _ in range(100):
        mid = (lo + hi) / 2
        if (mid * profile).clamp(max=MAX_RATE).mean() < mean_rate:
            lo = mid
        else:
            hi = mid
    rates = (hi * profile).clamp(max=MAX_RATE).float()
    return torch.stack([rates[torch.randperm(ffn, generator=gen)] for _ in range(layers)])


def _set_biases(layer: nn.Module, h: torch.Tensor, rates: torch.Tensor, stride: int) -> None:
    """Make neuron j fire on a share rates[j] of the residuals h[::stride]: cut between two order statistics."""
    weight = layer.mlp.gate_proj.weight * layer.post_attention_layernorm.weight
    scores = (weight[:, 1:] @ h.reshape(-1, h.shape[-1])[::stride, 1:].T).sort(dim=1).values
    n = scores.shape[1]
    below = ((1.0 - rates) * n).round().long().clamp(1, n - 1)[:, None]
    cut = (scores.gather(1, below - 1) + scores.gather(1, below))[:, 0] / 2
    layer.mlp.gate_proj.weight[:, 0] = -cut / (layer.post_attention_layernorm.weight[0] * BIAS_VALUE)


def shrink_bias_columns(model: LlamaForCausalLM) -> None:
    """Move the size of each gate's bias column into the norm weight of channel 0, leaving the model's function
    unchanged (up_proj reads the same normalised channel, so its column 0 shrinks by the same factor).

    The biases come out 20-200 times larger than the other gate weights; block-quantised formats would
    otherwise flatten the weights that share a block with them.
    """
    with torch.no_grad():
        for layer in model.model.layers:
            gate = layer.mlp.gate_proj.weight
            scale = float(gate[:, 0].abs().max() / gate[:, 1:].abs().max())
            if scale > 1.0:
                layer.post_attention_layernorm.weight[0] *= scale
                gate[:, 0] /= scale
                layer.mlp.up_proj.weight[:, 0] /= scale


@contextmanager
def biases_follow_input(model: LlamaForCausalLM, rates: torch.Tensor, stride: int = 1) -> Iterator[None]:
    """While active, each forward pass first re-derives every layer's gate biases from that layer's input
    (from every `stride`-th token of it: sorting the scores is the costly part of a training step).

    The hook runs just before the layer's FFN, so each layer is calibrated on inputs that already reflect
    the calibrated layers below it.
    """

    def hook(layer: nn.Module, layer_rates: torch.Tensor) -> Callable[[nn.Module, tuple[torch.Tensor, ...]], None]:
        def before_norm(_module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            with torch.no_grad():
                _set_biases(layer, args[0].detach(), layer_rates, stride)

        return before_norm

    handles = [
        layer.post_attention_layernorm.register_forward_pre_hook(hook(layer, rates[i]))
        for i, layer in enumerate(model.model.layers)
    ]
    with hooked(handles):
        yield


def train(
    model: LlamaForCausalLM,
    bases: list[torch.Tensor],
    stream: torch.Tensor,
    rates: torch.Tensor,
    steps: int,
    gen: torch.Generator,
    progress: Progress,
    seq_len: int = SEQ_LEN,
) -> None:
    """Next-token training on random windows of `seq_len` tokens of `stream`, with the biases tracking the target
    rates. Each step sees the same number of tokens whatever the window length, so long windows cost no more."""
    rows = max(1, BATCH * SEQ_LEN // seq_len)
    matrices = [p for p in model.parameters() if p.dim() == 2]
    vectors = [p for p in model.parameters() if p.dim() != 2]
    opt = torch.optim.AdamW(
        [{"params": matrices, "weight_decay": 0.1}, {"params": vectors, "weight_decay": 0.0}], lr=LR, betas=(0.9, 0.95)
    )
    warmup = max(1, steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))
    )
    model.train()
    with biases_follow_input(model, rates, TRAIN_CALIBRATION_STRIDE):
        for step in range(steps):
            starts = torch.randint(0, len(stream) - seq_len, (rows,), generator=gen).tolist()
            batch = torch.stack([stream[s : s + seq_len] for s in starts])
            loss = model(input_ids=batch, labels=batch).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            restore_structure(model, bases)
            progress("train", step + 1, steps)
    model.eval()


@dataclass(frozen=True)
class Observed:
    """One forward pass seen from inside: per layer the FFN input h [tokens, E] and which neurons fired."""

    inputs: list[torch.Tensor]
    fired: list[torch.Tensor]  # bool [tokens, F]: gate_proj(post_attention_layernorm(h)) > 0
    loss: float


def observe(model: LlamaForCausalLM, batch: torch.Tensor, rates: torch.Tensor | None = None) -> Observed:
    """Run `batch` through the model and record each layer's FFN input and firing pattern.

    With `rates`, the same pass first calibrates every layer's biases to them (see biases_follow_input).
    """
    layers = list(model.model.layers)
    inputs: list[torch.Tensor] = [torch.empty(0)] * len(layers)
    fired: list[torch.Tensor] = [torch.empty(0)] * len(layers)

    def keep_input(i: int) -> Callable[[nn.Module, tuple[torch.Tensor, ...]], None]:
        def hook(_module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            inputs[i] = args[0].detach().reshape(-1, args[0].shape[-1])

        return hook

    def keep_firing(i: int) -> Callable[[nn.Module, tuple[torch.Tensor, ...], torch.Tensor], None]:
        def hook(_module: nn.Module, _args: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
            fired[i] = (output > 0).reshape(-1, output.shape[-1])

        return hook

    handles = [
        layer.post_attention_layernorm.register_forward_pre_hook(keep_input(i)) for i, layer in enumerate(layers)
    ]
    handles += forward_hooks(layers, "mlp.gate_proj", keep_firing)
    with hooked(handles), torch.no_grad(), biases_follow_input(model, rates) if rates is not None else nullcontext():
        loss = float(model(input_ids=batch, labels=batch).loss)
    return Observed(inputs, fired, loss)


def save_model(model: LlamaForCausalLM, tokenizer_model: bytes, model_dir: Path) -> None:
    model_dir.mkdir()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # progress belongs to the caller's callback, not to stderr
    try:
        model.save_pretrained(model_dir)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    save_tokenizer(tokenizer_model, model.config.max_position_embeddings, model_dir)
