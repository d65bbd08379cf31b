"""Decode steps replayed from CUDA graphs: the GPU side of a LLaMA-shaped model whose FFN is split between the GPU's
hot-FFN kernels and the CPU's row kernels (ffn/hybrid.py), with at most one host wait per layer.

A step of T tokens (one per sequence) is a fixed program over buffers made once per batch size and cache. Per layer
the GPU runs attention, the FFN's norm and the predictor (piece A), then the resident neurons it selects (piece B).
Where the layer has neurons on the host alone, A's outputs that the host reads (the FFN's input and the selection)
are copied into pinned memory behind A and the host waits for them while B runs, computes the cold neurons, and
sends their sum back before the next layer's A. Device pieces between two host pieces are captured as one graph, so a
layer with no cold neuron joins its neighbours' graph: with the whole FFN on the GPU a token is one graph and one
wait (for its logits).

With the dynamic schedule, a layer's promotions (ffn/hybrid.py) are copied on a side stream after the step that
chose them, into the slots the graphs read, and the layer's piece B of the next step waits for them.

A batch size's graphs are captured at its first step, which runs the same program eagerly (Triton compiles its
kernels, cuBLAS makes its handles) and gives that step's logits; capture itself computes nothing. The step reads no
value on the host: the batch's tokens, positions and slots are copied to the device, attention reads
every row of the cache under a mask (kv/batch.Step.fixed), and nothing in a piece may wait for the device.
`capture=False` runs the same program eagerly, which is how the CPU's simulated device tests it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from qinfer.core.model_spec import ModelSpec
from qinfer.runtime.ffn.hybrid import HybridRunner, host_buffer
from qinfer.runtime.kv.batch import Step, TokenBatch, table_rows
from qinfer.runtime.kv.cache import Cache, KVCache

# Set to 0, decode steps on a GPU run eagerly (the same numbers, more launches): a way around a CUDA build whose
# graphs misbehave without failing to record.
GRAPHS_VARIABLE = "QINFER_CUDA_GRAPHS"


class GraphedForward(Protocol):
    """What a family's forward gives the graphed step (LlamaForward)."""

    cfg: ModelSpec
    device: torch.device
    embed: torch.Tensor

    def fixed_step(self, batch: TokenBatch, rows: int) -> Step: ...

    def attention_block(
        self, i: int, h: torch.Tensor, step: Step, cache: Cache
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def head(self, h: torch.Tensor) -> torch.Tensor: ...


@dataclass
class _Device:
    """Device work: captured into the graph of the pieces around it."""

    run: Callable[[], None]


@dataclass
class _Send:
    """After layer `layer`'s piece A: its host reads copied into pinned memory, and an event behind them."""

    layer: int


@dataclass
class _Receive:
    """After layer `layer`'s piece B was queued: the host waits for its reads, computes, and sends the sum back."""

    layer: int


@dataclass
class _HostLayer:
    """One cold layer's host side: pinned copies of what the host reads, the event behind them, and the sum's way
    back (pinned, then a device buffer that the next layer's graph reads)."""

    reads: list[torch.Tensor | None] = field(default_factory=list)
    ready: torch.cuda.Event | None = None
    result: torch.Tensor | None = None
    on_device: torch.Tensor | None = None


def _resolved(device: torch.device) -> torch.device:
    """`device` with its index: a tensor made on torch.device("cuda") reports "cuda:0", which does not equal it."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


class GraphStep:
    """The program of one batch size over one cache, and, once captured, its graphs."""

    def __init__(
        self, forward: GraphedForward, runner: HybridRunner, cache: KVCache, tokens: int, capture: bool, pool: Any
    ):
        """`pool`: the CUDA graph memory pool every batch size's graphs share (their steps never run at once)."""
        self.forward, self.runner, self.cache, self.capture, self.pool = forward, runner, cache, capture, pool
        device, cfg = forward.device, forward.cfg
        self.host_batch = [host_buffer((tokens,), torch.long, device) for _ in range(3)]
        self.host_h = host_buffer((tokens, cfg.hidden), torch.float32, device)
        self.batch = TokenBatch(*(torch.empty(tokens, dtype=torch.long, device=device) for _ in range(3)))
        self.h0 = torch.empty(tokens, cfg.hidden, device=device)
        # The layers with a host part (neurons on the host alone), made when the program is.
        self.host = {i: _HostLayer() for i in range(cfg.layers) if runner.cold(i)}
        # What the pieces hand each other; after capture, the graphs' own output tensors.
        self.values: dict[str, torch.Tensor | list[torch.Tensor | None] | Step | None] = {}
        self.program = self._program()
        self.graphs: list[torch.cuda.CUDAGraph] | None = None

    def _program(self) -> list[_Device | _Send | _Receive]:
        program: list[_Device | _Send | _Receive] = [_Device(self._begin)]
        for i in range(self.forward.cfg.layers):
            cold = i in self.host
            program.append(_Device(lambda i=i: self._attention(i)))
            if cold:
                program.append(_Send(i))
            program.append(_Device(lambda i=i: self._ffn(i)))
            if cold:
                program.append(_Receive(i))
        program.append(_Device(self._end))
        return program

    def _residual(self, layer: int) -> torch.Tensor:
        """The residual stream after layer `layer` (-1: the embeddings)."""
        if layer < 0:
            return self.h0
        h, ffn = self.values["h"], self.values[f"ffn{layer}"]
        assert isinstance(h, torch.Tensor) and isinstance(ffn, torch.Tensor)
        host = self.host.get(layer)
        # Summed in the eager path's order: the layer's two parts first, then the residual.
        return h + (ffn if host is None else ffn + host.on_device)

    def _begin(self) -> None:
        self.values["step"] = self.forward.fixed_step(self.batch, self.cache.ctx)

    def _attention(self, i: int) -> None:
        step = self.values["step"]
        assert isinstance(step, Step)
        h, x = self.forward.attention_block(i, self._residual(i - 1), step, self.cache)
        scores = self.runner.device_scores(i, h)
        self.values |= {"h": h, f"x{i}": x, f"scores{i}": scores}
        if i in self.host:
            self.values[f"reads{i}"] = self.runner.host_reads(i, x, h, scores)

    def _ffn(self, i: int) -> None:
        x, scores = self.values[f"x{i}"], self.values[f"scores{i}"]
        assert isinstance(x, torch.Tensor) and (scores is None or isinstance(scores, torch.Tensor))
        self.values[f"ffn{i}"] = self.runner.device_ffn(i, x, scores)

    def _end(self) -> None:
        self.values["logits"] = self.forward.head(self._residual(self.forward.cfg.layers - 1))

    def _send(self, layer: int) -> None:
        # The dynamic schedule's promotions (copied after the last step; here, where an eager step chose them) are in
        # the slots before B reads them.
        self.runner.promote(layer)
        self.runner.await_promoted(layer)
        host, reads = self.host[layer], self.values[f"reads{layer}"]
        assert isinstance(reads, list)
        if not host.reads:
            host.reads = [None if t is None else host_buffer(t.shape, t.dtype, t.device) for t in reads]
        for mine, t in zip(host.reads, reads, strict=True):
            if mine is not None and t is not None:
                mine.copy_(t, non_blocking=True)
        if self.forward.device.type == "cuda":
            host.ready = torch.cuda.Event()
            host.ready.record()

    def _receive(self, layer: int) -> None:
        host = self.host[layer]
        if host.ready is not None:
            host.ready.synchronize()
        out = self.runner.host_ffn(layer, *host.reads)
        if host.result is None or host.on_device is None:
            host.result = host_buffer(out.shape, out.dtype, self.forward.device)
            host.on_device = torch.empty(out.shape, dtype=out.dtype, device=self.forward.device)
        host.result.copy_(out)
        host.on_device.copy_(host.result, non_blocking=True)

    def _host_piece(self, piece: _Send | _Receive) -> None:
        if isinstance(piece, _Send):
            self._send(piece.layer)
        else:
            self._receive(piece.layer)

    def _eager(self) -> None:
        for piece in self.program:
            if isinstance(piece, _Device):
                piece.run()
            else:
                self._host_piece(piece)

    def _record(self) -> torch.Tensor:
        """One eager run on a side stream, which is this step (its logits are returned; capture computes nothing)
        and warms what capture needs; then the graphs, each over the device pieces between two host pieces, in one
        memory pool. The step runs once: its host parts (the neuron cache's view of it) see it once."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._eager()
        torch.cuda.current_stream().wait_stream(side)
        logits = self.values["logits"]
        assert isinstance(logits, torch.Tensor)
        graphs = []
        group: list[_Device] = []

        def close() -> None:
            if group:
                graph = torch.cuda.CUDAGraph()
                # Thread-local: a server's other threads may use CUDA meanwhile (a copy, a query of memory).
                with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                    for piece in group:
                        piece.run()
                graphs.append(graph)
                group.clear()

        for piece in self.program:
            if isinstance(piece, _Device):
                group.append(piece)
            else:
                close()
        close()
        self.graphs = graphs
        return logits

    def _replay(self) -> None:
        assert self.graphs is not None
        graphs = iter(self.graphs)
        within = False  # whether the graph holding the current run of device pieces was replayed
        for piece in self.program:
            if isinstance(piece, _Device):
                if not within:
                    next(graphs).replay()
                    within = True
            else:
                within = False
                self._host_piece(piece)

    def run(self, batch: TokenBatch) -> torch.Tensor:
        """Logits [T, V] on the host for a decode batch of this step's size."""
        for layer in range(self.forward.cfg.layers):
            if layer not in self.host:
                # A layer this program gives no host piece (all its neurons resident) may still have promotions
                # chosen elsewhere (an eager step, another batch size's program): in its slots before it runs.
                self.runner.promote(layer)
                self.runner.await_promoted(layer)
        fields = ("tokens", "positions", "slots")
        for name, host in zip(fields, self.host_batch, strict=True):
            host.copy_(getattr(batch, name))
            getattr(self.batch, name).copy_(host, non_blocking=True)
        self.host_h.copy_(table_rows(self.forward.embed, batch.tokens))
        self.h0.copy_(self.host_h, non_blocking=True)
        if self.graphs is not None:
            self._replay()
            logits = self.values["logits"]
        elif self.capture:
            logits = self._record()
        else:
            self._eager()
            logits = self.values["logits"]
        assert isinstance(logits, torch.Tensor)
        logits = logits.cpu()
        for layer in self.host:
            self.runner.promote(layer)  # on a side stream, while the host samples and embeds the next step
        return logits


class GraphSteps:
    """The graphed decode steps of one forward, one `GraphStep` per batch size over the cache last used."""

    def __init__(self, forward: GraphedForward, runner: HybridRunner, capture: bool = True):
        self.forward, self.runner, self.capture = forward, runner, capture
        self.steps: dict[int, GraphStep] = {}
        self.cache: KVCache | None = None
        self.failed: str | None = None  # why graphs could not be recorded here; the eager path decodes instead
        self.pool: Any = None  # made with the first graphs

    def takes(self, batch: TokenBatch, cache: Cache) -> bool:
        """A decode batch (one token per sequence) over a full cache on the device, with the static split's kernels."""
        on_device = isinstance(cache, KVCache) and cache.k.device == _resolved(self.forward.device)
        return batch.one_per_slot and on_device and self.runner.in_kernel and self.failed is None

    def run(self, batch: TokenBatch, cache: Cache) -> torch.Tensor | None:
        """The step's logits on the host; None where its graphs could not be recorded (said once, on stderr), after
        which `takes` refuses and the caller runs the step eagerly, writing the same KV rows again."""
        assert isinstance(cache, KVCache)
        if cache is not self.cache:
            # Graphs address one cache's tensors: another cache's steps are recorded anew.
            self.steps, self.cache = {}, cache
        step = self.steps.get(batch.tokens.shape[0])
        recording = self.capture and (step is None or step.graphs is None)
        try:
            return (step or self._new_step(cache, batch)).run(batch)
        except RuntimeError as exc:  # CUDA's and torch's capture errors
            if not recording:
                raise
            self.failed, self.steps = str(exc).splitlines()[0] if str(exc) else type(exc).__name__, {}
            print(f"qinfer: decoding without CUDA graphs, which could not be recorded: {self.failed}", file=sys.stderr)
            return None

    def _new_step(self, cache: KVCache, batch: TokenBatch) -> GraphStep:
        if self.capture and self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        tokens = batch.tokens.shape[0]
        step = self.steps[tokens] = GraphStep(self.forward, self.runner, cache, tokens, self.capture, self.pool)
        return step
