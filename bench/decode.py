"""Decode speed on the CPU, side by side in one run: transformers, our runtime dense, our runtime sparse.

    .venv/bin/python bench/decode.py [--models synth,7b-slice] [--tokens 32] [--rounds 5] [--quant Q4_0]
                                     [--work work/bench] [-t N] [-c 256] [--prompt-tokens 128]
                                     [--powerinfer-main PATH] [--prefill-only [--before-kernels DIR]]

(a) transformers `generate`, greedy, dense, in f16 and f32 (the faster one is the ratio's baseline);
(b) our runtime, dense FFN, on the plain f16 GGUF; (c) our runtime, predictor-sparse FFN, on the f16 PowerInfer
GGUF, with the native sparse FFN kernel, and (c') the same on torch's gather path (QINFER_NATIVE=0).
With --quant, a second row per model runs (b), (c) and (c') on the files quantized to that type
(against the same transformers baselines). Decode tokens/s is 1 / the median time of one decode step over n
steps after the prompt (transformers' steps are timed by a logits processor), best of --rounds interleaved
runs, so that other load on a shared machine skews it little. Models are built under --work on first use
(`bench_model`, also used by bench/gpu_check.sh); the 7B slice takes about a minute and 4 GB of RAM.

A second table sets our runtime beside its peers in the same interleaved rounds (bench/decode_peers.py):
llama.cpp through llama-cpp-python (the `peers` extra) on the dense files, the PowerInfer engine's `main` with
--powerinfer-main on the dense and the PowerInfer files, and the limit, the bytes a step must read over the read
bandwidth measured at the start of the run; with the prompt (prefill) tokens/s of ours and the peers over the
bench's prompt, a sentence repeated to at least --prompt-tokens tokens.

--prefill-only times just the prompt, ours (b) and llama.cpp's on the dense files, in the same interleaved rounds,
and prints that table alone: the quick comparison of prompt speed (a 512-token prompt needs -c 520 or more). With
--before-kernels DIR it also times ours on the native kernels built from DIR's decode_layer.c and row_kernels.c (a
checkout of them before a change), swapped in for each of its runs, so that before and after share every round.
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from decode_peers import (
    LLAMA_CPP_MISSING,
    Speed,
    StepBytes,
    Timer,
    engine_main_problem,
    llama_cpp_available,
    llama_cpp_decoder,
    powerinfer_decoder,
    read_bandwidth,
    selected_shares,
    step_bytes,
)
from machine import cpu
from rich.console import Console
from rich.table import Table
from transformers import LlamaForCausalLM, LogitsProcessor, LogitsProcessorList

from qinfer.prep.convert.convert import convert
from qinfer.prep.convert.quantize import quantize_gguf
from qinfer.prep.synth.build import SynthShape, build_synth
from qinfer.runtime.engine.engine import Engine, Request
from qinfer.runtime.engine.sampling import SamplingParams
from qinfer.runtime.engine.tokenizer import GGUFTokenizer
from qinfer.runtime.kernels import row_kernels
from qinfer.runtime.model.model_file import open_model

SHAPES = {
    "synth": SynthShape(),
    # Four 7B-shaped layers, constructed (not trained) to ~90% FFN sparsity with exact predictors; a context long
    # enough for a 512-token prompt (a slice built before it held 256: rebuild it under a new --work).
    "7b-slice": SynthShape(layers=4, hidden=4096, ffn=11008, heads=32, kv_heads=32, context=1024),
    # The same layer count at a quarter of the width: a quick stand-in for the 7B slice.
    "small-slice": SynthShape(layers=4, hidden=1024, ffn=2752, heads=8, kv_heads=8),
}


@dataclass(frozen=True)
class BenchModel:
    name: str
    model_dir: Path  # Hugging Face checkpoint, for transformers
    powerinfer: Path  # f16 PowerInfer GGUF
    dense: Path  # f16 dense GGUF


def bench_model(work: Path, name: str) -> BenchModel:
    """Build `name` under `work/name` unless it is already there."""
    if name not in SHAPES:
        raise SystemExit(f"unknown model {name!r}; use one of {', '.join(SHAPES)}")
    root = work / name
    model = BenchModel(name, root / "synth" / "model", root / f"{name}.powerinfer.gguf", root / f"{name}.gguf")
    if not (root / "synth" / "synth.json").exists():
        steps = None if name == "synth" else 0
        build_synth(root / "synth", SHAPES[name], seed=0, train_steps=steps)
    if not model.powerinfer.exists():
        convert(model.model_dir, model.powerinfer, root / "synth" / "predictor", "f16")
    if not model.dense.exists():
        convert(model.model_dir, model.dense, None, "f16")
    return model


def quantized(model: BenchModel, qtype: str) -> BenchModel:
    """The model's GGUFs quantized to `qtype` (made on first use)."""
    files = []
    for source in (model.powerinfer, model.dense):
        target = source.with_name(source.name.replace(model.name, f"{model.name}.{qtype}", 1))
        if not target.exists():
            quantize_gguf(source, target, qtype)
        files.append(target)
    return BenchModel(f"{model.name} {qtype}", model.model_dir, files[0], files[1])


PROMPT = "Once upon a time there was a little dog"


def bench_prompt(tokenizer: GGUFTokenizer, tokens: int) -> str:
    """PROMPT repeated until it holds at least `tokens` tokens: the prompt every column prefills."""
    text = PROMPT
    while len(tokenizer.encode(text)) < tokens:
        text += " " + PROMPT
    return text


GREEDY = SamplingParams(temperature=0.0)


class _Stamps(LogitsProcessor):
    """Records when each generation step's logits are ready."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.times.append(time.perf_counter())
        return scores


def transformers_decoder(
    model_dir: Path, prompt_ids: list[int], n: int, dtype: torch.dtype, device: str = "cpu"
) -> Timer:
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()

    def tps() -> Speed:
        stamps = _Stamps()
        with torch.inference_mode():
            model.generate(
                torch.tensor([prompt_ids], device=device),
                max_new_tokens=n + 1,
                min_new_tokens=n + 1,
                do_sample=False,
                pad_token_id=0,
                logits_processor=LogitsProcessorList([stamps]),
            )
        return Speed(1.0 / statistics.median(b - a for a, b in itertools.pairwise(stamps.times)))

    return tps


def runtime_decoder(path: Path, ffn: str, prompt_ids: list[int], n: int, ctx: int, native: bool = True) -> Timer:
    timed = engine_decoder(Engine.open(path, ctx_size=ctx, ffn=ffn), prompt_ids, n)

    def tps() -> Speed:
        os.environ["QINFER_NATIVE"] = "1" if native else "0"
        return timed()

    return tps


def engine_decoder(engine: Engine, prompt_ids: list[int], n: int) -> Timer:
    """An opened engine's prompt and then n greedy tokens, as `qinfer run` steps (groups of steps where the engine
    takes them: Engine.step), each step's time per token it gave (reading its tokens back ends it)."""

    def tps() -> Speed:
        started = time.perf_counter()
        engine.submit(Request(prompt_ids, n + 2, GREEDY, ignore_eos=True))
        # The steps that compute the prompt, in chunks of the engine's prefill_chunk; the last samples a first token.
        while not engine.step():
            pass
        prompt_seconds = time.perf_counter() - started
        seconds: list[float] = []
        while len(seconds) < n:
            started = time.perf_counter()
            tokens = len(engine.step(group=True))
            seconds += [(time.perf_counter() - started) / tokens] * tokens
        for slot in engine.active_slots():  # a group may have ended the sequence at its length
            engine.cancel(slot)
        engine.erase(0)  # the next round's prompt is prefilled whole, not found in the prompt cache
        return Speed(1.0 / statistics.median(seconds), len(prompt_ids) / prompt_seconds)

    return tps


# The PowerInfer engine computes only these weight types (and decodes its f32 PowerInfer files to garbage).
ENGINE_TYPES = ("F16", "Q4_0")


# A peer that did not run (not installed, not asked for, or not on this file type) shows as a dash.
NOT_RUN = Speed(math.nan)


def _cell(tps: float | None) -> str:
    return "—" if tps is None or math.isnan(tps) else f"{tps:.2f}"


def _ratio(ours: float, other: float) -> str:
    return "—" if math.isnan(ours) or math.isnan(other) else f"{ours / other:.2f}x"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="synth,7b-slice", help=f"comma-separated, from {', '.join(SHAPES)}")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5, help="interleaved repetitions; the best of each is shown")
    parser.add_argument("--quant", choices=["Q4_0", "Q8_0"], help="also run the files quantized to this type")
    parser.add_argument("--work", type=Path, default=Path("work/bench"))
    parser.add_argument("-t", "--threads", type=int, default=0)
    parser.add_argument("-c", "--ctx", type=int, default=256, help="context size, for ours and the peers")
    parser.add_argument(
        "--prompt-tokens", type=int, default=128, help="prefill at least this many tokens before decoding"
    )
    parser.add_argument(
        "--powerinfer-main", type=Path, help="the `main` of a PowerInfer engine CPU build: adds its column"
    )
    parser.add_argument(
        "--prefill-only", action="store_true", help="time only the prompt, ours and llama.cpp's, on the dense files"
    )
    parser.add_argument(
        "--before-kernels", type=Path, help="with --prefill-only: also ours on the kernels built from this directory"
    )
    args = parser.parse_args()
    if args.prefill_only:
        prefill_only(args)
        return
    if args.powerinfer_main is not None and (problem := engine_main_problem(args.powerinfer_main)):
        print(problem, file=sys.stderr)
        raise SystemExit(2)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    console = Console(width=max(Console().width, 170))  # the tables are wider than a pipe's default 80 columns
    llama_cpp = llama_cpp_available()
    if not llama_cpp:
        console.print(LLAMA_CPP_MISSING, markup=False)  # its pip extra's [peers] is no markup
    bandwidth = read_bandwidth()
    console.print(f"{cpu()}; read bandwidth {bandwidth / 1e9:.1f} GB/s (torch sum over 1 GiB, {threads} threads, best "
                  "of 5)", markup=False)  # fmt: skip
    table = Table(title=f"decode tokens/s on the CPU ({threads} threads, {args.tokens} tokens)")
    columns = ("model", "(a) HF f16", "(a) HF f32", "(b) ours dense", "(c) ours sparse", "(c') torch path")
    for col in (*columns, "b / best a", "c / b", "c' / b"):
        table.add_column(col, justify="right")
    peers = Table(
        title=f"ours beside the peers: decode tokens/s ({threads} threads, {args.tokens} tokens, -c {args.ctx}, "
        f"after a prompt of {args.prompt_tokens}+ tokens)",
        caption="ours: (b) on dense files, (c) on PowerInfer ones; llama.cpp applies SiLU to a `llama` file (speed "
        "only); limit: bytes a step reads / read bandwidth; prompt: prefill tokens/s of the bench's prompt "
        "(--prompt-tokens)",
    )
    peers.add_column("file", no_wrap=True)
    for col in ("ours", "llama.cpp", "PowerInfer", "limit", "ours/llama.cpp", "ours/PowerInfer", "ours/limit"):
        peers.add_column(col, justify="right")
    for col in ("prompt: ours", "llama.cpp", "PowerInfer"):
        peers.add_column(col, justify="right")
    for name in args.models.split(","):
        model = bench_model(args.work, name)
        tokenizer = GGUFTokenizer(open_model(model.powerinfer).metadata)
        prompt = bench_prompt(tokenizer, args.prompt_tokens)
        prompt_ids = tokenizer.encode(prompt)
        if len(prompt_ids) + args.tokens + 2 > args.ctx:
            parser.error(f"a {len(prompt_ids)}-token prompt and {args.tokens} tokens do not fit -c {args.ctx}")
        decoders = {
            "hf16": transformers_decoder(model.model_dir, prompt_ids, args.tokens, torch.float16),
            "hf32": transformers_decoder(model.model_dir, prompt_ids, args.tokens, torch.float32),
        }
        variants = [(model, "F16"), *([(quantized(model, args.quant), args.quant)] if args.quant else [])]
        limits: dict[str, StepBytes] = {}
        for v, qtype in variants:
            decoders[f"{v.name} dense"] = runtime_decoder(v.dense, "dense", prompt_ids, args.tokens, args.ctx)
            decoders[f"{v.name} sparse"] = runtime_decoder(v.powerinfer, "sparse", prompt_ids, args.tokens, args.ctx)
            decoders[f"{v.name} torch"] = runtime_decoder(
                v.powerinfer, "sparse", prompt_ids, args.tokens, args.ctx, False
            )
            if llama_cpp:
                decoders[f"{v.name} llama.cpp dense"] = llama_cpp_decoder(
                    v.dense, prompt_ids, args.tokens, threads, args.ctx
                )
            if args.powerinfer_main is not None and qtype in ENGINE_TYPES:
                for kind, path in (("dense", v.dense), ("sparse", v.powerinfer)):
                    decoders[f"{v.name} engine {kind}"] = powerinfer_decoder(
                        args.powerinfer_main, path, prompt, args.tokens, threads, args.ctx
                    )
            elif args.powerinfer_main is not None:
                console.print(f"{v.name}: no PowerInfer column, the engine computes only {', '.join(ENGINE_TYPES)}")
            shares = selected_shares(v.powerinfer, prompt_ids, args.tokens, args.ctx)
            limits[v.name] = step_bytes(v.powerinfer, shares)
            console.print(
                f"{v.name}: a step reads {limits[v.name].dense / 1e6:.1f} MB dense, {limits[v.name].sparse / 1e6:.1f} "
                f"MB sparse ({statistics.fmean(shares):.1%} of neurons picked per token, measured on our run)"
            )
        best: dict[str, Speed] = {}
        # Interleaved rounds, best of each: load from other processes on a shared machine only ever slows a run.
        for _ in range(args.rounds):
            for key, decode in decoders.items():
                speed = decode()
                best[key] = best[key].best(speed) if key in best else speed
        os.environ.pop("QINFER_NATIVE")
        hf16, hf32 = best["hf16"].decode, best["hf32"].decode
        baseline = max(hf16, hf32)
        for v, _ in variants:
            dense, sparse, gather = (best[f"{v.name} {k}"].decode for k in ("dense", "sparse", "torch"))
            console.print(
                f"{v.name}: HF f16 {hf16:.2f}, HF f32 {hf32:.2f}, dense {dense:.2f}, sparse {sparse:.2f}, "
                f"sparse on torch's path {gather:.2f} tok/s"
            )
            table.add_row(
                v.name,
                f"{hf16:.2f}",
                f"{hf32:.2f}",
                f"{dense:.2f}",
                f"{sparse:.2f}",
                f"{gather:.2f}",
                f"{dense / baseline:.2f}x",
                f"{sparse / dense:.2f}x",
                f"{gather / dense:.2f}x",
            )
            for kind, path, step in (
                ("dense", v.dense, limits[v.name].dense),
                ("sparse", v.powerinfer, limits[v.name].sparse),
            ):
                ours = best[f"{v.name} {kind}"]
                llama = best.get(f"{v.name} llama.cpp {kind}", NOT_RUN)
                engine = best.get(f"{v.name} engine {kind}", NOT_RUN)
                limit = bandwidth / step
                peers.add_row(
                    path.name,
                    _cell(ours.decode),
                    _cell(llama.decode),
                    _cell(engine.decode),
                    _cell(limit),
                    _ratio(ours.decode, llama.decode),
                    _ratio(ours.decode, engine.decode),
                    _ratio(ours.decode, limit),
                    _cell(ours.prompt),
                    _cell(llama.prompt),
                    _cell(engine.prompt),
                )
    console.print(table)
    console.print(peers)


def kernels_from(directory: Path) -> ctypes.CDLL:
    """The native kernels built from `directory`'s C sources, in a cache directory of their own (a build removes
    other builds of its instruction set from its cache)."""
    saved = row_kernels.SOURCE, row_kernels.SOURCES, os.environ.get("XDG_CACHE_HOME")
    row_kernels.SOURCE = directory / "decode_layer.c"
    row_kernels.SOURCES = (row_kernels.SOURCE, directory / "row_kernels.c")
    os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="qinfer-before-")
    row_kernels.load.cache_clear()
    try:
        lib = row_kernels.load(row_kernels.target())
    finally:
        row_kernels.SOURCE, row_kernels.SOURCES, cache = saved
        os.environ.pop("XDG_CACHE_HOME")
        if cache is not None:
            os.environ["XDG_CACHE_HOME"] = cache
        row_kernels.load.cache_clear()
    if lib is None:
        raise SystemExit(f"the kernels in {directory} do not build")
    return lib


def on_kernels(lib: ctypes.CDLL, timer: Timer) -> Timer:
    """`timer` with every product of its run on `lib`."""

    def run() -> Speed:
        ours = row_kernels.kernel
        row_kernels.kernel = lambda: lib
        try:
            return timer()
        finally:
            row_kernels.kernel = ours

    return run


def prefill_only(args: argparse.Namespace) -> None:
    """Prompt tokens/s of ours (dense) and llama.cpp on each model's dense files, best of --rounds interleaved."""
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    console = Console(width=max(Console().width, 170))
    if not llama_cpp_available():
        console.print(LLAMA_CPP_MISSING, markup=False)
    console.print(cpu(), markup=False)
    table = Table(title=f"prompt (prefill) tokens/s on the CPU ({threads} threads, -c {args.ctx})")
    before = None if args.before_kernels is None else kernels_from(args.before_kernels)
    columns = ("ours before", "ours", "llama.cpp", "before/llama.cpp", "ours/llama.cpp", "ours/before")
    for col in ("file", "prompt tokens", *(columns if before else columns[1:3] + columns[4:5])):
        table.add_column(col, justify="right")
    for name in args.models.split(","):
        model = bench_model(args.work, name)
        tokenizer = GGUFTokenizer(open_model(model.dense).metadata)
        prompt_ids = tokenizer.encode(bench_prompt(tokenizer, args.prompt_tokens))
        if len(prompt_ids) + args.tokens + 2 > args.ctx:
            raise SystemExit(f"a {len(prompt_ids)}-token prompt and {args.tokens} tokens do not fit -c {args.ctx}")
        files = [model.dense, *([quantized(model, args.quant).dense] if args.quant else [])]
        decoders: dict[tuple[Path, str], Timer] = {}
        for path in files:
            decoders[path, "ours"] = runtime_decoder(path, "dense", prompt_ids, args.tokens, args.ctx)
            if before is not None:
                timer = runtime_decoder(path, "dense", prompt_ids, args.tokens, args.ctx)
                decoders[path, "before"] = on_kernels(before, timer)
            if llama_cpp_available():
                decoders[path, "llama.cpp"] = llama_cpp_decoder(path, prompt_ids, args.tokens, threads, args.ctx)
        speeds: dict[tuple[Path, str], Speed] = {}
        for _ in range(args.rounds):
            for key, run in decoders.items():
                speed = run()
                assert speed.prompt is not None
                speeds[key] = speeds[key].best(speed) if key in speeds else speed
        # NaN where no run of a peer finished (llama_cpp_decoder): Speed.best keeps the best of those that did.
        best = {key: math.nan if s.prompt is None else s.prompt for key, s in speeds.items()}
        for path in files:
            ours, llama = best[path, "ours"], best.get((path, "llama.cpp"), math.nan)
            cells = [_cell(ours), _cell(llama), _ratio(ours, llama)]
            if before is not None:
                was = best[path, "before"]
                cells = [_cell(was), *cells[:2], _ratio(was, llama), cells[2], _ratio(ours, was)]
            table.add_row(path.name, str(len(prompt_ids)), *cells)
    console.print(table)


if __name__ == "__main__":
    main()
