"""A tiny ReLU OPT with a GPT-2 byte-level BPE vocabulary and exact predictors, for testing the OPT path end to end.

Weights are random (no training). The predictors are exact by construction, as for the synth Falcon: the FFN reads
LayerNorm(h), which centres h (a linear map C h) and divides by a positive scale, so with zero biases on that
LayerNorm and on fc1 neuron j fires iff (W diag(g) C h)_j > 0; fc1 = [diag(g) C; -diag(g) C] and fc2 = [W, -W]
give fc2 @ relu(fc1 @ h) = W diag(g) C h (width 2E). `exact_predictors=False` gives those biases random values
too, for tests of the bias arithmetic, and the predictors are then only approximate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import OPTConfig, OPTForCausalLM

from qinfer.core.errors import UserError
from qinfer.formats.atomic_file import atomic_directory
from qinfer.prep.synth.bpe import OPT_BOS, OPT_EOS, OPT_PAD, save_bpe_tokenizer
from qinfer.prep.synth.corpus import synth_corpus
from qinfer.prep.synth.model import blank_model
from qinfer.prep.synth.predictors import save_predictors
from qinfer.prep.synth.tokenizer import TOKENIZER_CHARS


@dataclass(frozen=True)
class OPTShape:
    layers: int = 2
    hidden: int = 64
    ffn: int = 256
    heads: int = 4
    vocab: int = 512  # BPE tokens; the embedding is padded to a multiple of 8 beyond them, as OPT's is
    context: int = 256

    @property
    def padded_vocab(self) -> int:
        return -(-(self.vocab + 1) // 8) * 8


def opt_config(shape: OPTShape) -> OPTConfig:
    return OPTConfig(
        vocab_size=shape.padded_vocab,
        hidden_size=shape.hidden,
        num_hidden_layers=shape.layers,
        ffn_dim=shape.ffn,
        num_attention_heads=shape.heads,
        max_position_embeddings=shape.context,
        word_embed_proj_dim=shape.hidden,
        do_layer_norm_before=True,
        activation_function="relu",
        dropout=0.0,
        bos_token_id=OPT_BOS,
        eos_token_id=OPT_EOS,
        pad_token_id=OPT_PAD,
        tie_word_embeddings=True,
        dtype="float32",
    )


def init_opt(shape: OPTShape, gen: torch.Generator, exact_predictors: bool) -> OPTForCausalLM:
    """Unit-scale random weights (transformers' 0.02 init would make every logit nearly zero)."""
    if shape.hidden % shape.heads:
        raise UserError(f"cannot build a synth OPT with hidden={shape.hidden} and {shape.heads} heads")
    model = blank_model(OPTForCausalLM, opt_config(shape))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("embed_tokens.weight"):
                param.normal_(0.0, 1.0, generator=gen)
            elif name.endswith("embed_positions.weight"):
                param.normal_(0.0, 0.3, generator=gen)
            elif param.dim() == 2:
                param.normal_(0.0, 1.0 / math.sqrt(param.shape[1] * 2 * shape.layers), generator=gen)
            elif exact_predictors and name.endswith(("final_layer_norm.bias", "fc1.bias")) and ".layers." in name:
                param.zero_()  # keeps the predictors exact (see the module notes)
            elif name.endswith("bias"):
                param.normal_(0.0, 0.1, generator=gen)
            else:
                param.copy_(1.0 + 0.2 * torch.randn(param.shape, generator=gen))
    # OPT's head is its token embedding; the parameters above were drawn before the two were tied.
    model.lm_head.weight = model.model.decoder.embed_tokens.weight
    return model.eval()


def exact_opt_predictors(model: OPTForCausalLM) -> list[tuple[torch.Tensor, torch.Tensor]]:
    predictors = []
    for layer in model.model.decoder.layers:
        g = layer.final_layer_norm.weight.detach()
        e = g.shape[0]
        centred = g[:, None] * (torch.eye(e) - 1.0 / e)
        up = layer.fc1.weight.detach()
        predictors.append((torch.cat([centred, -centred]), torch.cat([up, -up], dim=1)))
    return predictors


def build_synth_opt(
    out: Path, shape: OPTShape = OPTShape(), seed: int = 0, exact_predictors: bool = True
) -> tuple[Path, Path]:
    """Write out/model (HF OPT checkpoint with a GPT-2 BPE tokenizer, laid out as facebook/opt-* repos are) and
    out/predictor; returns both."""
    gen = torch.Generator().manual_seed(seed)
    model = init_opt(shape, gen, exact_predictors)
    with atomic_directory(out) as tmp:
        tmp.chmod(0o755)
        (tmp / "model").mkdir()
        model.save_pretrained(tmp / "model")
        save_bpe_tokenizer(synth_corpus(seed, TOKENIZER_CHARS, "train"), shape.vocab, tmp / "model")
        save_predictors(exact_opt_predictors(model), 0.0, tmp / "predictor")
    return out / "model", out / "predictor"
