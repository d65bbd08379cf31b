"""How many tokens each window of a corpus holds when a model reads it for profiling, calibration or predictor
training: the commands' defaults, and the one rule that keeps a window within the model's context."""

from __future__ import annotations

from qinfer.core.errors import UserError

PROFILE_WINDOW = 512
CALIBRATE_WINDOW = 512
PREDICTOR_WINDOW = 256


def window_length(seq_len: int | None, default: int, context: int) -> int:
    """`seq_len`, or where it is None `default` cut to the model's context. A longer window is refused: a model with
    learned positions (OPT) has no position past its context, and a rotary one was never trained on them."""
    if seq_len is None:
        return min(default, context)
    if seq_len > context:
        raise UserError(
            f"seq-len {seq_len} is longer than the model's context of {context} tokens; pass at most {context}"
        )
    return seq_len
