"""The `window` KV cache: a fixed number of rows per layer, sequence and kv head, filled by importance.

Each row holds one token's key and value and remembers that token's position, so rows need not be contiguous:
keys are stored after rope, which is why an evicted position leaves only a gap and the kept rows stay exact.
Which rows survive (qinfer.core.kv_policy): the sinks, the recent window, and the rows with the most attention
mass, accumulated with a decay so that it measures the last few windows. Every kv head chooses for itself, from
the attention of its own group of query heads.

New tokens are attended together with the kept rows before anything is evicted (as H2O does), so a prompt of
`CHUNK` tokens briefly holds that many rows more; longer prompts go in chunks, each chunk seeing the rows its
predecessors kept.
"""

from __future__ import annotations

import math

import torch

from qinfer.core.kv_policy import F32_KV, GPU_KV_TYPES, KVPolicy
from qinfer.core.model_spec import ModelSpec
from qinfer.runtime.kernels.abi import EMPTY_ROW
from qinfer.runtime.kv.batch import Rows, Step, attend_by_part

CHUNK = 256


class WindowKVCache:
    """k, v: [layers, slots, kv_heads, rows, head_dim]; pos (the token position, EMPTY_ROW for none) and mass (the
    decayed attention mass the row received): [layers, slots, kv_heads, rows]. The native decode step
    (kernels/decode_layer.c) computes a decode step's `_attend` and `_keep` over these same tensors."""

    rows_by_position = False

    def __init__(self, cfg: ModelSpec, ctx: int, slots: int, device: torch.device | str, policy: KVPolicy) -> None:
        self.split = policy.split(ctx)
        self.ctx = ctx
        self.rows = self.split.rows
        shape = (cfg.layers, slots, cfg.kv_heads, self.rows)
        on_cpu = torch.device(device).type == "cpu"
        self.types = F32_KV if on_cpu else GPU_KV_TYPES
        dtype = torch.float32 if on_cpu else torch.float16
        self.k = torch.zeros((*shape, cfg.head_dim), device=device, dtype=dtype)
        self.v = torch.zeros((*shape, cfg.head_dim), device=device, dtype=dtype)
        self.pos = torch.full(shape, EMPTY_ROW, device=device, dtype=torch.int32)
        self.mass = torch.zeros(shape, device=device, dtype=torch.float32)
        self.decay = 0.5 ** (1.0 / self.split.half_life)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k, self.v, self.pos, self.mass))

    def query_rows(self, step: Step, keep: Rows) -> Rows:
        """Every query is needed (KVCache.query_rows): each adds to the attention mass that chooses the rows kept."""
        return None

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, step: Step, queries: Rows = None
    ) -> torch.Tensor:
        """q [T, heads, d], k and v [T, kv_heads, d] at the batch's positions in its slots (a prompt in one slot, or
        one token per slot, or parts of both); returns [T, heads * d] and keeps the chosen rows. `queries` is always
        None (query_rows)."""
        assert queries is None
        if step.parts:
            return attend_by_part(self.attend, q, k, v, layer, step)
        positions, slots = step.batch.positions, step.batch.slots
        if not step.batch.single_sequence:
            return self._attend(q[:, None], k[:, None], v[:, None], layer, positions[:, None], slots).flatten(1)
        slot = slots[:1]
        outs = [
            self._attend(
                q[s : s + CHUNK][None],
                k[s : s + CHUNK][None],
                v[s : s + CHUNK][None],
                layer,
                positions[s : s + CHUNK][None],
                slot,
            )[0]
            for s in range(0, q.shape[0], CHUNK)
        ]
        return torch.cat(outs).flatten(1)

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, qpos: torch.Tensor, slots: torch.Tensor
    ) -> torch.Tensor:
        """B sequences of T new tokens each: q [B, T, heads, d], k/v [B, T, kv_heads, d], qpos [B, T]; slots [B].
        Returns [B, T, heads, d]."""
        b, t, heads, d = q.shape
        kv_heads = k.shape[2]
        group = heads // kv_heads
        device = self.k.device
        slots, qpos = slots.to(device), qpos.to(device)
        # A sequence that starts at position 0 is a new one: the slot's rows from an earlier sequence are forgotten.
        fresh = (qpos[:, 0] == 0)[:, None, None]
        old_pos = torch.where(fresh, EMPTY_ROW, self.pos[layer, slots])
        old_mass = torch.where(fresh, 0.0, self.mass[layer, slots])
        new_pos = qpos.to(torch.int32)[:, None, :].expand(b, kv_heads, t)
        keys = torch.cat((self.k[layer, slots].to(q.dtype), k.transpose(1, 2).to(q.dtype)), dim=2)
        values = torch.cat((self.v[layer, slots].to(q.dtype), v.transpose(1, 2).to(q.dtype)), dim=2)
        kpos = torch.cat((old_pos, new_pos), dim=2)  # [B, kv_heads, R + T]

        queries = q.permute(0, 2, 1, 3).reshape(b, kv_heads, group, t, d)
        logits = torch.einsum("bhgtd,bhkd->bhgtk", queries, keys).float() / math.sqrt(d)
        visible = (kpos[:, :, None, None, :] >= 0) & (kpos[:, :, None, None, :] <= qpos[:, None, None, :, None])
        probs = torch.softmax(logits.masked_fill(~visible, -math.inf), dim=-1)
        out = torch.einsum("bhgtk,bhkd->bhgtd", probs.to(values.dtype), values)

        # Each query's share decays with the steps after it, as if the tokens had come one at a time.
        weights = self.decay ** torch.arange(t - 1, -1, -1, device=device, dtype=torch.float32)
        received = torch.einsum("bhgtk,t->bhk", probs, weights)
        mass = torch.cat((old_mass * self.decay**t, received.new_zeros(b, kv_heads, t)), dim=2) + received
        self._keep(layer, slots, keys, values, kpos, mass, qpos[:, -1])
        return out.reshape(b, heads, t, d).transpose(1, 2)

    def _priority(self, kpos: torch.Tensor, mass: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        """Higher is kept first: sinks and the recent window always, then by mass; an empty row never."""
        s = self.split
        protected = (kpos < s.sinks) | (kpos > last[:, None, None] - s.recent)
        priority = torch.where(protected, math.inf, mass)
        return torch.where(kpos < 0, -math.inf, priority)

    def _keep(
        self,
        layer: int,
        slots: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        kpos: torch.Tensor,
        mass: torch.Tensor,
        last: torch.Tensor,
    ) -> None:
        """Store the best `rows` of the R old rows and T new ones, per sequence and kv head."""
        rows = self.rows
        new = keys.shape[2] - rows
        priority = self._priority(kpos, mass, last)
        if new == 1:
            # One new token (always recent, so always kept) replaces the weakest old row: only that row is written.
            victim = priority[..., :rows].argmin(dim=-1)  # [B, kv_heads]
            heads = torch.arange(keys.shape[1], device=keys.device)[None, :]
            at = (layer, slots[:, None], heads, victim)
            self.k[at] = keys[:, :, rows].to(self.k.dtype)
            self.v[at] = values[:, :, rows].to(self.v.dtype)
            self.mass[layer, slots] = mass[..., :rows]
            self.pos[layer, slots] = kpos[..., :rows]
            self.mass[at] = mass[:, :, rows]
            self.pos[at] = kpos[:, :, rows]
            return
        keep = priority.topk(rows, dim=-1).indices  # [B, kv_heads, rows]
        rows_of = keep[..., None].expand(*keep.shape, keys.shape[-1])
        self.k[layer, slots] = keys.gather(2, rows_of).to(self.k.dtype)
        self.v[layer, slots] = values.gather(2, rows_of).to(self.v.dtype)
        self.pos[layer, slots] = kpos.gather(2, keep)
        self.mass[layer, slots] = mass.gather(2, keep)
