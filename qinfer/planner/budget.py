"""VRAM accounting: bytes of every part that can live on the GPU, and of a placement.

Scratch reserve: a fixed 256 MiB (CUDA context, cuBLAS workspace, allocator slack) plus the f32 buffers one decode
step of one layer needs at once: per sequence the hidden state, q/k/v, the FFN activations and the attention scores
over the rows the KV policy attends, with a factor 2 because the engine double-buffers them, and the float32
copies of those rows' keys and values that attention makes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from qinfer.core.errors import UserError
from qinfer.core.kv_policy import KVPolicy
from qinfer.formats.activation_files import Unit
from qinfer.planner.model_layout import ModelLayout
from qinfer.planner.placement import Placement

MIB = 1 << 20
GIB = 1 << 30
SCRATCH_FIXED = 256 * MIB
KV_ELEMENT_BYTES = 2


@dataclass(frozen=True)
class BudgetOptions:
    ctx_size: int = 512
    batch: int = 1
    gpu_embeddings: bool = False
    kv_policy: KVPolicy = KVPolicy()


@dataclass(frozen=True)
class VramAccount:
    """Bytes per category if placed on the GPU; per-layer lists where the planner can decide layer by layer.
    `neuron_bytes` and `ffn_neurons` are of the model's `unit`: FFN neurons, or a mixture's experts."""

    attention: tuple[int, ...]
    kv_cache: tuple[int, ...]
    predictors: tuple[int, ...]
    neuron_bytes: tuple[float, ...]
    ffn_neurons: tuple[int, ...]
    output: int
    embeddings: int
    scratch: int
    unit: Unit = "neuron"

    @property
    def fixed(self) -> int:
        """What is on the GPU whatever the placement: scratch and, when chosen, the embeddings."""
        return self.scratch + self.embeddings

    @property
    def dense(self) -> int:
        """Every dense part on the GPU: attention, KV cache, output head, embeddings if chosen, scratch."""
        return sum(self.attention) + sum(self.kv_cache) + self.output + self.fixed

    @property
    def ffn_total(self) -> float:
        return sum(b * n for b, n in zip(self.neuron_bytes, self.ffn_neurons, strict=True)) + sum(self.predictors)


def kv_cache_bytes(layout: ModelLayout, options: BudgetOptions) -> int:
    """One layer's f16 KV cache as the runtime allocates it; under `full`, 2 * ctx * batch * kv_dim * 2 bytes."""
    return options.kv_policy.layer_bytes(layout.spec, options.ctx_size, options.batch, KV_ELEMENT_BYTES)


def scratch_bytes(layout: ModelLayout, options: BudgetOptions) -> int:
    e = layout.spec.hidden
    f = layout.ffn_width
    kv = layout.spec.kv_dim
    rows = options.kv_policy.attended_rows(options.ctx_size)
    per_sequence = (2 * e + 2 * kv + 2 * f + layout.spec.heads * rows) * 4
    # Attention reads a layer's f16 keys and values as float32 copies, which a batched or graphed step copies once
    # more with the rows a sequence must not see zeroed (runtime/kv/cache.py); made once per layer, not doubled.
    kv_copies = 4 * kv * rows * 4
    return SCRATCH_FIXED + options.batch * (2 * per_sequence + kv_copies)


def account(layout: ModelLayout, options: BudgetOptions) -> VramAccount:
    if options.ctx_size < 1 or options.batch < 1:
        raise UserError("--ctx-size and --batch must be at least 1")
    kv = kv_cache_bytes(layout, options)
    return VramAccount(
        attention=tuple(layer.attention_bytes for layer in layout.layers),
        kv_cache=(kv,) * layout.n_layers,
        predictors=tuple(layer.predictor_bytes for layer in layout.layers),
        neuron_bytes=tuple(layer.neuron_bytes for layer in layout.layers),
        ffn_neurons=tuple(layer.ffn_neurons for layer in layout.layers),
        output=layout.output_bytes,
        embeddings=layout.embedding_bytes if options.gpu_embeddings else 0,
        scratch=scratch_bytes(layout, options),
        unit=layout.unit,
    )


def vram_used(acct: VramAccount, placement: Placement) -> dict[str, float]:
    """Bytes on the GPU by category for `placement`."""
    layers = range(len(acct.attention))
    return {
        "attention": sum(acct.attention[i] for i in layers if placement.attention_on_gpu[i]),
        "kv cache": sum(acct.kv_cache[i] for i in layers if placement.attention_on_gpu[i]),
        "output head": acct.output if placement.output_on_gpu else 0,
        "embeddings": acct.embeddings,
        "predictors": sum(acct.predictors[i] for i in layers if placement.predictor_on_gpu(i)),
        "ffn neurons": sum(acct.neuron_bytes[i] * int(placement.gpu_neurons[i].sum()) for i in layers),
        "scratch": acct.scratch,
    }


def minimum_budget(acct: VramAccount, dense_on_gpu: bool) -> int:
    """The smallest budget with a feasible plan: no FFN neuron on the GPU, dense parts there if they must be."""
    return acct.dense if dense_on_gpu else acct.fixed


def require_budget(acct: VramAccount, budget: int, dense_on_gpu: bool) -> None:
    need = minimum_budget(acct, dense_on_gpu)
    if budget < need:
        what = "the dense parts (attention, KV cache, output head, scratch)" if dense_on_gpu else "the scratch reserve"
        # The need rounded up, so that the figure given is a budget that holds it (0.25 GiB against 0.25 did not).
        least = math.ceil(need / GIB * 1e4) / 1e4
        raise UserError(
            f"a VRAM budget of {budget / GIB:.4g} GiB cannot hold {what}: at least {least:.4f} GiB "
            f"({need} bytes) is needed; raise --vram-budget or lower --ctx-size/--batch"
        )
