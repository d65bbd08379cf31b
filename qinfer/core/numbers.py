"""Numbers read from files (GGUF metadata, config.json, device profiles) checked for type and range before anything
computes with them: a zero, negative or non-finite one would otherwise end in a traceback far from its cause, or
in a silently wrong model or plan."""

from __future__ import annotations

from dataclasses import dataclass

from qinfer.core.errors import UserError

COUNT_MAX = 1 << 31  # far above any model's sizes, and inside the int32 ggml and torch index with
FLOAT32_MAX = 3.4028234663852886e38  # the largest finite float32: what a GGUF float key holds


@dataclass(frozen=True)
class Span:
    """The finite numbers from `low` to `high`, `low` itself left out where `low_open`."""

    low: float
    high: float
    low_open: bool = False

    def holds(self, number: float) -> bool:
        above = number > self.low if self.low_open else number >= self.low
        return above and number <= self.high

    def __str__(self) -> str:
        return f"{'(' if self.low_open else '['}{self.low:g}, {self.high:g}]"


FLOAT32 = Span(-FLOAT32_MAX, FLOAT32_MAX)  # every finite float32


def whole(value: object, key: str, where: object, fix: str, low: int = 1) -> int:
    """`value` of `key` in `where` as a whole number from `low` up; bool is an int to Python, and a float 4.5 would
    truncate silently: both are refused, with `fix` saying what to do."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value < COUNT_MAX:
        wanted = "a positive whole number" if low == 1 else f"a whole number of at least {low}"
        raise UserError(f"{where}: {key} is {value!r}, not {wanted}; {fix}")
    return value


def real(value: object, key: str, where: object, span: Span, fix: str) -> float:
    """`value` of `key` in `where` as a number in `span` (NaN and the infinities never are)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not span.holds(value):
        raise UserError(f"{where}: {key} is {value!r}, not a number in {span}; {fix}")
    return float(value)
