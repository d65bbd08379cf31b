"""Our GPU/CPU split beside the PowerInfer engine's, on one GPU, on the same files and budgets, in one run.

    python bench/gpu.py --powerinfer-main PATH [--models 7b-slice] [--quant Q4_0] [--rounds 3] [--tokens 64]
                        [--work work/bench] [-c 256] [--budgets 4,8]

Per file (the f16 PowerInfer GGUF, and with --quant the file quantized to that type) and budget, decode tokens/s,
best of --rounds interleaved rounds:
- split, the dense parts and 35% of the FFN on the GPU: ours static (the device selects and computes its neurons
  in the hot-FFN kernels, each step replayed from CUDA graphs), the same without graphs, ours static on torch's
  ops (the earlier path), ours dynamic (promotions between graphed steps, and on torch's ops); the engine with its
  own plan (its solver, run by `main`), and the engine with our plan (our .gpuidx beside the file);
- all FFN on the GPU: ours (with and without graphs), the engine (its own plan);
- dense, every layer on the GPU: the engine on the dense GGUF (-ngl 99);
- ours all on the CPU, and transformers' eager `generate` on the GPU (f16), as references;
- with --budgets, the split at each of those budgets (GiB): ours static and the engine with its own plan.
`--models 7b` is the full depth of a LLaMA-7B shape (32 layers): the 7b-slice's four layers repeated, with their
activation counts (bench/deep_model.py); it has no transformers row. `--models 7b --budgets 4,8` gives the 4 GiB,
8 GiB and all-FFN rows of a 7B.
Our rows also give peak VRAM (torch's allocator, from opening the model to the end of its first round) against the
budget. Without --powerinfer-main the engine's rows are left out. The first line names the GPU and the CPU.

Each configuration runs beside its own link to the model in a directory of its own under --work, so that the
engine's plan and ours never meet unless a row asks for ours. bench/gpu_check.sh runs this on a fresh machine.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from decode import bench_model, bench_prompt, engine_decoder, quantized, transformers_decoder
from decode_peers import Speed, Timer, engine_main_problem, powerinfer_decoder
from deep_model import deep_model
from machine import cpu
from rich.console import Console
from rich.table import Table

from qinfer.planner.budget import GIB
from qinfer.planner.make_plan import PlanOptions, dry_run_account
from qinfer.prep.profile.activation_profile import profile_activations
from qinfer.prep.synth.corpus import synth_corpus
from qinfer.runtime.engine.engine import Engine
from qinfer.runtime.engine.tokenizer import GGUFTokenizer
from qinfer.runtime.ffn.hybrid import HybridRunner
from qinfer.runtime.kernels.row_kernels import release_threads
from qinfer.runtime.model.model_file import open_model

SPLIT_SHARE, WHOLE_SHARE = 0.35, 1.05  # of the FFN's bytes, beside the dense parts
# Models made by repeating a slice's layers: name -> (the slice, the layer count).
DEEP = {"7b": ("7b-slice", 32)}
# The CPU threads of the torch-path splits opened here: a split's CPU part runs on its own, whose OpenMP team stays.
CPU_PARTS: list[ThreadPoolExecutor] = []


def machine() -> str:
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    return f"GPU: {gpu}; CPU: {cpu()}, {os.cpu_count()} threads; torch {torch.__version__}"


def placed(model: Path, work: Path, name: str) -> Path:
    """`model` linked into a directory of its own, its activation files beside it, as the engine and our planner
    both look for them."""
    directory = work / name
    directory.mkdir(parents=True, exist_ok=True)
    for source in (model, model.parent / "activation"):
        link = directory / source.name
        if not link.exists():
            link.symlink_to(source.resolve())
    return directory / model.name


@dataclass
class Ours:
    """One of our configurations, opened once and stepped each round; peak VRAM from its first round."""

    timer: Timer
    peak: Callable[[], float | None]
    graphs: Callable[[], str | None]  # how its steps ran: replayed from graphs, or why not


def ours(path: Path, prompt_ids: list[int], n: int, ctx: int, budget: float | None, schedule: str,
         in_kernel: bool | None = None, graphs: bool = True) -> Ours:  # fmt: skip
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if cuda else 0
    device = ("cuda" if cuda else "cpu") if budget is not None else None
    engine = Engine.open(path, ctx_size=ctx, vram_budget_gib=budget, schedule=schedule, device=device)
    runner = engine.runtime.forward.ffn if engine.runtime is not None else None
    if isinstance(runner, HybridRunner):
        if in_kernel is not None:
            runner.in_kernel = in_kernel
        if not runner.in_kernel:
            CPU_PARTS.append(runner.pool)
    if not graphs:
        engine.forward.graphs = None
    peaks: list[float] = []
    timed = engine_decoder(engine, prompt_ids, n)

    def tps() -> Speed:
        end_idle_teams()
        speed = timed()
        if cuda and not peaks:
            peaks.append((torch.cuda.max_memory_allocated() - base) / GIB)
        return speed

    def graphed() -> str | None:
        steps = engine.forward.graphs
        if steps is None:
            return None
        if steps.failed is not None:
            return f"not graphed: {steps.failed}"
        return f"graphs for batch sizes {sorted(steps.steps)}" if steps.steps else "no step was graphed"

    return Ours(tps, lambda: peaks[0] if peaks else None, graphed)


def end_idle_teams() -> None:
    """End the OpenMP teams this process's threads keep (the main thread's, and each torch-path split's CPU
    thread's) before a configuration is timed; it makes its own again. The idle teams of the configurations opened
    beside it would outnumber the cores, and libgomp then makes every team's barriers sleep instead of spinning, a
    wake each, which a user running one engine does not see."""
    release_threads()
    for pool in CPU_PARTS:
        pool.submit(release_threads).result()


def _failing() -> Speed:
    raise AssertionError("unreachable: a configuration that did not open is never timed")


def decode_table(
    title: str,
    keys: list[str],
    best: dict[str, Speed],
    failed: dict[str, str],
    peaks: dict[str, tuple[Callable[[], float | None], float]],
    budgets: list[float],
) -> Table:
    """One row per "file|configuration" key: its best tokens/s, its peak VRAM against its budget, and ours over the
    engine's on the same file and budget."""
    table = Table(title=title)
    for column in ("file", "configuration", "tokens/s", "peak VRAM / budget GiB", "vs engine"):
        table.add_column(column, justify="right" if column != "configuration" else "left")
    peers = {"split ours static": "split engine, own plan", "all FFN ours": "all FFN engine"}
    peers |= {f"split ours static, {b:g} GiB": f"split engine, own plan, {b:g} GiB" for b in budgets}
    for key in keys:
        file, label = key.split("|")
        tps = best[key].decode if key in best else math.nan
        peak = ""
        if key in peaks:
            measured, budget = peaks[key][0](), peaks[key][1]
            peak = f"{measured:.3f} / {budget:.3f}" if measured is not None else f"- / {budget:.3f}"
        peer = peers.get(label)
        versus = best.get(f"{file}|{peer}") if peer else None
        ratio = f"{tps / versus.decode:.2f}x" if versus is not None and not math.isnan(tps) else ""
        table.add_row(file, label, "failed" if key in failed else f"{tps:.1f}", peak, ratio)
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="7b-slice", help="comma-separated, from bench/decode.py's shapes")
    parser.add_argument("--quant", choices=["Q4_0"], help="also run the files quantized to this type")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--work", type=Path, default=Path("work/bench"))
    parser.add_argument("-c", "--ctx", type=int, default=256)
    parser.add_argument("--powerinfer-main", type=Path, help="the `main` of a PowerInfer engine CUDA build")
    parser.add_argument("--budgets", default="", help="comma-separated GiB: also the split at each of these budgets")
    args = parser.parse_args()
    try:
        budgets = sorted({float(b) for b in args.budgets.split(",") if b.strip()})
    except ValueError:
        budgets = [math.nan]
    if not all(math.isfinite(b) and b > 0 for b in budgets):
        raise SystemExit(f"--budgets {args.budgets!r}: give positive GiB, comma-separated (4,8)")
    if args.powerinfer_main is not None and (problem := engine_main_problem(args.powerinfer_main)):
        print(problem, file=sys.stderr)
        raise SystemExit(2)
    console = Console(width=max(Console().width, 150))
    console.print(machine(), markup=False)
    cuda = torch.cuda.is_available()
    threads = os.cpu_count() or 1
    for name in args.models.split(","):
        slice_name, depth = DEEP.get(name, (name, 0))
        model = bench_model(args.work, slice_name)
        root = model.powerinfer.parent
        if not (root / "activation" / "activation_0.pt").exists():
            corpus = root / "corpus.txt"
            corpus.write_text(synth_corpus(1, 400_000, "calibrate"))
            profile_activations(model.model_dir, corpus, root / "activation", tokens=16384, seq_len=256,
                                device="cuda" if cuda else "cpu")  # fmt: skip
        if depth:
            model = deep_model(model, args.work / name, name, depth)
        tokenizer = GGUFTokenizer(open_model(model.powerinfer).metadata)
        prompt = bench_prompt(tokenizer, 32)
        prompt_ids = tokenizer.encode(prompt)
        variants = [model, *([quantized(model, args.quant)] if args.quant else [])]
        timers: dict[str, Timer] = {}
        failed: dict[str, str] = {}
        graph_notes: dict[str, Callable[[], str | None]] = {}
        peaks: dict[str, tuple[Callable[[], float | None], float]] = {}
        for v in variants:
            _, acct = dry_run_account(v.powerinfer, 1 << 50, PlanOptions(ctx_size=args.ctx, batch=1))
            split = (acct.dense + SPLIT_SHARE * acct.ffn_total) / GIB
            whole = (acct.dense + WHOLE_SHARE * acct.ffn_total) / GIB
            # Every configuration stays open (its VRAM held) through the rounds: at a 7B's full depth the ablations
            # (no graphs, torch's ops) would take about 30 GiB more, beside the engine's runs, so only a slice has them.
            rows: list[tuple[str, str, float | None, str, bool | None, bool]] = [
                ("split ours static", "split-ours", split, "static", None, True),
                ("split ours static, no graphs", "split-ours", split, "static", None, False),
                ("split ours static, torch ops", "split-ours", split, "static", False, False),
                ("split ours dynamic", "split-ours", split, "dynamic", None, True),
                ("split ours dynamic, torch ops", "split-ours", split, "dynamic", False, False),
                ("all FFN ours", "whole-ours", whole, "static", None, True),
                ("all FFN ours, no graphs", "whole-ours", whole, "static", None, False),
                ("all-CPU ours", "cpu", None, "static", None, False),
                *((f"split ours static, {b:g} GiB", f"split-ours-{b:g}", b, "static", None, True) for b in budgets),
            ]
            if depth:
                rows = [row for row in rows if not row[0].endswith((", no graphs", ", torch ops"))]
            for label, directory, budget, schedule, in_kernel, graphs in rows:
                path = placed(v.powerinfer, args.work / "gpu" / v.name.replace(" ", "-"), directory)
                key = f"{v.name}|{label}"
                try:
                    run = ours(path, prompt_ids, args.tokens, args.ctx, budget, schedule, in_kernel, graphs)
                except Exception as exc:  # noqa: BLE001 - a configuration that does not open is reported, not fatal
                    failed[key] = f"{type(exc).__name__}: {exc}"
                    traceback.print_exc()
                    timers[key] = _failing
                    continue
                timers[key] = run.timer
                if graphs:
                    graph_notes[key] = run.graphs
                if budget is not None:
                    peaks[key] = (run.peak, budget)
            if args.powerinfer_main is not None:
                engine_rows = [
                    ("split engine, own plan", v.powerinfer, "split-engine", ("--vram-budget", f"{split:.4f}")),
                    ("split engine, our plan", v.powerinfer, "split-ours", ("--vram-budget", f"{split:.4f}")),
                    ("all FFN engine", v.powerinfer, "whole-engine", ("--vram-budget", f"{whole:.4f}")),
                    ("dense all-GPU engine", v.dense, "dense-engine", ("-ngl", "99")),
                    *(
                        (
                            f"split engine, own plan, {b:g} GiB",
                            v.powerinfer,
                            f"split-engine-{b:g}",
                            ("--vram-budget", f"{b:g}"),
                        )
                        for b in budgets
                    ),
                ]
                for label, file, directory, extra in engine_rows:
                    path = placed(file, args.work / "gpu" / v.name.replace(" ", "-"), directory)
                    # A hung run must fail its row, not use up a GPU session's few minutes; a full depth's first run
                    # also makes the engine's own plan of 32 layers.
                    timers[f"{v.name}|{label}"] = powerinfer_decoder(
                        args.powerinfer_main, path, prompt, args.tokens, threads, args.ctx, extra,
                        timeout_s=540 if depth else 180,
                    )  # fmt: skip
        if cuda and not depth:
            timers[f"{model.name}|transformers eager, GPU f16"] = transformers_decoder(
                model.model_dir, prompt_ids, args.tokens, torch.float16, "cuda"
            )
        best: dict[str, Speed] = {}

        for done in range(1, args.rounds + 1):
            for key, timer in timers.items():
                if key in failed:
                    continue
                try:
                    speed = timer()
                except Exception as exc:  # noqa: BLE001 - a row that does not run is reported, not fatal
                    failed[key] = f"{type(exc).__name__}: {exc}"
                    traceback.print_exc()
                    continue
                best[key] = best[key].best(speed) if key in best else speed
            # After every round: a run stopped by a time limit still leaves the rounds it finished.
            title = f"{name}: decode tokens/s, best of {done} interleaved rounds"
            title += f" of {args.rounds} (so far)" if done < args.rounds else ""
            console.print(decode_table(f"{title}, {args.tokens} tokens", list(timers), best, failed, peaks, budgets))
        for key, why in failed.items():
            console.print(f"{key}: {why}", markup=False)
        for key, note in graph_notes.items():
            if (said := note()) is not None:
                console.print(f"{key}: {said}", markup=False)


if __name__ == "__main__":
    main()
