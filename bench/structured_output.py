"""What structured output costs a decode step: tokens/s of the same greedy generation with and without a JSON-schema
constraint (llguidance's mask computed and applied before each sample), side by side in one run.

    .venv/bin/python bench/structured_output.py MODEL.gguf [MODEL.gguf ...] [--tokens 48] [--rounds 3]

The schema is an object with a long free string, so the mask is computed at every step and the model, not the
grammar, decides each token; the first mask after loading (llguidance's one-time vocabulary setup) is left out.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from qinfer.runtime.engine.engine import Engine, Request
from qinfer.runtime.engine.grammar_constraint import Grammars
from qinfer.runtime.engine.sampling import SamplingParams

SCHEMA = {"type": "object", "properties": {"story": {"type": "string"}}, "required": ["story"]}
GREEDY = SamplingParams(0.0, 0, 1.0)


def decode_seconds(engine: Engine, prompt: list[int], n: int, grammars: Grammars | None) -> float:
    """Median seconds of one decode step (sampling included) over n steps."""
    constraint = grammars.json_schema(SCHEMA) if grammars is not None else None
    slot = engine.submit(Request(prompt, n + 1, GREEDY, ignore_eos=True, constraint=constraint))
    steps = []
    while slot in engine.active_slots():
        started = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - started)
    return statistics.median(steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", type=Path, nargs="+")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    for path in args.models:
        engine = Engine.open(path, ctx_size=256)
        grammars = Grammars(engine.tokenizer)
        prompt = engine.tokenizer.encode("Once upon a time there was a little dog")
        decode_seconds(engine, prompt, 2, grammars)  # llguidance's one-time setup for this vocabulary
        best = {"free": float("inf"), "json_schema": float("inf")}
        for _ in range(args.rounds):
            best["free"] = min(best["free"], decode_seconds(engine, prompt, args.tokens, None))
            best["json_schema"] = min(best["json_schema"], decode_seconds(engine, prompt, args.tokens, grammars))
        free, constrained = 1 / best["free"], 1 / best["json_schema"]
        print(f"{path.name} (vocabulary {engine.tokenizer.vocab_size}): {free:.1f} tok/s free, {constrained:.1f} "
              f"constrained: {constrained / free:.3f}x ({(best['json_schema'] - best['free']) * 1e6:.0f} us a token)")


if __name__ == "__main__":
    main()
