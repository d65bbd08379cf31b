"""Mixture-of-experts decode speed on the CPU: ours beside llama.cpp on the same GGUF, f16 and Q4_0.

    .venv/bin/python bench/moe.py [--slices mixtral-slice,qwen3moe-slice] [--rounds 3] [--threads 2]
                                  [--tokens 32] [--prompt-tokens 128] [--keep DIR] [--profile-tokens 20000]

Each slice (qinfer/prep/synth/moe_slice.py: two full-width layers of Mixtral-8x7B's or Qwen3-30B-A3B's shape, random
weights) is built, converted to an f16 GGUF and quantized to Q4_0, under --keep (reused when there; without it, in a
temporary directory removed at the end; the Mixtral slice is about 6 GB in f16). Decode tokens/s is 1 / the median
step of --tokens greedy steps after a prompt of --prompt-tokens or more, for batch 1, best of --rounds interleaved
rounds, so that load from other processes on a shared machine skews it little. llama.cpp runs through
llama-cpp-python (the `peers` extra); without it that column is skipped.

A second table puts each slice's planned GPU/CPU split beside llama.cpp's `--n-cpu-moe` split at the same budget
(the dense parts and half of the experts' bytes), in the planner's time model, on a routing profile measured over
the synthetic corpus by the tiny model of the slice's family with the slice's experts (--profile-tokens tokens).
"""

from __future__ import annotations

import argparse
import math
import tempfile
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from decode import bench_prompt, engine_decoder
from decode_peers import LLAMA_CPP_MISSING, Speed, Timer, llama_cpp_available, llama_cpp_decoder
from machine import cpu
from rich.console import Console
from rich.table import Table

from qinfer.formats.activation_files import count_basis, read_activations
from qinfer.planner.budget import GIB
from qinfer.planner.make_plan import PlanOptions, compare_expert_splits, dry_run_account
from qinfer.prep.convert.convert import convert
from qinfer.prep.convert.quantize import quantize_gguf
from qinfer.prep.profile.activation_profile import profile_activations
from qinfer.prep.synth.corpus import synth_corpus
from qinfer.prep.synth.moe import MoeShape, build_moe
from qinfer.prep.synth.moe_slice import SLICES, build_moe_slice
from qinfer.runtime.engine.engine import Engine
from qinfer.runtime.engine.tokenizer import GGUFTokenizer
from qinfer.runtime.model.model_file import open_model

TYPES = ("F16", "Q4_0")


def slice_files(root: Path, name: str) -> dict[str, Path]:
    """The slice's GGUF by type, each built under `root` unless it is there already."""
    model_dir = root / name / "model"
    if not (model_dir / "config.json").exists():
        build_moe_slice(model_dir, name)
    files = {"F16": root / name / f"{name}.f16.gguf", "Q4_0": root / name / f"{name}.q4_0.gguf"}
    if not files["F16"].exists():
        convert(model_dir, files["F16"], None, "f16")
    if not files["Q4_0"].exists():
        quantize_gguf(files["F16"], files["Q4_0"], "Q4_0")
    return files


def routing_profile(root: Path, name: str, tokens: int) -> tuple[np.ndarray, ...]:
    """Per layer, the chance that a token chooses each expert, measured as `make all` measures a tiny model: the
    tiny checkpoint of the slice's family, with the slice's count of experts and of experts per token, profiled over
    the synthetic corpus (`qinfer prep profile`). Random routers like the slice's; no trained model is at hand."""
    family, shape = SLICES[name]
    tiny = replace(MoeShape(), experts=shape.experts, used=shape.used)
    model_dir = root / name / "tiny"
    if not (model_dir / "config.json").exists():
        build_moe(model_dir, family, tiny)
    corpus = root / "corpus.txt"
    if not corpus.exists():
        corpus.write_text(synth_corpus(seed=0, n_chars=200_000), encoding="utf-8")
    out = root / name / "activation"
    if not (out / "summary.json").exists():
        profile_activations(model_dir, corpus, out, tokens=tokens, seq_len=128, device="cpu")
    profiled = count_basis(out).tokens
    return tuple(counts.double().numpy() / profiled for counts in read_activations(out))


def split_table(console: Console, root: Path, files: dict[str, dict[str, Path]], tokens: int) -> None:
    """Each slice's planned CPU/GPU split beside llama.cpp's --n-cpu-moe split at a budget that holds the dense parts
    and half of the experts' bytes, in the planner's time model (its default GPU and CPU profiles), for the measured
    routing profile and for uniform routing."""
    options = PlanOptions()
    table = Table(
        title=f"planned split vs --n-cpu-moe at dense parts + half the experts (planner's model: {options.gpu} GPU, "
        f"{options.cpu} CPU, batch {options.batch}, ctx {options.ctx_size})"
    )
    columns = ("slice", "type", "routing", "budget GiB", "planned tok/s", "--n-cpu-moe", "tok/s", "planned / n-cpu-moe")
    for col in columns:
        table.add_column(col, justify="right")
    for name, paths in files.items():
        measured = routing_profile(root, name, tokens)
        top_half = [float(np.sort(p)[::-1][: len(p) // 2].sum() / p.sum()) for p in measured]
        console.print(f"{name}: the most-routed half of the experts takes {', '.join(f'{s:.0%}' for s in top_half)} "
                      "of the routings, by layer")  # fmt: skip
        for qtype, path in paths.items():
            layout, acct = dry_run_account(path, 1 << 50, options)
            experts = sum(b * n for b, n in zip(acct.neuron_bytes, acct.ffn_neurons, strict=True))
            budget = int(acct.dense + experts / 2)
            uniform = tuple(np.full(len(p), p.sum() / len(p)) for p in measured)
            for routing, frequencies in (("measured", measured), ("uniform", uniform)):
                split = compare_expert_splits(layout, frequencies, budget, options)
                n_cpu = split.n_cpu_moe
                baseline = ("—",) * 3 if n_cpu is None else (
                    str(n_cpu.layers), f"{n_cpu.tokens_per_second:.2f}", f"{split.ratio:.2f}x"
                )
                table.add_row(
                    name, qtype, routing, f"{budget / GIB:.2f}", f"{split.planned_tokens_per_second:.2f}", *baseline
                )  # fmt: skip
    console.print(table)


def _cell(tps: float) -> str:
    return "—" if math.isnan(tps) else f"{tps:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slices", default=",".join(SLICES), help=f"comma-separated, from {', '.join(SLICES)}")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved repetitions; the best of each is shown")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=128, help="prefill at least this many tokens first")
    parser.add_argument("--keep", type=Path, help="build the files here and reuse them on later runs")
    parser.add_argument("--profile-tokens", type=int, default=20_000, help="tokens the routing profile counts")
    args = parser.parse_args()
    names = args.slices.split(",")
    if unknown := [n for n in names if n not in SLICES]:
        parser.error(f"unknown slice {unknown[0]!r}; use {', '.join(SLICES)}")
    torch.set_num_threads(args.threads)
    console = Console(width=max(Console().width, 120))
    llama_cpp = llama_cpp_available()
    if not llama_cpp:
        console.print(LLAMA_CPP_MISSING, markup=False)
    with tempfile.TemporaryDirectory(prefix="moe-bench-") as spare:
        root = args.keep or Path(spare)
        files = {name: slice_files(root, name) for name in names}
        decoders: dict[tuple[str, str, str], Timer] = {}
        for name in names:
            tokenizer = GGUFTokenizer(open_model(files[name]["F16"]).metadata)
            prompt_ids = tokenizer.encode(bench_prompt(tokenizer, args.prompt_tokens))
            ctx = len(prompt_ids) + args.tokens + 8
            for qtype in TYPES:
                path = files[name][qtype]
                engine = Engine.open(path, ctx_size=ctx, ffn="dense")
                decoders[name, qtype, "ours"] = engine_decoder(engine, prompt_ids, args.tokens)
                if llama_cpp:
                    decoders[name, qtype, "llama.cpp"] = llama_cpp_decoder(
                        path, prompt_ids, args.tokens, args.threads, ctx
                    )
        best: dict[tuple[str, str, str], Speed] = {}
        # Interleaved rounds, best of each: load from other processes only ever slows a run.
        for _ in range(args.rounds):
            for key, decode in decoders.items():
                speed = decode()
                best[key] = best[key].best(speed) if key in best else speed
        table = Table(
            title=f"MoE decode tokens/s, batch 1, {args.threads} threads, {cpu()} (best of {args.rounds} "
            f"interleaved rounds, {args.tokens} tokens after a {args.prompt_tokens}+ token prompt)"
        )
        for col in ("slice", "type", "ours", "llama.cpp", "ours / llama.cpp"):
            table.add_column(col, justify="right")
        for name in names:
            for qtype in TYPES:
                ours = best[name, qtype, "ours"].decode
                theirs = best.get((name, qtype, "llama.cpp"), Speed(math.nan)).decode
                ratio = "—" if math.isnan(theirs) else f"{ours / theirs:.2f}x"
                table.add_row(name, qtype, _cell(ours), _cell(theirs), ratio)
        console.print(table)
        split_table(console, root, files, args.profile_tokens)


if __name__ == "__main__":
    main()
