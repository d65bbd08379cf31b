"""The engine: batched decode over slots at different positions equals decoding each prompt alone (mixed steps,
with prompts in chunks: test_mixed_step.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from qinfer.core.errors import UserError
from qinfer.runtime.engine.engine import Engine, Request, StepOutput
from qinfer.runtime.engine.generate import generate, generate_many
from qinfer.runtime.engine.sampling import SamplingParams
from qinfer.runtime.kv.batch import TokenBatch
from tests.support.logits_hook import LogitsHook

PROMPTS = ["Once upon a time", "The dog ran fast, and the cat slept.", "Tom said", "One day a little girl named Lily"]
GREEDY = SamplingParams(temperature=0.0)


@pytest.mark.parametrize("ffn", ["dense", "sparse"])
@pytest.mark.parametrize("file", ["pi-f32", "pi-f16"])
def test_batched_decode_equals_each_prompt_alone(gguf_files: dict[str, Path], ffn: str, file: str) -> None:
    """pi-f32 decodes through torch, pi-f16 through the native layer step (one call a step for the batch); both
    with the default f16 cache."""
    alone = Engine.open(gguf_files[file], ctx_size=96, ffn=ffn)
    expected = [generate(alone, p, 20, GREEDY, ignore_eos=True).tokens for p in PROMPTS]
    together = Engine.open(gguf_files[file], slots=3, ctx_size=96, ffn=ffn)
    # Four prompts on three slots: the fourth starts when a slot frees, so lengths and positions differ.
    results = generate_many(together, PROMPTS, 20, GREEDY, ignore_eos=True)
    assert [r.tokens for r in results] == expected
    assert len({len(e) for e in expected}) == 1 and len(expected[0]) == 20


def test_slots_fill_free_and_finish(gguf_files: dict[str, Path]) -> None:
    engine = Engine.open(gguf_files["pi-f16"], slots=2, ctx_size=32)
    ids = engine.tokenizer.encode(PROMPTS[1])
    a = engine.submit(Request(ids, 3, GREEDY, ignore_eos=True))
    b = engine.submit(Request(ids, 100, GREEDY, ignore_eos=True))
    assert engine.free_slots() == 0
    with pytest.raises(UserError, match="slots are busy"):
        engine.submit(Request(ids, 3, GREEDY))
    with pytest.raises(UserError, match="context holds 32"):
        Engine.open(gguf_files["pi-f16"], ctx_size=32).submit(Request(list(range(40)), 3, GREEDY))
    finished: dict[int, tuple[int, str | None]] = {}
    counts = {a: 0, b: 0}
    while engine.free_slots() < 2:
        for out in engine.step():
            counts[out.slot] += out.token is not None
            if out.finished:
                finished[out.slot] = (counts[out.slot], out.reason)
    assert finished[a] == (3, "length")
    # Slot b runs until all 32 positions hold tokens; the token sampled from the last one still comes out.
    assert finished[b] == (32 - len(ids) + 1, "length")
    c = engine.submit(Request(ids, 2, GREEDY))
    engine.cancel(c)
    assert engine.free_slots() == 2 and engine.step() == []


def test_eos_stops_a_sequence_unless_ignored(gguf_files: dict[str, Path]) -> None:
    engine = Engine.open(gguf_files["pi-f32"], ctx_size=64)
    eos = engine.tokenizer.eos_id
    assert eos is not None
    eos_first = LogitsHook(lambda logits: logits.index_fill(0, torch.tensor([eos]), 1e9))
    for ignore, expected in ((False, StepOutput(0, None, True, "stop")), (True, StepOutput(0, eos, False, None))):
        request = Request(engine.tokenizer.encode(PROMPTS[0]), 10, GREEDY, ignore_eos=ignore, constraint=eos_first)  # type: ignore[arg-type]
        slot = engine.submit(request)
        assert engine.step() == [expected]
        engine.cancel(slot)


def test_a_prompt_computes_the_head_for_its_last_token_alone(gguf_files: dict[str, Path]) -> None:
    """The engine asks a prompt's forward for the last token's logits only: the row the full head gives (to the
    float rounding of a product of one token rather than of many)."""
    engine = Engine.open(gguf_files["pi-f16"], ctx_size=64)
    ids = torch.tensor(engine.tokenizer.encode(PROMPTS[1]))
    with torch.inference_mode():
        full = engine.forward.forward(TokenBatch.prompt(ids, 0), engine.cache)
        last = engine.forward.forward(TokenBatch.prompt(ids, 0), engine.cache, [len(ids) - 1])
    assert last.shape == (1, full.shape[1])
    assert (last[0] - full[-1]).abs().max() <= 1e-5 * full[-1].abs().max()
