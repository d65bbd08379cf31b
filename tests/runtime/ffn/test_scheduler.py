"""Dynamic scheduling: the per-step split balances both sides; the neuron cache stays in budget and does not thrash."""

from __future__ import annotations

import pytest
import torch

from qinfer.planner.time_model import seconds
from qinfer.runtime.ffn.neuron_cache import CachePolicy, NeuronCache
from qinfer.runtime.ffn.split_cost import SplitCosts, balance, step_times
from tests.support.devices import device

POLICY = CachePolicy(decay=0.8, margin=0.15, max_swaps=4, period=1)


def selection(*ids: int | torch.Tensor, neurons: int) -> torch.Tensor:
    """The bool mask over `neurons` that selects `ids`."""
    mask = torch.zeros(neurons, dtype=torch.bool)
    for i in ids:
        mask[i] = True
    return mask


def _consistent(cache: NeuronCache) -> None:
    occupied = cache.slot_neuron[cache.slot_neuron >= 0]
    assert occupied.unique().numel() == occupied.numel()
    assert torch.equal(torch.nonzero(cache.neuron_slot >= 0).flatten().sort().values, occupied.sort().values)
    for slot, neuron in enumerate(cache.slot_neuron.tolist()):
        if neuron >= 0:
            assert int(cache.neuron_slot[neuron]) == slot


def test_a_step_decays_every_score_and_adds_to_the_selected_ones() -> None:
    cache = NeuronCache(5, 2, torch.tensor([0]), POLICY)
    expected = cache.scores * POLICY.decay
    expected[[1, 3]] += 1.0 - POLICY.decay
    cache.observe(selection(1, 3, neurons=5))
    assert torch.allclose(cache.scores, expected) and cache.scores[1] > 0 and cache.scores[0] > 0


def test_cache_never_exceeds_its_slots_under_random_activity() -> None:
    g = torch.Generator().manual_seed(0)
    cache = NeuronCache(200, 24, torch.arange(0, 40, 2), POLICY)
    for step in range(300):
        hot = torch.randperm(200, generator=g)[: 10 + step % 50]
        cache.observe(selection(hot, neurons=200))
        slots, neurons = cache.rebalance()
        assert slots.numel() == neurons.numel() <= POLICY.max_swaps
        assert cache.resident <= cache.capacity == 24
        _consistent(cache)
    assert cache.swaps > 0


def test_hot_neurons_fill_free_slots_then_displace_cold_ones() -> None:
    cache = NeuronCache(100, 6, torch.tensor([0, 1, 2, 3]), POLICY)
    for _ in range(10):
        cache.observe(selection(0, 1, 50, 51, 52, 53, neurons=100))
        cache.rebalance()
    resident = set(cache.slot_neuron.tolist())
    # 50..53 are hot: two took the free slots, two replaced the now-cold planned neurons 2 and 3; 0 and 1 stay.
    assert resident == {0, 1, 50, 51, 52, 53}


def test_hysteresis_keeps_equally_hot_neurons_from_swapping_back_and_forth() -> None:
    cache = NeuronCache(10, 2, torch.tensor([0, 1]), POLICY)
    for step in range(200):
        # Four neurons share the work equally, two at a time: none is hotter than a resident one by the margin.
        cache.observe(selection(0, 2, neurons=10) if step % 2 else selection(1, 3, neurons=10))
        cache.rebalance()
    assert cache.swaps == 0
    for _ in range(20):
        cache.observe(selection(2, 3, neurons=10))
        cache.rebalance()
    assert set(cache.slot_neuron.tolist()) == {2, 3}
    assert cache.swaps == 2


def swaps_one_by_one(cache: NeuronCache) -> list[tuple[int, int]]:
    """The (slot, neuron) swaps of the policy as it reads: outsiders hottest first, each to the next free slot, else
    in place of the coldest resident left where it beats that one by the margin, until one does not."""
    scores, slot_neuron = cache.scores.tolist(), cache.slot_neuron.tolist()
    outside = sorted((n for n in range(len(scores)) if int(cache.neuron_slot[n]) < 0), key=lambda n: -scores[n])
    candidates = [n for n in outside[: cache.policy.max_swaps] if scores[n] > 0]
    free = [slot for slot, n in enumerate(slot_neuron) if n < 0]
    coldest = sorted((slot for slot, n in enumerate(slot_neuron) if n >= 0), key=lambda slot: scores[slot_neuron[slot]])
    swaps = []
    for c in candidates:
        if free:
            swaps.append((free.pop(0), c))
        elif coldest and scores[c] > scores[slot_neuron[coldest[0]]] + cache.policy.margin:
            swaps.append((coldest.pop(0), c))
        else:
            break
    return swaps


@pytest.mark.parametrize("capacity, resident", [(24, 24), (24, 20), (24, 0), (300, 250)])
def test_rebalance_makes_the_swaps_of_the_policy_one_by_one(capacity: int, resident: int) -> None:
    g = torch.Generator().manual_seed(capacity + resident)
    cache = NeuronCache(200, capacity, torch.randperm(200, generator=g)[:resident], CachePolicy(max_swaps=8))
    for _ in range(20):
        # Distinct scores, so that no two neurons tie (a sort may break a tie either way), half of them too cold to
        # be a candidate at all.
        cache.scores = (torch.randperm(200, generator=g).float() - 100) / 200
        want = swaps_one_by_one(cache)
        slots, neurons = cache.rebalance()
        assert list(zip(slots.tolist(), neurons.tolist(), strict=True)) == want
        _consistent(cache)


def costs_for(latency: float = 0.0) -> SplitCosts:
    """A neuron of 1000 bytes and 200 FLOPs a token: 10 ns to read on the CPU and 1 ns on the GPU, 2 ns and 1 ps a
    token to compute, 30 ns across PCIe."""
    return SplitCosts(1000, 200, gpu=device("gpu", 1e12, 2e14, 1000 / 30e-9, latency), cpu=device("cpu", 1e11, 1e11))


def test_costs_are_the_planners() -> None:
    """A neuron's time is the planner's: the slower of reading and computing, on each side."""
    costs = costs_for()
    assert costs.cpu_per_neuron(1) == pytest.approx(10e-9) and costs.cpu_per_neuron(64) == pytest.approx(128e-9)
    assert costs.cpu_per_neuron(64) == pytest.approx(float(seconds(1000, 64 * 200, costs.cpu)))
    assert costs.gpu_per_neuron(64) == pytest.approx(1e-9) and costs.ship == pytest.approx(30e-9)


def test_split_moves_with_active_counts_and_batch_size() -> None:
    costs = costs_for()
    assert balance(costs, n_gpu=1000, n_cpu=100, batch=1) == 0  # both sides already take as long
    # At batch 1 the CPU's time is the read, which shipping needs as well: nothing to gain by it.
    assert balance(costs, 900, 100, 1) == 0
    small, big = balance(costs, 900, 100, 8), balance(costs, 900, 100, 64)
    assert 0 < small < big  # at batch 64 the CPU's FLOPs dominate: ship more of its neurons to the GPU
    assert max(step_times(costs, 900, 100, 64, big)) < max(step_times(costs, 900, 100, 64, 0)) / 2
    assert balance(costs, n_gpu=5000, n_cpu=0, batch=1) < 0  # an idle CPU takes some GPU neurons
    for latency in (0.0, 5e-6):
        costs = costs_for(latency)
        for n_gpu, n_cpu, batch in ((900, 100, 64), (5000, 0, 1), (10, 3000, 4), (900, 100, 1)):
            best = balance(costs, n_gpu, n_cpu, batch)
            best_time = max(step_times(costs, n_gpu, n_cpu, batch, best))
            for m in range(-n_gpu, n_cpu + 1):
                assert best_time <= max(step_times(costs, n_gpu, n_cpu, batch, m)) + 1e-12
    assert balance(costs, 900, 100, 1) == 0  # a sync costs more than shipping saves at batch 1


def test_calibration_follows_measured_cpu_time_within_bounds() -> None:
    costs = costs_for()
    for _ in range(50):
        costs.calibrate(1000, 1, 2 * 1000 * 10e-9)
    assert abs(costs.cpu_scale - 2.0) < 1e-3
    for _ in range(50):
        costs.calibrate(1000, 1, 1.0)
    assert costs.cpu_scale == 8.0
