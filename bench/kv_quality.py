"""What a `window` KV cache costs in accuracy: perplexity and attention-mass recall against the full cache.

    .venv/bin/python bench/kv_quality.py [--model X.gguf | --work DIR] [--ctx 2048] [--windows 2]
                                         [--budgets 0.5 0.25 0.125]

Without --model it builds a long-context synth ReLU-LLaMA (context and training windows of --ctx tokens) into
--work, once, and converts it. On held-out synth text cut into windows of --ctx tokens (llama.cpp's perplexity
windows: BOS first, the second half scored), every token is decoded one at a time with the dense FFN, so the only
difference between runs is which KV rows each token can see. For each budget it compares three policies:

- recent:        the most recent tokens only (a sliding window);
- sinks+recent:  4 attention sinks plus the recent window (StreamingLLM);
- ours:          sinks, a recent window and heavy hitters by decayed accumulated attention mass (`--kv-policy window`).

Recall is the share of the attention probability that full attention (over every earlier token of the same
run) puts on the rows the policy kept, averaged over scored tokens, layers and heads.
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from qinfer.core.kv_policy import F32_KV, KVPolicy
from qinfer.core.model_spec import ModelSpec
from qinfer.prep.convert.convert import convert
from qinfer.prep.synth.build import SynthShape, build_synth
from qinfer.prep.synth.corpus import synth_corpus
from qinfer.runtime.engine.tokenizer import GGUFTokenizer
from qinfer.runtime.kv.batch import TokenBatch
from qinfer.runtime.kv.cache import Cache, make_kv_cache
from qinfer.runtime.kv.window import WindowKVCache
from qinfer.runtime.model.forward import TransformerForward
from qinfer.runtime.model.loader import RuntimeOptions, load_forward
from qinfer.runtime.model.model_file import open_model

# Fewer steps leave the model's attention nearly uniform over the whole context, where no policy can matter.
TRAIN_STEPS = 1000


def baselines(budget: float) -> dict[str, KVPolicy]:
    return {
        "recent": KVPolicy("window", budget, sinks=0, recent_share=1.0),
        "sinks+recent": KVPolicy("window", budget, recent_share=1.0),
        "ours": KVPolicy("window", budget),
    }


class RecallProbe(WindowKVCache):
    """A window cache that also keeps every key (a shadow of the full cache) to measure, before each eviction,
    how much of full attention's probability lands on the rows the window still holds."""

    def __init__(self, cfg: ModelSpec, ctx: int, policy: KVPolicy, scored_from: int) -> None:
        super().__init__(cfg, ctx, 1, "cpu", policy)
        self.shadow = torch.zeros(cfg.layers, cfg.kv_heads, ctx, cfg.head_dim)
        self.scored_from = scored_from
        self.recall_sum = 0.0
        self.recall_count = 0

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, qpos: torch.Tensor, slots: torch.Tensor
    ) -> torch.Tensor:
        pos = int(qpos[0, 0])
        self.shadow[layer, :, pos] = k[0, 0]
        if pos >= self.scored_from:
            heads = q.shape[2]
            group = heads // k.shape[2]
            keys = self.shadow[layer, :, : pos + 1].repeat_interleave(group, dim=0)  # [heads, pos+1, d]
            probs = torch.softmax(torch.einsum("hd,hkd->hk", q[0, 0], keys) / math.sqrt(q.shape[-1]), dim=-1)
            rows = self.pos[layer, 0].long()  # [kv_heads, R]; a fresh slot's rows are all empty
            held = torch.zeros(k.shape[2], pos + 1).scatter_add_(1, rows.clamp(min=0), (rows >= 0).float()) > 0
            held[:, pos] = True
            self.recall_sum += float((probs * held.repeat_interleave(group, dim=0)).sum(-1).mean())
            self.recall_count += 1
        return super()._attend(q, k, v, layer, qpos, slots)


@dataclass(frozen=True)
class Measured:
    perplexity: float
    recall: float
    seconds: float


def measure(forward: TransformerForward, windows: list[list[int]], policy: KVPolicy | None) -> Measured:
    ctx = len(windows[0])
    first = ctx // 2
    nll: list[torch.Tensor] = []
    recall: list[float] = []
    started = time.perf_counter()
    with torch.inference_mode():
        for tokens in windows:
            # The window cache keeps float32 rows: the full one does too, so that only the policy differs.
            cache: Cache = (
                make_kv_cache(forward.cfg, ctx, types=F32_KV)
                if policy is None
                else RecallProbe(forward.cfg, ctx, policy, first)
            )
            logits = torch.cat([forward.forward(TokenBatch.decode([t], [j], [0]), cache) for j, t in enumerate(tokens)])
            logp = torch.log_softmax(logits[first : ctx - 1].double(), dim=-1)
            nll.append(-logp.gather(1, torch.tensor(tokens[first + 1 :])[:, None])[:, 0])
            if isinstance(cache, RecallProbe):
                recall.append(cache.recall_sum / cache.recall_count)
    ppl = math.exp(float(torch.cat(nll).mean()))
    return Measured(ppl, sum(recall) / len(recall) if recall else 1.0, time.perf_counter() - started)


def long_context_model(work: Path, ctx: int) -> Path:
    """The synth model trained on windows of `ctx` tokens, built once into `work`."""
    gguf = work / f"synth-ctx{ctx}.powerinfer.gguf"
    if gguf.is_file():
        return gguf
    shape = SynthShape(layers=2, hidden=64, ffn=256, heads=4, kv_heads=2, vocab=512, context=ctx, predictor_rank=32)
    work.mkdir(parents=True, exist_ok=True)
    print(f"building a synth model with a context of {ctx} tokens into {work} ...", flush=True)
    synth = build_synth(work / f"synth-ctx{ctx}", shape, seed=0, train_steps=TRAIN_STEPS, train_seq_len=ctx)
    return convert(synth.model_dir, gguf, synth.predictor_dir).outfile


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="a GGUF to measure instead of the synth model")
    parser.add_argument("--work", type=Path, default=Path("work/kv_quality"))
    parser.add_argument("--ctx", type=int, default=2048)
    parser.add_argument("--windows", type=int, default=2)
    parser.add_argument("--budgets", type=float, nargs="+", default=[0.5, 0.25, 0.125])
    args = parser.parse_args()
    path = args.model or long_context_model(args.work, args.ctx)
    model = open_model(path)
    forward = load_forward(model, RuntimeOptions(ffn="dense")).forward
    tokenizer = GGUFTokenizer(model.metadata)
    need = args.windows * args.ctx
    chars = need * 6
    ids = tokenizer.encode(synth_corpus(0, chars, "heldout"))
    while len(ids) < need:
        chars *= 2
        ids = tokenizer.encode(synth_corpus(0, chars, "heldout"))
    windows = [[tokenizer.bos_id, *ids[i * args.ctx + 1 : (i + 1) * args.ctx]] for i in range(args.windows)]
    full = measure(forward, windows, None)
    print(f"{path.name}: {args.windows} windows of {args.ctx} tokens, the second half of each scored")
    print(f"full KV: perplexity {full.perplexity:.4f} ({full.seconds:.0f} s)")
    print(f"{'budget':>7} {'rows':>5} {'policy':>13} {'perplexity':>11} {'vs full':>8} {'recall':>7}")
    for budget in args.budgets:
        for name, policy in baselines(budget).items():
            m = measure(forward, windows, policy)
            change = m.perplexity / full.perplexity - 1
            print(
                f"{budget:>7.1%} {policy.rows(args.ctx):>5} {name:>13} {m.perplexity:>11.4f} {change:>+8.2%} "
                f"{m.recall:>7.2%}",
                flush=True,
            )


if __name__ == "__main__":
    main()
