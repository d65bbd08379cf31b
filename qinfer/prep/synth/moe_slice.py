"""Full-width slices of real mixtures of experts (a few layers of Mixtral-8x7B's or Qwen3-30B-A3B's shape), with
random weights, for decode benchmarks: too large for transformers to build in float32 on a small machine, so the
checkpoint is written tensor by tensor as float16 safetensors, each expert in the per-expert names the converter
reads. The router is random too, so each token picks its own experts, as in a trained model.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import save_file

from qinfer.formats.atomic_file import atomic_directory
from qinfer.prep.synth.moe import _VOCABULARY, MOE_CLASSES, MoeShape, moe_config
from qinfer.prep.synth.swiglu import synth_tokenizer

SLICES = {
    # Mixtral-8x7B: 32 heads of 128 over 8 key-value heads, 8 experts of 14336, 2 of them per token.
    "mixtral-slice": ("mixtral", MoeShape(hidden=4096, heads=32, kv_heads=8, expert_ffn=14336, experts=8, vocab=32000,
                                          context=1024)),
    # Qwen3-30B-A3B: 32 heads of 128 (wider than 2048 / 32) with q/k norms over 4 key-value heads, 128 experts of
    # 768, 8 of them per token.
    "qwen3moe-slice": ("qwen3moe", MoeShape(hidden=2048, heads=32, kv_heads=4, expert_ffn=768, qwen3_head_dim=128,
                                            experts=128, used=8, vocab=32000, context=1024)),
}  # fmt: skip
TOKENIZER_VOCAB = 640  # the tokenizer is the tiny models' own; the rest of the 32000 rows are never looked up
SHARD_BYTES = 512 << 20  # tensors are written in shards of about this size, so no more is held at once
INIT_STD = 0.02
# Each family's checkpoint names of layer i's router and expert j's gate, up and down (transformers' own classes
# hold the experts fused; their saved checkpoints, which the converter reads, name them one by one).
_MOE_PREFIX = {"mixtral": "model.layers.{i}.block_sparse_moe", "qwen3moe": "model.layers.{i}.mlp"}
_EXPERT_MATRICES = {"mixtral": ("w1", "w3", "w2"), "qwen3moe": ("gate_proj", "up_proj", "down_proj")}


def _shapes(family: str, shape: MoeShape) -> Iterator[tuple[str, tuple[int, ...]]]:
    """Every tensor's checkpoint name and shape, layer by layer."""
    config = moe_config(family, shape, shape.vocab, {"bos": 1, "eos": 2}, INIT_STD)
    with torch.device("meta"):
        model = MOE_CLASSES[family](config)
    experts = config.num_local_experts if family == "mixtral" else config.num_experts
    for name, param in model.named_parameters():
        if ".mlp." not in name:
            yield name, tuple(param.shape)
        elif name.endswith("mlp.gate.weight"):
            i = int(name.split(".")[2])
            prefix = _MOE_PREFIX[family].format(i=i)
            yield f"{prefix}.gate.weight", tuple(param.shape)
            gate, up, down = _EXPERT_MATRICES[family]
            f, e = shape.expert_ffn, shape.hidden
            for j in range(experts):
                yield from ((f"{prefix}.experts.{j}.{w}.weight", s) for w, s in ((gate, (f, e)), (up, (f, e))))
                yield f"{prefix}.experts.{j}.{down}.weight", (e, f)


def _random(name: str, size: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    if len(size) == 1:  # norms (and Qwen3's q/k norms) near 1, as trained ones are
        return (1.0 + INIT_STD * torch.randn(size, generator=gen)).half()
    return (INIT_STD * torch.randn(size, generator=gen)).half()


def build_moe_slice(out: Path, name: str, layers: int = 2, seed: int = 0) -> Path:
    """Write slice `name` (a key of SLICES) with `layers` layers as a Hugging Face checkpoint to `out`."""
    family, shape = SLICES[name]
    shape = replace(shape, layers=layers)
    gen = torch.Generator().manual_seed(seed)
    with atomic_directory(out) as tmp:
        tokenizer = synth_tokenizer(_VOCABULARY[family], tmp, seed, TOKENIZER_VOCAB, shape.context)
        ids = {"bos": tokenizer.bos_token_id, "eos": tokenizer.eos_token_id}
        config = moe_config(family, shape, shape.vocab, ids, INIT_STD)
        config.architectures = [MOE_CLASSES[family].__name__]  # what save_pretrained of a model would write
        config.save_pretrained(tmp)
        if family != "mixtral":  # Mistral's SentencePiece files are in place already
            tokenizer.save_pretrained(tmp)
        shard: dict[str, torch.Tensor] = {}
        held, count = 0, 0
        for tensor, size in _shapes(family, shape):
            shard[tensor] = _random(tensor, size, gen)
            held += shard[tensor].nbytes
            if held >= SHARD_BYTES:
                save_file(shard, tmp / f"model-{count:05d}.safetensors", metadata={"format": "pt"})
                shard, held, count = {}, 0, count + 1
        if shard:
            save_file(shard, tmp / f"model-{count:05d}.safetensors", metadata={"format": "pt"})
    return out
