"""A Q4_0 PowerInfer file on the GPU/CPU split path (the GPU side simulated on the CPU)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from qinfer.formats.activation_files import write_activations
from qinfer.formats.gguf_reader import open_gguf
from qinfer.planner.budget import GIB
from qinfer.planner.make_plan import PlanOptions, dry_run_account
from qinfer.prep.convert.quantize import quantize_gguf
from qinfer.runtime.engine.engine import Engine
from qinfer.runtime.engine.generate import generate
from qinfer.runtime.engine.sampling import SamplingParams
from qinfer.runtime.engine.tokenizer import GGUFTokenizer
from qinfer.runtime.ffn.hybrid import DeviceSlots, HybridRunner
from qinfer.runtime.ffn.sparse import dense_ffn
from qinfer.runtime.kernels import quant_rows
from qinfer.runtime.kernels.quant_rows import QuantizedMatrix
from qinfer.runtime.kv.batch import TokenBatch
from qinfer.runtime.kv.cache import KVCache
from qinfer.runtime.model.forward import ffn_weights
from qinfer.runtime.model.loader import RuntimeOptions, load_forward
from qinfer.runtime.model.model_file import open_model

PROMPT = "Once upon a time, the dog and the cat went"


@pytest.fixture(scope="module")
def q4(gguf_files: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny PowerInfer file as Q4_0, beside random activation counts (the planner's input)."""
    directory = tmp_path_factory.mktemp("q4")
    source = shutil.copy(gguf_files["pi-f16"], directory / "tiny.powerinfer.gguf")
    path = quantize_gguf(Path(source), directory / "tiny.q4.powerinfer.gguf").outfile
    config = open_model(path).config
    counts = torch.randint(0, 1000, (config.layers, config.ffn), generator=torch.Generator().manual_seed(0))
    write_activations(directory / "activation", counts, 1000, {})
    return path


def budget_gib(path: Path, share: float, ctx_size: int) -> float:
    """Room for the dense parts and `share` of the FFN neurons at their Q4_0 bytes."""
    _, acct = dry_run_account(path, GIB, PlanOptions(ctx_size=ctx_size))
    return (acct.dense + acct.ffn_total * share) / GIB


def decode_logits(path: Path, ids: list[int], options: RuntimeOptions) -> torch.Tensor:
    forward = load_forward(open_model(path), options).forward
    cache = KVCache(forward.cfg, 64)
    with torch.inference_mode():
        return torch.cat([forward.forward(TokenBatch.decode([t], [j], [0]), cache) for j, t in enumerate(ids)])


def assert_equal_but_for_a_rounding(logits: torch.Tensor, expected: torch.Tensor) -> None:
    """Logits of two paths that compute the same integer block products of Q4_0 rows, but reach the inputs they
    quantize to Q8_0 through float sums in another order (attention, norms, a split's two halves): now and then an
    input value lands on the other side of a rounding and moves its token's logits by about a quantization step, and
    the later tokens that attend to it by less. How often depends on the instruction sets the sums take: an Intel
    Xeon's native build moved one token of a 57-token prompt (by 3e-3 of the largest logit); its plain C build with
    oneDNN held to SSE4.1, 22 of them (by at most 5e-3), and 4 of a split's 19. Every token stays within 1% of the
    largest logit and most agree to the summation order; a path wired wrong moves most tokens, or one by more."""
    assert logits.shape == expected.shape
    scale = expected.abs().max().item()
    off = (logits - expected).abs().amax(dim=1)
    assert off.max().item() < 1e-2 * scale
    assert int((off < 1e-4 * scale).sum()) >= len(off) / 2


def test_q4_prompt_logits_match_token_by_token(q4: Path) -> None:
    """A prompt of a Q4_0 file prefilled at once (its products through a kernel of many tokens: the blocked integer
    product, or under 24 tokens on AVX-512 VNNI, under 10 where AMX runs the blocked product, the sixteen-row one)
    gives the logits of feeding it a token at a time."""
    ids = GGUFTokenizer(open_model(q4).metadata).encode(PROMPT * 3)
    assert len(ids) > 16
    options = RuntimeOptions(ffn="dense")
    forward = load_forward(open_model(q4), options).forward
    with torch.inference_mode():
        prompt = forward.forward(TokenBatch.prompt(torch.tensor(ids), 0), KVCache(forward.cfg, 64))
    assert_equal_but_for_a_rounding(prompt, decode_logits(q4, ids, options))


def test_split_q4_matches_cpu_sparse(q4: Path) -> None:
    ids = GGUFTokenizer(open_model(q4).metadata).encode(PROMPT)
    cpu = decode_logits(q4, ids, RuntimeOptions(ffn="sparse"))
    budget = budget_gib(q4, 0.5, 512)
    for schedule in ("static", "dynamic"):
        split = RuntimeOptions(vram_budget_gib=budget, device="cpu", schedule=schedule, reset_gpu_index=True)
        assert_equal_but_for_a_rounding(decode_logits(q4, ids, split), cpu)
    plan = load_forward(open_model(q4), split).plan
    assert plan is not None
    assert 0 < sum(int(m.sum()) for m in plan.placement.gpu_neurons) < sum(m.size for m in plan.placement.gpu_neurons)
    assert (q4.parent / "tiny.q4.powerinfer.gguf.generated.gpuidx").is_file()


@pytest.mark.parametrize("schedule", ["static", "dynamic"])
def test_split_q4_holds_raw_blocks_at_the_planned_bytes(q4: Path, schedule: str) -> None:
    budget = budget_gib(q4, 0.5, 512)
    options = RuntimeOptions(vram_budget_gib=budget, device="cpu", schedule=schedule, reset_gpu_index=True)
    loaded = load_forward(open_model(q4), options)
    runner, plan = loaded.forward.ffn, loaded.plan
    assert isinstance(runner, HybridRunner) and plan is not None
    for s, planned_neurons in zip(runner.slots, plan.placement.gpu_neurons, strict=True):
        assert all(isinstance(t, QuantizedMatrix) and t.blocks.dtype == torch.uint8 for t in (s.up, s.down_t, s.gate))
        # A layer's predictor is on the device, quantized, exactly where the plan put (and budgeted) it.
        on_device = isinstance(s.fc1, QuantizedMatrix) and isinstance(s.fc2, QuantizedMatrix)
        assert on_device == planned_neurons.any() and (on_device or s.fc1 is None and s.fc2 is None)
    # Q4_0: 18 bytes per 32 weights, 108 bytes a neuron of the tiny model, where float32 slots took 768.
    capacity = [c.capacity for c in runner.caches]
    planned = sum(layer.neuron_bytes * c for layer, c in zip(plan.layout.layers, capacity, strict=True))
    assert runner.device_bytes() == planned
    resident = sum(c.resident for c in runner.caches)
    assert resident * plan.layout.layers[0].neuron_bytes == plan.vram["ffn neurons"] > 0
    if schedule == "static":
        assert runner.device_bytes() == plan.vram["ffn neurons"]
    assert runner.predictor_bytes() == plan.vram["predictors"] > 0
    assert plan.vram_total - plan.vram["ffn neurons"] + runner.device_bytes() <= budget * GIB


def test_q4_cache_swaps_keep_device_blocks_equal_to_the_file(q4: Path) -> None:
    greedy = SamplingParams(temperature=0.0)
    expected = generate(Engine.open(q4, ctx_size=96, ffn="sparse"), PROMPT, 40, greedy, ignore_eos=True).tokens
    split = Engine.open(
        q4, ctx_size=96, vram_budget_gib=budget_gib(q4, 0.3, 96), schedule="dynamic", device="cpu", reset_gpu_index=True
    )
    assert split.runtime is not None
    runner = split.runtime.forward.ffn
    assert isinstance(runner, HybridRunner)
    assert generate(split, PROMPT, 40, greedy, ignore_eos=True).tokens == expected
    assert sum(c.swaps for c in runner.caches) > 0
    raw = {t.name: np.asarray(t.data) for t in open_gguf(q4).tensors}
    for i, (slots, cache) in enumerate(zip(runner.slots, runner.caches, strict=True)):
        used = torch.nonzero(cache.slot_neuron >= 0).flatten()
        neurons = cache.slot_neuron[used].numpy()
        for name, mine in (("ffn_up", slots.up), ("ffn_down_t", slots.down_t), ("ffn_gate", slots.gate)):
            assert isinstance(mine, QuantizedMatrix)
            assert torch.equal(mine.blocks[used], torch.from_numpy(raw[f"blk.{i}.{name}.weight"][neurons]))
            assert not mine.blocks[cache.slot_neuron < 0].any()  # empty slots: zero blocks, zero rows


def test_prefill_over_quantized_slots_expands_chunk_by_chunk(q4: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    w = ffn_weights(open_model(q4), 0)
    slots = DeviceSlots.allocate(w, w.neurons + 5, torch.device("cpu"), predictors=False)
    order = torch.randperm(w.neurons, generator=torch.Generator().manual_seed(1))
    slots.load(w, torch.arange(w.neurons), order)
    x = torch.randn(7, w.up.shape[1], generator=torch.Generator().manual_seed(2))
    # 40 expanded rows per chunk: the 261 slots (5 empty) take 7 chunks, and the sum is the layer's dense FFN.
    monkeypatch.setattr(quant_rows, "EXPAND_CHUNK_BYTES", 40 * w.up.shape[1] * 4)
    assert torch.allclose(slots.dense(w.form, x), dense_ffn(w, x), rtol=0, atol=1e-4)
