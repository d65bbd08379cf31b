"""The admission loop shared by run and serve: sequences join free slots between steps and leave when finished, a
refused request fails alone and is told before any step that could fail, and a failed step frees every slot."""

from __future__ import annotations

import pytest

from qinfer.runtime.engine.admission import Admission, Sequence
from qinfer.runtime.engine.engine import Request, StepOutput
from qinfer.runtime.engine.sampling import SamplingParams
from qinfer.runtime.engine.token_text import TokenText


class FakeEngine:
    """Two slots; a prompt of [0] is refused; each step gives every running slot its next token, ending at 3; a
    group is two steps' outputs."""

    def __init__(self, fail_step: bool = False) -> None:
        self.active: dict[int, int] = {}
        self.fail_step = fail_step
        self.cancelled: list[int] = []

    def free_slots(self) -> int:
        return 2 - len(self.active)

    def submit(self, request: Request) -> int:
        if request.prompt_ids == [0]:
            raise ValueError("refused")
        slot = min({0, 1} - self.active.keys())
        self.active[slot] = 0
        return slot

    def reused_tokens(self, slot: int) -> int:
        return 0

    def cancel(self, slot: int) -> None:
        self.cancelled.append(slot)
        self.active.pop(slot, None)

    def step(self, group: bool = False) -> list[StepOutput]:
        if self.fail_step:
            raise RuntimeError("the step failed")
        if group:
            return self.step() + self.step()
        outputs = []
        for slot in sorted(self.active):
            self.active[slot] += 1
            done = self.active[slot] == 3
            outputs.append(StepOutput(slot, self.active[slot], done, "length" if done else None))
            if done:
                del self.active[slot]
        return outputs


def sequence(prompt: list[int]) -> Sequence:
    return Sequence(Request(prompt, 3, SamplingParams()), TokenText(lambda ids: " ".join(map(str, ids)), prompt))


def test_sequences_join_between_steps_and_leave_when_done() -> None:
    admission: Admission[Sequence] = Admission(FakeEngine())  # type: ignore[arg-type]
    first, second, third = sequence([1]), sequence([2]), sequence([3])
    for s in (first, second, third):
        admission.add(s)
    finished = []
    while admission.busy:
        finished += [d.sequence for d in admission.step() if d.finished]
    assert finished == [first, second, third]  # the third waited for a slot, then ran
    assert [s.output.tokens for s in finished] == [[1, 2, 3]] * 3


def test_each_delivery_of_a_group_counts_the_tokens_up_to_it() -> None:
    """A group brings a sequence several tokens in one step: each delivery's count is its own (a response cut at a
    stop string reports the tokens up to it)."""
    admission: Admission[Sequence] = Admission(FakeEngine())  # type: ignore[arg-type]
    admission.add(sequence([1]))
    counts = []
    while admission.busy:
        counts.append([d.generated for d in admission.step()])
    assert counts == [[1, 2], [3]]


def test_a_refusal_is_told_before_a_step_that_fails() -> None:
    engine = FakeEngine(fail_step=True)
    admission: Admission[Sequence] = Admission(engine)  # type: ignore[arg-type]
    good, refused = sequence([1]), sequence([0])
    admission.add(good)
    admission.add(refused)
    told = admission.step()
    assert [(d.sequence, str(d.refused)) for d in told] == [(refused, "refused")]
    with pytest.raises(RuntimeError, match="the step failed"):
        admission.step()
    assert admission.fail_running() == [good] and engine.cancelled == [0] and not admission.busy
