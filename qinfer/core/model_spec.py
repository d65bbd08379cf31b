"""A model's hyper-parameters, one vocabulary for every stage: convert, profile, planner, runtime and profiles."""

from __future__ import annotations

from dataclasses import dataclass

from qinfer.core.numbers import Span

DEFAULT_ROPE_BASE = 10000.0
# What a norm's epsilon and a rope base may be, wherever they are read: an epsilon of 0 or less divides by zero or
# takes the root of a negative, and a base of 0 or less makes NaN frequencies.
NORM_EPS = Span(1e-12, 1.0)
ROPE_BASE = Span(1e-6, 1e12)


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3.1's "llama3" rope scaling: long wavelengths slowed by `factor`, short ones kept, the band between
    blended; a converter turns it into the file's per-frequency divisors (rope_freqs)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_context: int


@dataclass(frozen=True)
class Experts:
    """A mixture-of-experts FFN: each token runs the `used` experts its router scores highest, of `count`, each a
    SwiGLU of `ffn` neurons, and sums them weighted by the router's softmax."""

    count: int
    used: int
    ffn: int
    shared_ffn: int = 0  # neurons of the shared expert every token runs, sigmoid-gated (Qwen2-MoE); 0: none
    norm_top_k: bool = True  # the chosen experts' weights rescaled to sum to 1 (Mixtral, Qwen3-MoE)


@dataclass(frozen=True)
class ModelSpec:
    arch: str  # general.architecture: a key of qinfer.core.architectures.ARCHITECTURES
    name: str
    vocab_size: int
    context_length: int  # tokens of context (OPT's position table has a few rows more; see its Architecture)
    hidden: int  # E
    layers: int
    ffn: int  # F, neurons per FFN
    heads: int
    kv_heads: int
    norm_eps: float  # RMSNorm's epsilon for llama and bamboo, LayerNorm's for falcon and opt
    rope_dim: int = 0  # rotated dimensions per head; 0 where the model has no rope (opt)
    rope_theta: float | None = None  # None: not given, the default base applies
    tie_word_embeddings: bool = False
    # What the FFN's neurons compute (a key of architectures.ACTIVATIONS); None: the family's own.
    activation: str | None = None
    sliding_window: int | None = None  # each token attends to its last this-many positions (Mistral); None: all
    rope_scaling: RopeScaling | None = None  # from config.json only; a file holds its result, rope_freqs
    experts: Experts | None = None  # None: one dense FFN of `ffn` neurons per layer
    # Dimensions of each head where they are not hidden / heads (Qwen3-MoE: 128 for 2048 / 32); None: they are.
    head_size: int | None = None

    @property
    def head_dim(self) -> int:
        return self.head_size or self.hidden // self.heads

    @property
    def q_dim(self) -> int:
        """Rows of q, and columns of the attention's output projection."""
        return self.head_dim * self.heads

    @property
    def kv_dim(self) -> int:
        return self.head_dim * self.kv_heads

    @property
    def rope_base(self) -> float:
        return DEFAULT_ROPE_BASE if self.rope_theta is None else self.rope_theta
