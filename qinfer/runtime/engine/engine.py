"""The serving engine: fixed slots, each one sequence with its own KV-cache rows, decoded together step by step.

`submit` takes a request into a free slot without computing anything. Each `step` is one forward call carrying
every running sequence's next token and chunks of the prompts not yet computed, oldest first, up to `prefill_chunk`
prompt tokens (vLLM's chunked prefill, llama.cpp's unified batch), each token at its own slot and position; then
it samples the next token of every sequence it gave logits: the running ones, and those whose prompt it completed.
So a long prompt stalls the running streams for one chunk's forward at a time rather than for its whole prefill.

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

import ctypes
import itertools
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from qinfer.core.errors import UserError
from qinfer.core.kv_policy import DEFAULT_KV_TYPES, KVPolicy, KVTypes
from qinfer.core.step_budget import DEFAULT_PREFILL_CHUNK
from qinfer.runtime.engine.heap import keep_freed_memory
from qinfer.runtime.engine.sampling import NonFiniteLogits, SamplingParams, greedy_rows, sample_next
from qinfer.runtime.engine.tokenizer import GGUFTokenizer
from qinfer.runtime.kv.batch import TokenBatch
from qinfer.runtime.kv.cache import make_kv_cache, non_finite_cause
from qinfer.runtime.model.forward import ModelForward
from qinfer.runtime.model.loader import LoadedRuntime, RuntimeOptions, fit_context, load_forward
from qinfer.runtime.model.model_file import open_model

if TYPE_CHECKING:
    # Only the server builds constraints; llguidance is part of the `serve` extra.
    from qinfer.runtime.engine.grammar_constraint import Constraint

# Greedy decode steps go to the native layer step in groups (vLLM's multi-step scheduling) of at most GROUP_STEPS,
# lasting about GROUP_SECONDS: where a step is short, what Python does around each one (its batch, the argmax, the
# bookkeeping) took as long as the step (the tiny synth model: 4 layers in 120 us, and about as much around them). A
# request that arrives during a group, while a slot is free, ends it after the step under way (Engine.arrival); one
# cancelled waits for it.
GROUP_SECONDS = 0.002
GROUP_STEPS = 16


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
    order: int  # when it took its slot: the oldest prompt is computed first
    generator: torch.Generator
    tokens: list[int]  # the tokens in the KV cache, position by position
    reused: int  # of the prompt's, those whose rows were already in the slot
    generated: int = 0
    next_token: int | None = None  # sampled, not yet in the KV cache: the next step computes it

    @property
    def position(self) -> int:
        """Tokens already in the KV cache."""
        return len(self.tokens)

    @property
    def prefilling(self) -> bool:
        return self.position < len(self.request.prompt_ids)

    def left(self, ctx_size: int) -> int:
        """Tokens it may still generate: its max_tokens, and the context's positions (none: it ends on length)."""
        return min(self.request.max_tokens - self.generated, ctx_size - self.position)


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
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
    ):
        if slots < 1 or ctx_size < 2:
            raise UserError("an engine needs at least one slot and a context of at least 2 tokens")
        if prefill_chunk < 1:
            raise UserError("a step must take at least one prompt token; raise --prefill-chunk")
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
        self.prefill_chunk = prefill_chunk  # the most prompt tokens one step computes
        self._order = itertools.count()
        self.runtime: LoadedRuntime | None = None  # how `open` set the model up (FFN mode, plan, schedule)
        self._step_seconds = float("inf")  # the last step's forward (per step, a group's), which sizes the next group
        # The step widths (running sequences) the forward refused a group: its refusals depend on what it is and, with
        # a schedule, on the width (greedy_steps), never on a step's tokens.
        self._ungrouped: set[int] = set()
        # Set by another thread when a request arrives (the server's EngineWorker.submit): a group of steps under way
        # ends after its current step, so that the request waits a step for its slot rather than the whole group.
        self.arrival = ctypes.c_int32(0)

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
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
    ) -> Engine:
        """Load a GGUF and set up its runtime (see loader.RuntimeOptions for the FFN, GPU and KV settings); the
        context as loader.fit_context gives it (None: 512 or the model's own where shorter, 0: the model's own).
        Once it is loaded, the process's malloc keeps freed blocks (heap.py): loading's own are handed back."""
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
        keep_freed_memory()
        tokenizer = GGUFTokenizer(model.metadata)
        device = loaded.forward.device
        engine = cls(
            loaded.forward, tokenizer, slots, ctx, device, options.kv_policy, kv_types, reuse_prompts, prefill_chunk
        )
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
        """KV-cache rows holding a running sequence's token, over all slots (not those a free slot keeps for the
        prompt cache)."""
        return sum(self.positions().values())

    def active_slots(self) -> list[int]:
        return sorted(self._active)

    def require_room(self, prompt_ids: list[int]) -> None:
        """Refuse a prompt that leaves no room in a slot's context for a token after it (`submit` does; a command
        can ask before it echoes the prompt)."""
        if not prompt_ids:
            raise UserError("the prompt is empty")
        if len(prompt_ids) >= self.ctx_size:
            raise UserError(
                f"the prompt is {len(prompt_ids)} tokens but the context holds {self.ctx_size}; raise --ctx-size"
            )

    def submit(self, request: Request) -> int:
        """Take `request` into a free slot, its prompt to be computed by the steps that follow; the slot."""
        self.require_room(request.prompt_ids)
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
        generator = torch.Generator().manual_seed(request.seed)
        self._active[slot] = _Sequence(request, next(self._order), generator, prompt[:reused], reused)
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

    def step(self, group: bool = False) -> list[StepOutput]:
        """One forward over the running sequences' next tokens and the prompt chunks `_chunks` picks, then the next
        token of every sequence it gave logits (the running ones, and those whose prompt it completed), in the
        order of their slots. With `group`, where no prompt waits for a chunk and every running sequence decodes
        greedily with no constraint, a group of such steps (`_group`): their outputs step by step."""
        seqs = self._active
        running = {slot: seq.next_token for slot, seq in sorted(seqs.items()) if seq.next_token is not None}
        chunks = self._chunks()
        if not running and not chunks:
            return []
        if group and not chunks and len(running) not in self._ungrouped:
            grouped = self._group(running)
            if grouped is not None:
                return grouped
        parts = []
        if running:
            positions = [seqs[slot].position for slot in running]
            parts.append(TokenBatch.decode(list(running.values()), positions, list(running)))
        sampled, rows = list(running), list(range(len(running)))
        end = len(running)
        for slot, chunk in chunks:
            seq = seqs[slot]
            parts.append(TokenBatch.prompt(torch.tensor(chunk), seq.position, slot))
            end += len(chunk)
            if seq.position + len(chunk) == len(seq.request.prompt_ids):
                # Only a completed prompt's last token gives logits: the head is computed for no other chunk row.
                sampled.append(slot)
                rows.append(end - 1)
        try:
            start = time.perf_counter()
            with torch.inference_mode():
                logits = self.forward.forward(TokenBatch.join(parts), self.cache, rows).cpu()
            self._step_seconds = time.perf_counter() - start
        except Exception as exc:  # noqa: BLE001 - re-raised below unless a prompt's chunk can take the blame
            if not chunks:
                raise
            # A chunk can fail where the decode tokens alone would not (a long context's attention scores, say):
            # its request fails alone, as a prompt computed in one piece did, and the streams step without it.
            failed = []
            for slot, _ in chunks:
                self._end(slot)
                failed.append(StepOutput(slot, None, True, "error", f"the prompt failed: {exc}"))
            return sorted(failed + self.step(), key=lambda out: out.slot)
        # Only a forward that returned wrote every layer's rows: one that raised leaves the sequences as they were.
        for slot, token in running.items():
            seqs[slot].tokens.append(token)
            seqs[slot].next_token = None
        for slot, chunk in chunks:
            seqs[slot].tokens += chunk
        # logits[i] is the sequence's in slot sampled[i].
        order = sorted(range(len(sampled)), key=sampled.__getitem__)
        greedy = self._greedy_tokens(logits, sampled)
        return [self._sample(sampled[i], logits[i], greedy[i]) for i in order]

    def _group(self, running: dict[int, int]) -> list[StepOutput] | None:
        """Greedy steps of the running sequences (slot: the token to compute) in one native call, as many as fit
        GROUP_SECONDS at the last step's pace, GROUP_STEPS and every sequence's tokens and context left: each step's
        outputs, as `step` gives them. The call ends a group at a step that gives an end of text or unusable logits,
        or, while a slot is free, after the step under way once a request arrives (`arrival`); that step, the last,
        goes through `_sample` as any step's. None where no group applies: one step then."""
        steps = min(GROUP_STEPS, int(GROUP_SECONDS / self._step_seconds))
        if steps < 2:
            return None
        seqs = self._active
        requests = [seqs[slot].request for slot in running]
        if any(r.constraint is not None or not r.sampling.greedy for r in requests):
            return None
        steps = min(steps, *(seqs[slot].left(self.ctx_size) for slot in running))
        if steps < 2:
            return None
        # An end of text ends a sequence, and so the group, unless every sequence ignores it.
        ends = [] if all(r.ignore_eos for r in requests) else sorted(self.tokenizer.end_ids)
        batch = TokenBatch.decode(list(running.values()), [seqs[slot].position for slot in running], list(running))
        # With every slot busy an arrival waits for a sequence to end, and a group already ends there.
        stop = self.arrival if self.free_slots() > 0 else None
        start = time.perf_counter()
        with torch.inference_mode():
            grouped = self.forward.greedy_steps(batch, self.cache, steps, ends, stop)
        if grouped is None:
            self._ungrouped.add(len(running))
            return None
        tokens, logits = grouped
        self._step_seconds = (time.perf_counter() - start) / len(tokens)
        outputs = []
        for step_tokens in tokens[:-1]:
            for slot, token in zip(running, step_tokens, strict=True):
                seq = seqs[slot]
                seq.tokens.append(seq.next_token)  # type: ignore[arg-type]
                seq.generated += 1
                seq.next_token = token
                outputs.append(StepOutput(slot, token, False, None))
        for slot in running:
            seqs[slot].tokens.append(seqs[slot].next_token)  # type: ignore[arg-type]
            seqs[slot].next_token = None
        return outputs + [self._sample(slot, logits[i], tokens[-1][i]) for i, slot in enumerate(running)]

    def _greedy_tokens(self, logits: torch.Tensor, sampled: list[int]) -> list[int]:
        """Per row of logits (the sequence in slot sampled[i]'s): its argmax where that sequence decodes greedily
        with no constraint and the row is usable, else -1. The rows that take it go in one reduction together: a
        row's own checks and argmax took tens of microseconds of dispatch each (a 32-sequence step of the tiny
        model: 1.9 ms that way, 1.05 ms with the rows' checks and argmax each in one call for all); a batch that
        samples pays none (32 rows of 128256: 1.4 ms)."""
        picks = [
            i
            for i, slot in enumerate(sampled)
            if self._active[slot].request.constraint is None and self._active[slot].request.sampling.greedy
        ]
        tokens = [-1] * len(sampled)
        if picks:
            rows = logits if len(picks) == len(sampled) else logits[picks]
            for i, token in zip(picks, greedy_rows(rows), strict=True):
                tokens[i] = token
        return tokens

    def _chunks(self) -> list[tuple[int, list[int]]]:
        """The prompt tokens this step computes, by slot: of the prompts not yet in the cache, oldest first, as many
        as `prefill_chunk` allows beside the running sequences' tokens (which always go: no stream waits)."""
        budget = self.prefill_chunk
        chunks = []
        waiting = [slot for slot, seq in self._active.items() if seq.prefilling]
        for slot in sorted(waiting, key=lambda s: self._active[s].order):
            seq = self._active[slot]
            chunk = seq.request.prompt_ids[seq.position : seq.position + budget]
            chunks.append((slot, chunk))
            budget -= len(chunk)
            if budget == 0:
                break
        return chunks

    def _sample(self, slot: int, logits: torch.Tensor, greedy: int) -> StepOutput:
        """The next token of the sequence in `slot`: `greedy` where it is one (_greedy_tokens), else one from its
        logits; the sequence ends where it should."""
        seq = self._active[slot]
        constraint = seq.request.constraint
        try:
            if greedy >= 0:
                token = greedy
            else:
                if constraint is not None:
                    logits = constraint.mask(logits)
                token = sample_next(logits, seq.request.sampling, seq.generator)
            ends = token in self.tokenizer.end_ids and not seq.request.ignore_eos
            if constraint is not None and not ends:
                constraint.advance(token)
        except Exception as exc:  # noqa: BLE001 - one sequence's bad logits or settings must not end the batch
            broken = isinstance(exc, NonFiniteLogits)
            cause = f": {non_finite_cause(self.cache, slot, seq.position)}" if broken else ""
            self._end(slot)
            return StepOutput(slot, None, True, "error", f"sampling failed: {exc}{cause}")
        if ends:
            self._end(slot)
            return StepOutput(slot, None, True, "stop")
        seq.generated += 1
        if constraint is not None and constraint.complete:
            self._end(slot)
            return StepOutput(slot, token, True, "stop")
        if seq.left(self.ctx_size) <= 0:
            self._end(slot)
            return StepOutput(slot, token, True, "length")
        seq.next_token = token
        return StepOutput(slot, token, False, None)
