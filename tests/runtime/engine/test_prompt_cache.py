"""The prompt cache: a prompt that begins with a slot's kept tokens reuses their KV rows and computes only the
rest, with the logits and greedy tokens of a prompt computed whole, until the slot is erased; a chat's second turn
prefills its new tokens."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
import torch

from qinfer.core.kv_policy import KVPolicy
from qinfer.runtime.engine.engine import Engine, Request
from qinfer.runtime.engine.sampling import SamplingParams
from qinfer.runtime.engine.worker import EngineWorker
from qinfer.runtime.server.app import create_app
from qinfer.runtime.server.thread import serve_in_thread
from tests.support.logits_hook import LogitsHook

GREEDY = SamplingParams(0.0, 0, 1.0)


def run(engine: Engine, ids: list[int], n: int) -> tuple[int, int, list[int], torch.Tensor]:
    """The slot taken, the prompt tokens reused there, the n greedy tokens, and the first step's logits."""
    seen = LogitsHook()
    slot = engine.submit(Request(ids, n, GREEDY, ignore_eos=True, constraint=seen))  # type: ignore[arg-type]
    reused = engine.reused_tokens(slot)
    tokens: list[int] = []
    while slot in engine.active_slots():
        tokens += [out.token for out in engine.step() if out.slot == slot and out.token is not None]
    return slot, reused, tokens, seen.seen[0]


@pytest.mark.parametrize("ffn", ["dense", "sparse"])
def test_a_continued_prompt_reuses_the_rows(gguf_files: dict[str, Path], ffn: str) -> None:
    engine = Engine.open(gguf_files["pi-f32"], slots=2, ctx_size=128, ffn=ffn)
    fresh = Engine.open(gguf_files["pi-f32"], slots=1, ctx_size=128, ffn=ffn)
    first = engine.tokenizer.encode("Once upon a time, there was a little dog named Max.")
    slot, _, answer, _ = run(engine, first, 8)
    # The next turn resends the conversation: the prompt, the answer, then new text.
    follow = [*first, *answer, *engine.tokenizer.encode(" Max liked to play", add_bos=False)]
    again, reused, tokens, logits = run(engine, follow, 8)
    # Every row the slot kept is reused: the prompt and the answer's tokens fed back (the last one never was).
    assert again == slot and reused == len(first) + 7
    _, _, expected_tokens, expected_logits = run(fresh, follow, 8)
    assert tokens == expected_tokens
    # Rows made in decode steps rather than in one prefill: equal to float rounding (and the same picks).
    assert (logits - expected_logits).abs().max().item() < 1e-3


def test_reuse_is_counted_and_skipped_where_rows_are_not_positions(gguf_files: dict[str, Path]) -> None:
    engine = Engine.open(gguf_files["pi-f32"], slots=1, ctx_size=128)
    ids = engine.tokenizer.encode("Lily found a red ball in the park.")
    slot = engine.submit(Request(ids, 1, GREEDY))
    assert engine.reused_tokens(slot) == 0
    engine.step()
    slot = engine.submit(Request(ids, 1, GREEDY))
    assert engine.reused_tokens(slot) == len(ids) - 1  # the last token is computed again, for its logits
    engine.erase(slot)  # a busy slot's tokens are its sequence's: kept
    engine.cancel(slot)
    assert engine.reused_tokens(engine.submit(Request(ids, 1, GREEDY))) == len(ids) - 1
    engine.cancel(slot)
    engine.erase(slot)
    assert engine.reused_tokens(engine.submit(Request(ids, 1, GREEDY))) == 0
    engine.cancel(slot)
    window = Engine.open(gguf_files["pi-f32"], slots=1, ctx_size=128, kv_policy=KVPolicy("window", 32))
    window.submit(Request(ids, 1, GREEDY))
    window.step()
    assert window.reused_tokens(window.submit(Request(ids, 1, GREEDY))) == 0


def test_a_chats_second_turn_prefills_only_its_new_tokens(gguf_files: dict[str, Path]) -> None:
    engine = Engine.open(gguf_files["pi-f32"], slots=2, ctx_size=256)
    with serve_in_thread(create_app(EngineWorker(engine), "tiny")) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        history = [{"role": "user", "content": "Tell me about Lily and her red ball in the park."}]
        first = client.chat.completions.create(model="tiny", messages=history, max_tokens=12, temperature=0)  # type: ignore[arg-type]
        history += [
            {"role": "assistant", "content": first.choices[0].message.content or ""},
            {"role": "user", "content": "And then?"},
        ]
        second = client.chat.completions.create(model="tiny", messages=history, max_tokens=12, temperature=0)  # type: ignore[arg-type]
    timings = second.model_extra["timings"]  # type: ignore[index]
    assert first.usage is not None and second.usage is not None
    # The first turn's prompt and most of its answer come from the cache; the new turn's words are computed.
    assert timings["cache_n"] >= first.usage.prompt_tokens
    assert timings["prompt_n"] == second.usage.prompt_tokens - timings["cache_n"] < second.usage.prompt_tokens / 2
    fresh = Engine.open(gguf_files["pi-f32"], slots=1, ctx_size=256)
    with serve_in_thread(create_app(EngineWorker(fresh), "tiny")) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        alone = client.chat.completions.create(model="tiny", messages=history, max_tokens=12, temperature=0)  # type: ignore[arg-type]
    assert alone.choices[0].message.content == second.choices[0].message.content


def test_a_new_conversation_takes_a_free_slot_and_alternating_ones_both_hit(gguf_files: dict[str, Path]) -> None:
    """Every prompt shares its BOS with every used slot: that alone must not evict another conversation's rows
    while a slot keeps nothing, nor the more recent one when all keep something."""
    engine = Engine.open(gguf_files["pi-f32"], slots=2, ctx_size=128)
    assert engine.tokenizer.add_bos
    a = engine.tokenizer.encode("Once upon a time, there was a little dog named Max.")
    b = engine.tokenizer.encode("Lily found a red ball in the park.")
    slot_a, _, answer_a, _ = run(engine, a, 4)
    slot_b, reused_b, answer_b, _ = run(engine, b, 4)
    assert slot_b != slot_a and reused_b == 0
    for _ in range(2):  # the two users' next turns, alternating: each finds its own rows
        a = [*a, *answer_a, *engine.tokenizer.encode(" Then", add_bos=False)]
        again_a, reused_a, answer_a, _ = run(engine, a, 4)
        b = [*b, *answer_b, *engine.tokenizer.encode(" Then", add_bos=False)]
        again_b, reused_b, answer_b, _ = run(engine, b, 4)
        assert (again_a, again_b) == (slot_a, slot_b) and reused_a > 10 and reused_b > 8
    # A third conversation with both slots keeping rows evicts the one kept longest ago (a's).
    third, _, _, _ = run(engine, engine.tokenizer.encode("Tom said"), 2)
    assert third == slot_a


def test_prompt_reuse_can_be_turned_off(gguf_files: dict[str, Path]) -> None:
    """Off, nothing tells one client how much of its prompt another sent: each prompt is computed whole."""
    engine = Engine.open(gguf_files["pi-f32"], slots=1, ctx_size=128, reuse_prompts=False)
    ids = engine.tokenizer.encode("Lily found a red ball in the park.")
    run(engine, ids, 2)
    assert run(engine, ids, 2)[1] == 0
