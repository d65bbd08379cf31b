"""One native call for every layer of a decode step on the CPU, and the output head (decode_layer.c): one new token
for each of one or more sequences, each in its own slot of the KV cache, and short prompt chunks beside them or alone.

`DecodeLayers.build` describes every layer's weights to the kernel once, as ctypes structures over the mapped
rows, and allocates the scratch the kernel works in; each step then costs one call, with no tensor made in between
(rope's tables too are made in it): on a small model, a call per layer and torch's tables took as long as the
layers. It applies to llama, bamboo, qwen2, falcon and opt files whose matrices are F16, Q4_0 or Q8_0 rows,
with a dense FFN, the predictor's sparse one or a calibrated gate's, and to the mixtures of experts (mixtral,
qwen2moe, qwen3moe) whose experts are all on the CPU, and a KV cache on the CPU: the full one in
float32, f16 or q8_0 (each of K and V), or the window cache, whose kept rows the kernel attends, weighs and replaces
as kv/window.py does. A step with prompt tokens (`Placement`) runs here too where it is short and the FFN a prompt
gets is the one the kernel computes; everything else (long prompts, the GPU split, the oracle) keeps the torch path,
which computes the same layer. The output head (the final norm, then the output rows) ends the call where its rows
are F16, Q4_0 or Q8_0; then the call can also run several greedy decode steps in a row (`greedy_steps`), each
step's tokens the last one's argmax, their input rows looked up in the embedding table.
"""

from __future__ import annotations

import ctypes
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, cast

import torch

from qinfer.core.architectures import ACTIVATIONS, FfnForm, architecture
from qinfer.core.errors import UserError
from qinfer.core.kv_policy import KVSplit, KVTypes
from qinfer.core.model_spec import Experts, ModelSpec
from qinfer.runtime.kernels import row_kernels
from qinfer.runtime.kernels.abi import CACHE_CODES, SCRATCH, Call, Dims, Layer, Matrix, Scratch, Stacks, form_code
from qinfer.runtime.kernels.quant_rows import TransposedQuantized, Weight

# How a forward call's tokens sit in the cache's slots: one per slot (a decode step), runs of several per slot (prompt
# chunks), or both (a mixed step: the running sequences' tokens beside chunks).
Placement = Literal["decode", "prompt", "mixed"]

# The longest prompt chunk a call gives the layer step: a chunk alone, and a chunk in a step of several parts (chunks
# beside one another or beside decode tokens). The torch path computes a step part by part, reading the weights once a
# part, where the kernel reads them once for the whole step but computes the last layer for every token (the torch
# path computes that layer's FFN for the rows asked for alone). Time native / torch (bench/prompt_steps.py times such
# cases) on an Intel Xeon (two threads): the tiny synth model's chunk of 6 tokens 0.23, of 128 0.81, and of 6 beside
# 32 decode tokens 0.24; the 7B slice's (4 layers) f16 chunk of 6 0.87, 16 0.99, 32 1.01, 128 1.07, Q4_0 16 0.99, 32
# 1.18, 128 1.19; beside 8 or 32 decode tokens, chunks of 6 to 64 tokens 0.52-0.92 (f16 and Q4_0). Several chunks of 5
# tokens: the tiny model's 4 to 32 alone 0.14-0.16 (13 beside 16 decode tokens 0.15), the 7B slice's 4 to 32 alone
# 0.44-0.51 (f16) and 8 alone 0.47 (Q4_0), 13 beside 16 decode tokens 0.46 (f16), 4 of 24 beside 8 decode tokens
# 0.77-0.83; where one long chunk rules the cost, 128 + 5 alone 1.02 (f16) and 1.08 (Q4_0), 256 + 8 1.13, and beside 8
# decode tokens 64 + 5 0.85, 200 + 5 1.03.
PROMPT_TOKENS = 16
MIXED_PROMPT_TOKENS = 64
# The scratch holds a call's every token and keeps its largest size for as long as the model is loaded, so a call with
# prompt tokens takes at most STEP_TOKENS tokens (a server's step of 32 slots and the default --prefill-chunk's 512
# prompt tokens fits), and attention scores (floats: tokens x heads x (context + 1)) of at most PROMPT_SCORES, 64 MiB,
# a long context's few tokens. Beside the scores the 7B slice's scratch took 20 MB for 96 tokens and 112 MB for 544.
STEP_TOKENS = 1024
PROMPT_SCORES = 1 << 24


@dataclass(frozen=True)
class LayerRows:
    """One layer's weights besides its FFN, as the layer step reads them; each family describes its own
    (`native_rows` in model/llama.py, falcon.py, opt.py). A LayerNorm has biases, an RMSNorm none."""

    attn_norm: torch.Tensor
    q: Weight
    k: Weight
    v: Weight
    o: Weight
    ffn_norm: torch.Tensor
    attn_norm_bias: torch.Tensor | None = None
    ffn_norm_bias: torch.Tensor | None = None
    q_bias: torch.Tensor | None = None
    k_bias: torch.Tensor | None = None
    v_bias: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None  # the FFN's, which belongs to no neuron
    q_norm: torch.Tensor | None = None  # RMSNorm weights over each head of q and of k (Qwen3)
    k_norm: torch.Tensor | None = None


@dataclass(frozen=True)
class HeadRows:
    """The output head as the native step reads it: the final norm's weights (and a LayerNorm's bias) and the
    output rows; each family describes its own (`native_head`)."""

    norm: torch.Tensor
    output: Weight
    norm_bias: torch.Tensor | None = None


# What the layer step reads of the rooms above it (the FFN runner, the forward's step, the KV cache), described
# here rather than imported, so that the kernels depend on nothing above them.
class FFNRows(Protocol):
    """One layer's FFN rows and predictor (ffn/sparse.py's FFNWeights)."""

    @property
    def form(self) -> FfnForm: ...
    @property
    def gate(self) -> Weight | None: ...
    @property
    def up(self) -> Weight: ...
    @property
    def down_t(self) -> Weight: ...
    @property
    def fc1(self) -> Weight | None: ...
    @property
    def fc2(self) -> Weight | None: ...
    @property
    def up_bias(self) -> torch.Tensor | None: ...
    @property
    def has_predictor(self) -> bool: ...
    @property
    def gate_threshold(self) -> float: ...


class SwiGLURows(Protocol):
    """A shared expert (ffn/experts.py's SwiGLU): gate and up [F, E], down [E, F]."""

    @property
    def gate(self) -> Weight: ...
    @property
    def up(self) -> Weight: ...
    @property
    def down(self) -> Weight: ...


class ExpertRows(SwiGLURows, Protocol):
    """One layer's router and experts (ffn/experts.py's ExpertWeights): gate, up and down stacked [N, ...]."""

    @property
    def router(self) -> Weight: ...
    @property
    def shared(self) -> SwiGLURows | None: ...
    @property
    def shared_gate(self) -> Weight | None: ...


class LayerRunner(Protocol):
    """An FFN runner (ffn/runners.py) that says which of its decode steps the layer step may compute: every layer's
    rows and the predictor's threshold (None: every neuron, the dense FFN), or None where it computes differently."""

    def native_rows(self) -> tuple[Sequence[FFNRows], float | None] | None: ...


class ExpertLayerRunner(Protocol):
    """A mixture's FFN runner (ffn/experts.py): every layer's experts where it computes them all on the CPU, as the
    layer step may, else None."""

    def native_experts(self) -> Sequence[ExpertRows] | None: ...


class Schedule(Protocol):
    """A predictor-sparse runner's choice per layer and step between the predictor's rows and the dense ones
    (ffn/schedule.py), told the union each call's last step read. A step of one token always takes the predictor's
    rows (`sparse(layer, 1)`), which lets greedy_steps run such steps under a schedule."""

    def sparse(self, layer: int, tokens: int) -> bool: ...
    def observe(self, layer: int, tokens: int, union: int) -> None: ...


class Positions(Protocol):
    @property
    def slots(self) -> torch.Tensor: ...
    @property
    def positions(self) -> torch.Tensor: ...


class Tokens(Positions, Protocol):
    @property
    def tokens(self) -> torch.Tensor: ...


class CacheRows(Protocol):
    """A KV cache (kv/cache.py): K and V as [layers, slots, kv_heads, rows, row] in the element types `types`;
    `rows_by_position` where row p of a slot holds position p (the full cache), else a window cache (WindowRows)."""

    k: torch.Tensor
    v: torch.Tensor
    ctx: int
    rows_by_position: bool
    types: KVTypes


class WindowRows(CacheRows, Protocol):
    """A window cache (kv/window.py): `rows` rows per layer, slot and kv head, each row's position and attention
    mass [layers, slots, kv_heads, rows], which a decode step multiplies by `decay`."""

    pos: torch.Tensor
    mass: torch.Tensor
    rows: int
    split: KVSplit
    decay: float


def _matrix(weight: object) -> Matrix | None:
    layout = row_kernels.layout(weight)
    if layout is None:
        return None
    address, stride, code, shape = layout
    return Matrix(address, stride, code, shape[0], shape[1])


def _down(down_t: Weight | TransposedQuantized) -> tuple[Matrix | None, int]:
    """down as the kernel reads it, and whether it holds neuron rows [F, E] (1) or is the dense file's [E, F] (0)."""
    if isinstance(down_t, TransposedQuantized):
        return _matrix(down_t.matrix), 0
    if isinstance(down_t, torch.Tensor) and down_t.stride(1) != 1 and down_t.T.is_contiguous():
        return _matrix(down_t.T), 0
    return _matrix(down_t), 1


class DecodeLayers:
    """The kernel's description of every layer, its dimensions and its scratch, made once for one FFN runner.

    One forward call at a time: the scratch, the call's description and the dimensions are rewritten by each call
    (the engine runs one step at a time, on one thread)."""

    def __init__(
        self,
        cfg: ModelSpec,
        runner: LayerRunner,
        layers: list[Layer],
        dims: Dims,
        keep: list[object],
        head: tuple[Matrix, int, int | None] | None = None,
    ):
        """`head`: the output rows, the final norm's weights and bias (addresses), where the head runs natively."""
        self.cfg = cfg
        self.runner = runner
        self.layers = (Layer * len(layers))(*layers)
        self.dims = dims
        self._keep = keep  # every tensor the structures point into, alive as long as they are
        self.predictor = bool(dims.sparse)
        # A prompt's FFN is every neuron whose gate fires, what the kernel computes where no gate threshold skips any
        # (a calibrated one would) and the predictor is turned off (for a call without decode tokens). A mixture's
        # experts are read per token here and once for all the tokens that chose them in torch, which a prompt's
        # tokens favour: its prompts keep the torch path.
        self._prompts = not dims.experts and all(layer.gate_threshold == 0.0 for layer in layers)
        schedule = getattr(runner, "schedule", None) if self.predictor else None
        self.schedule: Schedule | None = schedule
        self._scratch = Scratch()
        self._buffers: dict[str, torch.Tensor] = {}  # what the scratch points into
        # What each step's call passes and its per-layer lists: which layers the schedule makes sparse, and the
        # neurons each read.
        self._call = Call()
        self._sparse = (ctypes.c_int32 * len(layers))()
        self._read = (ctypes.c_int64 * len(layers))()
        self._call.read = ctypes.addressof(self._read)
        self._layers_at, self._dims_at = ctypes.addressof(self.layers), ctypes.addressof(dims)
        self._scratch_at, self._call_at = ctypes.addressof(self._scratch), ctypes.addressof(self._call)
        # The output rows and the final norm's weights and bias, where the head runs natively.
        self.output, self._norm = (None, None) if head is None else (head[0], head[1:])

    @classmethod
    def build(
        cls,
        cfg: ModelSpec,
        attn: Sequence[LayerRows],
        runner: object,
        parallel: bool = False,
        head: HeadRows | None = None,
    ) -> DecodeLayers | None:
        """The layers' description, or None where the kernel does not apply to this model and FFN runner; `parallel`:
        attention and FFN both read the layer's input (falcon); `head`: the output head, which runs natively too
        where its rows are ones the kernel reads."""
        if not row_kernels.enabled() or cfg.rope_dim not in (0, cfg.head_dim):
            return None
        keep: list[object] = []
        if cfg.experts is None:
            described = cls._ffn_layers(cfg, attn, runner, keep)
        else:
            described = cls._expert_layers(cfg.experts, attn, runner, keep)
        if described is None:
            return None
        layers, ffn, widest = described
        dims = Dims(
            hidden=cfg.hidden, heads=cfg.heads, kv_heads=cfg.kv_heads, head_dim=cfg.head_dim, ctx=0, tokens=0,
            widest=max(cfg.hidden, cfg.q_dim, widest), window=cfg.sliding_window or 0, eps=cfg.norm_eps,
            rope_neox=int(architecture(cfg.arch).rope == "neox"), layer_norm=int(attn[0].attn_norm_bias is not None),
            parallel=int(parallel), **ffn,
        )  # fmt: skip
        return cls(cfg, runner, layers, dims, keep, cls._head_rows(head, keep))

    @staticmethod
    def _head_rows(head: HeadRows | None, keep: list[object]) -> tuple[Matrix, int, int | None] | None:
        """The head's output rows and its norm's addresses, or None where the kernel does not read the rows."""
        output = None if head is None else _matrix(head.output)
        if head is None or output is None:
            return None
        norm = head.norm.float().contiguous()
        bias = None if head.norm_bias is None else head.norm_bias.float().contiguous()
        keep.extend([norm, bias, head.output, output])
        return output, norm.data_ptr(), None if bias is None else bias.data_ptr()

    @classmethod
    def _ffn_layers(
        cls, cfg: ModelSpec, attn: Sequence[LayerRows], runner: object, keep: list[object]
    ) -> tuple[list[Layer], dict[str, float | int], int] | None:
        """Every layer of a dense or sparse FFN, the dimensions that describe the FFN, and the widest input its
        products quantize; None where the kernel does not apply."""
        selected = runner.native_rows() if hasattr(runner, "native_rows") else None
        if selected is None:
            return None
        ffn, chosen = selected
        sparse, threshold = chosen is not None, chosen or 0.0
        if not ffn:
            return None
        form = ffn[0].form
        if (form.biased and any(w.up_bias is None for w in ffn)) or (sparse and not all(w.has_predictor for w in ffn)):
            return None
        layers, down_rows = [], set()
        for a, w in zip(attn, ffn, strict=True):
            layer = cls._layer(a, w, sparse, keep)
            if layer is None:
                return None
            layers.append(layer[0])
            down_rows.add(layer[1])
        if len(down_rows) != 1:
            return None
        # Predictor ranks may differ per layer: the scratch holds the largest.
        rank = max(w.fc1.shape[0] for w in ffn) if sparse else 0  # type: ignore[union-attr]
        dims = {
            "ffn": cfg.ffn, "predictor": rank, "threshold": threshold, "form": form_code(form), "sparse": int(sparse),
            "down_rows": down_rows.pop(),
        }  # fmt: skip
        return layers, dims, max(cfg.ffn, rank)

    @classmethod
    def _expert_layers(
        cls, experts: Experts, attn: Sequence[LayerRows], runner: object, keep: list[object]
    ) -> tuple[list[Layer], dict[str, float | int], int] | None:
        """Every layer of a mixture, the dimensions that describe it, and the widest input its products quantize
        (each token's experts' activations and the shared expert's, quantized together); None where the kernel does
        not apply."""
        rows = cast(ExpertLayerRunner, runner).native_experts() if hasattr(runner, "native_experts") else None
        if not rows:
            return None
        layers = [cls._expert_layer(a, w, keep) for a, w in zip(attn, rows, strict=True)]
        if any(layer is None for layer in layers):
            return None
        dims = {
            "ffn": experts.shared_ffn, "experts": experts.count, "used": experts.used, "expert_ffn": experts.ffn,
            "norm_top_k": int(experts.norm_top_k), "form": form_code(ACTIVATIONS["silu"]),  # experts are SwiGLU
        }  # fmt: skip
        return cast(list[Layer], layers), dims, experts.used * experts.ffn + experts.shared_ffn

    @staticmethod
    def _attention(a: LayerRows, keep: list[object]) -> dict[str, Matrix | int] | None:
        """A layer's attention fields of the kernel's description, or None where a matrix is not rows it reads."""
        matrices = {name: _matrix(getattr(a, name)) for name in ("q", "k", "v", "o")}
        if any(m is None for m in matrices.values()):
            return None
        vectors = (
            "attn_norm", "ffn_norm", "attn_norm_bias", "ffn_norm_bias", "q_bias", "k_bias", "v_bias", "o_bias",
            "down_bias", "q_norm", "k_norm",
        )  # fmt: skip
        floats = {name: v.float().contiguous() for name in vectors if (v := getattr(a, name)) is not None}
        keep.extend([*floats.values(), a.q, a.k, a.v, a.o])
        return cast(dict[str, Matrix], matrices) | {name: v.data_ptr() for name, v in floats.items()}

    @classmethod
    def _layer(cls, a: LayerRows, w: FFNRows, sparse: bool, keep: list[object]) -> tuple[Layer, int] | None:
        attention = cls._attention(a, keep)
        down, down_rows = _down(w.down_t)
        weights = {"up": w.up}
        if w.gate is not None:
            weights["gate"] = w.gate
        if sparse:
            weights |= {"fc1": w.fc1, "fc2": w.fc2}
        matrices = {name: _matrix(t) for name, t in weights.items()}
        if attention is None or down is None or any(m is None for m in matrices.values()):
            return None
        floats = {} if w.up_bias is None else {"up_bias": w.up_bias.float().contiguous()}
        keep.extend([*floats.values(), *weights.values(), w.down_t])
        layer = Layer(
            **attention, **matrices, down=down, **{name: v.data_ptr() for name, v in floats.items()},
            gate_threshold=w.gate_threshold,
        )  # fmt: skip
        return layer, down_rows

    @classmethod
    def _expert_layer(cls, a: LayerRows, w: ExpertRows, keep: list[object]) -> Layer | None:
        """A mixture's layer: attention, the router and the expert stacks, and the shared expert (its down an [E, F]
        matrix) and its gate where there is one; the router and the gate as float32 rows."""
        attention = cls._attention(a, keep)
        stacks = [row_kernels.stack_layout(t) for t in (w.gate, w.up, w.down)]
        if attention is None or any(st is None for st in stacks) or not isinstance(w.router, torch.Tensor):
            return None
        (g, gt, ge, gr), (u, ut, ue, ur), (d, dt, de, dr) = stacks  # type: ignore[misc]
        experts, f, n = w.gate.shape
        floats = {"router": w.router}
        shared: dict[str, Matrix | None] = {}
        if w.shared is not None:
            shared = {name: _matrix(getattr(w.shared, name)) for name in ("gate", "up", "down")}
            if any(m is None for m in shared.values()) or not isinstance(w.shared_gate, torch.Tensor):
                return None
            floats["shared_gate"] = w.shared_gate
        rows = {name: v.float().contiguous() for name, v in floats.items()}
        keep.extend([*rows.values(), w.gate, w.up, w.down, w.shared])
        return Layer(
            **attention, **shared, experts=Stacks(g, u, d, ge, gr, ue, ur, de, dr, gt, ut, dt, experts, f, n),
            **{name: v.data_ptr() for name, v in rows.items()},
        )  # fmt: skip

    def placement(
        self, h: torch.Tensor, batch: Positions, freq: torch.Tensor | None, cache: CacheRows, runner: object
    ) -> Placement | None:
        """How this forward call's tokens sit in the cache where it is one the kernel computes, else None: all on the
        CPU, with rope's frequencies where the model has rope (`freq`), with the FFN runner the layers were described
        for (a runner swapped in later, to record or to test, gets the torch path), and tokens the kernel takes
        (`_placement`)."""
        if not (
            runner is self.runner
            and h.device.type == "cpu"
            and h.dtype == torch.float32
            and h.is_contiguous()
            and cache.k.device.type == "cpu"
            and cache.types.k in CACHE_CODES
            and cache.types.v in CACHE_CODES
            and (freq is not None) == (self.cfg.rope_dim > 0)
            and (freq is None or (freq.dtype == torch.float32 and freq.is_contiguous() and freq.device.type == "cpu"))
            and row_kernels.enabled()
        ):
            return None
        return self._placement(batch, h.shape[0], cache)

    def _placement(self, batch: Positions, tokens: int, cache: CacheRows) -> Placement | None:
        """One token per slot of the cache (a decode step); or, over the full cache and where prompts get the kernel's
        FFN, runs of tokens at distinct positions of their slots, at most STEP_TOKENS tokens whose attention scores fit
        PROMPT_SCORES: one run alone of at most PROMPT_TOKENS, or several parts (runs beside one another, or beside
        single tokens in a mixed step, where the decode tokens' FFN is the prompt's: no predictor) whose longest run
        is at most MIXED_PROMPT_TOKENS. A step's few slots go through a list: the same checks in torch took 9 us of
        dispatch."""
        slots = batch.slots.tolist()
        if not (len(slots) == tokens > 0 and min(slots) >= 0 and max(slots) < cache.k.shape[1]):
            return None
        distinct = set(slots)
        if len(distinct) == tokens:
            return "decode"
        if not (cache.rows_by_position and self._prompts):
            return None
        runs = [n for n in Counter(slots).values() if n > 1]
        alone = len(runs) == len(distinct)
        # One slot's chunk is the torch path's one part; several parts it would read the weights for each.
        if max(runs) > (PROMPT_TOKENS if len(distinct) == 1 else MIXED_PROMPT_TOKENS):
            return None
        if tokens > STEP_TOKENS or tokens * self.cfg.heads * (cache.ctx + 1) > PROMPT_SCORES:
            return None
        if len(set(zip(slots, batch.positions.tolist(), strict=True))) < tokens:
            return None
        if alone:
            return "prompt"
        return None if self.predictor else "mixed"

    def _scratch_for(self, ctx: int, tokens: int) -> None:
        """(Re)allocate the scratch for `tokens` tokens over a cache of `ctx` positions (the attention scores grow
        with both), in the sizes the kernel asks for."""
        self.dims.ctx, self.dims.tokens = ctx, tokens
        sizes = (ctypes.c_int64 * len(SCRATCH))()
        row_kernels.kernel().qinfer_scratch_sizes(ctypes.addressof(self.dims), sizes)  # type: ignore[union-attr]
        # Bytes from torch's allocator, which aligns them for the kernel's vector loads.
        self._buffers = {
            name: torch.empty(size * ctypes.sizeof(kind), dtype=torch.uint8)
            for (name, kind), size in zip(SCRATCH, sizes, strict=True)
        }
        for name, buffer in self._buffers.items():
            setattr(self._scratch, name, buffer.data_ptr())

    def _describe_cache(self, cache: CacheRows) -> None:
        """The cache's element types and, for a window cache, its rows and policy, into the dimensions; where each
        layer's part of it is, into the call."""
        self.dims.k_type, self.dims.v_type = CACHE_CODES[cache.types.k], CACHE_CODES[cache.types.v]
        k, v, call = cache.k, cache.v, self._call
        call.k_cache, call.k_stride = k.data_ptr(), k.stride(0) * k.element_size()
        call.v_cache, call.v_stride = v.data_ptr(), v.stride(0) * v.element_size()
        window = None if cache.rows_by_position else cast(WindowRows, cache)
        self.dims.kept = 0 if window is None else window.rows
        self.dims.sinks = 0 if window is None else window.split.sinks
        self.dims.recent = 0 if window is None else window.split.recent
        self.dims.decay = 1.0 if window is None else window.decay
        call.pos_cache = None if window is None else window.pos.data_ptr()
        call.mass_cache = None if window is None else window.mass.data_ptr()
        call.pos_stride = 0 if window is None else window.pos.stride(0)
        call.mass_stride = 0 if window is None else window.mass.stride(0)

    def step(
        self,
        h: torch.Tensor,
        batch: Positions,
        cache: CacheRows,
        placement: Placement,
        freq: torch.Tensor | None,
        rows: list[int] | None = None,
    ) -> torch.Tensor | None:
        """Every layer for the tokens h [T, E] (updated in place) at the batch's positions and slots, in one native
        call with the head: the logits [len(rows), V] of the tokens `rows` lists (None: every token's), or None where
        the head does not run natively (h then holds the last layer's output). `freq`: rope's frequencies (None
        without rope); `placement`: how the tokens sit in the slots (`placement`)."""
        tokens = h.shape[0]
        self._prepare(tokens, cache, placement, freq)
        call = self._call
        logits = picked = None
        wanted = tokens if rows is None else len(rows)
        if self.output is not None and 0 < wanted <= self.dims.tokens:
            logits = torch.empty(wanted, self.output.rows)
            picked = None if rows is None else (ctypes.c_int64 * wanted)(*rows)  # alive until the call returns
            self._ask_head(logits, picked)
        else:
            call.output = None
        self._run(h, batch, cache, placement)
        return logits

    def greedy_steps(
        self, h: torch.Tensor, batch: Tokens, cache: CacheRows, freq: torch.Tensor | None, embed: torch.Tensor,
        steps: int, ends: Sequence[int], stop: ctypes.c_int32 | None = None,
    ) -> tuple[list[list[int]], torch.Tensor] | None:  # fmt: skip
        """Up to `steps` decode steps (placement "decode") of the batch's tokens in one native call, each step's
        tokens the argmax of the last one's logits (-1 where they are unusable: sampling.greedy_rows) at the next
        positions, its input rows looked up in `embed` (the table a token's input row is, alone) into h [T, E]: each
        step's tokens and the last one's logits [T, V]. The steps end after the first that gives -1 or a token of
        `ends`, or once `stop` is set (by another thread: the call reads it after each step). None where the head
        does not run natively, `embed` is not float32 or float16 rows, or a schedule weighs each step of more than
        one token (the call would weigh its steps as one). One token's steps are the steps one by one: each gets the
        sparse rows (Schedule), and the schedule keeps what the last one read."""
        tokens = h.shape[0]
        if (
            self.output is None
            or (self.schedule is not None and tokens > 1)
            or embed.dtype not in (torch.float32, torch.float16)
            or embed.dim() != 2
            or embed.shape[1] != self.cfg.hidden
            or embed.stride(1) != 1
            or embed.device.type != "cpu"
        ):
            return None
        self._prepare(tokens, cache, "decode", freq)
        call = self._call
        logits = torch.empty(tokens, self.output.rows)
        chosen = torch.empty(steps, tokens, dtype=torch.int64)
        ids = _int64(batch.tokens)
        stops = (ctypes.c_int64 * len(ends))(*ends)  # alive until the call returns
        self._ask_head(logits, None)
        call.steps, call.embed, call.embed_stride = steps, embed.data_ptr(), embed.stride(0) * embed.element_size()
        call.embed_rows, call.embed_half = embed.shape[0], int(embed.dtype == torch.float16)
        call.ids, call.next = ids.data_ptr(), chosen.data_ptr()
        call.ends, call.n_ends = ctypes.addressof(stops), len(ends)
        call.stop = None if stop is None else ctypes.addressof(stop)
        taken = self._run(h, batch, cache, "decode")
        return chosen[:taken].tolist(), logits

    def _ask_head(self, logits: torch.Tensor, picked: ctypes.Array[ctypes.c_int64] | None) -> None:
        """The call ends in the head, its logits [n, V] those of the tokens `picked` lists (None: every token)."""
        assert self.output is not None and self._norm is not None
        call = self._call
        call.rows = None if picked is None else ctypes.addressof(picked)
        call.n_rows, call.logits = logits.shape[0], logits.data_ptr()
        call.output, (call.norm, call.norm_bias) = ctypes.addressof(self.output), self._norm

    def _prepare(self, tokens: int, cache: CacheRows, placement: Placement, freq: torch.Tensor | None) -> None:
        """The scratch sized for `tokens` over the cache, the cache described, and one step of no embedding asked
        for (greedy_steps asks for more)."""
        if cache.ctx != self.dims.ctx or tokens > self.dims.tokens:
            self._scratch_for(cache.ctx, max(tokens, self.dims.tokens))
        self._describe_cache(cache)
        call = self._call
        call.freq = None if freq is None else freq.data_ptr()
        # One step, every token's logits where a head is asked for; nothing left pointing at a past call's arrays.
        call.steps, call.n_ends = 1, 0
        call.embed = call.ids = call.next = call.ends = call.rows = call.stop = None
        # A prompt's tokens alone get every neuron; the schedule weighs decode steps.
        decode = placement != "prompt"
        if self.predictor:
            selected = self.runner.native_rows()
            assert selected is not None and selected[1] is not None
            self.dims.threshold = selected[1]
            self.dims.sparse = int(decode)
        scheduled = self.schedule is not None and decode
        if scheduled:
            for i in range(len(self.layers)):
                self._sparse[i] = self.schedule.sparse(i, tokens)  # type: ignore[union-attr]
        call.sparse = ctypes.addressof(self._sparse) if scheduled else None

    def _run(self, h: torch.Tensor, batch: Positions, cache: CacheRows, placement: Placement) -> int:
        """The call as described, for the tokens h at the batch's positions and slots; the steps it took."""
        tokens = h.shape[0]
        slots, positions = _int64(batch.slots), _int64(batch.positions)
        # The library in force at the call (a benchmark swaps one in for the kernels before a change).
        status = row_kernels.kernel().qinfer_decode_step(  # type: ignore[union-attr]
            self._layers_at, len(self.layers), self._call_at, self._dims_at, self._scratch_at, h.data_ptr(), tokens,
            positions.data_ptr(), slots.data_ptr(), cache.k.shape[1], torch.get_num_threads(),
        )  # fmt: skip
        if status == -3:
            raise UserError(f"context of {cache.ctx} tokens exceeded")
        row_kernels.check(min(int(status), 0))
        if self.schedule is not None and placement != "prompt":
            for i in range(len(self.layers)):
                self.schedule.observe(i, tokens, self._read[i])
        return int(status)


def _int64(t: torch.Tensor) -> torch.Tensor:
    """t as contiguous int64, itself where it is (a batch's are): the conversions' calls cost microseconds a step."""
    return t if t.dtype == torch.int64 and t.is_contiguous() else t.to(torch.int64).contiguous()
