"""GPU/CPU split on a simulated GPU (a second CPU tensor set): the merged result equals the all-CPU sparse one."""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from qinfer.core.errors import UserError
from qinfer.core.kv_policy import F32_KV
from qinfer.formats.gpuidx import GpuIndex, gpuidx_path_for, write_gpuidx
from qinfer.planner.budget import GIB
from qinfer.planner.make_plan import PlanOptions, dry_run_account
from qinfer.prep.convert.quantize import quantize_gguf
from qinfer.runtime.engine.engine import Engine
from qinfer.runtime.engine.generate import generate, generate_many
from qinfer.runtime.engine.sampling import SamplingParams
from qinfer.runtime.ffn import hybrid
from qinfer.runtime.ffn.hybrid import HybridRunner
from qinfer.runtime.ffn.neuron_cache import CachePolicy
from qinfer.runtime.ffn.sparse import activations
from qinfer.runtime.ffn.split_cost import SplitCosts
from qinfer.runtime.kernels.weight_rows import weighted_row_sum
from qinfer.runtime.kv.batch import TokenBatch
from qinfer.runtime.kv.cache import KVCache
from qinfer.runtime.model.graph_step import GRAPHS_VARIABLE, GraphStep, GraphSteps
from tests.support.cli_in_process import run_in_process
from tests.support.devices import device
from tests.support.fake_activation import write_power_law_activation

# The split's device side: the GPU where there is one (the kernels compiled for it take its tensors alone), else a
# simulated one on the CPU, the kernels in Triton's interpreter.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PROMPTS = ["Once upon a time", "The dog ran fast, and the cat slept.", "Tom said"]
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture
def model(tmp_path: Path, gguf_files: dict[str, Path]) -> Path:
    path = tmp_path / "tiny.powerinfer.gguf"
    shutil.copy(gguf_files["pi-f32"], path)
    write_power_law_activation(tmp_path / "activation")
    return path


def _budget_gib(model: Path, slots: int, share: float) -> float:
    """Room for the dense parts and `share` of the FFN neurons."""
    _, acct = dry_run_account(model, 1 << 40, PlanOptions(ctx_size=96, batch=slots))
    return (acct.dense + acct.ffn_total * share) / GIB


def _hybrid(engine: Engine) -> HybridRunner:
    assert engine.runtime is not None
    runner = engine.runtime.forward.ffn
    assert isinstance(runner, HybridRunner)
    return runner


@pytest.mark.parametrize("schedule", ["static", "dynamic"])
def test_split_merge_equals_all_cpu(model: Path, schedule: str) -> None:
    cpu_only = Engine.open(model, slots=3, ctx_size=96)
    expected = [r.tokens for r in generate_many(cpu_only, PROMPTS, 16, GREEDY, ignore_eos=True)]
    budget = _budget_gib(model, 3, 0.3)
    split = Engine.open(model, slots=3, ctx_size=96, vram_budget_gib=budget, schedule=schedule, device="cpu")
    runner = _hybrid(split)
    assert [r.tokens for r in generate_many(split, PROMPTS, 16, GREEDY, ignore_eos=True)] == expected
    # The device side really computed neurons; with the static split the CPU did too (dynamic may ship them all).
    assert sum(s.device for s in runner.last) > 0
    assert schedule == "dynamic" or sum(s.cpu for s in runner.last) > 0
    resident = sum(c.resident for c in runner.caches)
    assert 0 < resident < sum(w.neurons for w in runner.layers)
    assert gpuidx_path_for(model).exists()


def test_split_logits_match_cpu_logits_whichever_way_neurons_move(model: Path) -> None:
    cpu_only = Engine.open(model, ctx_size=96)
    split = Engine.open(
        model, ctx_size=96, vram_budget_gib=_budget_gib(model, 1, 0.3), schedule="dynamic", device="cpu"
    )
    runner = _hybrid(split)
    ids = torch.tensor(cpu_only.tokenizer.encode(PROMPTS[1]))
    a, b = KVCache(cpu_only.forward.cfg, 96), KVCache(split.forward.cfg, 96)
    # A CPU 1000x slower than modelled ships CPU neurons to the device; one 1000x faster takes device neurons.
    # Its time is the FLOPs', which shipping saves (reading the rows, which shipping needs too, takes 1000x less).
    gpu, cpu = device("gpu", 1e9, 1e12, pcie=1e10), device("cpu", 1e12, 1e9)
    for scale, moved in ((1000.0, 1), (1e-3, -1)):
        runner.costs = SplitCosts(1.0, 100.0, gpu, cpu, cpu_scale=scale)
        runner.costs.calibrate = lambda *_: None  # type: ignore[method-assign] - keep the forced scale
        with torch.inference_mode():
            cpu_only.forward(ids[:4], 0, a), split.forward(ids[:4], 0, b)
            for j in range(4, len(ids)):
                expected = cpu_only.forward(ids[j : j + 1], j, a)
                assert torch.allclose(split.forward(ids[j : j + 1], j, b), expected, rtol=0, atol=1e-4)
        # The plan gives the first layer no GPU neuron, and so no slots: it has none to give the CPU.
        movable = runner.last if moved > 0 else runner.last[1:]
        assert runner.caches[0].capacity == 0 and all(s.moved * moved > 0 for s in movable)


@pytest.mark.parametrize("rows", ["f32", "Q4_0"])
def test_in_kernel_split_logits_match_cpu_logits(model: Path, rows: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The device side selecting and computing its neurons in the hot-FFN kernels (Triton's interpreter here, the
    GPU's compiler on a GPU) while the CPU computes the rest: the same logits as all on the CPU."""
    pytest.importorskip("triton")
    if rows == "Q4_0":
        model = quantize_gguf(model, model.with_name("tiny.q4.powerinfer.gguf"), "Q4_0").outfile
        # The kernels multiply float x by the dequantized rows, as torch's path does; the CPU's row kernels
        # quantize x to Q8_0 first (as llama.cpp does), which moves logits by about 1e-2.
        monkeypatch.setenv("QINFER_NATIVE", "0")
    cuda = torch.cuda.is_available()
    cpu_only = Engine.open(model, ctx_size=96, ffn="sparse")
    budget = _budget_gib(model, 1, 0.4)  # the engine has one slot
    split = Engine.open(model, ctx_size=96, vram_budget_gib=budget, schedule="static", device=DEVICE)
    runner = _hybrid(split)
    assert runner.in_kernel == cuda  # a simulated device takes torch's ops unless asked
    runner.in_kernel = True
    ids = torch.tensor(cpu_only.tokenizer.encode(PROMPTS[1]))
    a = KVCache(cpu_only.forward.cfg, 96, types=F32_KV)
    b = KVCache(split.forward.cfg, 96, device=split.forward.device, types=F32_KV)
    # A GPU keeps its cache in f16 whatever the types say (as the planner budgets it).
    tolerance = 1e-2 if cuda else 1e-4
    with torch.inference_mode():
        cpu_only.forward(ids[:4], 0, a), split.forward(ids[:4], 0, b)
        for j in range(4, 10):
            expected = cpu_only.forward(ids[j : j + 1], j, a)
            assert torch.allclose(split.forward(ids[j : j + 1], j, b).cpu(), expected, rtol=0, atol=tolerance)
    assert sum(s.device for s in runner.last) > 0 and sum(s.cpu for s in runner.last) > 0


def test_in_kernel_split_computes_a_prompt_on_the_calling_thread(model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernels' split does its host work on the calling thread, so a prompt's CPU part runs there too: on a
    thread of its own it left an idle OpenMP team beside the caller's, whose barriers then slept (a wake each) where
    the two teams outnumber the cores, and each decode step's host part took twice as long."""
    budget = _budget_gib(model, 1, 0.4)
    split = Engine.open(model, ctx_size=96, vram_budget_gib=budget, schedule="static", device=DEVICE)
    runner = _hybrid(split)
    runner.in_kernel = True
    computed_on: list[int] = []

    def activations(*args: object) -> torch.Tensor:
        computed_on.append(threading.get_ident())
        return hybrid_activations(*args)

    hybrid_activations = hybrid.activations
    monkeypatch.setattr(hybrid, "activations", activations)
    ids = torch.tensor(split.tokenizer.encode(PROMPTS[1]))
    with torch.inference_mode():
        split.forward(ids, 0, KVCache(split.forward.cfg, 96, device=split.forward.device, types=F32_KV))
    # Each layer's device part and CPU part, both on this thread.
    assert len(computed_on) == 2 * split.forward.cfg.layers and set(computed_on) == {threading.get_ident()}


def test_in_kernel_split_decodes_several_sequences(model: Path) -> None:
    """Three sequences in one step, each token's selection its own inside the kernels: each decodes its greedy
    tokens as all on the CPU. The synth predictors are exact, so a stricter threshold than the file's leaves out
    neurons that do fire: a neuron selected for one token but computed for all would show."""
    pytest.importorskip("triton")
    cpu_only = Engine.open(model, slots=3, ctx_size=96, ffn="sparse")
    cpu_only.forward.native = None  # the native step keeps the file's threshold
    budget = _budget_gib(model, 3, 0.4)
    split = Engine.open(model, slots=3, ctx_size=96, vram_budget_gib=budget, schedule="static", device=DEVICE)
    runner = _hybrid(split)
    runner.in_kernel = True
    for sparse in (cpu_only.forward.ffn, runner):
        sparse.threshold = 2.0
    expected = [r.tokens for r in generate_many(cpu_only, PROMPTS, 12, GREEDY, ignore_eos=True)]
    assert [r.tokens for r in generate_many(split, PROMPTS, 12, GREEDY, ignore_eos=True)] == expected


@pytest.mark.parametrize("share", [0.4, 1.05])
def test_graphed_step_gives_the_eager_split_logits(model: Path, share: float) -> None:
    """The decode step as a fixed program (captured in CUDA graphs on a GPU, run eagerly on the simulated device):
    attention over every cache row under a mask, the host's part between a layer's two graphs, and with every
    neuron resident one graph per token: the logits of the eager split, step by step, one sequence and three."""
    pytest.importorskip("triton")
    cuda = torch.cuda.is_available()
    budget = _budget_gib(model, 3, share)
    split = Engine.open(model, slots=3, ctx_size=96, vram_budget_gib=budget, schedule="static", device=DEVICE)
    runner, forward = _hybrid(split), split.forward
    runner.in_kernel = True
    graphs = forward.graphs if cuda else GraphSteps(forward, runner, capture=False)
    assert graphs is not None
    assert any(runner.cold(i) for i in range(forward.cfg.layers)) == (share < 1)
    ids = torch.tensor(split.tokenizer.encode(PROMPTS[1]))
    caches = [KVCache(forward.cfg, 96, slots=3, device=forward.device, types=F32_KV) for _ in range(2)]
    tolerance = 2e-3 if cuda else 1e-5
    with torch.inference_mode():
        forward.graphs = None
        for slot, start in enumerate((0, 5, 2)):
            for cache in caches:
                forward(ids[start : start + 4], 0, cache, slot)
        for j in range(4, 9):
            one = TokenBatch.decode([int(ids[j])], [j], [0])
            three = TokenBatch.decode([int(t) for t in ids[j : j + 3]], [j, j, j], [0, 1, 2])
            for batch in (one, three):
                forward.graphs = None
                expected = forward.forward(batch, caches[0]).cpu()
                forward.graphs = graphs
                assert graphs.takes(batch, caches[1])
                got = forward.forward(batch, caches[1])
                assert got.device.type == "cpu" and torch.allclose(got, expected, rtol=0, atol=tolerance)
    assert sorted(graphs.steps) == [1, 3]
    for step in graphs.steps.values():
        # Every neuron resident: no host piece, so one graph a token; else a host wait for each cold layer.
        assert bool(step.host) == (share < 1)
        assert step.graphs is None if not cuda else len(step.graphs) == 1 + 2 * len(step.host)


@pytest.mark.parametrize("steps", ["eager", "graphed", "alternating"])
def test_the_dynamic_schedule_in_the_kernels_gives_the_cpu_logits_while_neurons_move(model: Path, steps: str) -> None:
    """Promotions chosen each step, copied between steps into the slots the kernels (and a GPU's graphs) read: the
    logits stay the all-CPU ones as neurons move in and out, eagerly, through the graphed program (captured on a
    GPU), and with the two alternating, so that promotions one kind of step chose reach the other's slots."""
    pytest.importorskip("triton")
    cuda = torch.cuda.is_available()
    cpu_only = Engine.open(model, ctx_size=96, ffn="sparse")
    budget = _budget_gib(model, 1, 0.4)
    split = Engine.open(model, ctx_size=96, vram_budget_gib=budget, schedule="dynamic", device=DEVICE)
    runner, forward = _hybrid(split), split.forward
    runner.in_kernel = True
    for cache in runner.caches:
        cache.policy = CachePolicy(decay=0.5, margin=0.05, period=1)
    graphs = forward.graphs if cuda else GraphSteps(forward, runner, capture=False)
    ids = torch.tensor(cpu_only.tokenizer.encode(PROMPTS[1]))
    a = KVCache(cpu_only.forward.cfg, 96, types=F32_KV)
    b = KVCache(forward.cfg, 96, device=forward.device, types=F32_KV)
    with torch.inference_mode():
        forward.graphs = None
        cpu_only.forward(ids[:3], 0, a), forward(ids[:3], 0, b)
        for j in range(3, 14):
            graphed = steps == "graphed" or (steps == "alternating" and j % 2 == 1)
            forward.graphs = graphs if graphed else None
            expected = cpu_only.forward(ids[j : j + 1], j, a)
            got = forward(ids[j : j + 1], j, b).cpu()
            assert torch.allclose(got, expected, rtol=0, atol=2e-3 if cuda else 1e-4)
    assert sum(c.swaps for c in runner.caches) > 0


def test_graphs_that_cannot_be_recorded_leave_the_step_eager(
    model: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A capture that fails (a CUDA build that refuses some op in a graph) is said once; that step and the rest run
    eagerly, with the same logits."""
    pytest.importorskip("triton")
    budget = _budget_gib(model, 1, 0.4)
    split = Engine.open(model, ctx_size=96, vram_budget_gib=budget, schedule="static", device=DEVICE)
    runner, forward = _hybrid(split), split.forward
    runner.in_kernel = True
    graphs = GraphSteps(forward, runner, capture=True)

    def refuse(step: GraphStep) -> None:
        step._eager()  # the warm-up before capture, which writes the step's KV rows
        raise RuntimeError("operation not permitted when stream is capturing\nmore detail")

    monkeypatch.setattr(GraphStep, "_record", refuse)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", object)
    ids = torch.tensor(split.tokenizer.encode(PROMPTS[1]))
    a, b = (KVCache(forward.cfg, 96, device=forward.device, types=F32_KV) for _ in range(2))
    with torch.inference_mode():
        forward(ids[:4], 0, a), forward(ids[:4], 0, b)
        for j in range(4, 7):
            forward.graphs = None
            expected = forward(ids[j : j + 1], j, a)
            forward.graphs = graphs
            assert torch.equal(forward(ids[j : j + 1], j, b), expected)
    assert graphs.failed == "operation not permitted when stream is capturing" and not graphs.steps
    assert capsys.readouterr().err.count("decoding without CUDA graphs") == 1


def _second_layer_planned_empty(source: Path, tmp_path: Path) -> Path:
    """The tiny PowerInfer model with a plan that puts 64 of the first layer's neurons on the GPU and none of the
    second's, in 1 GiB (room to spare)."""
    model = tmp_path / "tiny.powerinfer.gguf"
    shutil.copy(source, model)
    write_power_law_activation(tmp_path / "activation")
    first = np.zeros(256, np.int32)
    first[:64] = 1
    write_gpuidx(gpuidx_path_for(model), GpuIndex(1, (first, np.zeros(256, np.int32))))
    return model


def test_a_layer_without_gpu_neurons_prefills(tmp_path: Path, gguf_files: dict[str, Path]) -> None:
    """A plan may give a layer no GPU neuron: its empty slots add nothing to a prompt, in f16 rows too."""
    model = _second_layer_planned_empty(gguf_files["pi-f16"], tmp_path)
    split = Engine.open(model, ctx_size=96, vram_budget_gib=1.0, schedule="static", device="cpu")
    assert [c.resident for c in _hybrid(split).caches] == [64, 0]
    expected = generate(Engine.open(model, ctx_size=96, ffn="sparse"), PROMPTS[1], 8, GREEDY, ignore_eos=True)
    assert generate(split, PROMPTS[1], 8, GREEDY, ignore_eos=True).tokens == expected.tokens


def test_the_spare_goes_to_the_layers_whose_gpu_can_select(tmp_path: Path, gguf_files: dict[str, Path]) -> None:
    """Under the dynamic schedule the budget's spare fills the slots of a layer the plan gave GPU neurons (and so
    its predictor there); one it gave none gets no slots, since nothing on the GPU could select among them."""
    model = _second_layer_planned_empty(gguf_files["pi-f16"], tmp_path)
    split = Engine.open(model, ctx_size=96, vram_budget_gib=1.0, schedule="dynamic", device="cpu")
    assert [(c.resident, c.capacity) for c in _hybrid(split).caches] == [(64, 256), (0, 0)]


def test_a_layer_without_a_gpu_predictor_takes_no_promotions_in_the_kernels(
    tmp_path: Path, gguf_files: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A runner given slots for a layer with no predictor on the device (the loader gives none) promotes nothing
    there on the kernels' path: the device could not select them, and the host would skip them as resident, so the
    neurons promoted would be computed by neither side."""
    pytest.importorskip("triton")
    # The runner is swapped in after loading: on a GPU the graphs made at load would still step the loader's.
    monkeypatch.setenv(GRAPHS_VARIABLE, "0")
    model = _second_layer_planned_empty(gguf_files["pi-f32"], tmp_path)
    split = Engine.open(model, ctx_size=96, vram_budget_gib=1.0, schedule="dynamic", device=DEVICE)
    planned = _hybrid(split)
    assert split.runtime is not None
    resident = [torch.arange(64), torch.empty(0, dtype=torch.long)]
    runner = HybridRunner(
        planned.layers, planned.threshold, planned.device, resident, [256, 256], [True, False], planned.costs,
        dynamic=True, in_kernel=True,
    )  # fmt: skip
    split.runtime.forward.ffn = runner
    for cache in runner.caches:
        cache.policy = CachePolicy(decay=0.5, margin=0.05, period=1)
    expected = generate(Engine.open(model, ctx_size=96, ffn="sparse"), PROMPTS[1], 12, GREEDY, ignore_eos=True)
    assert generate(split, PROMPTS[1], 12, GREEDY, ignore_eos=True).tokens == expected.tokens
    assert runner.caches[0].swaps > 0 and runner.caches[1].capacity == 256 and runner.caches[1].resident == 0


@pytest.mark.parametrize(("rows", "schedule"), [("f16", "static"), ("f16", "dynamic"), ("Q4_0", "static")])
def test_a_prompts_cpu_part_leaves_the_resident_neurons_out(
    tmp_path: Path, gguf_files: dict[str, Path], monkeypatch: pytest.MonkeyPatch, rows: str, schedule: str
) -> None:
    """In f16 and Q4_0 rows a prompt's CPU part goes through the row kernel over the neurons not in the device's
    slots (after the dynamic schedule moved some in), and with the device's part it sums every neuron's output."""
    model = tmp_path / "tiny.powerinfer.gguf"
    if rows == "f16":
        shutil.copy(gguf_files["pi-f16"], model)
    else:
        quantize_gguf(gguf_files["pi-f16"], model, rows)
    write_power_law_activation(tmp_path / "activation")
    budget = _budget_gib(model, 1, 0.4)
    split = Engine.open(model, ctx_size=96, vram_budget_gib=budget, schedule=schedule, device="cpu")
    runner = _hybrid(split)
    planned = [c.slot_neuron.clone() for c in runner.caches]
    generate(split, PROMPTS[1], 24, GREEDY, ignore_eos=True)
    moved = any(not torch.equal(p, c.slot_neuron) for p, c in zip(planned, runner.caches, strict=True))
    assert moved == (schedule == "dynamic")
    given: list[torch.Tensor] = []

    def kernel_ffn(w: object, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor | None:
        given.append(ids)
        out = hybrid_kernel_ffn(w, x, ids)
        assert out is not None  # the row kernel took the rows
        return out

    hybrid_kernel_ffn = hybrid.kernel_ffn
    monkeypatch.setattr(hybrid, "kernel_ffn", kernel_ffn)
    x = torch.randn(40, split.forward.cfg.hidden, generator=torch.Generator().manual_seed(0))
    for layer, (w, cache) in enumerate(zip(runner.layers, runner.caches, strict=True)):
        out = runner(layer, x, x, prefill=True)
        expected = weighted_row_sum(activations(w.form, x, w.gate, w.up), w.down_t)
        # Q4_0 rows take their input in Q8_0 blocks on the CPU's side only (the simulated device expands them).
        assert (out - expected).abs().max() <= (1e-5 if rows == "f16" else 1e-2) * expected.abs().max()
        held = cache.slot_neuron[cache.slot_neuron >= 0]
        assert 0 < given[-1].numel() < w.neurons
        assert sorted(torch.cat((given[-1], held)).tolist()) == list(range(w.neurons))


def test_neuron_rows_on_device_stay_within_the_budget(model: Path) -> None:
    budget = _budget_gib(model, 1, 0.5)
    split = Engine.open(model, ctx_size=96, vram_budget_gib=budget, schedule="dynamic", device="cpu")
    runner = _hybrid(split)
    assert split.runtime is not None and split.runtime.plan is not None
    plan = split.runtime.plan
    dense = plan.vram_total - plan.vram["ffn neurons"]
    generate(split, PROMPTS[0], 24, GREEDY, ignore_eos=True)
    assert dense + runner.device_bytes() <= budget * GIB
    assert runner.device_bytes() >= plan.vram["ffn neurons"]  # the planned neurons, plus spare slots if any


def test_stale_or_mismatched_gpuidx_is_a_clear_error(model: Path) -> None:
    budget = _budget_gib(model, 1, 0.3)
    Engine.open(model, ctx_size=96, vram_budget_gib=budget, device="cpu")
    changed = r"stale: vram budget was [0-9.]+ GiB, is now [0-9.]+ GiB; rebuild it with --reset-gpu-index"
    with pytest.raises(UserError, match=changed):
        Engine.open(model, ctx_size=96, vram_budget_gib=budget * 1.1, device="cpu")
    Engine.open(model, ctx_size=96, vram_budget_gib=budget * 1.1, device="cpu", reset_gpu_index=True)
    write_gpuidx(gpuidx_path_for(model), GpuIndex(0, (np.zeros(100, np.int32), np.zeros(100, np.int32))))
    with pytest.raises(UserError, match="FFN sizes 2 x 100, this one has 2 x 256"):
        Engine.open(model, ctx_size=96, vram_budget_gib=budget, device="cpu")


def test_missing_activation_names_the_profile_command(model: Path) -> None:
    shutil.rmtree(model.parent / "activation")
    with pytest.raises(UserError, match=r"`qinfer prep profile` \(a SwiGLU model: `qinfer prep calibrate`\)"):
        Engine.open(model, ctx_size=96, vram_budget_gib=1.0, device="cpu")


def test_without_a_gpu_the_budget_only_shapes_the_plan(model: Path) -> None:
    engine = Engine.open(model, ctx_size=96, vram_budget_gib=_budget_gib(model, 1, 0.3))
    assert engine.runtime is not None and engine.runtime.plan is not None
    if not torch.cuda.is_available():
        assert "no GPU: the plan is kept for a GPU machine; everything runs sparse on the CPU" in engine.runtime.notes
        assert engine.forward.device.type == "cpu"
    disabled = Engine.open(model, ctx_size=96, vram_budget_gib=1.0, disable_gpu_index=True, device="cpu")
    assert sum(c.capacity for c in _hybrid(disabled).caches) == 0
    if not torch.cuda.is_available():  # no plan was made or read: none is kept
        auto = Engine.open(model, ctx_size=96, vram_budget_gib=1.0, disable_gpu_index=True).runtime
        assert auto is not None and "no GPU: everything runs sparse on the CPU" in auto.notes
    assert (
        generate(disabled, PROMPTS[0], 8, GREEDY, ignore_eos=True).tokens
        == generate(Engine.open(model, ctx_size=96), PROMPTS[0], 8, GREEDY, ignore_eos=True).tokens
    )


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "qinfer", *args], capture_output=True, text=True, timeout=300)


def test_run_command_plans_on_the_spot_and_decodes_in_parallel(model: Path) -> None:
    budget = f"{_budget_gib(model, 2, 0.3):.6f}"
    args = ["run", "-m", str(model), "-n", "6", "--temp", "0", "--ignore-eos", "-c", "96", "--vram-budget", budget]
    result = _cli(*args, "--parallel", "2", "--schedule", "dynamic")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert [line[:4] for line in lines] == ["[0] ", "[1] "] and lines[0][4:] == lines[1][4:]  # greedy: same text
    assert "plan:" in result.stderr and "decode: 12 tokens" in result.stderr
    assert gpuidx_path_for(model).exists()
    # The rest through the entry point in this process: the separate process above has shown the real start.
    stale = run_in_process(*args[:-1], "0.5", "--parallel", "2")
    assert stale.returncode == 2 and stale.stderr.strip().count("\n") == 0
    assert "stale" in stale.stderr and "--reset-gpu-index" in stale.stderr
    assert run_in_process(*args[:-1], "0.5", "--parallel", "2", "--reset-gpu-index").returncode == 0


def test_run_command_without_activation_statistics_names_the_profile_command(model: Path) -> None:
    shutil.rmtree(model.parent / "activation")
    result = run_in_process("run", "-m", str(model), "-n", "4", "--vram-budget", "1")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "qinfer prep profile" in result.stderr


@pytest.mark.parametrize("in_kernel", [False, True], ids=["torch ops", "kernels"])
def test_dynamic_cache_swaps_keep_device_rows_equal_to_the_file(model: Path, in_kernel: bool) -> None:
    """On the kernels' path the swaps chosen in a step are copied at the layer's next one (`promote`): once they
    are, the slots, the device's map of them and the host's view of residency agree with the file and the cache."""
    if in_kernel:
        pytest.importorskip("triton")
    budget = _budget_gib(model, 1, 0.3)
    split = Engine.open(model, ctx_size=96, vram_budget_gib=budget, schedule="dynamic", device=DEVICE)
    runner = _hybrid(split)
    runner.in_kernel = in_kernel
    generate(split, PROMPTS[1], 40, GREEDY, ignore_eos=True)
    assert sum(c.swaps for c in runner.caches) > 0
    for layer in range(len(runner.layers)):
        runner.promote(layer)
        runner.await_promoted(layer)  # a GPU copies them on a side stream
    for i, (w, slots, cache) in enumerate(zip(runner.layers, runner.slots, runner.caches, strict=True)):
        assert torch.equal(runner.slot_neuron[i].cpu().long(), cache.slot_neuron)
        assert torch.equal(runner.resident[i], cache.neuron_slot >= 0)
        used = torch.nonzero(cache.slot_neuron >= 0).flatten()
        neurons = cache.slot_neuron[used]
        up, down_t = slots.up.cpu(), slots.down_t.cpu()
        assert torch.equal(up[used], w.up[neurons]) and torch.equal(down_t[used], w.down_t[neurons])
        assert slots.gate is not None and w.gate is not None and torch.equal(slots.gate.cpu()[used], w.gate[neurons])
        assert cache.resident <= cache.capacity == slots.up.shape[0]
