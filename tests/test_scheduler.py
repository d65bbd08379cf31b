"""Dynamic scheduling: the per-step split balances both sides; the neuron cache stays in budget and does not thrash."""

from __future__ import annotations

import torch

from qinfer_runtime.neuron_cache import CachePolicy, NeuronCache
from qinfer_runtime.split_cost import SplitCosts, balance, step_times

POLICY = CachePolicy(decay=0.8, margin=0.15, max_swaps=4, period=1)


def _consistent(cache: NeuronCache) -> None:
    occupied = cache.slot_neuron[cache.slot_neuron >= 0]
    assert occupied.unique().numel() == occupied.numel()
    assert torch.equal(torch.nonzero(cache.neuron_slot >= 0).flatten().sort().values, occupied.sort().values)
    for slot, neuron in enumerate(cache.slot_neuron.tolist()):
        if neuron >= 0:
            assert int(cache.neuron_slot[neuron]) == slot


def test_cache_never_exceeds_its_slots_under_random_activity() -> None:
    g = torch.Generator().manual_seed(0)
    cache = NeuronCache(200, 24, torch.arange(0, 40, 2), POLICY)
    for step in range(300):
        hot = torch.randperm(200, generator=g)[: 10 + step % 50]
        cache.observe(hot)
        slots, neurons = cache.rebalance()
        assert slots.numel() == neurons.numel() <= POLICY.max_swaps
        assert cache.resident <= cache.capacity == 24
        _consistent(cache)
    assert cache.swaps > 0


def test_hot_neurons_fill_free_slots_then_displace_cold_ones() -> None:
    cache = NeuronCache(100, 6, torch.tensor([0, 1, 2, 3]), POLICY)
    for _ in range(10):
        cache.observe(torch.tensor([0, 1, 50, 51, 52, 53]))
        cache.rebalance()
    resident = set(cache.slot_neuron.tolist())
    # 50..53 are hot: two took the free slots, two replaced the now-cold planned neurons 2 and 3; 0 and 1 stay.
    assert resident == {0, 1, 50, 51, 52, 53}


def test_hysteresis_keeps_equally_hot_neurons_from_swapping_back_and_forth() -> None:
    cache = NeuronCache(10, 2, torch.tensor([0, 1]), POLICY)
    for step in range(200):
        # Four neurons share the work equally, two at a time: none is hotter than a resident one by the margin.
        cache.observe(torch.tensor([0, 2]) if step % 2 else torch.tensor([1, 3]))
        cache.rebalance()
    assert cache.swaps == 0
    for _ in range(20):
        cache.observe(torch.tensor([2, 3]))
        cache.rebalance()
    assert set(cache.slot_neuron.tolist()) == {2, 3}
    assert cache.swaps == 2


def test_split_moves_with_active_counts_and_batch_size() -> None:
    # A CPU 10x slower per neuron read than the GPU, and far slower per FLOP; PCIe between the two.
    costs = SplitCosts(cpu_read=10e-9, cpu_flop=2e-9, gpu_read=1e-9, gpu_flop=1e-12, ship=30e-9)
    assert balance(costs, n_gpu=1200, n_cpu=100, batch=1) == 0  # both sides already take as long
    small, big = balance(costs, 900, 100, 1), balance(costs, 900, 100, 64)
    assert 0 < small < big  # at batch 64 the CPU's FLOPs dominate: ship more of its neurons to the GPU
    assert max(step_times(costs, 900, 100, 64, big)) < max(step_times(costs, 900, 100, 64, 0)) / 2
    assert balance(costs, n_gpu=5000, n_cpu=0, batch=1) < 0  # an idle CPU takes some GPU neurons
    for latency in (0.0, 5e-6):
        costs.ship_latency = latency
        for n_gpu, n_cpu, batch in ((900, 100, 64), (5000, 0, 1), (10, 3000, 4), (900, 100, 1)):
            best = balance(costs, n_gpu, n_cpu, batch)
            best_time = max(step_times(costs, n_gpu, n_cpu, batch, best))
            for m in range(-n_gpu, n_cpu + 1):
                assert best_time <= max(step_times(costs, n_gpu, n_cpu, batch, m)) + 1e-12
    assert balance(costs, 900, 100, 1) == 0  # a sync costs more than shipping saves at batch 1


def test_calibration_follows_measured_cpu_time_within_bounds() -> None:
    costs = SplitCosts(cpu_read=10e-9, cpu_flop=0.0, gpu_read=1e-9, gpu_flop=0.0, ship=30e-9)
    for _ in range(50):
        costs.calibrate(1000, 1, 2 * 1000 * 10e-9)
    assert abs(costs.cpu_scale - 2.0) < 1e-3
    for _ in range(50):
        costs.calibrate(1000, 1, 1.0)
    assert costs.cpu_scale == 8.0
