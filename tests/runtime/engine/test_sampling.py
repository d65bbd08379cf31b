"""Sampling's filters and draw against the plain definitions: a sort of every token, and observed frequencies."""

from __future__ import annotations

import pytest
import torch

from qinfer.runtime.engine.sampling import NUCLEUS_FEW, SamplingParams, candidates, draw, sample_next


def kept_by_sorting(scores: torch.Tensor, top_k: int, top_p: float) -> tuple[set[int], set[int]]:
    """The tokens top-k and top-p keep, from a float64 sort of every token, and those whose place is too close to
    call in float32 (the mass before them within 1e-5 of top_p)."""
    n = scores.numel()
    order = torch.argsort(scores.double(), descending=True)[: top_k if 0 < top_k < n else n]
    probs = torch.softmax(scores.double()[order], 0)
    before = probs.cumsum(0) - probs
    kept = before < top_p
    kept[0] = True
    return set(order[kept].tolist()), set(order[(before - top_p).abs() < 1e-5].tolist())


@pytest.mark.parametrize("n", [5, 300, 5000])
@pytest.mark.parametrize("spread", [0.3, 8.0])
@pytest.mark.parametrize("top_p", [0.0, 1e-9, 0.3, 0.9, 0.999, 1.0])
def test_candidates_are_what_a_sort_of_every_token_keeps(n: int, spread: float, top_p: float) -> None:
    scores = torch.randn(n, generator=torch.Generator().manual_seed(n)) * spread
    scores[n // 2] = float("-inf")  # a token a grammar ruled out
    for top_k in sorted({0, 1, 3, 40, NUCLEUS_FEW - 1, NUCLEUS_FEW, NUCLEUS_FEW + 1, n - 1, n, n + 5}):
        values, ids = candidates(scores, top_k, top_p)
        ids = torch.arange(n) if ids is None else ids
        assert len(values) >= 1 and torch.equal(values, scores[ids])
        want, close = kept_by_sorting(scores, top_k, top_p)
        assert set(ids.tolist()) ^ want <= close, (top_k, top_p)
        if top_p < 1.0:
            assert values.tolist() == sorted(values.tolist(), reverse=True)


def test_top_k_keeps_exactly_k_of_scores_tied_at_the_kth() -> None:
    values, ids = candidates(torch.tensor([1.0, 2.0, 2.0, 2.0, 0.0]), 2, 1.0)
    assert values.tolist() == [2.0, 2.0] and ids is not None and set(ids.tolist()) < {1, 2, 3}
    values, ids = candidates(torch.tensor([1.0, 2.0, 2.0, 2.0, 0.0]), 2, 0.9)
    assert values.tolist() == [2.0, 2.0] and ids is not None and set(ids.tolist()) < {1, 2, 3}


def test_a_nucleus_past_the_first_few_tokens_is_found_among_all() -> None:
    # Equal scores: top_p = 0.5 keeps half of them, far more than NUCLEUS_FEW.
    n = 8 * NUCLEUS_FEW
    values, ids = candidates(torch.zeros(n), 0, 0.5)
    assert ids is not None and len(set(ids.tolist())) == len(values) == n // 2


def test_draw_gives_each_index_its_probability_and_never_one_of_none() -> None:
    probs = torch.tensor([0.0, 0.5, 0.0, 0.25, 0.25, 0.0])  # sums exact in binary
    uniforms = torch.rand(20000, generator=torch.Generator().manual_seed(0), dtype=torch.float64).tolist()
    counts = torch.bincount(torch.tensor([draw(probs, u) for u in uniforms]), minlength=6)
    assert counts[[0, 2, 5]].tolist() == [0, 0, 0]
    assert torch.allclose(counts.double() / 20000, probs.double(), atol=0.015)
    # The ends of the uniform range, and the points where the running sum steps: the index the step belongs to.
    assert [draw(probs, u) for u in (0.0, 0.5 - 1e-12, 0.5, 0.75, 1.0 - 2**-53)] == [1, 1, 3, 4, 4]


def test_sampling_draws_again_what_it_drew_for_the_same_seed() -> None:
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(0))

    def draws(seed: int) -> list[int]:
        generator = torch.Generator().manual_seed(seed)
        return [sample_next(logits, SamplingParams(1.0, 0, 0.9), generator) for _ in range(50)]

    assert draws(1) == draws(1) != draws(2)
