"""Which KV-cache rows a sequence keeps: every row (`full`), or a fixed budget of them (`window`).

One fact for the runtime, which allocates the rows, and the planner, which budgets their bytes: how many rows a
policy keeps per layer, sequence and kv head, how they split into sinks, recent window and heavy hitters, and what
one row costs.

`window` keeps, per layer and kv head, the first `sinks` positions (attention sinks, as StreamingLLM), the most
recent `recent` positions, and up to `heavy` more chosen by accumulated attention mass (heavy hitters, as H2O).
The mass decays by half every `half_life` decode steps (by default one recent window), so a token's importance is
judged over the last few windows rather than its whole history, which would favour old tokens only for having been
seen longer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from qinfer.core.errors import UserError
from qinfer.core.model_spec import ModelSpec

KVPolicyKind = Literal["full", "window"]
KV_POLICIES: tuple[KVPolicyKind, ...] = ("full", "window")

# A window cache also keeps, per row and kv head, the row's position (int32) and its accumulated attention mass
# (float32): the runtime allocates them beside K and V, so the planner budgets them too.
WINDOW_ROW_EXTRA_BYTES = 4 + 4
MIN_WINDOW_ROWS = 4
SINKS = 4


@dataclass(frozen=True)
class KVSplit:
    """How a window of `rows` rows is shared out; sinks + recent + heavy == rows."""

    sinks: int
    recent: int
    heavy: int
    half_life: int  # decode steps over which a row's accumulated attention mass halves

    @property
    def rows(self) -> int:
        return self.sinks + self.recent + self.heavy


@dataclass(frozen=True)
class KVPolicy:
    """`budget` is a fraction of the context when <= 1 (1 = all of it), else a number of tokens; ignored by
    `full`."""

    kind: KVPolicyKind = "full"
    budget: float = 1.0
    sinks: int = SINKS  # at most a quarter of the rows
    # Of the rows after the sinks; the rest are heavy hitters. A short recent window and a mass that halves every
    # window were best on bench/kv_quality.py at every budget (a longer memory favours tokens that were important
    # long ago; a longer window spends rows on recent tokens that attention mass would keep anyway).
    recent_share: float = 0.1
    half_life_windows: float = 1.0  # the mass's half-life, in recent windows

    def __post_init__(self) -> None:
        if self.kind not in KV_POLICIES:
            raise UserError(f"unknown KV policy {self.kind!r}; use one of {', '.join(KV_POLICIES)}")
        if not (math.isfinite(self.budget) and self.budget > 0):
            raise UserError(f"--kv-budget must be a positive number of tokens or a fraction, not {self.budget}")
        if self.budget > 1 and self.budget != int(self.budget):
            raise UserError(f"--kv-budget {self.budget:g}: give a whole number of tokens, or a fraction up to 1")
        if self.sinks < 0 or not 0.0 <= self.recent_share <= 1.0 or not self.half_life_windows > 0:
            raise UserError("a window needs sinks >= 0, a recent share in [0, 1] and a positive half-life")

    @property
    def windowed(self) -> bool:
        return self.kind == "window"

    def require_fits(self, cfg: ModelSpec) -> None:
        """Refuse a window for a model that attends to a sliding window of its own (Mistral): the runtime, which
        would keep the wrong rows, and the planner, which would budget them."""
        if self.windowed and cfg.sliding_window is not None:
            raise UserError(
                f"this model attends to its last {cfg.sliding_window} tokens itself (a sliding window); "
                "use --kv-policy full"
            )

    def rows(self, ctx: int) -> int:
        """KV rows kept per layer, sequence and kv head for a context of `ctx` tokens."""
        if not self.windowed:
            return ctx
        wanted = int(self.budget) if self.budget > 1 else math.ceil(self.budget * ctx)
        if min(wanted, ctx) < MIN_WINDOW_ROWS:
            raise UserError(f"--kv-budget keeps {wanted} of {ctx} tokens; a window needs at least {MIN_WINDOW_ROWS}")
        return min(wanted, ctx)

    def attended_rows(self, ctx: int) -> int:
        """Rows one decode step scores: a window also scores the new token's row before evicting one for it."""
        return self.rows(ctx) + 1 if self.windowed else ctx

    def split(self, ctx: int) -> KVSplit:
        rows = self.rows(ctx)
        sinks = min(self.sinks, rows // 4)
        recent = max(1, round((rows - sinks) * self.recent_share))
        heavy = rows - sinks - recent
        return KVSplit(sinks, recent, heavy, max(1, round(recent * self.half_life_windows)))

    def row_bytes(self, spec: ModelSpec, element_bytes: int) -> int:
        """Bytes of one row (one token of one sequence) across a layer's kv heads: K, V and the window's extras."""
        extra = WINDOW_ROW_EXTRA_BYTES if self.windowed else 0
        return spec.kv_heads * (2 * spec.head_dim * element_bytes + extra)

    def layer_bytes(self, spec: ModelSpec, ctx: int, slots: int, element_bytes: int) -> int:
        """One layer's KV cache for `slots` sequences of up to `ctx` tokens."""
        return self.rows(ctx) * slots * self.row_bytes(spec, element_bytes)


def parse_kv_budget(text: str) -> float:
    """--kv-budget: tokens ("512") or a fraction of the context ("0.25", "25%")."""
    value = text.strip()
    try:
        number = float(value[:-1]) / 100 if value.endswith("%") else float(value)
    except ValueError:
        raise UserError(f"--kv-budget {text!r} is neither a number of tokens nor a fraction such as 0.25") from None
    KVPolicy("window", number)  # validates
    return number


# The element types a CPU KV cache may hold, by llama.cpp's names (--cache-type-k/-v), each as (values per block,
# bytes per block). q8_0 is llama.cpp's Q8_0 (gguf's table): blocks of 32 values, each an f16 scale d = max|x| / 127
# and 32 int8 q = round(x / d), so a row of head_dim values is head_dim / 32 blocks.
CACHE_TYPES: dict[str, tuple[int, int]] = {
    "f16": (1, 2),
    "f32": (1, 4),
    "q8_0": GGML_QUANT_SIZES[GGMLQuantizationType.Q8_0],
}
Q8_0 = "q8_0"


@dataclass(frozen=True)
class KVTypes:
    """The element types of a CPU cache's keys and values: f16 by default, as llama.cpp's, which halves what
    attention reads at a long context; f32 keeps them exactly; q8_0 takes 34 bytes per 32 values, about half of
    f16's, at a rounding of max|x| / 254 per block. A GPU cache is always f16."""

    k: str = "f16"
    v: str = "f16"

    def row_bytes(self, head_dim: int) -> tuple[int, int]:
        """Bytes of one position's key row and value row in one kv head; refused in one line where head_dim is not
        a whole number of a type's blocks."""
        sizes = []
        for name, option in ((self.k, "-ctk"), (self.v, "-ctv")):
            block, size = CACHE_TYPES[name]
            if head_dim % block:
                raise UserError(
                    f"{option} {name} stores blocks of {block} values, and this model's heads have {head_dim}; "
                    f"use {option} f16"
                )
            sizes.append(head_dim // block * size)
        return sizes[0], sizes[1]


DEFAULT_KV_TYPES = KVTypes()
F32_KV = KVTypes("f32", "f32")  # exact keys and values: what a comparison with a float32 reference needs
GPU_KV_TYPES = KVTypes("f16", "f16")  # a GPU cache's, whatever -ctk and -ctv say
