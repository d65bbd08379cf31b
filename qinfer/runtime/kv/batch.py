"""What one forward call addresses in the KV cache: its tokens, their positions and slots (`TokenBatch`), and what
every layer of the call shares (`Step`: positions on the device, rope's tables, the attention mask)."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch


def table_rows(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """table[ids] for 1-D ids (a step's tokens in an embedding table). Indexing makes an OpenMP region of a few
    dozen rows, and under load a region waits for every thread of its team (a 32-token lookup of the tiny model took
    3.7 ms instead of 7 us beside the test suite, on 2 cores); index_select copies up to about 32k elements on the
    calling thread (32 tokens of a 1024-wide table) and is the faster of the two at every size (numpy's take and
    f16 cast, serial at any size, took 8x as long for 32 tokens of a 4096-wide f16 table)."""
    return torch.index_select(table, 0, ids)


@dataclass(frozen=True)
class TokenBatch:
    """tokens, positions and KV-cache slots, one entry per token. Each slot's tokens are one run at consecutive
    positions: all of one slot (a prompt or a chunk of one), one token per distinct slot (a decode step), or both
    in one call (a mixed step: the running sequences' tokens, then chunks of prompts)."""

    tokens: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor

    @classmethod
    def prompt(cls, tokens: torch.Tensor, start: int, slot: int = 0) -> TokenBatch:
        n = tokens.shape[0]
        return cls(tokens, torch.arange(start, start + n), torch.full((n,), slot, dtype=torch.long))

    @classmethod
    def decode(cls, tokens: list[int], positions: list[int], slots: list[int]) -> TokenBatch:
        # One array's rows: every decode step makes this batch, and numpy's array of the lists, shared by torch, took
        # 4.3 us, where torch's tensor of them took 7.3 and its rows 4.8 more (an Intel Xeon).
        return cls(*(torch.from_numpy(row) for row in np.array([tokens, positions, slots], dtype=np.int64)))

    @classmethod
    def join(cls, batches: list[TokenBatch]) -> TokenBatch:
        if len(batches) == 1:
            return batches[0]  # a step of decode tokens alone: nothing to concatenate
        return cls(*(torch.cat([getattr(b, name) for b in batches]) for name in ("tokens", "positions", "slots")))

    def __getitem__(self, rows: slice) -> TokenBatch:
        return TokenBatch(self.tokens[rows], self.positions[rows], self.slots[rows])

    @property
    def single_sequence(self) -> bool:
        return bool((self.slots == self.slots[0]).all())

    @property
    def one_per_slot(self) -> bool:
        """Every token in a slot of its own, as in a decode step: no query needs another's keys of this call."""
        return self.slots.unique().numel() == self.slots.numel()

    def parts(self) -> list[tuple[int, int]]:
        """The ranges of tokens attention takes in one go: each run of several tokens of one slot (a prompt's chunk,
        which reads its slot's rows under a causal mask) alone, and the single tokens between them together (one
        sequence's rows each). A chunk's tokens gathered row by row would copy its slot's rows once per token."""
        slots = self.slots.tolist()
        parts: list[tuple[int, int]] = []
        singles = False  # whether the last part gathers single tokens
        start = 0
        for end in range(1, len(slots) + 1):
            if end < len(slots) and slots[end] == slots[start]:
                continue
            single = end - start == 1
            if single and singles:
                parts[-1] = (parts[-1][0], end)
            else:
                parts.append((start, end))
            singles, start = single, end
        return parts


@dataclass(frozen=True)
class Step:
    """What every layer of one forward call shares, made once per call rather than once per layer: the batch, its
    positions on the compute device, rope's cos/sin tables (None without rope) and the attention mask (None where
    every query may see every cached position, as a single decode token does).

    A `fixed` step is one whose shapes and work do not depend on the values in it, as a step replayed from a CUDA
    graph must be: its batch lives on the device, and attention reads every row of the cache under `mask`.

    A step whose batch has several `TokenBatch.parts` has no mask of its own: attention runs part by part
    (`attend_by_part`), each part's step with its own mask."""

    batch: TokenBatch
    positions: torch.Tensor
    mask: torch.Tensor | None
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None
    fixed: bool = False
    parts: tuple[Step, ...] = ()


def batch_step(
    batch: TokenBatch,
    positions: torch.Tensor,
    window: int | None,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
) -> Step:
    """The eager `Step` of `batch` (its positions already on the compute device), split into parts where it has
    several."""
    ranges = batch.parts()
    if len(ranges) == 1:
        return Step(batch, positions, attention_mask(batch, positions.device, window), cos, sin)
    parts = tuple(batch_step(batch[a:b], positions[a:b], window) for a, b in ranges)
    return Step(batch, positions, None, cos, sin, parts=parts)


Rows = list[int] | None  # increasing indices of a step's tokens; None: every one


def part_ranges(step: Step, kept: Rows = None) -> Iterator[tuple[Step, int, int, int, int]]:
    """Each of the step's parts with the range of its tokens in the batch, start and end, and the range of its tokens
    among `kept` (increasing indices of the batch's tokens; None: every one), which is start and end themselves where
    every token is kept."""
    start = 0
    for part in step.parts:
        end = start + part.batch.tokens.shape[0]
        a, b = (start, end) if kept is None else (bisect_left(kept, start), bisect_left(kept, end))
        yield part, start, end, a, b
        start = end


def by_part(step: Step, run: Callable[[Step, slice], torch.Tensor], keep: Rows = None) -> torch.Tensor:
    """run(part, rows) over each of the step's parts in turn, `rows` the part's tokens in the batch; the outputs in
    the batch's order. With `keep`, the tensors `run` reads hold those tokens alone: `rows` are then the part's kept
    tokens among them, and a part with none is skipped."""
    return torch.cat([run(part, slice(a, b)) for part, _, _, a, b in part_ranges(step, keep) if b > a])


Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int, Step, Rows], torch.Tensor]


def attend_by_part(
    attend: Attend, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, step: Step, queries: Rows = None
) -> torch.Tensor:
    """A cache's `attend` over each of the step's parts in turn; the outputs in the batch's order. With `queries`
    (the tokens whose rows alone q holds, as `parts_take_queries` allows), each part attends its own among them:
    all of its tokens, or where it is one sequence's run (a prompt's chunk), some or none."""
    outs = []
    for part, start, end, a, b in part_ranges(step, queries):
        mine = None if queries is None or b - a == end - start else [r - start for r in queries[a:b]]
        outs.append(attend(q[a:b], k[start:end], v[start:end], layer, part, mine))
    return torch.cat(outs)


def parts_take_queries(step: Step, queries: list[int]) -> bool:
    """Whether each of the step's parts keeps all of its tokens among `queries`, or is one sequence's run, whose
    queries `attend_by_part` can take some or none of (the single tokens of several slots go all together)."""
    return all(
        b - a == end - start or part.batch.single_sequence for part, start, end, a, b in part_ranges(step, queries)
    )


def attention_mask(batch: TokenBatch, device: torch.device, window: int | None = None) -> torch.Tensor | None:
    """Query t sees cached positions up to and including its own; with a sliding `window`, only the last `window`
    of them (Mistral's attention)."""
    n = batch.tokens.shape[0]
    end = int(batch.positions.max()) + 1
    if batch.single_sequence:
        start = int(batch.positions[0])
        # A single token sees all of them, so it needs no mask (and SDPA then takes its unmasked kernel).
        if n == 1 and (window is None or end <= window):
            return None
        mask = torch.ones(n, start + n, dtype=torch.bool, device=device).tril(start)
        return mask if window is None else mask.triu(start - window + 1)
    return rows_mask(batch.positions.to(device), end, window)


def rows_mask(positions: torch.Tensor, rows: int, window: int | None = None) -> torch.Tensor:
    """[T, 1, 1, rows]: which of the first `rows` cached positions each token at `positions` sees (one token per
    sequence), as a bool mask made on the positions' device from their values there."""
    seen = torch.arange(rows, device=positions.device)[None, :]
    mask = seen <= positions[:, None]
    if window is not None:
        mask &= seen > positions[:, None] - window
    return mask[:, None, None, :]
