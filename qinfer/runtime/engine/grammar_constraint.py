"""Structured output: the tokens a request may sample are those its grammar allows next (a JSON schema, or any
JSON object), through llguidance, the grammar engine llama.cpp and vLLM also use.

llguidance computes the allowed-token mask from the grammar and the vocabulary (built once per tokenizer) in tens
of microseconds a token; the engine applies it to a sequence's logits before sampling and feeds it each token
sampled. A sequence ends when its grammar is complete and allows nothing more, or when the model ends it where the
grammar may stop.
"""

from __future__ import annotations

import json
from typing import Any

import llguidance
import llguidance.hf
import llguidance.numpy
import numpy as np
import torch
from transformers import PreTrainedTokenizerFast

from qinfer.core.errors import UserError
from qinfer.runtime.engine.tokenizer import GGUFTokenizer


class GrammarError(UserError):
    """A schema or grammar the engine cannot compile, or a sampled token it refused."""


class Constraint:
    """One sequence's grammar state."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int):
        self._matcher = matcher
        self._vocab_size = vocab_size
        self._bitmask = llguidance.numpy.allocate_token_bitmask(1, vocab_size)

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` [V] with every token the grammar forbids next set to -inf (a new tensor: the step's logits are
        the forward's, made in inference mode)."""
        llguidance.numpy.fill_next_token_bitmask(self._matcher, self._bitmask)
        # Bit t % 32 of word t // 32 allows token t: the words' little-endian bytes, unpacked, are the tokens in order.
        allowed = np.unpackbits(self._bitmask.view(np.uint8), bitorder="little")[: self._vocab_size]
        return logits.masked_fill(torch.from_numpy(allowed == 0), float("-inf"))

    def advance(self, token: int) -> None:
        if not self._matcher.consume_token(token):
            raise GrammarError(f"the grammar refused token {token}: {self._matcher.get_error()}")

    @property
    def complete(self) -> bool:
        """The grammar is satisfied and allows no further token."""
        return self._matcher.is_stopped()


class Grammars:
    """Compiles requests' grammars against one model's vocabulary."""

    def __init__(self, tokenizer: GGUFTokenizer):
        self.vocab_size = tokenizer.vocab_size
        wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend)
        self._tokenizer = llguidance.hf.from_tokenizer(
            wrapped, n_vocab=self.vocab_size, eos_token=sorted(tokenizer.end_ids)
        )

    def json_schema(self, schema: dict[str, Any] | None) -> Constraint:
        """Output that is one JSON value valid under `schema`; None: any JSON object."""
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                json.dumps(schema if schema is not None else {"type": "object"}),
                defaults={"whitespace_flexible": False},
            )
        except ValueError as exc:
            raise GrammarError(f"the JSON schema is not one: {_first_line(str(exc))}") from None
        # The matcher compiles the grammar, and holds any error instead of raising it.
        matcher = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"the grammar does not compile: {_first_line(matcher.get_error())}")
        constraint = Constraint(matcher, self.vocab_size)
        # Some schemas compile and still admit nothing (one that only refers to itself): the engine finds out at
        # the first token, which would otherwise end the answer empty, as if it were one.
        constraint.mask(torch.zeros(self.vocab_size))
        if matcher.is_error():
            raise GrammarError(f"the JSON schema admits no value: {_first_line(matcher.get_error())}")
        return constraint


def _first_line(message: str) -> str:
    """The engine's reason without the parser state it dumps after it."""
    return message.strip().splitlines()[0] if message.strip() else "no reason given"
