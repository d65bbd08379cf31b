"""What every model forward shares: rope's tables, the FFN weights of a layer, and the layer loop.

A forward maps a `TokenBatch` (one prompt, or one new token for each of several sequences at their own
positions) to logits, reading and extending each sequence's rows of the KV cache. Architectures subclass
`TransformerForward` and implement `block`; the FFN is a pluggable `FFNRunner` (dense, sparse or hybrid).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import fields, replace
from typing import TYPE_CHECKING, Any, Protocol

import torch

from qinfer.core.architectures import architecture
from qinfer.core.errors import UserError
from qinfer.core.model_spec import Experts, ModelSpec
from qinfer.core.names import BIAS, Tensor, tensor_name
from qinfer.runtime.ffn.experts import ExpertRunner, ExpertWeights, SwiGLU
from qinfer.runtime.ffn.runners import DenseRunner
from qinfer.runtime.ffn.sparse import FFNWeights
from qinfer.runtime.kernels.decode_layer import DecodeLayers, HeadRows, LayerRows
from qinfer.runtime.kernels.quant_rows import Weight
from qinfer.runtime.kv.batch import Step, TokenBatch, batch_step, by_part, rows_mask, table_rows
from qinfer.runtime.kv.cache import Cache
from qinfer.runtime.model.model_file import ModelFile
from qinfer.runtime.model.rope import inv_freq, rope_tables

if TYPE_CHECKING:
    from qinfer.runtime.model.graph_step import GraphSteps


def ffn_weights(model: ModelFile, i: int) -> FFNWeights:
    """Layer i's FFN rows (neuron i = row i) and predictor, as mapped views, in the form of the model's family."""
    form = architecture(model.config.arch).form(model.config.activation)
    t = model.tensor
    # A dense GGUF stores down as [E, F]; its transpose is a free view with the PowerInfer row layout.
    down_t = t(tensor_name(Tensor.FFN_DOWN_T, i)) if model.powerinfer else t(tensor_name(Tensor.FFN_DOWN, i)).T
    return FFNWeights(
        form=form,
        up=t(tensor_name(Tensor.FFN_UP, i)),
        down_t=down_t,
        gate=t(tensor_name(Tensor.FFN_GATE, i)) if form.gated else None,
        fc1=model.tensors.get(tensor_name(Tensor.FC1, i)),
        fc2=model.tensors.get(tensor_name(Tensor.FC2, i)),
        up_bias=t(tensor_name(Tensor.FFN_UP, i, BIAS)) if form.biased else None,
        gate_threshold=model.gate_thresholds[i] if model.gate_thresholds is not None else 0.0,
    )


def expert_weights(model: ModelFile, experts: Experts, i: int) -> ExpertWeights:
    """Layer i's router and experts (and shared expert), as mapped views."""

    def t(part: Tensor) -> Weight:
        return model.tensor(tensor_name(part, i))

    shared = None
    if experts.shared_ffn:
        shared = SwiGLU(t(Tensor.FFN_GATE_SHEXP), t(Tensor.FFN_UP_SHEXP), t(Tensor.FFN_DOWN_SHEXP))
    return ExpertWeights(
        router=t(Tensor.FFN_GATE_INP),
        gate=t(Tensor.FFN_GATE_EXPS),
        up=t(Tensor.FFN_UP_EXPS),
        down=t(Tensor.FFN_DOWN_EXPS),
        shared=shared,
        shared_gate=None if shared is None else t(Tensor.FFN_GATE_INP_SHEXP),
    )


def expert_runner(model: ModelFile, experts: Experts) -> ExpertRunner:
    """Every expert a token chooses, on the CPU."""
    return ExpertRunner([expert_weights(model, experts, i) for i in range(model.config.layers)], experts)


def dense_runner(model: ModelFile) -> FFNRunner:
    """Every neuron of every layer, or every expert a token chooses, on the CPU."""
    if model.config.experts is not None:
        return expert_runner(model, model.config.experts)
    return DenseRunner([ffn_weights(model, i) for i in range(model.config.layers)])


def down_bias(model: ModelFile, i: int) -> torch.Tensor:
    """down's bias of a biased FFN, under its name in this kind of file."""
    return model.tensor(tensor_name(Tensor.FFN_DOWN_T if model.powerinfer else Tensor.FFN_DOWN, i, BIAS))


def to_device(weights: Any, device: torch.device) -> Any:
    """A block's weight dataclass with every tensor (or tuple of them) moved to `device`; absent ones stay None."""
    moved = {}
    for f in fields(weights):
        value = getattr(weights, f.name)
        if value is not None:
            moved[f.name] = tuple(t.to(device) for t in value) if isinstance(value, tuple) else value.to(device)
    return replace(weights, **moved)


def kept_rows(
    h: torch.Tensor, out: torch.Tensor, keep: list[int] | None, queries: list[int] | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual h and attention's output at the rows `keep` alone (every row where None): the output holds those
    alone already where it was computed for `queries` (Cache.query_rows)."""
    if keep is None:
        return h, out
    return h[keep], out if queries is not None else out[keep]


class FFNRunner(Protocol):
    """Computes layer `layer`'s FFN for normalised input x [T, E]; h is the predictor's input
    (docs/formats.md#predictor-directories).
    `prefill` asks for dense matmuls (sparsity pays off in decode, not for many tokens at once)."""

    def __call__(self, layer: int, x: torch.Tensor, h: torch.Tensor, prefill: bool) -> torch.Tensor: ...


class ModelForward(Protocol):
    cfg: ModelSpec
    device: torch.device

    def forward(self, batch: TokenBatch, cache: Cache, rows: list[int] | None = None) -> torch.Tensor: ...

    def greedy_steps(
        self, batch: TokenBatch, cache: Cache, steps: int, ends: Sequence[int], stop: ctypes.c_int32 | None = None
    ) -> tuple[list[list[int]], torch.Tensor] | None: ...


class TransformerForward:
    """Embedding lookup (CPU, mapped), the blocks, the output head; dense parts run on `device`.

    A family implements `load_block` (its per-layer weights, other than the FFN), `load_head`, `block` and `head`.
    """

    cfg: ModelSpec
    device: torch.device
    embed: torch.Tensor
    ffn: FFNRunner
    # The whole layer as one native call (kernels/decode_layer.py), for the steps it takes, computing exactly what
    # `block` computes; for a family that describes its layers (`native_rows`), on the CPU.
    native: DecodeLayers | None = None
    parallel = False  # attention and FFN both read the layer's input (falcon)
    # Decode steps replayed from CUDA graphs (graph_step.py), for the steps they take; set by a family that can.
    graphs: GraphSteps | None = None

    def __init__(self, model: ModelFile, ffn: FFNRunner | None = None, device: torch.device | str = "cpu"):
        self.cfg = model.config
        self.device = torch.device(device)
        self.attn = [to_device(self.load_block(model, i), self.device) for i in range(self.cfg.layers)]
        self.embed = model.tensor(tensor_name(Tensor.TOKEN_EMBD))
        # On the device already: a step replayed from a graph can copy nothing from the host.
        self.inv_freq = inv_freq(model).to(self.device) if self.cfg.rope_dim else None
        self.load_head(model)
        self.ffn = ffn or dense_runner(model)
        self.native = self.native_layers()

    def native_rows(self) -> list[LayerRows] | None:
        """Every layer's weights besides the FFN as the native layer step reads them; None: the family has no
        native step."""
        return None

    def native_head(self) -> HeadRows | None:
        """The output head as the native step reads it; None: the family's head stays in torch."""
        return None

    def native_layers(self) -> DecodeLayers | None:
        """The native layer step for these weights and the current FFN runner, where it applies."""
        rows = self.native_rows() if self.device.type == "cpu" else None
        if rows is None:
            return None
        return DecodeLayers.build(self.cfg, rows, self.ffn, self.parallel, self.native_head())

    def load_block(self, model: ModelFile, i: int) -> Any:
        raise NotImplementedError

    def load_head(self, model: ModelFile) -> None:
        """The output norm and head, onto `device`; runs after `embed` is set, which a tied head reuses."""
        raise NotImplementedError

    def block(
        self, i: int, h: torch.Tensor, step: Step, cache: Cache, prefill: bool, keep: list[int] | None
    ) -> torch.Tensor:
        """Layer i on the residual stream h [T, E]. With `keep` (increasing indices of h's rows), the layer's output
        for those tokens alone [len(keep), E]: attention still writes every token's keys and values, and what
        follows it runs on the kept rows (`feed_forward` with the same `keep`)."""
        raise NotImplementedError

    def head(self, h: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def feed_forward(
        self, i: int, x: torch.Tensor, h: torch.Tensor, step: Step, prefill: bool, keep: list[int] | None
    ) -> torch.Tensor:
        """Layer i's FFN, on the rows of `keep` where given (x and h hold those alone). A mixed step runs it part by
        part, as each part would run alone: a prompt's chunk dense (its last token too, where it is the one kept),
        the decode tokens through the runner's decode path (the predictor's neurons, where it is sparse), so that
        what a stream decodes does not depend on the prompts that share its steps."""
        if keep == []:
            return x  # [0, E]: by_part would join no part's output, and a runner need not handle no tokens
        if not step.parts:
            return self.ffn(i, x, h, prefill)
        return by_part(step, lambda part, rows: self.ffn(i, x[rows], h[rows], not part.batch.one_per_slot), keep)

    def embed_tokens(self, batch: TokenBatch) -> torch.Tensor:
        return table_rows(self.embed, batch.tokens).float().to(self.device)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Rope's cos/sin tables at `positions`, on their device; (None, None) for a model without rope."""
        return rope_tables(self.inv_freq, positions) if self.inv_freq is not None else (None, None)

    def step(self, batch: TokenBatch) -> Step:
        positions = batch.positions.to(self.device)
        return batch_step(batch, positions, self.cfg.sliding_window, *self.rope(positions))

    def fixed_step(self, batch: TokenBatch, rows: int) -> Step:
        """The `Step` of a decode batch already on the device, over all `rows` of the cache (kv/batch.Step.fixed):
        made from the device's values alone, so that a CUDA graph can replay it."""
        positions = batch.positions
        mask = rows_mask(positions, rows, self.cfg.sliding_window)
        return Step(batch, positions, mask, *self.rope(positions), fixed=True)

    def forward(self, batch: TokenBatch, cache: Cache, rows: list[int] | None = None) -> torch.Tensor:
        """Logits [T, V] for the batch's tokens, appending their keys and values to `cache`; with `rows`, [len(rows),
        V] for those tokens alone (a prompt needs its last token's, and the output head of a large vocabulary over
        every prompt token costs as much as a layer or more)."""
        if int(batch.positions.max()) >= cache.ctx:
            raise UserError(f"context of {cache.ctx} tokens exceeded")
        if self.graphs is not None and self.graphs.takes(batch, cache):
            logits = self.graphs.run(batch, cache)
            if logits is not None:
                return logits if rows is None else logits[rows]
        h = self.embed_tokens(batch)
        if self.native is not None:
            # The layer step needs no Step (its masks and parts serve the torch path alone), nor rope's tables.
            placement = self.native.placement(h, batch, self.inv_freq, cache, self.ffn)
            if placement is not None:
                logits = self.native.step(h, batch, cache, placement, self.inv_freq, rows)
                return self.head(h if rows is None else h[rows]) if logits is None else logits
        step = self.step(batch)
        # Several tokens of one sequence (a prompt or its chunk): dense matmuls pay off (per part: feed_forward).
        prefill = not batch.one_per_slot
        # In the last layer only the rows asked for are needed past the keys and values, so a prompt's FFN there runs
        # for its last token alone (llama.cpp cuts its graph the same way), and so do its query and attention where
        # the cache allows (Cache.query_rows). by_part maps kept rows to the step's parts as increasing, non-negative
        # indices; other `rows` are taken from the whole layer's output.
        keep = rows if rows is not None and rows == sorted(set(rows)) and min(rows, default=0) >= 0 else None
        last = self.cfg.layers - 1
        for i in range(self.cfg.layers):
            h = self.block(i, h, step, cache, prefill, keep if i == last else None)
        return self.head(h if rows is None or keep is not None else h[rows])

    def greedy_steps(
        self, batch: TokenBatch, cache: Cache, steps: int, ends: Sequence[int], stop: ctypes.c_int32 | None = None
    ) -> tuple[list[list[int]], torch.Tensor] | None:
        """Up to `steps` greedy decode steps of a decode batch (one token per slot) in one native call
        (DecodeLayers.greedy_steps, which ends them early once another thread sets `stop`): each step's tokens and
        the last one's logits, every step at the next positions. None where that call does not apply: the caller
        steps one at a time."""
        # The kernel looks each step's input rows up in the table: a family whose input is more (OPT adds its
        # position's row) keeps single steps.
        embeds_alone = type(self).embed_tokens is TransformerForward.embed_tokens
        if self.native is None or self.graphs is not None or not embeds_alone:
            return None
        h = torch.empty(batch.tokens.shape[0], self.cfg.hidden)
        if self.native.placement(h, batch, self.inv_freq, cache, self.ffn) != "decode":
            return None
        return self.native.greedy_steps(h, batch, cache, self.inv_freq, self.embed, steps, ends, stop)

    def __call__(self, tokens: torch.Tensor, start: int, cache: Cache, slot: int = 0) -> torch.Tensor:
        return self.forward(TokenBatch.prompt(tokens, start, slot), cache)
