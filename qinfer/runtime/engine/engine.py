"""The serving engine: fixed slots, each one sequence with its own KV-cache rows, decoded together step by step.

`submit` runs a prompt (dense prefill) into a free slot; `step` samples the next token of every active
sequence and, for those that go on, runs one batched decode forward over all of them at their own positions.

A slot keeps the tokens whose keys and values it holds after its sequence ends, and a prompt goes to the free slot
whose tokens share the longest prefix with it: those rows are reused and only the rest is prefilled, so a chat's
next turn, which resends the conversation, costs only its new tokens (llama.cpp's prompt cache). A prompt that
shares no more than its first token (the BOS every prompt begins with) with any slot is a new conversation: it
takes a slot that keeps nothing, else the one whose tokens were kept longest ago, so that two conversations
alternating turns both keep their rows. The window cache keeps rows by importance rather than position, so there
nothing is reused; nor with `reuse_prompts` off, where whoever learns how much of a prompt was reused (a server's
`timings.cache_n`, or how soon a prompt is done) could learn another user's prompt.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from qinfer.core.errors import UserError
from qinfer.core.kv_policy import DEFAULT_KV_TYPES, KVPolicy, KVTypes
from qinfer.runtime.engine.sampling import NonFiniteLogits, SamplingParams, sample_next
from qinfer.runtime.engine.tokenizer import GGUFTokenizer
from qinfer.runtime.kv.batch import TokenBatch
from qinfer.runtime.kv.cache import make_kv_cache, non_finite_cause
from qinfer.runtime.model.forward import ModelForward
from qinfer.runtime.model.loader import LoadedRuntime, RuntimeOptions, fit_context, load_forward
from qinfer.runtime.model.model_file import open_model

if TYPE_CHECKING:
    # Only the server builds constraints; llguidance is part of the `serve` extra.
    from qinfer.runtime.engine.grammar_constraint import Constraint


@dataclass
class Request:
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    seed: int = 0
    ignore_eos: bool = False
    constraint: Constraint | None = None  # a grammar the output must follow (structured output)


@dataclass
class StepOutput:
    slot: int
    token: int | None  # None when the sequence ended on EOS
    finished: bool
    reason: str | None  # "stop" (EOS), "length" (max_tokens or a full context) or "error"
    error: str | None = None  # why this sequence failed; the others in the batch go on


@dataclass
class _Sequence:
    request: Request
    position: int  # tokens already in the KV cache
    generated: int
    logits: torch.Tensor  # for the next token, on the CPU
    generator: torch.Generator
    tokens: list[int]  # the tokens in the KV cache, position by position
    reused: int  # of the prompt's, those whose rows were already in the slot


def _shared_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class Engine:
    def __init__(
        self,
        forward: ModelForward,
        tokenizer: GGUFTokenizer,
        slots: int = 1,
        ctx_size: int = 512,
        cache_device: torch.device | str = "cpu",
        kv_policy: KVPolicy | None = None,
        kv_types: KVTypes = DEFAULT_KV_TYPES,
        reuse_prompts: bool = True,
    ):
        if slots < 1 or ctx_size < 2:
            raise UserError("an engine needs at least one slot and a context of at least 2 tokens")
        self.forward = forward
        self.tokenizer = tokenizer
        self.slots = slots
        self.ctx_size = ctx_size
        self.cache = make_kv_cache(forward.cfg, ctx_size, slots, cache_device, kv_policy, kv_types)
        self._active: dict[int, _Sequence] = {}
        # Per slot, the tokens whose rows it holds from its last sequence (reused by the next prompt they begin).
        self._kept: list[list[int]] = [[] for _ in range(slots)]
        self.reuse_prompts = reuse_prompts and self.cache.rows_by_position
        # Per slot, when its last sequence ended (a count of ended sequences): the oldest kept tokens go first.
        self._ended = [0] * slots
        self.runtime: LoadedRuntime | None = None  # how `open` set the model up (FFN mode, plan, schedule)

    @classmethod
    def open(
        cls,
        model_path: Path,
        *,
        slots: int = 1,
        ctx_size: int | None = None,
        vram_budget_gib: float | None = None,
        schedule: str = "auto",
        ffn: str = "auto",
        reset_gpu_index: bool = False,
        disable_gpu_index: bool = False,
        device: str | None = None,
        kv_policy: KVPolicy | None = None,
        kv_types: KVTypes = DEFAULT_KV_TYPES,
        reuse_prompts: bool = True,
    ) -> Engine:
        """Load a GGUF and set up its runtime (see loader.RuntimeOptions for the FFN, GPU and KV settings); the
        context as loader.fit_context gives it (None: 512 or the model's own where shorter, 0: the model's own)."""
        model = open_model(model_path)
        ctx, clamped = fit_context(model, ctx_size)
        options = RuntimeOptions(
            ffn=ffn,
            vram_budget_gib=vram_budget_gib,
            schedule=schedule,
            reset_gpu_index=reset_gpu_index,
            disable_gpu_index=disable_gpu_index,
            device=device,
            kv_policy=kv_policy or KVPolicy(),
            kv_types=kv_types,
        )
        loaded = load_forward(model, options, slots=slots, ctx_size=ctx)
        tokenizer = GGUFTokenizer(model.metadata)
        device = loaded.forward.device
        engine = cls(loaded.forward, tokenizer, slots, ctx, device, options.kv_policy, kv_types, reuse_prompts)
        engine.runtime = loaded
        if clamped is not None:
            loaded.notes.insert(0, clamped)
        return engine

    def free_slots(self) -> int:
        return self.slots - len(self._active)

    def positions(self) -> dict[int, int]:
        """Tokens in the KV cache of each busy slot."""
        return {slot: seq.position for slot, seq in list(self._active.items())}

    def rows_in_use(self) -> int:
        """KV-cache rows holding a token, over all slots."""
        return sum(self.positions().values())

    def active_slots(self) -> list[int]:
        return sorted(self._active)

    def submit(self, request: Request) -> int:
        if not request.prompt_ids:
            raise UserError("the prompt is empty")
        if len(request.prompt_ids) >= self.ctx_size:
            raise UserError(
                f"the prompt is {len(request.prompt_ids)} tokens but the context holds {self.ctx_size}; "
                "raise --ctx-size"
            )
        free = [s for s in range(self.slots) if s not in self._active]
        if not free:
            raise UserError(f"all {self.slots} slots are busy")
        prompt = request.prompt_ids
        shared = {s: _shared_prefix(self._kept[s], prompt) if self.reuse_prompts else 0 for s in free}
        slot = max(free, key=lambda s: shared[s])
        if shared[slot] <= 1:
            slot = min(free, key=lambda s: (bool(self._kept[s]), self._ended[s]))
        # At least the prompt's last token is computed again: its logits give the first new token.
        reused = min(shared[slot], len(prompt) - 1)
        self._kept[slot] = []  # its rows are rewritten from `reused` on
        with torch.inference_mode():
            suffix = torch.tensor(prompt[reused:])
            logits = self.forward.forward(TokenBatch.prompt(suffix, reused, slot), self.cache, last_only=True)
        generator = torch.Generator().manual_seed(request.seed)
        self._active[slot] = _Sequence(request, len(prompt), 0, logits[-1].cpu(), generator, list(prompt), reused)
        return slot

    def reused_tokens(self, slot: int) -> int:
        """Of the prompt of the sequence in `slot`, the tokens whose rows were already there."""
        return self._active[slot].reused

    def cancel(self, slot: int) -> None:
        self._end(slot)

    def erase(self, slot: int) -> None:
        """Forget the tokens the free `slot` keeps, so that the next prompt there is computed whole (llama.cpp's
        slot erase)."""
        if slot not in self._active:
            self._kept[slot] = []

    def _end(self, slot: int) -> None:
        seq = self._active.pop(slot, None)
        if seq is not None:
            self._kept[slot] = seq.tokens
            self._ended[slot] = max(self._ended) + 1

    def step(self) -> list[StepOutput]:
        outputs: list[StepOutput] = []
        tokens: list[int] = []
        positions: list[int] = []
        going: list[int] = []
        for slot in self.active_slots():
            seq = self._active[slot]
            constraint = seq.request.constraint
            try:
                logits = seq.logits if constraint is None else constraint.mask(seq.logits)
                token = sample_next(logits, seq.request.sampling, seq.generator)
                ends = token in self.tokenizer.end_ids and not seq.request.ignore_eos
                if constraint is not None and not ends:
                    constraint.advance(token)
            except Exception as exc:  # noqa: BLE001 - one sequence's bad logits or settings must not end the batch
                broken = isinstance(exc, NonFiniteLogits)
                cause = f": {non_finite_cause(self.cache, slot, seq.position)}" if broken else ""
                outputs.append(StepOutput(slot, None, True, "error", f"sampling failed: {exc}{cause}"))
                self._end(slot)
                continue
            if ends:
                outputs.append(StepOutput(slot, None, True, "stop"))
                self._end(slot)
                continue
            seq.generated += 1
            if constraint is not None and constraint.complete:
                outputs.append(StepOutput(slot, token, True, "stop"))
                self._end(slot)
                continue
            if seq.generated >= seq.request.max_tokens or seq.position >= self.ctx_size:
                outputs.append(StepOutput(slot, token, True, "length"))
                self._end(slot)
                continue
            outputs.append(StepOutput(slot, token, False, None))
            tokens.append(token)
            positions.append(seq.position)
            going.append(slot)
            seq.tokens.append(token)
            seq.position += 1
        if going:
            try:
                with torch.inference_mode():
                    logits = self.forward.forward(TokenBatch.decode(tokens, positions, going), self.cache).cpu()
            except BaseException:
                for slot in going:  # their rows for this step's tokens may not have been written
                    self._active[slot].tokens.pop()
                raise
            for row, slot in enumerate(going):
                self._active[slot].logits = logits[row]
        return outputs
