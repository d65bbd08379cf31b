#!/usr/bin/env bash
# The hybrid runtime on one GPU: the 7B-shaped slice with a VRAM budget that holds only part of the FFN.
# Prints decode tokens/s for the static and dynamic schedules, all-CPU and all-GPU, and peak VRAM against the
# budget (must stay under). Without CUDA it runs the same on a simulated GPU side (CPU tensors) and reports the
# simulated device's bytes instead of peak VRAM.
#
#   bench/gpu_check.sh [--small] [--tokens N] [--work DIR]     (--small: a quarter-width slice, for CPU machines)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
SHAPE=7b-slice
TOKENS=48
WORK=work/bench
while [[ $# -gt 0 ]]; do
  case "$1" in
    --small) SHAPE=small-slice; shift ;;
    --tokens) TOKENS="$2"; shift 2 ;;
    --work) WORK="$2"; shift 2 ;;
    *) echo "usage: $0 [--small] [--tokens N] [--work DIR]" >&2; exit 2 ;;
  esac
done

"$PY" - "$SHAPE" "$TOKENS" "$WORK" <<'PYTHON'
import sys
import time
from pathlib import Path

import torch

from qinfer.planner.budget import GIB
from qinfer.planner.make_plan import PlanOptions, dry_run_account
from qinfer.prep.profile.activation_profile import profile_activations
from qinfer.prep.synth.corpus import synth_corpus
from qinfer.runtime.engine.engine import Engine, Request
from qinfer.runtime.ffn.hybrid import HybridRunner
from qinfer.runtime.engine.sampling import SamplingParams

shape, tokens, work = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
sys.path.insert(0, "bench")
import decode as decode_bench  # noqa: E402 - bench/decode.py builds the benchmark models

cuda = torch.cuda.is_available()
device = "cuda" if cuda else "cpu"
started = time.perf_counter()
model = decode_bench.bench_model(work, shape)
root = model.powerinfer.parent
if not (root / "activation" / "activation_0.pt").exists():
    corpus = root / "corpus.txt"
    corpus.write_text(synth_corpus(1, 400_000, "calibrate"))
    profile_activations(model.model_dir, corpus, root / "activation", tokens=16384, seq_len=256, device=device)
print(f"{shape} on {torch.cuda.get_device_name() if cuda else 'CPU (simulated GPU side)'}; "
      f"model ready in {time.perf_counter() - started:.0f} s", flush=True)

ctx, slots = 256, 1
_, acct = dry_run_account(model.powerinfer, 1 << 50, PlanOptions(ctx_size=ctx, batch=slots))
partial = (acct.dense + 0.35 * acct.ffn_total) / GIB
whole = (acct.dense + 1.05 * acct.ffn_total) / GIB
greedy = SamplingParams(temperature=0.0)
prompt = "Once upon a time there was a little dog who"


def run(name: str, budget: float | None, schedule: str) -> None:
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    engine = Engine.open(model.powerinfer, slots=slots, ctx_size=ctx, vram_budget_gib=budget, schedule=schedule,
                         reset_gpu_index=budget is not None, device=device if budget is not None else None)
    ids = engine.tokenizer.encode(prompt)
    engine.submit(Request(ids, tokens + 2, greedy, ignore_eos=True))
    engine.step()
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(tokens):
        engine.step()
    if cuda:
        torch.cuda.synchronize()
    tps = tokens / (time.perf_counter() - t0)
    runner = engine.runtime.forward.ffn if engine.runtime else None
    line = f"{name:>10}: {tps:7.2f} tokens/s"
    if isinstance(runner, HybridRunner):
        on_dev = sum(s.device for s in runner.last)
        total = on_dev + sum(s.cpu for s in runner.last)
        line += f" | last step: {on_dev}/{total} active neurons on the device, swaps {sum(c.swaps for c in runner.caches)}"
    if budget is not None:
        if cuda:
            peak = torch.cuda.max_memory_allocated() - base
            verdict = "under" if peak <= budget * GIB else "OVER"
            line += f" | peak VRAM {peak / GIB:.2f} GiB vs budget {budget:.2f} GiB ({verdict})"
        elif isinstance(runner, HybridRunner):
            line += f" | simulated device neuron rows {runner.device_bytes() / GIB:.2f} GiB, budget {budget:.2f} GiB"
    print(line, flush=True)
    del engine


print(f"budget for the split: {partial:.2f} GiB (dense parts + 35% of the FFN); all-GPU: {whole:.2f} GiB")
run("static", partial, "static")
run("dynamic", partial, "dynamic")
run("all-CPU", None, "static")
run("all-GPU", whole, "static")
print(f"total {time.perf_counter() - started:.0f} s")
PYTHON
