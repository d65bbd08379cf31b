"""How far Q8_0 and Q4_0 move a synth model from its F16 file: logits and perplexity, side by side.

    .venv/bin/python bench/quantize_quality.py [--work DIR] [--ctx 128] [--train-steps 60]

Builds the tiny synth ReLU-LLaMA (the test suite's shape) and converts it to a PowerInfer F16 GGUF, quantizes
that to Q8_0 and Q4_0, then on held-out synth text reports per type: the max and mean absolute logit difference
from F16 over one window decoded token by token on the sparse path, and the perplexity (llama.cpp's windows)
with the dense and the sparse FFN, with its change from F16.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from qinfer.core.kv_policy import F32_KV
from qinfer.prep.convert.convert import convert
from qinfer.prep.convert.quantize import quantize_gguf
from qinfer.prep.synth.build import SynthShape, build_synth
from qinfer.prep.synth.corpus import synth_corpus
from qinfer.runtime.engine.perplexity import perplexity
from qinfer.runtime.engine.tokenizer import GGUFTokenizer
from qinfer.runtime.kv.batch import TokenBatch
from qinfer.runtime.kv.cache import KVCache
from qinfer.runtime.model.loader import RuntimeOptions, load_forward
from qinfer.runtime.model.model_file import open_model

SHAPE = SynthShape(layers=2, hidden=64, ffn=256, heads=4, kv_heads=2, vocab=512, context=256, predictor_rank=32)


def decode_logits(path: Path, ids: list[int]) -> torch.Tensor:
    forward = load_forward(open_model(path), RuntimeOptions(ffn="sparse")).forward
    cache = KVCache(forward.cfg, len(ids), types=F32_KV)
    with torch.inference_mode():
        return torch.cat([forward.forward(TokenBatch.decode([t], [j], [0]), cache) for j, t in enumerate(ids)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--ctx", type=int, default=128)
    parser.add_argument("--train-steps", type=int, default=60)
    parser.add_argument("--chars", type=int, default=20000, help="held-out text length")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.work) as tmp:
        synth = build_synth(Path(tmp) / "synth", SHAPE, seed=0, train_steps=args.train_steps)
        files = {"F16": convert(synth.model_dir, Path(tmp) / "f16.powerinfer.gguf", synth.predictor_dir).outfile}
        for target in ("Q8_0", "Q4_0"):
            files[target] = quantize_gguf(files["F16"], Path(tmp) / f"{target}.powerinfer.gguf", target).outfile
        tokenizer = GGUFTokenizer(open_model(files["F16"]).metadata)
        ids = tokenizer.encode(synth_corpus(0, args.chars, "heldout"))
        window = ids[: args.ctx]
        base = decode_logits(files["F16"], window)
        ppl = {
            (name, ffn): perplexity(
                load_forward(open_model(path), RuntimeOptions(ffn=ffn)).forward,
                ids,
                args.ctx,
                tokenizer.bos_id,
                ffn == "sparse",
            ).perplexity
            for name, path in files.items()
            for ffn in ("dense", "sparse")
        }
        print(f"{len(ids)} held-out tokens, windows of {args.ctx}; logits over {len(window)} decoded tokens")
        print(f"{'type':6}{'MiB':>7}{'max |dlogit|':>14}{'mean |dlogit|':>15}{'PPL dense':>11}{'PPL sparse':>12}")
        for name, path in files.items():
            diff = (decode_logits(path, window) - base).abs()
            dense, sparse = ppl[name, "dense"], ppl[name, "sparse"]
            change = (
                ""
                if name == "F16"
                else f"  ({dense / ppl['F16', 'dense'] - 1:+.2%} / {sparse / ppl['F16', 'sparse'] - 1:+.2%})"
            )
            print(
                f"{name:6}{path.stat().st_size / 2**20:7.2f}{diff.max().item():14.4f}{diff.mean().item():15.4f}"
                f"{dense:11.3f}{sparse:12.3f}{change}"
            )


if __name__ == "__main__":
    main()
