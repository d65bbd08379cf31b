"""A Q4_0 PowerInfer file on the GPU/CPU split path (the GPU side simulated on the CPU)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from planner.budget import GIB
from planner.make_plan import PlanOptions, dry_run_account
from qinfer_prep.activation_files import write_activations
from qinfer_prep.quantize import quantize_gguf
from qinfer_runtime.forward_loader import RuntimeOptions, load_forward
from qinfer_runtime.model_file import open_model
from qinfer_runtime.model_forward import KVCache, TokenBatch
from qinfer_runtime.tokenizer import GGUFTokenizer


def decode_logits(path: Path, ids: list[int], options: RuntimeOptions) -> torch.Tensor:
    forward = load_forward(open_model(path), options).forward
    cache = KVCache(forward.cfg, 64)
    with torch.inference_mode():
        return torch.cat([forward.forward(TokenBatch.decode([t], [j], [0]), cache) for j, t in enumerate(ids)])


def test_split_q4_matches_cpu_sparse(gguf_files: dict[str, Path], tmp_path: Path) -> None:
    source = shutil.copy(gguf_files["pi-f16"], tmp_path / "tiny.powerinfer.gguf")
    q4 = quantize_gguf(Path(source), tmp_path / "tiny.q4.powerinfer.gguf").outfile
    model = open_model(q4)
    counts = torch.randint(0, 1000, (model.config.layers, model.config.ffn), generator=torch.Generator().manual_seed(0))
    write_activations(tmp_path / "activation", counts, 1000, {})
    ids = GGUFTokenizer(model.metadata).encode("Once upon a time, the dog and the cat went")
    cpu = decode_logits(q4, ids, RuntimeOptions(ffn="sparse"))
    # Room for the dense parts and about half of the Q4_0 FFN rows (108 bytes a neuron), so the FFN is split.
    _, acct = dry_run_account(q4, GIB, PlanOptions(ctx_size=512))
    budget = (acct.dense + 108 * counts.numel() // 2) / GIB
    for schedule in ("static", "dynamic"):
        split = RuntimeOptions(vram_budget_gib=budget, device="cpu", schedule=schedule, reset_gpu_index=True)
        assert (decode_logits(q4, ids, split) - cpu).abs().max().item() < 1e-4, schedule
    plan = load_forward(open_model(q4), split).plan
    assert plan is not None and 0 < sum(int(m.sum()) for m in plan.placement.gpu_neurons) < counts.numel()
    assert (tmp_path / "tiny.q4.powerinfer.gguf.generated.gpuidx").is_file()
