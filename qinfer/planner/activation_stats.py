"""Per-layer activation statistics (`activation/activation_{i}.pt`) as firing probabilities: of each FFN neuron, or
of each expert of a mixture (the chance a token chooses it)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from qinfer.core.errors import UserError
from qinfer.formats.activation_files import Unit, activation_paths, count_basis, load_counts

_NOUN = {"neuron": "FFN neuron", "expert": "expert"}


@dataclass(frozen=True)
class ActivationStats:
    """`firing[i][j]`: probability that unit j of layer i fires on a token (a neuron), or that a token chooses it
    (an expert).

    Neuron counts become probabilities by dividing by the largest count in the model: profiling corpora are long
    enough that the hottest neuron of a ReLU model fires on (almost) every token, and older directories do not record
    the token count. Expert counts are divided by the tokens profiled, which their summary must record: no expert
    is chosen by every token, so the largest count says nothing about the tokens.
    """

    firing: tuple[np.ndarray, ...]
    digest: str


def load_activation(
    directory: Path, ffn_neurons: tuple[int, ...], unit: Unit = "neuron", arch: str | None = None
) -> ActivationStats:
    """`ffn_neurons`: the units per layer the model places, each a `unit`; a directory counting the other unit, or
    (where its summary records one) profiled on a model of another architecture than `arch`, is refused."""
    paths = activation_paths(directory, len(ffn_neurons))
    basis = count_basis(directory)
    if arch is not None and basis.arch is not None and basis.arch != arch:
        raise UserError(
            f"{directory} was profiled on a {basis.arch} model, but this is a {arch} model; profile this model with "
            "`qinfer prep profile` and pass its directory with --activation"
        )
    if basis.unit != unit:
        raise UserError(
            f"{directory} counts {_NOUN[basis.unit]}s but this model places {_NOUN[unit]}s; profile this model with "
            "`qinfer prep profile` and pass its directory with --activation"
        )
    digest = hashlib.sha256()
    counts = []
    for index, (path, f) in enumerate(zip(paths, ffn_neurons, strict=True)):
        raw = path.read_bytes()
        digest.update(f"{index}:{len(raw)}:".encode())
        digest.update(raw)
        counts.append(load_counts(path, f).detach().to(torch.float64).numpy())
    if unit == "neuron":
        return ActivationStats(firing=to_firing(counts), digest=digest.hexdigest())
    if not basis.tokens:
        raise UserError(f"{directory}/summary.json records no tokens profiled; re-profile the model")
    # The same counts over another number of tokens are other probabilities, so the plan they made is stale.
    digest.update(f"tokens:{basis.tokens}".encode())
    firing = tuple(np.clip(c / basis.tokens, 0.0, 1.0) for c in counts)
    return ActivationStats(firing=firing, digest=digest.hexdigest())


def to_firing(counts: list[np.ndarray]) -> tuple[np.ndarray, ...]:
    top = max(float(c.max()) for c in counts) if counts else 0.0
    if top <= 0:
        raise UserError("every activation count is zero; profile the model on a non-empty corpus")
    return tuple(np.clip(c / top, 0.0, 1.0) for c in counts)


def power_law_firing(
    n_layers: int, ffn: int, *, exponent: float = 1.1, mean_firing: float = 0.12, seed: int = 0
) -> tuple[np.ndarray, ...]:
    """Synthetic statistics: rank-r neuron fires with probability ~ r^-exponent (shuffled), ~`mean_firing` on average.

    Each layer gets its own exponent jitter so that layers differ in how concentrated their hot set is.
    """
    rng = np.random.default_rng(seed)
    ranks = np.arange(1, ffn + 1, dtype=np.float64)
    layers = []
    for _ in range(n_layers):
        p = ranks ** -(exponent * rng.uniform(0.7, 1.3))
        p = np.clip(p * mean_firing / p.mean(), 0.0, 1.0)
        layers.append(rng.permutation(p))
    return tuple(layers)
