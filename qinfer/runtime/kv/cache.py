"""The full KV cache: every position's K and V per layer, slot and kv head, and the choice between it and the window
cache (window.py) that a KV policy makes."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from qinfer.core.errors import UserError
from qinfer.core.kv_policy import DEFAULT_KV_TYPES, F32_KV, GPU_KV_TYPES, Q8_0, KVPolicy, KVTypes
from qinfer.core.model_spec import ModelSpec
from qinfer.runtime.kv.batch import Rows, Step, attend_by_part, parts_take_queries
from qinfer.runtime.kv.q8_rows import dequantize_rows, quantize_rows
from qinfer.runtime.kv.window import WindowKVCache

# The torch type each cache element type (qinfer.core.kv_policy.CACHE_TYPES) is held in: a q8_0 row is its blocks'
# bytes (q8_rows.py).
DTYPES = {"f16": torch.float16, "f32": torch.float32, Q8_0: torch.uint8}


def cache_types(types: KVTypes, device: torch.device | str) -> KVTypes:
    """The types a cache on `device` holds: the ones `types` names on the CPU; f16 on a GPU (what the planner
    budgets for), whatever -ctk and -ctv say."""
    return types if torch.device(device).type == "cpu" else GPU_KV_TYPES


class KVCache:
    """K and V per layer and slot: [layers, slots, kv_heads, ctx, row], a row being head_dim elements of f16 or f32,
    or the bytes of head_dim / 32 Q8_0 blocks, as `types` gives."""

    rows_by_position = True  # row p of a slot holds position p (the window cache's rows hold any position)

    def __init__(
        self,
        cfg: ModelSpec,
        ctx: int,
        slots: int = 1,
        device: torch.device | str = "cpu",
        types: KVTypes = DEFAULT_KV_TYPES,
    ):
        self.types = cache_types(types, device)
        shape = (cfg.layers, slots, cfg.kv_heads, ctx)
        k_bytes, v_bytes = self.types.row_bytes(cfg.head_dim)
        k_type, v_type = DTYPES[self.types.k], DTYPES[self.types.v]
        self.k = torch.zeros((*shape, k_bytes // k_type.itemsize), device=device, dtype=k_type)
        self.v = torch.zeros((*shape, v_bytes // v_type.itemsize), device=device, dtype=v_type)
        self.ctx = ctx

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k, self.v))

    def query_rows(self, step: Step, keep: Rows) -> Rows:
        """The tokens of `keep` (increasing indices of the step's tokens) where `attend` can take their queries alone,
        with every token's keys and values: a prompt, or prompts' chunks beside decode tokens, of which only some
        tokens' outputs are needed (the last layer's, below the head; none for a chunk that does not end its
        prompt). None where every query is needed."""
        if keep is None or len(keep) == step.batch.tokens.shape[0] or step.fixed:
            return None
        alone = parts_take_queries(step, keep) if step.parts else step.batch.single_sequence
        return keep if alone else None

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, step: Step, queries: Rows = None
    ) -> torch.Tensor:
        """Store k, v [T, kv_heads, d] at the batch's slots and positions, attend q [T, heads, d]; returns
        [T, heads*d]. With `queries` (from `query_rows`), q and the result hold those tokens' rows alone."""
        assert queries is None or self.query_rows(step, queries) == queries
        if step.parts:
            return attend_by_part(self.attend, q, k, v, layer, step, queries)
        n, batch = k.shape[0], step.batch
        if not step.fixed and batch.single_sequence:
            slot, start = int(batch.slots[0]), int(batch.positions[0])
            end = start + n
            # A slice write: no index tensors to build or move for the one sequence's consecutive positions.
            self.k[layer, slot, :, start:end] = _stored(self.types.k, k.transpose(0, 1), self.k.dtype)
            self.v[layer, slot, :, start:end] = _stored(self.types.v, v.transpose(0, 1), self.v.dtype)
            if queries == []:
                return q.flatten(1)  # [0, heads * d]: no output is needed, only the keys and values stored
            keys = _read(self.types.k, self.k[layer, slot, :, :end], q.dtype)
            values = _read(self.types.v, self.v[layer, slot, :, :end], q.dtype)
            out = _causal_attention(q.transpose(0, 1), keys, values, step.mask, start, queries).transpose(0, 1)
        else:
            slots = batch.slots.to(self.k.device)
            self.k[layer, slots, :, step.positions] = _stored(self.types.k, k, self.k.dtype)
            self.v[layer, slots, :, step.positions] = _stored(self.types.v, v, self.v.dtype)
            # A fixed step reads every row (its mask hides the ones past each position): no value reaches the host.
            end = self.ctx if step.fixed else int(batch.positions.max()) + 1
            assert step.mask is not None
            # Rows past a sequence's position may hold an earlier sequence's values, an f16 overflow's inf among
            # them, which the mask's -inf alone would turn into NaN: zeroed where the mask hides them.
            seen = step.mask.transpose(-1, -2)
            keys = _read(self.types.k, self.k[layer, slots, :, :end], q.dtype).where(seen, 0.0)
            values = _read(self.types.v, self.v[layer, slots, :, :end], q.dtype).where(seen, 0.0)
            out = F.scaled_dot_product_attention(
                q[:, :, None], keys, values, attn_mask=step.mask, enable_gqa=True
            )[:, :, 0]
        return out.reshape(q.shape[0], -1)


# On the CPU a prompt's queries go QUERY_BLOCK at a time, each block over the keys up to its last position alone:
# the scores past the causal edge are then mostly not computed, and a block's scores stay in cache. A 512-token
# prompt's attention (32 heads of 128) takes 21 ms where one call over every query takes 48, on two Zen 5 threads;
# a GPU's kernels need no such help.
QUERY_BLOCK = 64


def _causal_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None, start: int, queries: Rows
) -> torch.Tensor:
    """q [heads, T, d] of the tokens `queries` (None: every one) of a run of one sequence's tokens at positions
    start.., over its keys and values [kv_heads, start + tokens, d] under `mask` [tokens, start + tokens] (None:
    every query sees every key)."""
    n = q.shape[1]
    if mask is None or n <= QUERY_BLOCK or q.device.type != "cpu":
        mask = mask if mask is None or queries is None else mask[queries]
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
    blocks = []
    for a in range(0, n, QUERY_BLOCK):
        b = min(a + QUERY_BLOCK, n)
        block = slice(a, b) if queries is None else queries[a:b]
        seen = start + (b if queries is None else queries[b - 1] + 1)
        blocks.append(
            F.scaled_dot_product_attention(
                q[:, a:b], keys[:, :seen], values[:, :seen], attn_mask=mask[block, :seen], enable_gqa=True
            )
        )
    return torch.cat(blocks, dim=1)


def _stored(name: str, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows x [..., head_dim] as a cache of element type `name` holds them."""
    return quantize_rows(x) if name == Q8_0 else x.to(dtype)


def _read(name: str, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A cache's rows of element type `name` as `dtype` [..., head_dim]."""
    return (dequantize_rows(rows) if name == Q8_0 else rows).to(dtype)


Cache = KVCache | WindowKVCache


def non_finite_cause(cache: Cache, slot: int, positions: int) -> str:
    """Why logits `slot` computed through `cache` hold NaN or inf, as far as its first `positions` rows (the
    sequence's own; past them an earlier sequence's may remain) tell. A key or value beyond f16's range (65504) is
    inf in an f16 cache, and attention turns it into NaN, where an f32 cache keeps it; an f32 cache, or an f16 one
    without inf, leaves the weights as the cause."""
    rows = (cache.k[:, slot, :, :positions], cache.v[:, slot, :, :positions])
    if not any(t.dtype == torch.float16 and bool(torch.isinf(t).any()) for t in rows):
        return "the model's weights are damaged; re-convert it"
    if cache.k.device.type != "cpu":
        # cache_types: the GPU's cache is f16 whatever -ctk and -ctv say.
        return (
            "keys or values beyond f16's range overflowed the GPU's KV cache, which is always f16; run without "
            "--vram-budget and with -ctk f32 -ctv f32"
        )
    return "keys or values beyond f16's range overflowed the f16 KV cache; use -ctk f32 -ctv f32"


def make_kv_cache(
    cfg: ModelSpec,
    ctx: int,
    slots: int = 1,
    device: torch.device | str = "cpu",
    policy: KVPolicy | None = None,
    types: KVTypes = DEFAULT_KV_TYPES,
) -> Cache:
    """The cache that `policy` (qinfer.core.kv_policy; default full) describes, for `slots` sequences of `ctx`, in
    the element types `types` gives (the window cache keeps float32 on the CPU); refused in one line, before
    anything is allocated, where the host cannot hold its K and V."""
    window = policy if policy is not None and policy.windowed else None
    if window is not None:
        window.require_fits(cfg)
    rows = window.split(ctx).rows if window is not None else ctx
    lower = "lower the sequences (--parallel, --slots) or --ctx-size"
    if torch.device(device).type == "cpu":
        # A window's positions and masses are a few bytes a row more.
        row = sum((F32_KV if window is not None else types).row_bytes(cfg.head_dim))
        needed, free = cfg.layers * slots * cfg.kv_heads * rows * row, _host_memory()
        if needed > free:
            raise UserError(
                f"the KV cache for {slots} sequences of {ctx} tokens needs {needed / 2**30:.1f} GiB, more than the "
                f"{free / 2**30:.1f} GiB this machine has free; {lower}"
            )
    try:
        if window is not None:
            return WindowKVCache(cfg, ctx, slots, device, window)
        return KVCache(cfg, ctx, slots, device, types)
    except RuntimeError as exc:  # torch's allocators, on the host and on a GPU, fail with RuntimeErrors
        if "alloc" not in str(exc) and "out of memory" not in str(exc):
            raise
        raise UserError(f"the KV cache for {slots} sequences of {ctx} tokens does not fit in memory; {lower}") from None


def _host_memory() -> int:
    """Bytes the host can give now (Linux's MemAvailable), else its physical memory."""
    try:
        with open("/proc/meminfo", encoding="ascii") as info:
            for line in info:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
