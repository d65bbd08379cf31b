"""The planned split of a mixture of experts: resident experts on the device side, the rest on the CPU, summed
with the router's weights. On a machine without a GPU the device is the CPU simulating one (and CUDA where there
is one), so every machine checks what is computed where and that the sum is the CPU runner's."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from qinfer.core.expert_routing import route
from qinfer.core.kv_policy import F32_KV
from qinfer.formats.gpuidx import read_gpuidx
from qinfer.planner.budget import GIB
from qinfer.planner.make_plan import PlanOptions, dry_run_account
from qinfer.prep.convert.convert import convert
from qinfer.prep.convert.quantize import quantize_gguf
from qinfer.prep.synth.moe import MOE_FAMILIES
from qinfer.runtime.ffn.expert_split import ExpertSplit
from qinfer.runtime.ffn.experts import ExpertRunner, ExpertWeights, SwiGLU
from qinfer.runtime.kernels.weight_rows import linear
from qinfer.runtime.kv.batch import TokenBatch
from qinfer.runtime.kv.cache import KVCache
from qinfer.runtime.model.forward import expert_runner
from qinfer.runtime.model.loader import RuntimeOptions, load_forward
from qinfer.runtime.model.model_file import open_model
from tests.support.fake_activation import write_expert_activation
from tests.support.runtime_logits import hf_ids, reference_logits

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


class Recording(ExpertWeights):
    """ExpertWeights that remember which experts the CPU was asked for."""

    asked: list[int]

    def expert(self, j: int) -> SwiGLU:
        self.asked.append(j)
        return super().expert(j)


def _recording(runner: ExpertRunner) -> list[Recording]:
    layers = []
    for w in runner.layers:
        layer = Recording(w.router, w.gate, w.up, w.down, w.shared, w.shared_gate)
        object.__setattr__(layer, "asked", [])
        layers.append(layer)
    return layers


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", MOE_FAMILIES)
@pytest.mark.parametrize("tokens", [1, 9])
def test_the_split_sums_what_the_cpu_runner_computes(
    moe: dict[str, dict[str, Path]], family: str, device: str, tokens: int
) -> None:
    model = open_model(moe[family]["dense-f32"])
    assert model.config.experts is not None
    runner = expert_runner(model, model.config.experts)
    x = torch.randn(tokens, model.config.hidden, generator=torch.Generator().manual_seed(tokens))
    chosen = [route(linear(x, w.router), runner.experts.used, runner.experts.norm_top_k)[0] for w in runner.layers]
    # The first token's first expert on the device, so both sides have work in every layer.
    resident = [torch.tensor([int(c[0, 0])]) for c in chosen]
    layers = _recording(runner)
    split = ExpertSplit(ExpertRunner(list(layers), runner.experts), torch.device(device), resident)
    for layer in layers:
        layer.asked.clear()  # residency reads the resident experts once, to copy them
    for i in range(model.config.layers):
        expected = runner(i, x, x, tokens > 1)
        got = split(i, x.to(device), x.to(device), tokens > 1)
        assert got.device.type == device
        assert (got.cpu() - expected).abs().max().item() < 1e-5 * max(1.0, expected.abs().max().item())
        # The CPU computes exactly the chosen experts that are not resident.
        assert sorted(layers[i].asked) == sorted(set(chosen[i].flatten().tolist()) - set(resident[i].tolist()))


def test_resident_experts_and_the_router_live_on_the_device_side(moe: dict[str, dict[str, Path]]) -> None:
    model = open_model(moe["qwen2moe"]["dense-f32"])
    assert model.config.experts is not None
    runner = expert_runner(model, model.config.experts)
    split = ExpertSplit(runner, torch.device(DEVICES[-1]), [torch.tensor([1, 3]), torch.tensor([], dtype=torch.long)])
    assert [split.resident_count(i) for i in range(2)] == [2, 0]
    assert torch.equal(split.resident[0][3].up.cpu(), runner.layers[0].up[3])
    assert split.routers[1].device.type == DEVICES[-1]
    shared, gate = split.shared[0]
    assert shared is not None and gate is not None and gate.device.type == DEVICES[-1]


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_a_planned_run_keeps_the_plans_experts_on_the_device_side_and_equals_transformers(
    moe: dict[str, dict[str, Path]], family: str, tmp_path: Path
) -> None:
    path = tmp_path / f"{family}.gguf"
    shutil.copy(moe[family]["dense-f32"], path)
    experts = open_model(path).config.experts
    assert experts is not None
    counts = [[(7 * j + 3 * i) % experts.count + 1 for j in range(experts.count)] for i in range(2)]
    write_expert_activation(tmp_path / "activation", counts, sum(counts[0]))
    _, acct = dry_run_account(path, 1 << 40, PlanOptions(ctx_size=64))  # the run's context
    budget = acct.dense + 3 * int(acct.neuron_bytes[0]) + int(acct.neuron_bytes[0]) // 2
    loaded = load_forward(open_model(path), RuntimeOptions(vram_budget_gib=budget / GIB, device="cpu"), ctx_size=64)
    split = loaded.forward.ffn
    assert isinstance(split, ExpertSplit) and loaded.plan is not None
    assert loaded.plan.gpuidx_path is not None
    masks = read_gpuidx(loaded.plan.gpuidx_path).gpu_idx
    assert [sorted(split.resident[i]) for i in range(2)] == [np.flatnonzero(m).tolist() for m in masks]
    assert sum(split.resident_count(i) for i in range(2)) == 3
    ids = hf_ids(moe[family]["model"], "Once upon a time, Lily found a red ball in the park.")[:12]
    cache = KVCache(loaded.forward.cfg, 64, types=F32_KV)
    with torch.inference_mode():
        parts = [loaded.forward.forward(TokenBatch.prompt(torch.tensor(ids[:8]), 0), cache)]
        parts += [loaded.forward.forward(TokenBatch.decode([t], [8 + j], [0]), cache) for j, t in enumerate(ids[8:])]
    assert (torch.cat(parts) - reference_logits(moe[family]["model"], ids)).abs().max().item() < 1e-4


@pytest.mark.parametrize("outtype", ["f16", "Q4_0"])
def test_one_token_through_the_native_expert_call_leaves_the_resident_experts_out(
    moe: dict[str, dict[str, Path]], outtype: str, tmp_path: Path
) -> None:
    """A decode token's CPU half goes through the one native call over the chosen experts, which must skip the
    resident ones: counted twice or not at all, the sum would differ from the CPU runner's by a whole expert."""
    f16 = convert(moe["qwen3moe"]["model"], tmp_path / "f16.gguf", None, "f16").outfile
    path = f16 if outtype == "f16" else quantize_gguf(f16, tmp_path / "q4.gguf", outtype).outfile
    model = open_model(path)
    assert model.config.experts is not None
    runner = expert_runner(model, model.config.experts)
    x = torch.randn(1, model.config.hidden, generator=torch.Generator().manual_seed(3))
    chosen = [route(linear(x, w.router), runner.experts.used, runner.experts.norm_top_k)[0] for w in runner.layers]
    split = ExpertSplit(runner, torch.device(DEVICES[-1]), [c[0, :1] for c in chosen])
    for i in range(model.config.layers):
        expected = runner(i, x, x, False)
        assert (split(i, x, x, False) - expected).abs().max().item() < 1e-3 * expected.abs().max().item()
