"""Predictor ranks per layer: sized by how much of the layer fires and how concentrated the firing is."""

from __future__ import annotations

import math
from dataclasses import dataclass

RANK_STEP = 32  # ranks stay multiples of 32 so that Q4_0 blocks fit
BUDGET_SHARE = 0.1  # all predictors together within 10% of the model's FFN parameters


@dataclass(frozen=True)
class RankPlan:
    ranks: list[int]
    params: int  # predictor parameters, all layers
    budget: int  # BUDGET_SHARE of the FFN parameters (3 * E * F per layer)

    @property
    def within_budget(self) -> bool:
        return self.params <= self.budget


def max_rank(hidden: int, ffn: int) -> int:
    # Twice the hidden size already lets relu(fc1 h) carry any linear map of h exactly (relu(z) - relu(-z) = z).
    return max(RANK_STEP, RANK_STEP * (min(2 * hidden, ffn) // RANK_STEP))


def auto_ranks(density: list[float], top20_share: list[float], hidden: int, ffn: int) -> RankPlan:
    """Ranks in proportion to density / top20_share: a layer where more neurons fire, and firing is spread
    over more of them, has more to predict. The total stays within the budget whenever rank 32 per layer does;
    when even that is over (tiny hidden sizes: 32 * (E + F) > 0.3 * E * F), every layer gets 32 and
    `within_budget` says so."""
    per_rank = hidden + ffn
    budget = int(BUDGET_SHARE * 3 * hidden * ffn * len(density))
    weights = [max(d, 1e-6) / max(s, 1e-6) for d, s in zip(density, top20_share, strict=True)]
    ideal = [budget / per_rank * w / sum(weights) for w in weights]
    top = max_rank(hidden, ffn)
    ranks = [min(top, max(RANK_STEP, RANK_STEP * math.floor(r / RANK_STEP))) for r in ideal]
    # Flooring leaves budget unused: hand it out in steps of 32 to the layers furthest below their ideal rank.
    while True:
        spare = budget - sum(ranks) * per_rank
        room = [i for i, r in enumerate(ranks) if r + RANK_STEP <= top and RANK_STEP * per_rank <= spare]
        if not room:
            break
        neediest = max(room, key=lambda i: ideal[i] - ranks[i])
        ranks[neediest] += RANK_STEP
    return RankPlan(ranks, sum(ranks) * per_rank, budget)


def fixed_ranks(rank: int, layers: int, hidden: int, ffn: int) -> RankPlan:
    per_rank = hidden + ffn
    return RankPlan([rank] * layers, rank * per_rank * layers, int(BUDGET_SHARE * 3 * hidden * ffn * layers))
