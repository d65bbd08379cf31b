"""A tiny ReLU Falcon (Falcon-40B's layout) with exact predictors, for testing convert, quantize and the runtime.

Weights are random (no training): what the tests need is the architecture, not the text it writes. The
predictors are exact by construction: LayerNorm centres its input, a linear map C h, and divides by a
positive scale, so with a zero ln_mlp bias neuron j fires iff (W diag(g) C h)_j > 0 for the layer input h;
fc1 = [diag(g) C; -diag(g) C] and fc2 = [W, -W] give fc2 @ relu(fc1 @ h) = W diag(g) C h (width 2E).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import FalconConfig, FalconForCausalLM

from qinfer.core.errors import UserError
from qinfer.formats.atomic_file import atomic_directory
from qinfer.prep.synth.corpus import synth_corpus
from qinfer.prep.synth.model import blank_model
from qinfer.prep.synth.predictors import save_predictors
from qinfer.prep.synth.tokenizer import BOS, EOS, TOKENIZER_CHARS, save_tokenizer, train_tokenizer


@dataclass(frozen=True)
class FalconShape:
    layers: int = 2
    hidden: int = 64
    ffn: int = 256
    heads: int = 8
    kv_heads: int = 2
    vocab: int = 512
    context: int = 256


def falcon_config(shape: FalconShape) -> FalconConfig:
    return FalconConfig(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_kv_heads=shape.kv_heads,
        ffn_hidden_size=shape.ffn,
        new_decoder_architecture=True,
        parallel_attn=True,
        bias=False,
        alibi=False,
        activation="relu",
        max_position_embeddings=shape.context,
        layer_norm_epsilon=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=BOS,
        eos_token_id=EOS,
        tie_word_embeddings=False,
        dtype="float32",
    )


def init_falcon(shape: FalconShape, gen: torch.Generator) -> FalconForCausalLM:
    """Unit-scale random weights (transformers' 0.02 init would make every logit nearly zero)."""
    if shape.hidden % shape.heads or shape.heads % shape.kv_heads or (shape.hidden // shape.heads) % 2:
        raise UserError(f"cannot build a synth falcon with hidden={shape.hidden}, heads={shape.heads}/{shape.kv_heads}")
    model = blank_model(FalconForCausalLM, falcon_config(shape))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("word_embeddings.weight"):
                param.normal_(0.0, 1.0, generator=gen)
            elif param.dim() == 2:
                param.normal_(0.0, 1.0 / math.sqrt(param.shape[1] * 2 * shape.layers), generator=gen)
            elif name.endswith("ln_mlp.bias"):
                param.zero_()  # keeps the predictors exact (see the module notes)
            elif name.endswith("bias"):
                param.normal_(0.0, 0.1, generator=gen)
            else:
                param.copy_(1.0 + 0.2 * torch.randn(param.shape, generator=gen))
    return model.eval()


def exact_predictors(model: FalconForCausalLM) -> list[tuple[torch.Tensor, torch.Tensor]]:
    predictors = []
    for layer in model.transformer.h:
        g = layer.ln_mlp.weight.detach()
        e = g.shape[0]
        centred = g[:, None] * (torch.eye(e) - 1.0 / e)
        up = layer.mlp.dense_h_to_4h.weight.detach()
        predictors.append((torch.cat([centred, -centred]), torch.cat([up, -up], dim=1)))
    return predictors


def build_synth_falcon(out: Path, shape: FalconShape = FalconShape(), seed: int = 0) -> tuple[Path, Path]:
    """Write out/model (HF Falcon checkpoint with the synth tokenizer) and out/predictor; returns both."""
    gen = torch.Generator().manual_seed(seed)
    tokenizer_model = train_tokenizer(synth_corpus(seed, TOKENIZER_CHARS, "train"), shape.vocab)
    model = init_falcon(shape, gen)
    with atomic_directory(out) as tmp:
        tmp.chmod(0o755)
        (tmp / "model").mkdir()
        model.save_pretrained(tmp / "model")
        save_tokenizer(tokenizer_model, shape.context, tmp / "model")
        save_predictors(exact_predictors(model), 0.0, tmp / "predictor")
    return out / "model", out / "predictor"
