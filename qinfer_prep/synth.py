"""Build a tiny ReLU-sparse LLaMA ("synth") with a real tokenizer and PowerInfer-style predictors, offline.

No checkpoint or data set can be downloaded here, so tests and benchmarks need a model made on the spot that
still behaves like ReluLLaMA where it matters: most FFN neurons stay silent on each token, a few hot neurons do
most of the firing, and a small predictor can tell from the residual stream which neurons will fire.

How the sparsity is made exact: hidden channel 0 of the residual stream is held at a constant (the embedding
sets it, and o_proj and down_proj never write to it), so column 0 of each gate_proj acts as a per-neuron bias.
RMSNorm only rescales, so neuron j fires iff (gate_proj * norm weight) @ h > 0 for the un-normalised residual
h, and setting its bias to a quantile of the rest of that sum makes it fire at a chosen rate. The rates follow
a power law, which gives the hot/cold skew. While training, every batch re-derives the biases before the MLP
runs, so the model learns under the sparsity it will have; then one pass over calibration text fixes them,
layer by layer.

Why the predictors are exact: the rest of each gate_proj is kept at rank P/2 - 1 (its rows stay in a fixed
random subspace; P is capped at 2 * hidden), so with the bias column the sign-deciding matrix has rank P/2 and
fc2 @ relu(fc1 @ h) reproduces it, as relu(z) - relu(-z) = z. Real ReLU models get by with small predictors
for the same reason, their firing patterns are low-dimensional; here that is built in rather than learned.
"""

from __future__ import annotations

import io
import json
import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path

import sentencepiece as spm
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM, LlamaTokenizer
from transformers.initialization import no_init_weights
from transformers.tokenization_utils_base import generate_merges
from transformers.utils import logging as hf_logging

from qinfer_core.atomic_file import atomic_directory
from qinfer_core.errors import UserError
from qinfer_core.predictor_dir import FC1, FC2
from qinfer_prep.synth_corpus import paragraphs, synth_corpus

Progress = Callable[[str, int, int], None]
Predictor = tuple[torch.Tensor, torch.Tensor]  # fc1.weight [P, E], fc2.weight [F, P]

BIAS_VALUE = 1.0  # residual channel 0; the embedding std is 1 too, so after RMSNorm the channel is ordinary-sized
SEQ_LEN = 128
BATCH = 16
DEFAULT_TRAIN_STEPS = 100  # about 40 s on 2 cores for the default shape, to a held-out loss near 0.85
LR = 3e-3
TRAIN_CALIBRATION_STRIDE = 4
RATE_POWER = 1.3  # neuron firing rate ~ rank ** -RATE_POWER: the hottest 20% get about 75% of all firings
MAX_RATE = 0.9
PREDICTOR_RECALL = 0.97  # the threshold keeps this share of calibration firings (the sign suffices if exact)
SPECIAL_PIECES = ("<unk>", "<s>", "</s>")
BOS, EOS = 1, 2
TOKENIZER_CHARS = 400_000
TRAIN_CHARS_MAX = 4_000_000  # about a million tokens: windows drawn from it repeat rarely even in long runs
# Calibration and held-out text get up to 32 sequences each, fewer for big models (down to 2 for 7B-sized
# layers) so that each pass stays within this many FLOPs, i.e. seconds on 2 cores and little memory.
SAMPLE_ROWS = (2, 32)
SAMPLE_FLOPS = 2e11


@dataclass(frozen=True)
class SynthShape:
    layers: int = 4
    hidden: int = 128
    ffn: int = 512
    heads: int = 4
    kv_heads: int = 2
    vocab: int = 1024  # sentencepiece vocab size
    context: int = 256  # max_position_embeddings
    predictor_rank: int = 64  # P, the predictor hidden width; a multiple of 32

    @property
    def predictor_width(self) -> int:
        """P as written: never wider than the 2 * hidden (rounded up to 32) at which it is exact anyway."""
        return min(self.predictor_rank, 32 * math.ceil(2 * self.hidden / 32))

    @property
    def gate_rank(self) -> int:
        """Rank of gate_proj without its bias column, so that with it the predictor is exact."""
        return min(self.predictor_width // 2, self.hidden) - 1


@dataclass(frozen=True)
class SynthReport:
    model_dir: Path
    predictor_dir: Path
    sparsity: float  # mean fraction of FFN neurons not firing (gate <= 0) over held-out tokens, all layers
    top20_share: float  # share of firings held by each layer's hottest 20% of neurons, averaged over layers
    per_layer_sparsity: list[float]
    train_seconds: float
    heldout_loss: float  # next-token cross-entropy on held-out text; log(vocab) is a uniform guess
    predictor_recall: float  # share of held-out firings that the predictors flag, all layers
    predictor_sparsity: float  # share of neurons the predictors leave out on held-out tokens, all layers
    sparse_threshold: float


def build_synth(
    out: Path,
    shape: SynthShape = SynthShape(),
    seed: int = 0,
    train_steps: int | None = None,
    target_sparsity: float = 0.9,
    progress: Progress | None = None,
) -> SynthReport:
    """Write `out/model` (a Hugging Face LLaMA checkpoint with tokenizer), `out/predictor` and `out/synth.json`.

    Everything is built in a sibling directory that replaces `out` only when complete.
    """
    _check_args(shape, train_steps, target_sparsity)
    _check_replaceable(out)
    steps = DEFAULT_TRAIN_STEPS if train_steps is None else train_steps
    tell = progress or _no_progress
    gen = torch.Generator().manual_seed(seed)

    tell("tokenizer", 0, 1)
    tokenizer_model = train_tokenizer(synth_corpus(seed, TOKENIZER_CHARS, "train"), shape.vocab)
    sp = spm.SentencePieceProcessor(model_proto=tokenizer_model)
    tell("tokenizer", 1, 1)

    rates = firing_rates(shape.layers, shape.ffn, 1.0 - target_sparsity, gen)
    model, bases = init_model(shape, gen)
    started = time.monotonic()
    if steps:
        stream = token_stream(sp, synth_corpus(seed, min(steps * BATCH * SEQ_LEN * 5, TRAIN_CHARS_MAX), "train"))
        train(model, bases, stream, rates, steps, gen, tell)
    train_seconds = time.monotonic() - started

    rows = sample_rows(model)
    tell("calibrate", 0, 1)
    calib = observe(model, text_batch(sp, seed, "calibrate", rows), rates)
    shrink_bias_columns(model)
    predictors = build_predictors(model, bases, shape.predictor_width)
    threshold = choose_threshold(predictors, calib)
    tell("calibrate", 1, 1)
    tell("measure", 0, 1)
    stats = measure(predictors, threshold, observe(model, text_batch(sp, seed, "heldout", rows)))
    tell("measure", 1, 1)

    result = SynthReport(
        model_dir=out / "model",
        predictor_dir=out / "predictor",
        sparsity=stats.sparsity,
        top20_share=stats.top20_share,
        per_layer_sparsity=stats.per_layer_sparsity,
        train_seconds=train_seconds,
        heldout_loss=stats.loss,
        predictor_recall=stats.recall,
        predictor_sparsity=stats.predicted_sparsity,
        sparse_threshold=threshold,
    )
    tell("save", 0, 1)
    with atomic_directory(out) as tmp:
        tmp.chmod(0o755)  # a private temporary directory becomes an ordinary output one
        save_model(model, tokenizer_model, tmp / "model")
        save_predictors(predictors, threshold, tmp / "predictor")
        _write_json(tmp / "synth.json", _manifest(shape, seed, steps, target_sparsity, result))
    tell("save", 1, 1)
    return result


def _no_progress(stage: str, done: int, total: int) -> None:
    pass


def _check_args(shape: SynthShape, train_steps: int | None, target_sparsity: float) -> None:
    problems = []
    if min(shape.layers, shape.heads, shape.kv_heads) < 1 or shape.hidden < 2 or shape.ffn < 5:
        problems.append("layers, heads and kv_heads must be positive, hidden at least 2 and ffn at least 5")
    elif shape.hidden % shape.heads or (shape.hidden // shape.heads) % 2:
        problems.append(f"hidden={shape.hidden} must split into {shape.heads} heads of an even size")
    elif shape.heads % shape.kv_heads:
        problems.append(f"heads={shape.heads} must be a multiple of kv_heads={shape.kv_heads}")
    if shape.vocab < 384:
        problems.append(f"vocab={shape.vocab} is too small: 259 ids go to byte fallback and special tokens")
    if shape.context < SEQ_LEN:
        problems.append(f"context={shape.context} must be at least {SEQ_LEN}, the length of the text sequences")
    if shape.predictor_rank < 32 or shape.predictor_rank % 32:
        problems.append(f"predictor_rank={shape.predictor_rank} must be a positive multiple of 32")
    if train_steps is not None and train_steps < 0:
        problems.append(f"train_steps={train_steps} must be >= 0")
    if not 0.5 <= target_sparsity < 1.0:
        problems.append(f"target_sparsity={target_sparsity} must be in [0.5, 1)")
    if problems:
        raise UserError("cannot build a synth model: " + "; ".join(problems))


def _check_replaceable(out: Path) -> None:
    """Only an empty directory or an earlier synth build may be replaced, since the whole directory is swapped."""
    if out.exists() and not (out / "synth.json").is_file() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"{out} exists and is not an earlier synth build; pick a new or empty directory")


# --- text and tokenizer ------------------------------------------------------------------------------------


def train_tokenizer(text: str, vocab_size: int) -> bytes:
    """A LLaMA-style SentencePiece BPE model (byte fallback, split digits, no normalisation), serialised."""
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(paragraphs(text)),
        model_writer=model,
        model_type="bpe",
        vocab_size=vocab_size,
        # The stories hold under 2000 distinct pieces; a larger vocab_size (32000 for a 7B-shaped build) only
        # sizes the embedding, and its unused rows are ordinary padding to converters.
        hard_vocab_limit=False,
        byte_fallback=True,
        character_coverage=1.0,
        split_digits=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=True,
        allow_whitespace_only_pieces=True,
        unk_id=0,
        bos_id=BOS,
        eos_id=EOS,
        pad_id=-1,
        max_sentence_length=1 << 16,
        num_threads=1,  # more threads may break ties between equally frequent pairs differently
        minloglevel=2,
    )
    return model.getvalue()


def save_tokenizer(tokenizer_model: bytes, context: int, model_dir: Path) -> None:
    """tokenizer.model for SentencePiece and GGUF converters, tokenizer.json and its config for transformers.

    The fast tokenizer is built from the pieces directly because transformers' own conversion of a
    tokenizer.model needs protobuf; the BPE merges follow from the piece order, as transformers derives them.
    """
    (model_dir / "tokenizer.model").write_bytes(tokenizer_model)
    sp = spm.SentencePieceProcessor(model_proto=tokenizer_model)
    vocab = {sp.id_to_piece(i): i for i in range(sp.get_piece_size())}
    merges = generate_merges(vocab, skip_tokens=set(SPECIAL_PIECES))
    unk, bos, eos = SPECIAL_PIECES
    tokenizer = LlamaTokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=unk,
        bos_token=bos,
        eos_token=eos,
        add_bos_token=True,
        add_eos_token=False,
        model_max_length=context,
    )
    tokenizer.save_pretrained(model_dir)


def token_stream(sp: spm.SentencePieceProcessor, text: str) -> torch.Tensor:
    """Every story as <s> story </s>, concatenated."""
    ids: list[int] = []
    for story in sp.encode(paragraphs(text)):
        ids += [BOS, *story, EOS]
    return torch.tensor(ids, dtype=torch.long)


def text_batch(sp: spm.SentencePieceProcessor, seed: int, split: str, rows: int) -> torch.Tensor:
    """[rows, SEQ_LEN] consecutive tokens of one corpus split."""
    chars = rows * SEQ_LEN * 6
    stream = token_stream(sp, synth_corpus(seed, chars, split))
    while len(stream) < rows * SEQ_LEN:  # a vocabulary with longer pieces than usual
        chars *= 2
        stream = token_stream(sp, synth_corpus(seed, chars, split))
    return stream[: rows * SEQ_LEN].view(rows, SEQ_LEN)


def sample_rows(model: LlamaForCausalLM) -> int:
    flops_per_row = 2 * model.num_parameters() * SEQ_LEN
    return max(SAMPLE_ROWS[0], min(SAMPLE_ROWS[1], int(SAMPLE_FLOPS // flops_per_row)))


# --- model -----------------------------------------------------------------------------------------------------


def llama_config(shape: SynthShape) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.ffn,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        hidden_act="relu",
        max_position_embeddings=shape.context,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=BOS,
        eos_token_id=EOS,
        dtype="float32",
    )


def init_model(shape: SynthShape, gen: torch.Generator) -> tuple[LlamaForCausalLM, list[torch.Tensor]]:
    """The model with every weight drawn from `gen`, and per layer the basis [hidden - 1, gate_rank] that the
    rows of gate_proj (bias column aside) stay in. transformers' own init is skipped: it would draw from the
    global RNG, and for 7B-sized layers it would double the build time."""
    with no_init_weights():
        model = LlamaForCausalLM(llama_config(shape))
    residual_scale = 1.0 / math.sqrt(2 * shape.layers)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith("embed_tokens.weight"):
                param.normal_(0.0, 1.0, generator=gen)
            else:
                std = 1.0 / math.sqrt(param.shape[1])
                if name.endswith(("o_proj.weight", "down_proj.weight")):
                    std *= residual_scale
                param.normal_(0.0, std, generator=gen)
        bases = []
        for layer in model.model.layers:
            basis = torch.linalg.qr(torch.randn(shape.hidden - 1, shape.gate_rank, generator=gen)).Q
            # Unit-variance coordinates in the basis give the gate unit-variance pre-activations.
            coords = torch.randn(shape.ffn, shape.gate_rank, generator=gen) / math.sqrt(shape.gate_rank)
            layer.mlp.gate_proj.weight[:, 1:] = coords @ basis.T
            bases.append(basis)
    restore_structure(model, bases)
    return model, bases


def restore_structure(model: LlamaForCausalLM, bases: list[torch.Tensor]) -> None:
    """Re-impose what an optimizer step may disturb: the constant channel 0 and the gate's low rank."""
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = BIAS_VALUE
        for layer, basis in zip(model.model.layers, bases, strict=True):
            layer.self_attn.o_proj.weight[0] = 0.0
            layer.mlp.down_proj.weight[0] = 0.0
            layer.post_attention_layernorm.weight[0] = 1.0
            gate = layer.mlp.gate_proj.weight
            gate[:, 1:] = (gate[:, 1:] @ basis) @ basis.T


def firing_rates(layers: int, ffn: int, mean_rate: float, gen: torch.Generator) -> torch.Tensor:
    """[layers, ffn] target firing rates: a capped power law of the neuron's rank with mean `mean_rate`,
    dealt out to the neurons of each layer in a random order."""
    profile = torch.arange(1, ffn + 1, dtype=torch.float64) ** -RATE_POWER
    lo, hi = 0.0, float(ffn) ** RATE_POWER
    for _ in range(100):
        mid = (lo + hi) / 2
        if (mid * profile).clamp(max=MAX_RATE).mean() < mean_rate:
            lo = mid
        else:
            hi = mid
    rates = (hi * profile).clamp(max=MAX_RATE).float()
    return torch.stack([rates[torch.randperm(ffn, generator=gen)] for _ in range(layers)])


def _set_biases(layer: nn.Module, h: torch.Tensor, rates: torch.Tensor, stride: int) -> None:
    """Make neuron j fire on a share rates[j] of the residuals h[::stride]: cut between two order statistics."""
    weight = layer.mlp.gate_proj.weight * layer.post_attention_layernorm.weight
    scores = (weight[:, 1:] @ h.reshape(-1, h.shape[-1])[::stride, 1:].T).sort(dim=1).values
    n = scores.shape[1]
    below = ((1.0 - rates) * n).round().long().clamp(1, n - 1)[:, None]
    cut = (scores.gather(1, below - 1) + scores.gather(1, below))[:, 0] / 2
    layer.mlp.gate_proj.weight[:, 0] = -cut / (layer.post_attention_layernorm.weight[0] * BIAS_VALUE)


def shrink_bias_columns(model: LlamaForCausalLM) -> None:
    """Move the size of each gate's bias column into the norm weight of channel 0, leaving the model's function
    unchanged (up_proj reads the same normalised channel, so its column 0 shrinks by the same factor).

    The biases come out 20-200 times larger than the other gate weights; block-quantised formats would
    otherwise flatten the weights that share a block with them.
    """
    with torch.no_grad():
        for layer in model.model.layers:
            gate = layer.mlp.gate_proj.weight
            scale = float(gate[:, 0].abs().max() / gate[:, 1:].abs().max())
            if scale > 1.0:
                layer.post_attention_layernorm.weight[0] *= scale
                gate[:, 0] /= scale
                layer.mlp.up_proj.weight[:, 0] /= scale


@contextmanager
def biases_follow_input(model: LlamaForCausalLM, rates: torch.Tensor, stride: int = 1) -> Iterator[None]:
    """While active, each forward pass first re-derives every layer's gate biases from that layer's input
    (from every `stride`-th token of it: sorting the scores is the costly part of a training step).

    The hook runs just before the layer's FFN, so each layer is calibrated on inputs that already reflect
    the calibrated layers below it.
    """

    def hook(layer: nn.Module, layer_rates: torch.Tensor) -> Callable[[nn.Module, tuple[torch.Tensor, ...]], None]:
        def before_norm(_module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            with torch.no_grad():
                _set_biases(layer, args[0].detach(), layer_rates, stride)

        return before_norm

    handles = [
        layer.post_attention_layernorm.register_forward_pre_hook(hook(layer, rates[i]))
        for i, layer in enumerate(model.model.layers)
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def train(
    model: LlamaForCausalLM,
    bases: list[torch.Tensor],
    stream: torch.Tensor,
    rates: torch.Tensor,
    steps: int,
    gen: torch.Generator,
    progress: Progress,
) -> None:
    """Next-token training on random windows of `stream`, with the biases tracking the target rates."""
    matrices = [p for p in model.parameters() if p.dim() == 2]
    vectors = [p for p in model.parameters() if p.dim() != 2]
    opt = torch.optim.AdamW(
        [{"params": matrices, "weight_decay": 0.1}, {"params": vectors, "weight_decay": 0.0}], lr=LR, betas=(0.9, 0.95)
    )
    warmup = max(1, steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))
    )
    model.train()
    with biases_follow_input(model, rates, TRAIN_CALIBRATION_STRIDE):
        for step in range(steps):
            starts = torch.randint(0, len(stream) - SEQ_LEN, (BATCH,), generator=gen).tolist()
            batch = torch.stack([stream[s : s + SEQ_LEN] for s in starts])
            loss = model(input_ids=batch, labels=batch).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            restore_structure(model, bases)
            progress("train", step + 1, steps)
    model.eval()


# --- observing and predicting ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Observed:
    """One forward pass seen from inside: per layer the FFN input h [tokens, E] and which neurons fired."""

    inputs: list[torch.Tensor]
    fired: list[torch.Tensor]  # bool [tokens, F]: gate_proj(post_attention_layernorm(h)) > 0
    loss: float


def observe(model: LlamaForCausalLM, batch: torch.Tensor, rates: torch.Tensor | None = None) -> Observed:
    """Run `batch` through the model and record each layer's FFN input and firing pattern.

    With `rates`, the same pass first calibrates every layer's biases to them (see biases_follow_input).
    """
    layers = list(model.model.layers)
    inputs: list[torch.Tensor] = [torch.empty(0)] * len(layers)
    fired: list[torch.Tensor] = [torch.empty(0)] * len(layers)

    def keep_input(i: int) -> Callable[[nn.Module, tuple[torch.Tensor, ...]], None]:
        def hook(_module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            inputs[i] = args[0].detach().reshape(-1, args[0].shape[-1])

        return hook

    def keep_firing(i: int) -> Callable[[nn.Module, tuple[torch.Tensor, ...], torch.Tensor], None]:
        def hook(_module: nn.Module, _args: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
            fired[i] = (output > 0).reshape(-1, output.shape[-1])

        return hook

    handles = [
        layer.post_attention_layernorm.register_forward_pre_hook(keep_input(i)) for i, layer in enumerate(layers)
    ]
    handles += [layer.mlp.gate_proj.register_forward_hook(keep_firing(i)) for i, layer in enumerate(layers)]
    try:
        with torch.no_grad(), biases_follow_input(model, rates) if rates is not None else nullcontext():
            loss = float(model(input_ids=batch, labels=batch).loss)
    finally:
        for handle in handles:
            handle.remove()
    return Observed(inputs, fired, loss)


def build_predictors(model: LlamaForCausalLM, bases: list[torch.Tensor], width: int) -> list[Predictor]:
    """Per layer fc1 [width, E] and fc2 [F, width] with fc2 @ relu(fc1 @ h) = (gate_proj * norm weight) @ h.

    That matrix factors as A @ B: A = [bias column, gate coordinates in the basis], B = [norm weight of
    channel 0; basis^T scaled by the other norm weights]; fc1 = [B; -B] and fc2 = [A, -A], zero-padded.
    """
    predictors = []
    for layer, basis in zip(model.model.layers, bases, strict=True):
        with torch.no_grad():
            gate, norm = layer.mlp.gate_proj.weight, layer.post_attention_layernorm.weight
            a = torch.cat([gate[:, :1], gate[:, 1:] @ basis], dim=1)
            b = torch.zeros(a.shape[1], gate.shape[1])
            b[0, 0] = norm[0]
            b[1:, 1:] = basis.T * norm[1:]
        r = a.shape[1]
        fc1 = torch.zeros(width, gate.shape[1])
        fc2 = torch.zeros(gate.shape[0], width)
        fc1[:r], fc1[r : 2 * r] = b, -b
        fc2[:, :r], fc2[:, r : 2 * r] = a, -a
        predictors.append((fc1, fc2))
    return predictors


def predictor_scores(predictor: Predictor, h: torch.Tensor) -> torch.Tensor:
    fc1, fc2 = predictor
    return torch.relu(h @ fc1.T) @ fc2.T


def choose_threshold(predictors: list[Predictor], seen: Observed) -> float:
    """The score above which PREDICTOR_RECALL of the observed firings lie, but never above 0 (the exact sign)."""
    with torch.no_grad():
        scores = torch.cat(
            [predictor_scores(p, h)[f] for p, h, f in zip(predictors, seen.inputs, seen.fired, strict=True)]
        )
    if not len(scores):
        return 0.0
    k = max(1, int((1.0 - PREDICTOR_RECALL) * len(scores)))
    return min(0.0, float(scores.kthvalue(k).values))


@dataclass(frozen=True)
class Stats:
    per_layer_sparsity: list[float]
    top20_share: float
    loss: float
    recall: float
    predicted_sparsity: float

    @property
    def sparsity(self) -> float:
        return sum(self.per_layer_sparsity) / len(self.per_layer_sparsity)


def top_share(fired: torch.Tensor, fraction: float = 0.2) -> float:
    """Share of all firings in `fired` [tokens, F] that its hottest `fraction` of neurons account for."""
    counts = fired.sum(dim=0).sort(descending=True).values
    total = int(counts.sum())
    return int(counts[: max(1, int(fraction * len(counts)))].sum()) / total if total else 0.0


def measure(predictors: list[Predictor], threshold: float, seen: Observed) -> Stats:
    with torch.no_grad():
        flagged = [predictor_scores(p, h) >= threshold for p, h in zip(predictors, seen.inputs, strict=True)]
    firings = sum(int(f.sum()) for f in seen.fired)
    hits = sum(int((p & f).sum()) for p, f in zip(flagged, seen.fired, strict=True))
    return Stats(
        per_layer_sparsity=[1.0 - float(f.float().mean()) for f in seen.fired],
        top20_share=sum(top_share(f) for f in seen.fired) / len(seen.fired),
        loss=seen.loss,
        recall=hits / firings if firings else 1.0,
        predicted_sparsity=1.0 - sum(float(p.float().mean()) for p in flagged) / len(flagged),
    )


# --- saving ------------------------------------------------------------------------------------------------------


def save_model(model: LlamaForCausalLM, tokenizer_model: bytes, model_dir: Path) -> None:
    model_dir.mkdir()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # progress belongs to the caller's callback, not to stderr
    try:
        model.save_pretrained(model_dir)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    save_tokenizer(tokenizer_model, model.config.max_position_embeddings, model_dir)


def save_predictors(predictors: list[Predictor], threshold: float, predictor_dir: Path) -> None:
    predictor_dir.mkdir()
    for i, (fc1, fc2) in enumerate(predictors):
        torch.save({FC1: fc1, FC2: fc2}, predictor_dir / f"model_{i}.pt")
    _write_json(predictor_dir / "config.json", {"sparse_threshold": threshold})


def _write_json(path: Path, data: dict[str, object]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def _manifest(shape: SynthShape, seed: int, steps: int, target: float, result: SynthReport) -> dict[str, object]:
    """What synth.json records: the recipe, so the build can be repeated, and what was measured."""
    measured = {k: v for k, v in asdict(result).items() if k not in ("model_dir", "predictor_dir", "train_seconds")}
    return {"shape": asdict(shape), "seed": seed, "train_steps": steps, "target_sparsity": target, **measured}
