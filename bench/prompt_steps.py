"""The layer kernel against the torch path on steps that carry prompt chunks: each case is one forward call, timed
both ways in the same rounds (best of rounds), with the ratio native / torch that kernels/decode_layer.py's caps on
the chunks a call takes (PROMPT_TOKENS, MIXED_PROMPT_TOKENS) rest on.

    .venv/bin/python bench/prompt_steps.py                               # the synth model, built in a temp dir
    .venv/bin/python bench/prompt_steps.py -m work/bench/7b-slice/7b-slice.gguf --cases 0x32x5 16x13x5 0x128+5

A case DxPxL is D decode tokens beside P chunks of L tokens (DxL1+L2+... for chunks of other lengths), each chunk at
the start of a slot of its own and the decode tokens at position 20 of theirs; the kernel's caps are lifted for its
runs, so that every case is timed both ways, except where the kernel refuses the step whatever its size (a
predictor file's decode tokens beside chunks: a dash).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from machine import cpu
from serve_load import build_model

from qinfer.runtime.engine.engine import Engine
from qinfer.runtime.kernels import decode_layer
from qinfer.runtime.kv.batch import TokenBatch

CASES = ["0x1x16", "0x1x128", "0x4x5", "0x32x5", "16x1x64", "16x13x5", "8x4x24", "0x128+5", "8x200+5"]


def parse(case: str) -> tuple[int, list[int]]:
    decode, _, chunks = case.partition("x")
    if "+" in chunks:
        return int(decode), [int(n) for n in chunks.split("+")]
    count, _, length = chunks.partition("x")
    return int(decode), [int(length)] * int(count)


def step(decode: int, chunks: list[int]) -> tuple[TokenBatch, list[int]]:
    """The case's batch and the rows a step asks logits for: every decode token's and each chunk's last."""
    parts, rows = [], list(range(decode))
    if decode:
        parts.append(TokenBatch.decode([7] * decode, [20] * decode, list(range(decode))))
    end = decode
    for i, n in enumerate(chunks):
        parts.append(TokenBatch.prompt(torch.arange(3, 3 + n), 0, decode + i))
        end += n
        rows.append(end - 1)
    return TokenBatch.join(parts), rows


def best_of(run: Callable[[], object], repeats: int) -> float:
    run()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-m", "--model", type=Path, help="a GGUF; default: build the synth model")
    parser.add_argument("--cases", nargs="+", default=CASES)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="timed calls a case and path per round")
    parser.add_argument("-c", "--ctx-size", type=int, default=256)
    args = parser.parse_args()
    cases = [parse(case) for case in args.cases]
    slots = max(decode + len(chunks) for decode, chunks in cases)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or build_model(Path(tmp))
        measure(Engine.open(model, slots=slots, ctx_size=args.ctx_size), model.name, cases, args)


def measure(engine: Engine, name: str, cases: list[tuple[int, list[int]]], args: argparse.Namespace) -> None:
    forward, cache, native = engine.forward, engine.cache, engine.forward.native
    if native is None:
        sys.exit(f"{name}: no native layer step here (see QINFER_NATIVE and the kernel build)")
    # Every call the kernel can take, whatever its size: the caps are what this bench weighs.
    for cap in ("PROMPT_TOKENS", "MIXED_PROMPT_TOKENS", "STEP_TOKENS", "PROMPT_SCORES"):
        setattr(decode_layer, cap, sys.maxsize)
    takes = native.placement

    def timed(batch: TokenBatch, rows: list[int], path: str) -> float:
        native.placement = takes if path == "native" else (lambda *_: None)  # type: ignore[method-assign]
        try:
            with torch.inference_mode():
                return best_of(lambda: forward.forward(batch, cache, rows), args.repeats)
        finally:
            native.placement = takes  # type: ignore[method-assign]

    results: dict[str, dict[str, float]] = {case: {} for case in args.cases}
    for _ in range(args.rounds):
        for case, (decode, chunks) in zip(args.cases, cases, strict=True):
            batch, rows = step(decode, chunks)
            paths = ["torch"]
            if takes(forward.embed_tokens(batch), batch, forward.inv_freq, cache, forward.ffn) is not None:
                paths.append("native")
            for path in paths:
                results[case][path] = min(results[case].get(path, float("inf")), timed(batch, rows, path))
    print(f"{name}, {cpu()}, {torch.get_num_threads()} threads, context {args.ctx_size}, best of "
          f"{args.rounds} rounds of {args.repeats}")  # fmt: skip
    print(f"{'case':>12} {'native ms':>10} {'torch ms':>10} {'native / torch':>14}")
    for case in args.cases:
        got = results[case]
        torch_ms = got["torch"] * 1e3
        if "native" in got:
            print(f"{case:>12} {got['native'] * 1e3:>10.2f} {torch_ms:>10.2f} {got['native'] / got['torch']:>14.2f}")
        else:
            print(f"{case:>12} {'-':>10} {torch_ms:>10.2f} {'-':>14}")


if __name__ == "__main__":
    main()
