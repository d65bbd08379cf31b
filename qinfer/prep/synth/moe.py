"""Tiny mixture-of-experts checkpoints (Mixtral, Qwen2-MoE, Qwen3-MoE), for tests that cannot download one.

Each has what sets its family apart, only small: Mixtral 4 experts of which 2 run, with a SentencePiece
vocabulary; Qwen2-MoE q/k/v biases and a sigmoid-gated shared expert beside 4 experts whose top-2 weights are not
rescaled; Qwen3-MoE q/k norms, heads wider than hidden / heads and 8 experts, top-2 rescaled. Weights are random
(seeded).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (
    MixtralConfig,
    MixtralForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from qinfer.formats.atomic_file import atomic_directory
from qinfer.prep.synth.swiglu import decoder_config, save_checkpoint, synth_tokenizer

MOE_FAMILIES = ("mixtral", "qwen2moe", "qwen3moe")
# The SwiGLU family whose kind of vocabulary each has.
_VOCABULARY = {"mixtral": "mistral", "qwen2moe": "qwen2", "qwen3moe": "qwen2"}


@dataclass(frozen=True)
class MoeShape:
    layers: int = 2
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    expert_ffn: int = 32
    shared_ffn: int = 48  # Qwen2-MoE's shared expert
    qwen3_head_dim: int = 32  # wider than hidden / heads, as Qwen3-30B-A3B's heads (128 of 2048 / 32) are
    used: int = 2
    experts: int | None = None  # None: the family's own small count (_EXPERTS)
    vocab: int = 640
    context: int = 256


_EXPERTS = {"mixtral": 4, "qwen2moe": 4, "qwen3moe": 8}


def moe_config(
    family: str, shape: MoeShape, vocab: int, ids: dict[str, int | None], init_std: float
) -> PretrainedConfig:
    common = decoder_config(shape, vocab, ids, init_std)
    common |= dict(num_experts_per_tok=shape.used, tie_word_embeddings=False)
    experts = shape.experts or _EXPERTS[family]
    if family == "mixtral":
        return MixtralConfig(**common, intermediate_size=shape.expert_ffn, num_local_experts=experts)
    qwen = dict(common, num_experts=experts, moe_intermediate_size=shape.expert_ffn, intermediate_size=4 * shape.hidden)
    if family == "qwen2moe":
        return Qwen2MoeConfig(**qwen, shared_expert_intermediate_size=shape.shared_ffn, norm_topk_prob=False)
    return Qwen3MoeConfig(**qwen, head_dim=shape.qwen3_head_dim, norm_topk_prob=True)


MOE_CLASSES: dict[str, type[PreTrainedModel]] = {
    "mixtral": MixtralForCausalLM,
    "qwen2moe": Qwen2MoeForCausalLM,
    "qwen3moe": Qwen3MoeForCausalLM,
}


def build_moe(out: Path, family: str, shape: MoeShape = MoeShape(), seed: int = 0, init_std: float = 0.1) -> Path:
    """Write an untrained Hugging Face checkpoint of `family` with its tokenizer to `out` (replaced whole when
    complete). transformers starts biases at 0 and norms at 1; they are drawn at random here, so that a forward that
    drops Qwen2's biases or Qwen3's q/k norm weights shows in its logits."""
    if family not in MOE_FAMILIES:
        raise ValueError(f"family must be one of {MOE_FAMILIES}, not {family!r}")
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    vocabulary = _VOCABULARY[family]
    with atomic_directory(out) as tmp:
        tokenizer = synth_tokenizer(vocabulary, tmp, seed, shape.vocab, shape.context)
        ids = {"bos": tokenizer.bos_token_id, "eos": tokenizer.eos_token_id}
        vocab = max(shape.vocab, len(tokenizer))
        model = MOE_CLASSES[family](moe_config(family, shape, vocab, ids, init_std)).eval()
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("bias"):
                    param.normal_(0.0, init_std, generator=gen)
                elif name.endswith(("q_norm.weight", "k_norm.weight")):
                    param.normal_(1.0, init_std, generator=gen)
        save_checkpoint(model, tokenizer, vocabulary, tmp)
    return out
