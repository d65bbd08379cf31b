"""Training-free sparsity for SwiGLU models (CATS), measured side by side in one run: quality, then speed.

    .venv/bin/python bench/swiglu_sparsity.py [--part quality,speed] [--work work/bench-swiglu] [--rounds 3]
                                              [--tokens 32] [-t N] [--sparsities 0.3,0.5,0.7]

quality: a synth Llama-3-shaped model (SwiGLU, byte-level BPE) trained on the synth corpus; held-out perplexity
token by token (the decode path) at each sparsity, with the calibrated per-layer thresholds (CATS: |silu(gate)|
over a layer's threshold) and with a plain per-token top-k by |silu(gate)| keeping the same share of neurons.

speed: a slice of Llama-3-8B (4 layers of E 4096, F 14336, 32 heads, 8 kv heads; a 32000-token vocabulary, so
that the head weighs in a slice about as it does in the whole model), untrained, calibrated on synth text. Decode
tokens/s of our dense file (llama.cpp's layout), our calibrated files at each sparsity, llama.cpp on the dense file
(the `peers` extra, llama-cpp-python), in f16 and Q4_0, best of --rounds interleaved rounds, with the bandwidth
limit: the bytes a step must read (attention, head, the whole gate, and up and down of the kept share) over the
read bandwidth measured at the start.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from pathlib import Path

import torch
from decode import NOT_RUN, _cell, _ratio, runtime_decoder
from decode_peers import LLAMA_CPP_MISSING, Speed, llama_cpp_available, llama_cpp_decoder, read_bandwidth
from machine import cpu
from rich.console import Console
from rich.table import Table

from qinfer.planner.model_layout import read_model_layout
from qinfer.prep.convert.convert import convert
from qinfer.prep.convert.quantize import quantize_gguf
from qinfer.prep.profile.gate_calibration import calibrate_gate
from qinfer.prep.synth.corpus import synth_corpus
from qinfer.prep.synth.swiglu import SwigluShape, build_swiglu
from qinfer.runtime.engine.perplexity import perplexity
from qinfer.runtime.engine.tokenizer import GGUFTokenizer
from qinfer.runtime.ffn.sparse import FFNWeights, active_ids, dense_ffn, gate_act, sparse_rows
from qinfer.runtime.kernels.weight_rows import linear
from qinfer.runtime.model.loader import RuntimeOptions, forward_class, load_forward
from qinfer.runtime.model.model_file import open_model

QUALITY_SHAPE = SwigluShape(layers=4, hidden=256, ffn=768, heads=8, kv_heads=2, vocab=2048, context=512)
SLICE_SHAPE = SwigluShape(layers=4, hidden=4096, ffn=14336, heads=32, kv_heads=8, vocab=32000, context=1024)
PPL_CTX = 256


class TopKRunner:
    """Per decode token, the `keep` share of each layer's neurons with the largest |silu(gate)|; prompts dense."""

    def __init__(self, layers: list[FFNWeights], keep: float):
        self.layers = layers
        self.keep = keep

    def __call__(self, layer: int, x: torch.Tensor, h: torch.Tensor, prefill: bool) -> torch.Tensor:
        w = self.layers[layer]
        if prefill:
            return dense_ffn(w, x)
        assert w.gate is not None
        score = gate_act(w.form, linear(x, w.gate)).abs()
        top = score.topk(max(1, round(self.keep * w.neurons)), dim=1).indices
        mask = torch.zeros_like(score, dtype=torch.bool).scatter_(1, top, True)
        ids = active_ids(mask)
        return sparse_rows(w.form, x, w.gate, w.up, w.down_t, ids, mask[:, ids] if x.shape[0] > 1 else None)


def quality(work: Path, sparsities: list[float], console: Console) -> None:
    model_dir = work / "quality" / "model"
    if not (model_dir / "config.json").exists():
        started = time.monotonic()
        build_swiglu(model_dir, "llama3", QUALITY_SHAPE, train_steps=400)
        console.print(f"trained the quality model in {time.monotonic() - started:.0f} s")
    corpus = work / "quality" / "calibrate.txt"
    corpus.write_text(synth_corpus(1, 200_000, "calibrate"), encoding="utf-8")
    dense = work / "quality" / "dense.gguf"
    if not dense.exists():
        convert(model_dir, dense, None, "f16")
    tokenizer = GGUFTokenizer(open_model(dense).metadata)
    ids = tokenizer.encode(synth_corpus(2, 60_000, "heldout"))[: PPL_CTX * 16]

    def ppl_of(forward: object) -> float:
        return perplexity(forward, ids, PPL_CTX, tokenizer.bos_id, token_by_token=True).perplexity  # type: ignore[arg-type]

    base = ppl_of(load_forward(open_model(dense), RuntimeOptions(ffn="dense")).forward)
    table = Table(title=f"held-out perplexity, token by token, {len(ids)} tokens (dense {base:.3f})")
    for column in ("sparsity", "CATS ppl", "CATS / dense", "top-k ppl", "top-k / dense", "CATS skipped"):
        table.add_column(column, justify="right")
    for sparsity in sparsities:
        cal = calibrate_gate(model_dir, corpus, sparsity, work / "quality" / f"cal-{sparsity}", seq_len=256,
                             device="cpu")  # fmt: skip
        path = convert(model_dir, work / "quality" / f"cats-{sparsity}.powerinfer.gguf", None, "f16", cal.out).outfile
        cats = ppl_of(load_forward(open_model(path), RuntimeOptions()).forward)
        model = open_model(path)
        layers = load_forward(model, RuntimeOptions(ffn="dense")).forward.ffn.layers  # type: ignore[attr-defined]
        topk = ppl_of(forward_class(model)(model, TopKRunner(layers, 1.0 - sparsity), "cpu"))
        table.add_row(f"{sparsity:.0%}", f"{cats:.3f}", f"{cats / base:.3f}", f"{topk:.3f}", f"{topk / base:.3f}",
                      f"{statistics.fmean(cal.achieved):.1%}")  # fmt: skip
    console.print(table)


def slice_files(work: Path, sparsities: list[float], console: Console) -> dict[str, Path]:
    root = work / "slice"
    model_dir = root / "model"
    if not (model_dir / "config.json").exists():
        console.print("building the Llama-3-8B slice (random weights, about 4 GB of memory)")
        build_swiglu(model_dir, "llama3", SLICE_SHAPE)
    files = {"dense": root / "dense.gguf"}
    if not files["dense"].exists():
        convert(model_dir, files["dense"], None, "f16")
    corpus = root / "calibrate.txt"
    corpus.write_text(synth_corpus(1, 20_000, "calibrate"), encoding="utf-8")
    for sparsity in sparsities:
        path = root / f"cats-{sparsity}.powerinfer.gguf"
        if not path.exists():
            cal = calibrate_gate(model_dir, corpus, sparsity, root / f"cal-{sparsity}", tokens=1024, seq_len=128,
                                 device="cpu")  # fmt: skip
            convert(model_dir, path, None, "f16", cal.out)
        files[f"{sparsity:.0%}"] = path
        if sparsity:
            dense_layout = root / f"cats-dense-{sparsity}.gguf"
            if not dense_layout.exists():
                convert(model_dir, dense_layout, None, "f16", root / f"cal-{sparsity}", dense=True)
            files[f"{sparsity:.0%} dense layout"] = dense_layout
    for name, path in list(files.items()):
        q4 = path.with_name(path.name.replace(".gguf", ".q4_0.gguf"))
        if not q4.exists():
            quantize_gguf(path, q4, "Q4_0")
        files[f"{name} Q4_0"] = q4
    return files


def limit_bytes(path: Path, kept: float, whole_down: bool = False) -> float:
    """Attention, head and every layer's gate, plus up (and down, unless all of it is read) of the kept share of
    neurons."""
    layout = read_model_layout(path)
    shared = layout.output_bytes + sum(layer.attention_bytes for layer in layout.layers)
    ffn = sum(layer.ffn_neurons * layer.neuron_bytes for layer in layout.layers)
    return shared + ffn * ((2 + kept) if whole_down else (1 + 2 * kept)) / 3


def speed(work: Path, sparsities: list[float], rounds: int, tokens: int, console: Console) -> None:
    sparsities = sorted({0.0, *sparsities})
    files = slice_files(work, sparsities, console)
    tokenizer = GGUFTokenizer(open_model(files["dense"]).metadata)
    prompt = tokenizer.encode("Once upon a time there was a little dog " * 4)
    bandwidth = read_bandwidth()
    threads = torch.get_num_threads()
    peers = llama_cpp_available()
    if not peers:
        console.print(LLAMA_CPP_MISSING)
    for quant in ("", " Q4_0"):
        runs = {"dense": runtime_decoder(files["dense" + quant], "dense", prompt, tokens, 256)}
        runs |= {
            f"{s:.0%}": runtime_decoder(files[f"{s:.0%}" + quant], "auto", prompt, tokens, 256) for s in sparsities
        }
        for s in sparsities[1:]:
            name = f"{s:.0%} dense layout"
            runs[name] = runtime_decoder(files[name + quant], "auto", prompt, tokens, 256)
        if peers:
            runs["llama.cpp"] = llama_cpp_decoder(files["dense" + quant], prompt, tokens, threads, 256)
        best: dict[str, Speed] = {name: NOT_RUN for name in runs}
        console.print(f"timing{quant or ' f16'}: {len(runs)} decoders, {rounds} interleaved rounds")
        for _ in range(rounds):
            for name, run in runs.items():
                result = run()
                if math.isnan(best[name].decode) or result.decode > best[name].decode:
                    best[name] = result
        table = Table(title=f"Llama-3-8B slice{quant or ' f16'}: decode tokens/s, best of {rounds}, {threads} threads")
        for column in ("file", "tok/s", "/ our dense", "/ llama.cpp", "limit tok/s", "of limit"):
            table.add_column(column, justify="right")
        llama = best.get("llama.cpp", NOT_RUN).decode
        for name, result in best.items():
            dense = name in ("dense", "llama.cpp")
            share = 0.0 if dense else float(name.split("%")[0]) / 100
            # The dense files hold the same tensors as the calibrated ones, down laid out the other way; a dense
            # layout reads all of down.
            kept = 1.0 - share
            limit = bandwidth / limit_bytes(files["0%" + quant], kept, whole_down=dense or "layout" in name)
            of_limit = "—" if math.isnan(result.decode) else f"{result.decode / limit:.0%}"
            table.add_row(name, _cell(result.decode), _ratio(result.decode, best["dense"].decode),
                          _ratio(result.decode, llama), f"{limit:.2f}", of_limit)  # fmt: skip
        console.print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", default="quality,speed")
    parser.add_argument("--work", type=Path, default=Path("work/bench-swiglu"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("-t", "--threads", type=int, default=0)
    parser.add_argument("--sparsities", default="0,0.3,0.5,0.7")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    sparsities = [float(s) for s in args.sparsities.split(",")]
    console = Console()
    console.print(f"{cpu()}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    parts = args.part.split(",")
    if "quality" in parts:
        quality(args.work, sparsities, console)
    if "speed" in parts:
        speed(args.work, sparsities, args.rounds, args.tokens, console)


if __name__ == "__main__":
    main()
