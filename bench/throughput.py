"""Aggregate decode throughput on the CPU, side by side in one run: many sequences at once, and long contexts.

    .venv/bin/python bench/throughput.py [--model 7b-slice] [--quant Q4_0] [--batches 1,4,16,32]
                                         [--positions 128,2048,8192] [--steps 8] [--rounds 3] [-t N]
                                         [--cache-type f16,q8_0]
                                         [--llama-batched-bench PATH] [--powerinfer-batched-bench PATH]
                                         [--before-kernels DIR]

Two sweeps, on the f16 (and with --quant, the quantized) dense and PowerInfer files of bench/decode.py's models:
B sequences decoding together at a KV position of the first --positions entry, for each B of --batches; and one
sequence at each KV position of --positions. Tokens/s is B * steps / the seconds of `steps` decode steps (llama.cpp's
S_TG), best of --rounds interleaved rounds.

- ours: the runtime's decode forward over B slots of a KV cache of each --cache-type (keys and values alike; f16 by
  default, a comma-separated list for several in the same interleaved rounds), one native call a step for the
  batch, --ffn dense on the dense file and --ffn auto (the predictor with the adaptive schedule) on the PowerInfer
  file.
  The cache rows before the position are filled with random keys and values rather than prefilled: what a step
  costs does not depend on them. Sampling is left out, as the peers leave it out.
- llama.cpp: `llama-batched-bench` (-ctk f16 -ctv f16, a shared prompt of the position's length) on the dense
  files, beside our f16 cases; it applies SiLU to a `llama` file, so the speed compares, not the tokens.
- PowerInfer: the engine's `batched-bench` (built from its source; it runs on every physical core) on the dense and
  the PowerInfer files, beside our f16 cases.
- before (--before-kernels DIR): ours again on the native kernels built from DIR's decode_layer.c and
  row_kernels.c (a checkout of them before a change), in the same interleaved rounds.
- limit: B / (the bytes a step must read: every weight once, dense, plus each sequence's KV rows) * the read
  bandwidth measured at the start. Past a few sequences the products' arithmetic binds instead, which this limit
  leaves out.
"""

from __future__ import annotations

import argparse
import functools
import math
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from decode import bench_model, kernels_from, on_kernels, quantized
from decode_peers import peer_problem, read_bandwidth
from machine import cpu
from rich.console import Console
from rich.table import Table

from qinfer.core.kv_policy import CACHE_TYPES, Q8_0, KVTypes
from qinfer.planner.model_layout import ModelLayout, read_model_layout
from qinfer.runtime.kv.batch import TokenBatch
from qinfer.runtime.kv.cache import KVCache, make_kv_cache
from qinfer.runtime.kv.q8_rows import quantize_rows
from qinfer.runtime.model.forward import ModelForward
from qinfer.runtime.model.loader import RuntimeOptions, load_forward
from qinfer.runtime.model.model_file import open_model

PEER_CACHE = "f16"  # llama.cpp's default, which the peers get with -ctk/-ctv f16
# The engine computes only these weight types (as bench/decode.py finds).
ENGINE_TYPES = ("F16", "Q4_0")


@dataclass(frozen=True)
class Case:
    file: Path
    kind: str  # dense or sparse
    qtype: str  # the file's weight type
    batch: int
    position: int
    cache: str = PEER_CACHE  # the KV cache's element type, of keys and values alike


Timer = Callable[[], dict[Case, float]]


def ours(forward: ModelForward, cases: list[Case], steps: int) -> Timer:
    """Tokens/s of `steps` decode forwards of each case's B tokens, one per slot, from its KV position on."""

    def run() -> dict[Case, float]:
        speeds = {}
        for case in cases:
            types = KVTypes(case.cache, case.cache)
            cache = make_kv_cache(forward.cfg, case.position + steps, case.batch, types=types)
            assert isinstance(cache, KVCache)
            fill(cache.k, case.cache, forward.cfg.head_dim)
            fill(cache.v, case.cache, forward.cfg.head_dim)
            tokens = torch.randint(1, forward.cfg.vocab_size, (steps, case.batch)).tolist()
            slots = list(range(case.batch))
            with torch.inference_mode():
                # One untimed step first, as llama.cpp's bench warms up: the first call after a change of shape
                # sizes the layer step's scratch and touches the new cache's pages. Its row is written again below.
                forward.forward(TokenBatch.decode(tokens[0], [case.position] * case.batch, slots), cache)
                started = time.perf_counter()
                for j in range(steps):
                    positions = [case.position + j] * case.batch
                    forward.forward(TokenBatch.decode(tokens[j], positions, slots), cache)
                seconds = time.perf_counter() - started
            speeds[case] = case.batch * steps / seconds
            del cache
        return speeds

    return run


def fill(rows: torch.Tensor, name: str, head_dim: int) -> None:
    """A cache's rows of element type `name` filled with random keys or values, N(0, 0.5)."""
    values = torch.empty(*rows.shape[:-1], head_dim).normal_(0.0, 0.5)
    rows.copy_(quantize_rows(values) if name == Q8_0 else values)


# A result row of (llama.cpp's and the engine's) batched-bench: | PP | TG | B | N_KV | T_PP s | S_PP t/s | T_TG s |
# S_TG t/s | T s | S t/s |
ROW = re.compile(r"^\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*(\d+)\s*\|" + r"\s*([\d.]+)\s*\|" * 6)


def parse_batched_bench(text: str) -> dict[tuple[int, int], float]:
    """(position, B) -> S_TG from a batched-bench's table."""
    found = {}
    for line in text.splitlines():
        if (match := ROW.match(line.strip())) is not None:
            pp, _, batch = (int(match.group(i)) for i in (1, 2, 3))
            found[pp, batch] = float(match.group(8))
    return found


def peer(command: Callable[[int, list[int]], list[str]], cases: list[Case], steps: int) -> Timer:
    """A batched-bench run per KV position, over every batch size at that position."""
    by_position: dict[int, list[Case]] = {}
    for case in cases:
        by_position.setdefault(case.position, []).append(case)

    def run() -> dict[Case, float]:
        speeds = {}
        for position, group in by_position.items():
            argv = command(position, sorted({c.batch for c in group}))
            # The engine writes llama.log where it runs: a directory of its own, not the caller's.
            with tempfile.TemporaryDirectory(prefix="qinfer-peer-") as scratch:
                done = subprocess.run(argv, capture_output=True, text=True, timeout=3600, cwd=scratch)
            table = parse_batched_bench(done.stdout + done.stderr)
            if not table:
                tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
                print(f"{Path(argv[0]).name} gave no results ({tail})", file=sys.stderr)
            for case in group:
                if (position, case.batch) in table:
                    speeds[case] = table[position, case.batch]
        return speeds

    return run


def llama_command(binary: Path, file: Path, threads: int, steps: int) -> Callable[[int, list[int]], list[str]]:
    binary, file = binary.resolve(), file.resolve()  # the peers run in a directory of their own

    def argv(position: int, batches: list[int]) -> list[str]:
        ctx = position + max(batches) * steps + 16
        return [
            str(binary), "-m", str(file), "-c", str(ctx), "-b", "2048", "-ub", "512", "-npp", str(position),
            "-ntg", str(steps), "-npl", ",".join(map(str, batches)), "-t", str(threads), "-tb", str(threads),
            "-ctk", "f16", "-ctv", "f16", "-pps",
        ]  # fmt: skip

    return argv


def engine_command(binary: Path, file: Path, steps: int) -> Callable[[int, list[int]], list[str]]:
    """The engine's batched-bench, which takes positional arguments only (MODEL N_KV_MAX IS_PP_SHARED NGL MMQ PP TG
    PL) and runs on every physical core: the bench's -t should match the cores for a fair column."""
    binary, file = binary.resolve(), file.resolve()  # the peers run in a directory of their own

    def argv(position: int, batches: list[int]) -> list[str]:
        ctx = position + max(batches) * steps + 16
        return [
            str(binary), str(file), str(ctx), "1", "0", "0", str(position), str(steps), ",".join(map(str, batches)),
        ]  # fmt: skip

    return argv


@functools.cache
def model_layout(powerinfer: Path) -> ModelLayout:
    """The planner's accounting of a file, read once for all the cases and rounds that ask for it."""
    return read_model_layout(powerinfer)


def step_limit(powerinfer: Path, case: Case, steps: int, bandwidth: float) -> float:
    """B / (every weight once + every sequence's KV rows at its position) * bandwidth: the dense step's read bound,
    by the planner's accounting of the PowerInfer file of the case's type (the dense file holds the same weights)."""
    layout = model_layout(powerinfer)
    weights = layout.output_bytes + sum(
        layer.attention_bytes + layer.ffn_neurons * layer.neuron_bytes for layer in layout.layers
    )
    spec = layout.spec
    row = sum(KVTypes(case.cache, case.cache).row_bytes(spec.head_dim))
    kv = row * spec.layers * spec.kv_heads * (case.position + steps / 2) * case.batch
    return case.batch * bandwidth / (weights + kv)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="7b-slice", help="a model of bench/decode.py (synth, 7b-slice, ...)")
    parser.add_argument("--quant", choices=["Q4_0", "Q8_0"], help="also run the files quantized to this type")
    parser.add_argument("--batches", default="1,4,16,32")
    parser.add_argument("--positions", default="128,2048,8192")
    parser.add_argument("--steps", type=int, default=8, help="decode steps timed per case")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--work", type=Path, default=Path("work/bench"))
    parser.add_argument("-t", "--threads", type=int, default=0)
    parser.add_argument("--cache-type", default=PEER_CACHE, help=f"ours' KV cache types, of {', '.join(CACHE_TYPES)}")
    parser.add_argument("--llama-batched-bench", type=Path, help="llama.cpp's llama-batched-bench: adds its column")
    parser.add_argument("--powerinfer-batched-bench", type=Path, help="the engine's batched-bench: adds its column")
    parser.add_argument("--before-kernels", type=Path, help="also ours on the kernels built from this directory")
    args = parser.parse_args()
    for option, binary, what in (
        ("--llama-batched-bench", args.llama_batched_bench, "llama.cpp's llama-batched-bench"),
        ("--powerinfer-batched-bench", args.powerinfer_batched_bench, "a PowerInfer build's batched-bench"),
    ):
        if binary is not None and (problem := peer_problem(option, binary, what)):
            parser.error(problem)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    batches = [int(b) for b in args.batches.split(",")]
    positions = [int(p) for p in args.positions.split(",")]
    caches = args.cache_type.split(",")
    if any(name not in CACHE_TYPES for name in caches):
        parser.error(f"--cache-type: use {', '.join(CACHE_TYPES)}")
    console = Console(width=max(Console().width, 170))
    bandwidth = read_bandwidth()
    before = None if args.before_kernels is None else kernels_from(args.before_kernels)
    console.print(f"{cpu()}, {threads} threads; read bandwidth {bandwidth / 1e9:.1f} GB/s (torch sum over 1 GiB)")
    model = bench_model(args.work, args.model)
    variants = [(model, "F16"), *([(quantized(model, args.quant), args.quant)] if args.quant else [])]
    timers: dict[str, Timer] = {}
    cases: list[Case] = []
    powerinfer = {qtype: variant.powerinfer for variant, qtype in variants}
    for variant, qtype in variants:
        for kind, path in (("dense", variant.dense), ("sparse", variant.powerinfer)):
            shapes = [(b, positions[0]) for b in batches] + [(1, p) for p in positions[1:]]
            mine = [Case(path, kind, qtype, b, p, cache) for b, p in shapes for cache in caches]
            theirs = [Case(path, kind, qtype, b, p) for b, p in shapes]
            cases += mine
            forward = load_forward(open_model(path), RuntimeOptions(ffn="dense" if kind == "dense" else "auto"))
            timers[f"ours {path.name}"] = ours(forward.forward, mine, args.steps)
            if before is not None:
                timers[f"before {path.name}"] = on_kernels(before, ours(forward.forward, mine, args.steps))
            if args.llama_batched_bench is not None and kind == "dense":
                command = llama_command(args.llama_batched_bench, path, threads, args.steps)
                timers[f"llama.cpp {path.name}"] = peer(command, theirs, args.steps)
            if args.powerinfer_batched_bench is not None and qtype in ENGINE_TYPES:
                command = engine_command(args.powerinfer_batched_bench, path, args.steps)
                timers[f"engine {path.name}"] = peer(command, theirs, args.steps)
    best: dict[tuple[str, Case], float] = {}
    # Interleaved rounds, best of each: load from other processes on a shared machine only ever slows a run. The table
    # so far is printed after every round, so that a long run gives figures before it ends.
    for round_ in range(args.rounds):
        for name, timer in timers.items():
            started = time.perf_counter()
            for case, speed in timer().items():
                key = (name.split(" ", 1)[0], case)
                best[key] = max(best.get(key, 0.0), speed)
            console.print(f"round {round_ + 1}: {name} ({time.perf_counter() - started:.0f} s)")
        console.print(results(cases, best, powerinfer, bandwidth, args.steps, threads, round_ + 1, before is not None))


def results(
    cases: list[Case], best: dict[tuple[str, Case], float], powerinfer: dict[str, Path], bandwidth: float, steps: int,
    threads: int, rounds: int, with_before: bool = False,
) -> Table:  # fmt: skip
    table = Table(
        title=f"aggregate decode tokens/s ({threads} threads, {steps} steps, best of {rounds} rounds)"
    )
    columns = ("file", "B", "KV pos", "KV type", "ours", "llama.cpp", "PowerInfer", "limit", "ours/llama.cpp",
               "ours/PowerInfer", "ours/limit", "sparse/dense")  # fmt: skip
    for column in (*columns, *(("before", "ours/before") if with_before else ())):
        table.add_column(column, justify="right" if column != "file" else "left", no_wrap=True)
    for case in cases:
        mine = best.get(("ours", case), math.nan)
        llama = best.get(("llama.cpp", case), math.nan)
        engine = best.get(("engine", case), math.nan)
        limit = step_limit(powerinfer[case.qtype], case, steps, bandwidth)
        dense = next((c for c in cases if c.kind == "dense" and (c.qtype, c.batch, c.position, c.cache) ==
                      (case.qtype, case.batch, case.position, case.cache)), None)  # fmt: skip
        versus_dense = mine / best.get(("ours", dense), math.nan) if case.kind == "sparse" and dense else math.nan
        earlier = best.get(("before", case), math.nan)
        table.add_row(
            case.file.name, str(case.batch), str(case.position), case.cache,
            *(_cell(v) for v in (mine, llama, engine, limit)),
            *(_ratio(mine, other) for other in (llama, engine, limit)), _ratio(versus_dense, 1.0),
            *((_cell(earlier), _ratio(mine, earlier)) if with_before else ()),
        )  # fmt: skip
    return table


def _cell(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.2f}"


def _ratio(ours_: float, other: float) -> str:
    return "-" if math.isnan(ours_) or math.isnan(other) else f"{ours_ / other:.2f}x"


if __name__ == "__main__":
    main()
