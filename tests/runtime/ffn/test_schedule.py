"""The adaptive FFN schedule (ffn/schedule.py): one token keeps the predictor; a batch whose union covers the FFN
reads the dense rows where reading is what costs, and keeps the predictor where each token's few neurons save the
compute; the native step follows its choice layer by layer, and a layer it sends dense gives the dense FFN."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from qinfer.planner.device_profiles import DeviceProfile
from qinfer.runtime.ffn.runners import SparseRunner
from qinfer.runtime.ffn.schedule import FFNSchedule, LayerCost
from qinfer.runtime.kv.batch import TokenBatch
from qinfer.runtime.kv.cache import make_kv_cache
from qinfer.runtime.model.forward import TransformerForward
from qinfer.runtime.model.loader import RuntimeOptions, load_forward
from qinfer.runtime.model.model_file import open_model
from tests.runtime.kernels.test_decode_layer import F32

# A 7B layer in f16: 11008 neurons of 4096, a predictor of rank 1024.
LAYER = LayerCost(
    neurons=11008, gate_bytes=8192.0, up_down_bytes=16384.0, neuron_flops=8192.0, predictor_bytes=1024 * 8192.0 +
    11008 * 2048.0, predictor_flops=2.0 * 1024 * (4096 + 11008),
)  # fmt: skip
MEMORY_BOUND = DeviceProfile("slow-memory", "cpu", "", 64, 1.0 * 2**30, 1e15, 0.0, 0.0)
COMPUTE_BOUND = DeviceProfile("slow-compute", "cpu", "", 64, 1e15, 1e9, 0.0, 0.0)


def schedule_of(cpu: DeviceProfile) -> FFNSchedule:
    schedule = FFNSchedule([], cpu)
    schedule.costs, schedule.shares = [LAYER], [None]
    return schedule


def test_one_token_and_an_unmeasured_layer_keep_the_predictor() -> None:
    schedule = schedule_of(MEMORY_BOUND)
    assert schedule.sparse(0, 32)  # nothing measured yet
    schedule.observe(0, 32, 11008)
    assert schedule.shares[0] == pytest.approx(1.0)
    assert schedule.sparse(0, 1)


def test_a_covering_union_reads_dense_rows_where_reading_costs() -> None:
    """A 10% share per token: 4 tokens' union is a third of the FFN (the predictor saves), 32 tokens' is 97% (the
    predictor's own rows are then the extra); where compute is what costs, the predictor's per-token selection
    saves 90% of the gate products at any batch."""
    memory, compute = schedule_of(MEMORY_BOUND), schedule_of(COMPUTE_BOUND)
    for schedule in (memory, compute):
        schedule.observe(0, 4, round(11008 * (1 - 0.9**4)))
        assert schedule.shares[0] == pytest.approx(0.1, rel=1e-3)
    assert memory.sparse(0, 4) and not memory.sparse(0, 32)
    assert compute.sparse(0, 4) and compute.sparse(0, 32)
    assert LAYER.dense_seconds(32, 0.1, MEMORY_BOUND) < LAYER.sparse_seconds(32, 0.1, MEMORY_BOUND)


class Always:
    """A schedule that always answers `sparse`, and records what it is told."""

    def __init__(self, sparse: bool):
        self.answer = sparse
        self.seen: list[tuple[int, int, int]] = []

    def sparse(self, layer: int, tokens: int) -> bool:
        return self.answer

    def observe(self, layer: int, tokens: int, union: int) -> None:
        self.seen.append((layer, tokens, union))


def batch_logits(forward: TransformerForward) -> torch.Tensor:
    """Three prompts in three slots, then one batched decode step."""
    cache = make_kv_cache(forward.cfg, 32, 3, types=F32)
    with torch.inference_mode():
        for slot, prompt in enumerate(([5, 17, 300], [42, 9], [77, 128, 3, 250])):
            forward.forward(TokenBatch.prompt(torch.tensor(prompt), 0, slot), cache)
        return forward.forward(TokenBatch.decode([61, 19, 400], [3, 2, 4], [0, 1, 2]), cache)


@pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None, reason="no C compiler to build the kernel")
def test_the_native_step_follows_the_schedule(gguf_files: dict[str, Path]) -> None:
    """`--ffn auto` gives a predictor-sparse model the schedule, `--ffn sparse` none; with a threshold no neuron
    reaches, a layer the schedule keeps sparse reads no rows, and one it sends dense computes the dense FFN (the
    batch's logits are the dense runner's); every layer reports the union it read."""
    model = open_model(gguf_files["pi-f16"])
    auto = load_forward(model, RuntimeOptions(ffn="auto")).forward
    assert isinstance(auto, TransformerForward) and isinstance(auto.ffn, SparseRunner)
    assert isinstance(auto.ffn.schedule, FFNSchedule) and auto.native is not None
    assert auto.native.schedule is auto.ffn.schedule
    assert load_forward(model, RuntimeOptions(ffn="sparse")).forward.ffn.schedule is None  # type: ignore[attr-defined]
    dense = load_forward(model, RuntimeOptions(ffn="dense")).forward
    assert isinstance(dense, TransformerForward)
    reference = batch_logits(dense)
    auto.ffn.threshold = 1e9
    for answer in (False, True):
        schedule = Always(answer)
        auto.native.schedule = schedule
        logits = batch_logits(auto)
        assert [(layer, tokens) for layer, tokens, _ in schedule.seen] == [(0, 3), (1, 3)]
        unions = [union for *_, union in schedule.seen]
        assert all(u == 0 for u in unions) if answer else all(0 < u <= auto.cfg.ffn for u in unions)
        assert ((logits - reference).abs().max() <= 1e-4 * reference.abs().max()) == (not answer)
