"""Quality of trained predictors on held-out text, per layer, and their end effect on the model's perplexity.

    .venv/bin/python bench/predictor_quality.py [--hidden 256 --ffn 1024 --layers 4] [--work DIR] [--json FILE]

Builds a synth model (reused from --work when it is there), profiles it and trains predictors with
`--auto-rank` on the "calibrate" split of the synth corpus, then on the "heldout" split reports per layer:
recall, precision, predicted vs true sparsity and predictor size as % of the layer's FFN parameters; and the
mean next-token NLL with the FFN restricted to the predicted neurons vs dense. Targets: recall >= 0.95,
predicted sparsity within 10 points of the true one, NLL (so log-perplexity) up by less than 2%.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch

from qinfer.formats.predictor_dir import FC1, FC2, load_layer
from qinfer.prep.predictor.quality import layer_quality, mean_nll, predictor_logits, predictor_sparse_ffn
from qinfer.prep.predictor.residual_sample import collect_residuals
from qinfer.prep.predictor.training import TrainSettings, train_predictors
from qinfer.prep.profile.activation_profile import profile_activations
from qinfer.prep.profile.corpus_reader import corpus_files, token_windows
from qinfer.prep.profile.relu_model import load_relu_model
from qinfer.prep.synth.build import SynthShape, build_synth
from qinfer.prep.synth.corpus import synth_corpus

SEQ_LEN = 128
HELDOUT_TOKENS = 8192


def main() -> None:
    args = _parse()
    work = args.work or Path(tempfile.mkdtemp(prefix="predictor-quality-"))
    shape = SynthShape(layers=args.layers, hidden=args.hidden, ffn=args.ffn, heads=4, kv_heads=2, vocab=1024)
    synth = work / "synth"
    started = time.monotonic()
    if not (synth / "synth.json").is_file():
        build_synth(synth, shape, seed=args.seed, train_steps=args.train_steps)
    build_s = time.monotonic() - started
    (work / "calibrate.txt").write_text(synth_corpus(args.seed, args.train_tokens * 8, "calibrate"), encoding="utf-8")
    (work / "heldout.txt").write_text(synth_corpus(args.seed, HELDOUT_TOKENS * 8, "heldout"), encoding="utf-8")
    model_dir = synth / "model"

    started = time.monotonic()
    profiled = profile_activations(model_dir, work / "calibrate.txt", work / "activation", seq_len=SEQ_LEN)
    profile_s = time.monotonic() - started
    started = time.monotonic()
    settings = TrainSettings(seq_len=SEQ_LEN, train_tokens=args.train_tokens, heldout_tokens=4096)
    trained = train_predictors(model_dir, work / "calibrate.txt", work / "predictor", settings)
    train_s = time.monotonic() - started

    loaded = load_relu_model(model_dir, "f32", "cpu")
    windows = list(token_windows(loaded.tokenizer, corpus_files(work / "heldout.txt"), SEQ_LEN, HELDOUT_TOKENS))
    sample = collect_residuals(loaded, windows, batch_size=8)
    states = [load_layer(work / "predictor" / f"model_{i}.pt") for i in range(shape.layers)]
    predictors = [(s[FC1].float(), s[FC2].float()) for s in states]
    threshold = trained.sparse_threshold
    quality = [
        layer_quality(i, p, predictor_logits(p, sample.residuals[i].float()) >= threshold, sample.fired(i))
        for i, p in enumerate(predictors)
    ]
    dense = mean_nll(loaded.model, windows, 8, loaded.device)
    with predictor_sparse_ffn(loaded.layers, loaded.arch, predictors, threshold):
        sparse = mean_nll(loaded.model, windows, 8, loaded.device)

    print(f"synth model: {shape.layers} layers, hidden {shape.hidden}, ffn {shape.ffn} (build {build_s:.0f} s)")
    print(f"profile: {profiled.tokens} tokens in {profile_s:.1f} s; train-predictor --auto-rank: {train_s:.1f} s")
    print(f"held-out: {sample.tokens} tokens; sparse_threshold {threshold:.4f}")
    print(f"{'layer':>5} {'rank':>5} {'recall':>7} {'precision':>9} {'pred. sparsity':>14} {'true':>7} {'size %':>7}")
    for q in quality:
        print(
            f"{q.layer:>5} {q.rank:>5} {q.recall:>7.3f} {q.precision:>9.3f} {q.predicted_sparsity:>14.1%} "
            f"{q.true_sparsity:>7.1%} {q.size_share:>7.1%}"
        )
    share = trained.params / (trained.budget / 0.1)
    print(f"all predictors: {trained.params} params = {share:.1%} of FFN params (budget 10%)")
    rise = sparse / dense - 1.0
    print(
        f"mean NLL dense {dense:.4f} (ppl {math.exp(dense):.3f}), predictor-sparse {sparse:.4f} "
        f"(ppl {math.exp(sparse):.3f}): NLL {rise:+.2%}, perplexity {math.exp(sparse - dense) - 1:+.2%}"
    )
    ok = all(q.recall >= 0.95 and q.predicted_sparsity >= q.true_sparsity - 0.10 for q in quality) and rise < 0.02
    print("targets met" if ok else "targets NOT met")
    if args.json:
        result = {"layers": [asdict(q) for q in quality], "dense_nll": dense, "sparse_nll": sparse}
        args.json.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--ffn", type=int, default=1024)
    parser.add_argument("--train-steps", type=int, default=40)
    parser.add_argument("--train-tokens", type=int, default=20_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work", type=Path, help="keep the synth model, corpus and outputs here")
    parser.add_argument("--json", type=Path, help="also write the per-layer numbers here")
    return parser.parse_args()


if __name__ == "__main__":
    torch.set_num_threads(min(2, torch.get_num_threads()))
    main()
