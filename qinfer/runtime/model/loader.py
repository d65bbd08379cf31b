"""Choose and build a model's runtime: its forward class, the FFN runner (dense, sparse, hybrid) and the device.

With a VRAM budget the planner's `.gpuidx` (made on the spot when missing) says which neurons start on the GPU
and whether the dense parts go there; budget left over after the plan becomes spare neuron-cache slots for the
dynamic schedule. Without a GPU the plan is still made or checked, and everything runs sparse on the CPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from qinfer.core.architectures import architecture
from qinfer.core.errors import UserError
from qinfer.core.kv_policy import KVPolicy, KVTypes
from qinfer.core.model_spec import Experts
from qinfer.planner.budget import GIB
from qinfer.planner.device_profiles import DEFAULT_CPU, load_profile
from qinfer.planner.model_layout import ModelLayout
from qinfer.runtime.ffn.expert_split import ExpertSplit
from qinfer.runtime.ffn.hybrid import HybridRunner, require_split_support
from qinfer.runtime.ffn.runners import DenseRunner, Selector, SparseRunner
from qinfer.runtime.ffn.schedule import FFNSchedule
from qinfer.runtime.ffn.sparse import FFNWeights
from qinfer.runtime.ffn.split_cost import SplitCosts
from qinfer.runtime.kernels import row_kernels
from qinfer.runtime.model.falcon import FalconForward
from qinfer.runtime.model.forward import TransformerForward, expert_runner, ffn_weights
from qinfer.runtime.model.llama import LlamaForward
from qinfer.runtime.model.model_file import ModelFile
from qinfer.runtime.model.opt import OPTForward

if TYPE_CHECKING:
    from qinfer.planner.make_plan import Plan, PlanOptions

FFN_MODES = ("auto", "sparse", "dense", "oracle")
SCHEDULES = ("auto", "static", "dynamic")


# The forward of each decoder block layout that the architecture table names (Architecture.block).
FORWARDS: dict[str, type[TransformerForward]] = {"llama": LlamaForward, "falcon": FalconForward, "opt": OPTForward}


def forward_class(model: ModelFile) -> type[TransformerForward]:
    return FORWARDS[architecture(model.config.arch).block]


@dataclass(frozen=True)
class RuntimeOptions:
    """ffn: auto (sparse when the file has predictors, reading a layer's dense rows where a batch makes them
    cheaper: ffn/schedule.py), sparse (the predictor at every step), dense, or oracle (true active set; testing).
    vram_budget_gib: None runs without a GPU split. device: the GPU side ("cuda", or "cpu" to simulate one);
    None picks CUDA when available. kv_policy: which KV rows each sequence keeps, as the plan budgets them;
    kv_types: the element types of a CPU cache."""

    ffn: str = "auto"
    vram_budget_gib: float | None = None
    schedule: str = "auto"
    reset_gpu_index: bool = False
    disable_gpu_index: bool = False
    device: str | None = None
    kv_policy: KVPolicy = field(default_factory=KVPolicy)
    kv_types: KVTypes = field(default_factory=KVTypes)


@dataclass
class LoadedRuntime:
    forward: TransformerForward
    ffn_mode: str
    schedule: str
    plan: Plan | None = None
    notes: list[str] = field(default_factory=list)


def ffn_mode(model: ModelFile, requested: str, layers: list[FFNWeights]) -> str:
    if requested not in FFN_MODES:
        raise UserError(f"unknown FFN mode {requested!r}; use one of {', '.join(FFN_MODES)}")
    selects = all(w.has_predictor for w in layers) or model.gate_thresholds is not None
    if requested == "sparse" and not selects:
        raise UserError(
            f"{model.path} has neither predictors (fc1/fc2) nor gate thresholds; sparse decoding needs a PowerInfer "
            "GGUF (`qinfer prep convert` with a PREDICTOR_DIR or --calibration DIR)"
        )
    if requested == "auto":
        return "sparse" if selects else "dense"
    return requested


def selector(layers: list[FFNWeights]) -> Selector:
    """How a sparse run picks neurons: by predictor where the file has them, else by a calibrated gate threshold."""
    return "predictor" if all(w.has_predictor for w in layers) else "gate"


def gpu_device(requested: str | None) -> torch.device | None:
    """The GPU side: CUDA when present (or asked for), "cpu" to simulate one, None for none."""
    if requested is None:
        return torch.device("cuda") if torch.cuda.is_available() else None
    if requested.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"device {requested!r} asked for but CUDA is not available")
    return torch.device(requested)


def gpu_profile_name(device: torch.device | None) -> str:
    """The planner's GPU profile for this device; the default one when it is unknown or simulated."""
    if device is not None and device.type == "cuda":
        name = torch.cuda.get_device_name(device).lower()
        # The first key the device's name contains: an H100 PCIe's before the H100 SXM's.
        for key, profile in (
            ("h200", "h200"),
            ("h100 pcie", "h100-pcie"),
            ("h100", "h100"),
            ("4090", "rtx4090"),
            ("2080", "rtx2080ti"),
        ):
            if key in name:
                return profile
    from qinfer.planner.make_plan import PlanOptions

    return PlanOptions().gpu


@dataclass
class Placement:
    """Where FFN neurons start: planned resident ids and neuron-cache slots per layer, and the dense parts' side."""

    plan: Plan | None
    layout: ModelLayout
    resident: list[torch.Tensor]
    capacity: list[int]
    device_predictors: list[bool]  # per layer, whether its predictor goes to the GPU with its neurons
    dense_on_gpu: bool


# Said on a machine without a GPU where a plan was made or read (not under --disable-gpu-index).
_KEPT = "the plan is kept for a GPU machine; "


def _placement(model: ModelFile, options: RuntimeOptions, plan_options: PlanOptions, notes: list[str]) -> Placement:
    # The planner's solvers (pulp, scipy) load only when a budget asks for a plan, not for every run.
    from qinfer.planner.make_plan import dry_run_account, load_or_make_gpuidx

    assert options.vram_budget_gib is not None
    budget = int(options.vram_budget_gib * GIB)
    if options.disable_gpu_index:
        # Still refuse a budget too small for the dense parts, with the planner's message.
        layout, _ = dry_run_account(model.path, budget, plan_options)
        unit = "expert" if model.config.experts is not None else "FFN neuron"
        notes.append(f"--disable-gpu-index: every {unit} stays on the CPU")
        empty = [torch.empty(0, dtype=torch.long) for _ in layout.layers]
        return Placement(None, layout, empty, [0] * len(empty), [False] * len(empty), True)
    plan = load_or_make_gpuidx(model.path, budget, options=plan_options, reset=options.reset_gpu_index)
    resident = [torch.from_numpy(np.flatnonzero(m)).long() for m in plan.placement.gpu_neurons]
    predictors = [plan.placement.predictor_on_gpu(i) for i in range(len(resident))]
    # The budget left over becomes spare slots for the dynamic schedule, shared by the layers whose GPU can select
    # among them: one whose predictor the plan left on the CPU could not pick its slots' neurons in the kernels
    # (HybridRunner.device_selects). A layer with no predictor selects by its gate.
    takers = [
        on_gpu or layer.predictor_bytes == 0 for layer, on_gpu in zip(plan.layout.layers, predictors, strict=True)
    ]
    spare_per_taker = max(budget - plan.vram_total, 0) / max(sum(takers), 1)
    capacity = [
        min(layer.ffn_neurons, int(r.numel()) + (math.floor(spare_per_taker / layer.neuron_bytes) if takes else 0))
        for layer, r, takes in zip(plan.layout.layers, resident, takers, strict=True)
    ]
    share = sum(int(r.numel()) for r in resident) / sum(layer.ffn_neurons for layer in plan.layout.layers)
    verb = "reused" if plan.reused else "wrote"
    units, uses = ("experts", "routings") if model.config.experts is not None else ("FFN neurons", "activations")
    notes.append(
        f"plan: {share:.0%} of {units} on the GPU, {plan.gpu_activation_share:.0%} of {uses} ({verb} "
        f"{plan.gpuidx_path})"
    )
    dense_on_gpu = all(plan.placement.attention_on_gpu) and plan.placement.output_on_gpu
    return Placement(plan, plan.layout, resident, capacity, predictors, dense_on_gpu)


# The context of a run that names none: the model's own where that is shorter.
DEFAULT_CTX = 512


def fit_context(model: ModelFile, requested: int | None) -> tuple[int, str | None]:
    """The context a run gets: `requested` tokens (None: DEFAULT_CTX, 0: the model's own), at most the model's,
    and the note that says so where a requested one is cut: run, serve and perplexity all clamp, and say it."""
    own = model.config.context_length
    if requested is None:
        return min(DEFAULT_CTX, own), None
    if requested <= 0 or requested <= own:
        return (own if requested <= 0 else requested), None
    return own, f"-c {requested} is more than the model's context of {own} tokens; using {own}"


def _experts_runtime(
    model: ModelFile,
    experts: Experts,
    options: RuntimeOptions,
    make_forward: type[TransformerForward],
    slots: int,
    ctx_size: int,
) -> LoadedRuntime:
    """A mixture of experts runs every expert a token chooses; with a VRAM budget the plan's experts on the GPU
    side, the router and the shared expert with them, and the rest on the CPU."""
    if options.ffn in ("sparse", "oracle"):
        raise UserError(f"experts are not made sparse yet; run without --ffn {options.ffn}")
    runner = expert_runner(model, experts)
    cpu = torch.device("cpu")
    if options.vram_budget_gib is None:
        return LoadedRuntime(make_forward(model, runner, cpu), "dense", "static")
    if options.schedule == "dynamic":
        raise UserError("experts stay where the plan puts them; run without --schedule dynamic")
    device = gpu_device(options.device)
    notes: list[str] = []
    placed = _placement(model, options, _plan_options(device, options, slots, ctx_size), notes)
    if device is None:
        notes.append(f"no GPU: {_KEPT if placed.plan is not None else ''}every expert runs on the CPU")
        return LoadedRuntime(make_forward(model, runner, cpu), "dense", "static", placed.plan, notes)
    split = ExpertSplit(runner, device, placed.resident)
    forward = make_forward(model, split, device if placed.dense_on_gpu else cpu)
    return LoadedRuntime(forward, "dense", "static", placed.plan, notes)


def _plan_options(device: torch.device | None, options: RuntimeOptions, slots: int, ctx_size: int) -> PlanOptions:
    """The plan a run asks for: its context, one sequence per slot, this GPU's profile and the run's KV policy."""
    from qinfer.planner.make_plan import PlanOptions

    return PlanOptions(ctx_size=ctx_size, batch=slots, gpu=gpu_profile_name(device), kv_policy=options.kv_policy)


def load_forward(model: ModelFile, options: RuntimeOptions, slots: int = 1, ctx_size: int = 512) -> LoadedRuntime:
    if options.schedule not in SCHEDULES:
        raise UserError(f"unknown schedule {options.schedule!r}; use {', '.join(SCHEDULES)}")
    make_forward = forward_class(model)
    if model.config.experts is not None:
        return _experts_runtime(model, model.config.experts, options, make_forward, slots, ctx_size)
    layers = [ffn_weights(model, i) for i in range(model.config.layers)]
    mode = ffn_mode(model, options.ffn, layers)
    # Built (or found) now, so that a message about building them never lands inside generated text.
    row_kernels.enabled()
    cpu = torch.device("cpu")
    if mode == "dense":
        unused = [] if options.vram_budget_gib is None else ["dense FFN: the VRAM budget is not used; all on the CPU"]
        return LoadedRuntime(make_forward(model, DenseRunner(layers), cpu), mode, "static", notes=unused)
    threshold = model.sparse_threshold
    if options.vram_budget_gib is None or mode == "oracle":
        chosen = "oracle" if mode == "oracle" else selector(layers)
        # Asked for nothing in particular, a predictor-sparse model may read dense rows where a batch makes them
        # cheaper; --ffn sparse keeps the predictor for every step.
        adaptive = options.ffn == "auto" and chosen == "predictor"
        schedule = FFNSchedule(layers, load_profile(DEFAULT_CPU, "cpu")) if adaptive else None
        runner = SparseRunner(layers, threshold, chosen, schedule)
        return LoadedRuntime(make_forward(model, runner, cpu), mode, "static")
    device = gpu_device(options.device)
    if device is not None:
        require_split_support(layers[0].form)
    plan_options = _plan_options(device, options, slots, ctx_size)
    notes: list[str] = []
    placed = _placement(model, options, plan_options, notes)
    if device is None:
        notes.append(f"no GPU: {_KEPT if placed.plan is not None else ''}everything runs sparse on the CPU")
        forward = make_forward(model, SparseRunner(layers, threshold, selector(layers)), cpu)
        return LoadedRuntime(forward, mode, "static", placed.plan, notes)
    # With the index disabled nothing may live on the GPU, so neither may neurons be shipped there.
    dynamic = options.schedule != "static" and not options.disable_gpu_index
    layout = placed.layout
    rows = layers[0].form.matrices
    costs = SplitCosts(
        layout.layers[0].neuron_bytes,
        2.0 * rows * layout.spec.hidden,
        load_profile(plan_options.gpu, "gpu"),
        load_profile(plan_options.cpu, "cpu"),
    )
    hybrid = HybridRunner(
        layers, threshold, device, placed.resident, placed.capacity, placed.device_predictors, costs, dynamic
    )
    forward = make_forward(model, hybrid, device if placed.dense_on_gpu else cpu)
    return LoadedRuntime(forward, mode, "dynamic" if dynamic else "static", placed.plan, notes)
