"""Greedy decode steps in groups (Engine.step(group=True), one native call for several steps): the same outputs, step
by step, as single steps, ending where a single step would end a sequence, or after the step under way where a request
arrives; no group where a sequence samples, follows a grammar, or a schedule weighs each step of several sequences."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from qinfer.runtime.engine import engine as engine_module
from qinfer.runtime.engine.engine import Engine, Request, StepOutput
from qinfer.runtime.engine.sampling import SamplingParams
from qinfer.runtime.engine.worker import EngineWorker
from qinfer.runtime.ffn.schedule import FFNSchedule
from qinfer.runtime.kv.batch import TokenBatch
from qinfer.runtime.model.forward import TransformerForward
from tests.support.logits_hook import LogitsHook

PROMPTS = ["Once upon a time", "The dog ran fast, and the cat slept.", "Tom said"]
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(autouse=True)
def long_groups(monkeypatch: pytest.MonkeyPatch) -> None:
    """Groups of GROUP_STEPS whatever a step takes on this machine: the tests ask for groups, not a pace."""
    monkeypatch.setattr(engine_module, "GROUP_SECONDS", 1e9)


def outputs(engine: Engine, requests: list[Request], group: bool) -> tuple[list[StepOutput], int]:
    """Every output of the requests run together to their ends, in order, and the calls of `step` it took."""
    for request in requests:
        engine.submit(request)
    out, calls = [], 0
    while engine.active_slots():
        out += engine.step(group=group)
        calls += 1
    return out, calls


def requests(engine: Engine, ignore_eos: bool = True, sampling: SamplingParams = GREEDY) -> list[Request]:
    ids = [engine.tokenizer.encode(p) for p in PROMPTS]
    # Different lengths and one that runs into the end of the context (48 positions).
    return [
        Request(ids[0], 30, GREEDY, ignore_eos=ignore_eos),
        Request(ids[1], 60, sampling, seed=3, ignore_eos=ignore_eos),
        Request(ids[2], 11, GREEDY, ignore_eos=ignore_eos),
    ]


@pytest.mark.parametrize(("file", "ffn", "chunk"), [("dense-f16", "dense", 512), ("pi-f16", "sparse", 512),
                                                    ("dense-f16", "dense", 1)])  # fmt: skip
def test_groups_give_the_single_steps_outputs(gguf_files: dict[str, Path], file: str, ffn: str, chunk: int) -> None:
    """Three sequences of different lengths, one to the end of the context; with prompts a token a step, a step that
    carries a prompt's token stays single."""
    single = Engine.open(gguf_files[file], slots=3, ctx_size=48, ffn=ffn, prefill_chunk=chunk)
    expected, steps = outputs(single, requests(single), group=False)
    grouped = Engine.open(gguf_files[file], slots=3, ctx_size=48, ffn=ffn, prefill_chunk=chunk)
    got, calls = outputs(grouped, requests(grouped), group=True)
    assert got == expected
    assert [o.reason for o in expected if o.finished] == ["length"] * 3
    assert calls < steps / (3 if chunk > 1 else 1)  # groups of several steps were taken


def test_an_end_of_text_ends_a_group_where_it_ends_the_sequence(
    gguf_files: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A token the model gives mid-way, made the end of text: the sequence stops there with "stop", grouped or not,
    and a sequence that ignores it runs to its length."""
    probe = Engine.open(gguf_files["dense-f16"], slots=3, ctx_size=48)
    plain, _ = outputs(probe, requests(probe), group=False)
    end = [o.token for o in plain if o.slot == 0][7]
    monkeypatch.setattr(probe.tokenizer, "end_ids", frozenset({end}))
    runs = []
    for group in (False, True):
        engine = Engine.open(gguf_files["dense-f16"], slots=3, ctx_size=48)
        engine.tokenizer = probe.tokenizer
        reqs = requests(engine, ignore_eos=False)
        reqs[2].ignore_eos = True
        runs.append(outputs(engine, reqs, group))
    (single, steps), (grouped, calls) = runs
    assert grouped == single and calls < steps
    first = [o for o in single if o.slot == 0]
    assert len(first) == 8 and first[-1] == StepOutput(0, None, True, "stop")
    assert [o for o in single if o.slot == 2][-1].reason == "length"
    assert len([o for o in single if o.slot == 2]) == 11


def test_no_group_where_a_sequence_samples_or_follows_a_grammar(
    gguf_files: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    taken: list[int] = []
    real = TransformerForward.greedy_steps

    def counted(self: TransformerForward, *args: object) -> object:
        taken.append(1)
        return real(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(TransformerForward, "greedy_steps", counted)
    sampled = Engine.open(gguf_files["dense-f16"], slots=3, ctx_size=48)
    outputs(sampled, requests(sampled, sampling=SamplingParams(temperature=0.8)), group=True)
    constrained = Engine.open(gguf_files["dense-f16"], slots=1, ctx_size=48)
    any_token = LogitsHook(lambda logits: logits)
    request = Request(constrained.tokenizer.encode(PROMPTS[0]), 20, GREEDY, constraint=any_token)  # type: ignore[arg-type]
    outputs(constrained, [request], group=True)
    assert taken == []


def test_a_schedule_groups_one_sequences_steps_alone(gguf_files: dict[str, Path]) -> None:
    """--ffn auto's schedule picks sparse or dense rows for each step of several sequences: the native call declines
    a group once for each such width (three running, then two), and the engine steps those one at a time. One
    sequence's steps always get the sparse rows, so it groups them, with the single steps' outputs, and the schedule
    ends where the single steps leave it."""
    widths: list[int] = []
    real = TransformerForward.greedy_steps

    def counted(self: TransformerForward, batch: TokenBatch, *args: object) -> object:
        widths.append(batch.tokens.shape[0])
        return real(self, batch, *args)  # type: ignore[arg-type]

    def shortened(engine: Engine) -> list[Request]:
        """The second request ends first (its long prompt would keep it to the end of the context), the third next:
        the first runs on alone for its last 19 tokens."""
        reqs = requests(engine)
        reqs[1].max_tokens = 5
        return reqs

    single = Engine.open(gguf_files["pi-f16"], slots=3, ctx_size=48, ffn="auto")
    expected, steps = outputs(single, shortened(single), group=False)
    grouped = Engine.open(gguf_files["pi-f16"], slots=3, ctx_size=48, ffn="auto")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(TransformerForward, "greedy_steps", counted)
        got, calls = outputs(grouped, shortened(grouped), group=True)
    assert got == expected and calls < steps - 10
    assert widths[:2] == [3, 2] and len(widths) > 2 and set(widths[2:]) == {1}
    assert learnt(single) == learnt(grouped)


def learnt(engine: Engine) -> list[float | None]:
    """Per layer, the share of the FFN a token fires as the engine's schedule last measured it."""
    forward = engine.forward
    assert isinstance(forward, TransformerForward) and forward.native is not None
    schedule = forward.native.schedule
    assert isinstance(schedule, FFNSchedule)
    return schedule.shares


def test_a_group_lasts_about_its_seconds(gguf_files: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """The next group's steps are GROUP_SECONDS at the last step's pace, at most GROUP_STEPS."""
    engine = Engine.open(gguf_files["dense-f16"], slots=1, ctx_size=128)
    sizes: list[int] = []
    real = TransformerForward.greedy_steps

    def sized(self: TransformerForward, batch: object, cache: object, steps: int, *rest: object) -> object:
        sizes.append(steps)
        return real(self, batch, cache, steps, *rest)  # type: ignore[arg-type]

    monkeypatch.setattr(TransformerForward, "greedy_steps", sized)
    outputs(engine, [Request(engine.tokenizer.encode(PROMPTS[0]), 40, GREEDY, ignore_eos=True)], group=True)
    assert sizes[0] == engine_module.GROUP_STEPS and sum(sizes) > 30
    monkeypatch.setattr(engine_module, "GROUP_SECONDS", 0.0)
    sizes.clear()
    outputs(engine, [Request(engine.tokenizer.encode(PROMPTS[0]), 10, GREEDY, ignore_eos=True)], group=True)
    assert sizes == []


@pytest.mark.parametrize(("slots", "longest"), [(4, 1), (3, 10)])
def test_an_arrival_ends_each_group_after_the_step_under_way_while_a_slot_is_free(
    gguf_files: dict[str, Path], monkeypatch: pytest.MonkeyPatch, slots: int, longest: int
) -> None:
    """With Engine.arrival set (a request has come) every group ends after its first step where a slot is free to
    take the request. With the three slots busy the first group runs until the shortest sequence ends (its 11th
    token, the prompt's step gave the first); the groups after it have a free slot. The outputs are the single
    steps' either way."""
    sizes: list[int] = []
    real = TransformerForward.greedy_steps

    def sized(self: TransformerForward, *args: object) -> object:
        grouped = real(self, *args)  # type: ignore[arg-type]
        sizes.append(len(grouped[0]))  # type: ignore[index]
        return grouped

    single = Engine.open(gguf_files["dense-f16"], slots=slots, ctx_size=48)
    expected, _ = outputs(single, requests(single), group=False)
    engine = Engine.open(gguf_files["dense-f16"], slots=slots, ctx_size=48)
    engine.arrival.value = 1
    monkeypatch.setattr(TransformerForward, "greedy_steps", sized)
    got, _ = outputs(engine, requests(engine), group=True)
    assert got == expected and max(sizes) == longest and set(sizes[1:]) == {1}


def test_the_server_worker_signals_an_arrival_until_it_takes_the_request(gguf_files: dict[str, Path]) -> None:
    engine = Engine.open(gguf_files["dense-f16"], slots=1, ctx_size=48)
    worker = EngineWorker(engine)

    async def run() -> list[int]:
        job = worker.submit(Request(engine.tokenizer.encode(PROMPTS[0]), 4, GREEDY))
        seen = [engine.arrival.value]
        worker.start()
        while not (await job.events.get()).finished:
            pass
        return [*seen, engine.arrival.value]

    try:
        assert asyncio.run(run()) == [1, 0]
    finally:
        worker.stop()
