"""Mixed steps: one forward carries running sequences' decode tokens and chunks of a prompt, each token at its
own slot and position, with the logits of each sequence run alone; the engine's steps keep every running stream
going while a long prompt is computed a budget's worth at a time."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from qinfer.core.kv_policy import F32_KV, KVPolicy
from qinfer.runtime.engine.engine import Engine, Request
from qinfer.runtime.engine.sampling import SamplingParams
from qinfer.runtime.kernels.decode_layer import MIXED_PROMPT_TOKENS, PROMPT_TOKENS
from qinfer.runtime.kv.batch import TokenBatch, batch_step, parts_take_queries
from tests.support.native_placement import counting_runs

GREEDY = SamplingParams(temperature=0.0)
RUNNING = ["Once upon a time", "The dog ran fast, and the cat slept."]
LONG = "One day a little girl named Lily found a red ball in the park. She wanted to play with it, so she ran home."


def close(got: torch.Tensor, expected: torch.Tensor, tolerance: float = 1e-5) -> bool:
    return bool((got - expected).abs().max() <= tolerance * expected.abs().max())


def open_engine(path: Path, slots: int, policy: KVPolicy | None = None, ffn: str = "dense") -> Engine:
    return Engine.open(path, slots=slots, ctx_size=128, ffn=ffn, kv_types=F32_KV, kv_policy=policy)


def mixed_equals_alone(path: Path, policy: KVPolicy | None = None, ffn: str = "dense", native: bool = False) -> None:
    """Two sequences decode three tokens while a third's prompt goes in three chunks beside them: every decode
    token's logits, and the prompt's last token's, equal those of each sequence computed alone. In torch the last
    layer attends the queries of the rows asked for alone, except in the window cache, whose row masses need them
    all; with `native`, the layer kernel computes each mixed step in one call, where the sequence alone goes
    through either path: the logits then agree to the rounding of the products' order."""
    engine = open_engine(path, 3, policy, ffn)
    forward, encode = engine.forward.forward, engine.tokenizer.encode
    attended: list[tuple[int, int, int]] = []  # each call of the cache's attend: layer, queries, tokens
    attend = engine.cache.attend

    def counted(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, *rest: Any) -> torch.Tensor:
        attended.append((layer, q.shape[0], k.shape[0]))
        return attend(q, k, v, layer, *rest)

    engine.cache.attend = counted  # type: ignore[method-assign]
    assert (engine.forward.native is not None) == native  # type: ignore[attr-defined]
    tolerance = 1e-4 if native else 1e-5
    last_layer = engine.forward.cfg.layers - 1
    running = [encode(p) for p in RUNNING]
    long = encode(LONG)
    cuts = [0, len(long) // 3, 2 * len(long) // 3, len(long)]
    decoded: list[list[torch.Tensor]] = [[], []]
    with torch.inference_mode(), pytest.MonkeyPatch.context() as patch:
        runs = counting_runs(patch)
        fed = []
        for slot, ids in enumerate(running):
            last = forward(TokenBatch.prompt(torch.tensor(ids), 0, slot), engine.cache, [len(ids) - 1])
            fed.append([int(last.argmax())])
        for j in range(3):
            decode = TokenBatch.decode([f[-1] for f in fed], [len(ids) + j for ids in running], [0, 1])
            chunk = TokenBatch.prompt(torch.tensor(long[cuts[j] : cuts[j + 1]]), cuts[j], 2)
            rows = [0, 1] + ([1 + cuts[3] - cuts[2]] if j == 2 else [])
            attended.clear()
            runs.clear()
            logits = forward(TokenBatch.join([decode, chunk]), engine.cache, rows)
            assert logits.shape[0] == len(rows)
            tokens = 2 + cuts[j + 1] - cuts[j]
            queries = tokens if policy is not None and policy.windowed else len(rows)
            if native:
                assert attended == [] and runs == {"mixed": list(range(last_layer + 1))}
            else:
                assert [(q, n) for layer, q, n in attended if layer == last_layer and n == tokens] == [
                    (queries, tokens)
                ]
            for s in range(2):
                decoded[s].append(logits[s])
                fed[s].append(int(logits[s].argmax()))
        prompt_last = logits[2]

        alone = open_engine(path, 1, policy, ffn)
        for s, ids in enumerate(running):
            alone.forward.forward(TokenBatch.prompt(torch.tensor(ids), 0), alone.cache)
            for j in range(3):
                step = alone.forward.forward(TokenBatch.decode([fed[s][j]], [len(ids) + j], [0]), alone.cache)[0]
                assert close(decoded[s][j], step, tolerance), (s, j)
        whole = alone.forward.forward(TokenBatch.prompt(torch.tensor(long), 0), alone.cache, [len(long) - 1])[0]
    assert close(prompt_last, whole, tolerance)


def test_a_mixed_step_gives_each_sequence_its_own_logits(gguf_files: dict[str, Path]) -> None:
    mixed_equals_alone(gguf_files["pi-f32"])


def test_the_layer_kernel_takes_a_mixed_step_and_gives_each_sequence_its_own_logits(
    gguf_files: dict[str, Path],
) -> None:
    mixed_equals_alone(gguf_files["dense-f16"], native=True)


def test_several_prompts_beside_decode_tokens_go_in_one_native_call(gguf_files: dict[str, Path]) -> None:
    """Whole prompts, together longer than the longest chunk the kernel takes, go in one call of the layer kernel
    beside two running sequences' tokens (the torch path would read the weights once a prompt), and every sequence
    gets the logits it gets alone, to the rounding of the products' order."""
    engine = open_engine(gguf_files["dense-f16"], 5)
    encode = engine.tokenizer.encode
    running = [encode(p) for p in RUNNING]
    prompts = [encode(LONG), encode(RUNNING[1]), encode(f"{RUNNING[0]}, and {RUNNING[1].lower()}")]
    assert max(map(len, prompts)) <= MIXED_PROMPT_TOKENS < sum(map(len, prompts))
    alone = open_engine(gguf_files["dense-f16"], 1)
    with torch.inference_mode(), pytest.MonkeyPatch.context() as patch:
        nexts = []
        for slot, ids in enumerate(running):
            last = engine.forward.forward(TokenBatch.prompt(torch.tensor(ids), 0, slot), engine.cache, [len(ids) - 1])
            nexts.append(int(last.argmax()))
        runs = counting_runs(patch)
        parts = [TokenBatch.decode(nexts, [len(ids) for ids in running], [0, 1])]
        parts += [TokenBatch.prompt(torch.tensor(ids), 0, 2 + i) for i, ids in enumerate(prompts)]
        ends = torch.tensor([len(ids) for ids in prompts]).cumsum(0) + 1
        logits = engine.forward.forward(TokenBatch.join(parts), engine.cache, [0, 1, *ends.tolist()])
        assert runs == {"mixed": list(range(engine.forward.cfg.layers))}
        expected = []
        for ids, token in zip(running, nexts, strict=True):
            alone.forward.forward(TokenBatch.prompt(torch.tensor(ids), 0), alone.cache)
            expected.append(alone.forward.forward(TokenBatch.decode([token], [len(ids)], [0]), alone.cache)[0])
        for ids in prompts:
            expected.append(alone.forward.forward(TokenBatch.prompt(torch.tensor(ids), 0), alone.cache)[-1])
    for got, want in zip(logits, expected, strict=True):
        assert close(got, want, 1e-4)


@pytest.mark.parametrize("ffn", ["sparse", "dense"])
def test_several_prompts_alone_go_in_one_native_call(gguf_files: dict[str, Path], ffn: str) -> None:
    """Whole prompts, together longer than the longest prompt the kernel takes alone, go in one call of the layer
    kernel, on a predictor model too (a prompt gets every neuron), and each gets the logits it gets alone."""
    engine = open_engine(gguf_files["pi-f16"], 3, ffn=ffn)
    prompts = [engine.tokenizer.encode(text) for text in (LONG, RUNNING[1], RUNNING[0])]
    assert max(map(len, prompts)) <= MIXED_PROMPT_TOKENS and sum(map(len, prompts)) > PROMPT_TOKENS
    alone = open_engine(gguf_files["pi-f16"], 1, ffn=ffn)
    with torch.inference_mode(), pytest.MonkeyPatch.context() as patch:
        runs = counting_runs(patch)
        joined = TokenBatch.join([TokenBatch.prompt(torch.tensor(ids), 0, s) for s, ids in enumerate(prompts)])
        ends = (torch.tensor([len(ids) for ids in prompts]).cumsum(0) - 1).tolist()
        logits = engine.forward.forward(joined, engine.cache, ends)
        assert runs == {"prompt": list(range(engine.forward.cfg.layers))}
        for got, ids in zip(logits, prompts, strict=True):
            want = alone.forward.forward(TokenBatch.prompt(torch.tensor(ids), 0), alone.cache, [len(ids) - 1])[0]
            assert close(got, want, 1e-4)


def test_a_mixed_step_through_the_window_cache(gguf_files: dict[str, Path]) -> None:
    # Rows enough for every token: what the window keeps depends on no chunking, only on when it evicts.
    mixed_equals_alone(gguf_files["pi-f32"], KVPolicy("window", 1.0))


def test_a_mixed_step_of_a_mixture_of_experts(moe: dict[str, dict[str, Path]]) -> None:
    mixed_equals_alone(next(iter(moe.values()))["dense-f32"], ffn="auto")


def test_a_batch_splits_into_chunks_and_runs_of_single_tokens() -> None:
    batch = TokenBatch.join(
        [
            TokenBatch.decode([1, 2], [5, 9], [0, 3]),
            TokenBatch.prompt(torch.tensor([4, 5, 6]), 0, 1),
            TokenBatch.prompt(torch.tensor([7]), 2, 2),
            TokenBatch.prompt(torch.tensor([8, 9]), 4, 4),
        ]
    )
    assert batch.parts() == [(0, 2), (2, 5), (5, 6), (6, 8)]
    # Some of a chunk's queries, or none, may go alone; the single tokens of several slots go all together.
    step = batch_step(batch, batch.positions, None)
    assert parts_take_queries(step, [0, 1, 4, 5, 7]) and parts_take_queries(step, [0, 1, 5])
    assert not parts_take_queries(step, [0, 4, 5, 7]) and not parts_take_queries(step, [4, 5, 7])
    assert TokenBatch.decode([1, 2], [5, 9], [0, 3]).parts() == [(0, 2)]
    assert not batch.one_per_slot and TokenBatch.decode([1, 2], [5, 9], [0, 3]).one_per_slot


def record_batches(engine: Engine) -> list[TokenBatch]:
    batches: list[TokenBatch] = []
    forward = engine.forward.forward

    def recording(batch: TokenBatch, cache, rows=None):  # type: ignore[no-untyped-def]
        batches.append(batch)
        return forward(batch, cache, rows)

    engine.forward.forward = recording  # type: ignore[method-assign]
    return batches


def greedy(engine: Engine, ids: list[int], n: int) -> list[int]:
    slot = engine.submit(Request(ids, n, GREEDY, ignore_eos=True))
    tokens = []
    while slot in engine.active_slots():
        tokens += [out.token for out in engine.step() if out.token is not None]
    return tokens


def test_running_streams_flow_while_a_long_prompt_goes_in_chunks(gguf_files: dict[str, Path]) -> None:
    budget = 8
    engine = open_engine(gguf_files["pi-f32"], 3)
    engine.prefill_chunk = budget
    encode = engine.tokenizer.encode
    batches = record_batches(engine)
    slots = [engine.submit(Request(encode(p), 40, GREEDY, ignore_eos=True)) for p in RUNNING]
    tokens: dict[int, list[int]] = {}

    def step() -> set[int]:
        outs = engine.step()
        for out in outs:
            tokens.setdefault(out.slot, []).append(out.token)  # type: ignore[arg-type]
        return {out.slot for out in outs}

    while not all(s in tokens for s in slots):
        step()
    long = encode(LONG)
    c = engine.submit(Request(long, 5, GREEDY, ignore_eos=True))
    first, prefill_steps = len(batches), 0
    while c not in tokens:
        assert step() >= set(slots)  # every running stream got its token
        prefill_steps += 1
    assert prefill_steps == -(-len(long) // budget)
    chunks = [int((b.slots == c).sum()) for b in batches[first:]]
    assert chunks == [min(budget, len(long) - j * budget) for j in range(prefill_steps)]
    # Each step: the running sequences' tokens, one each, and at most `budget` prompt tokens beside them.
    assert all(b.tokens.numel() <= budget + len(slots) for b in batches)
    while engine.active_slots():
        step()
    alone = open_engine(gguf_files["pi-f32"], 1)  # each prompt whole, in one step
    assert tokens[slots[0]] == greedy(alone, encode(RUNNING[0]), 40)
    assert tokens[slots[1]] == greedy(alone, encode(RUNNING[1]), 40)
    assert tokens[c] == greedy(alone, long, 5)


def test_a_prompt_cancelled_mid_prefill_frees_its_slot_and_keeps_its_rows(gguf_files: dict[str, Path]) -> None:
    engine = open_engine(gguf_files["pi-f32"], 1)
    engine.prefill_chunk = 8
    long = engine.tokenizer.encode(LONG)
    slot = engine.submit(Request(long, 4, GREEDY, ignore_eos=True))
    assert engine.step() == [] and engine.step() == []  # two chunks in, no token yet
    engine.cancel(slot)
    assert engine.free_slots() == 1 and engine.step() == []
    # The chunks computed before the cancel are the next prompt's reused rows.
    again = engine.submit(Request(long, 4, GREEDY, ignore_eos=True))
    assert engine.reused_tokens(again) == 16
    engine.cancel(again)
    assert greedy(engine, long, 4) == greedy(open_engine(gguf_files["pi-f32"], 1), long, 4)


def test_a_failing_chunk_fails_its_prompt_alone(gguf_files: dict[str, Path]) -> None:
    """A step whose prompt chunk makes the forward fail (memory for a long context's scores, say) ends that request
    with an error and steps the running streams without it, instead of failing them all."""
    engine = open_engine(gguf_files["pi-f32"], 2)
    encode, forward = engine.tokenizer.encode, engine.forward.forward
    running = engine.submit(Request(encode(RUNNING[0]), 8, GREEDY, ignore_eos=True))
    first = engine.step()
    assert [out.slot for out in first] == [running]

    def failing(batch: TokenBatch, cache, rows=None):  # type: ignore[no-untyped-def]
        if not batch.one_per_slot:
            raise RuntimeError("out of memory")
        return forward(batch, cache, rows)

    engine.forward.forward = failing  # type: ignore[method-assign]
    doomed = engine.submit(Request(encode(LONG), 4, GREEDY, ignore_eos=True))
    outs = {out.slot: out for out in engine.step()}
    assert outs[doomed].finished and outs[doomed].reason == "error" and "out of memory" in (outs[doomed].error or "")
    assert outs[running].token is not None and not outs[running].finished
    assert engine.active_slots() == [running] and engine.free_slots() == 1
    engine.forward.forward = forward  # type: ignore[method-assign]
    tokens = [first[0].token, outs[running].token]
    while running in engine.active_slots():
        tokens += [out.token for out in engine.step() if out.token is not None]
    assert tokens == greedy(open_engine(gguf_files["pi-f32"], 1), encode(RUNNING[0]), 8)


def test_past_the_last_attention_only_the_rows_asked_for_run(gguf_files: dict[str, Path]) -> None:
    """The last layer's FFN runs for the rows whose logits are asked for alone: a prompt's last token (dense, as
    its whole prompt would), a decode token (through the decode path), and nothing of a chunk whose prompt goes on;
    the layers before it run every token."""
    engine = open_engine(gguf_files["pi-f32"], 3)
    forward, ffn = engine.forward, engine.forward.ffn
    last = forward.cfg.layers - 1
    calls: list[tuple[int, int, bool]] = []

    def recording(i: int, x: torch.Tensor, h: torch.Tensor, prefill: bool) -> torch.Tensor:
        calls.append((i, x.shape[0], prefill))
        return ffn(i, x, h, prefill)

    forward.ffn = recording
    with torch.inference_mode():
        forward.forward(TokenBatch.prompt(torch.tensor([1, 2, 3, 4, 5]), 0, 0), engine.cache, [4])
        assert [c for c in calls if c[0] == last] == [(last, 1, True)]
        assert sorted(c for c in calls if c[0] < last) == [(i, 5, True) for i in range(last)]
        calls.clear()
        decode = TokenBatch.decode([7], [5], [0])
        going_on = TokenBatch.prompt(torch.tensor([1, 2, 3]), 0, 1)
        ending = TokenBatch.prompt(torch.tensor([4, 5, 6, 7]), 0, 2)
        logits = forward.forward(TokenBatch.join([decode, going_on, ending]), engine.cache, [0, 7])
        assert logits.shape[0] == 2
        assert [c for c in calls if c[0] == last] == [(last, 1, False), (last, 1, True)]
        calls.clear()
        chunks = [TokenBatch.prompt(torch.tensor([8, 9]), 4, 0), TokenBatch.prompt(torch.tensor([1, 2]), 4, 2)]
        logits = forward.forward(TokenBatch.join(chunks), engine.cache, [])
    assert logits.shape[0] == 0
    assert sorted(c[0] for c in calls) == sorted(list(range(last)) * 2)
