"""A bounded sample of (residual stream, firing neurons) pairs per layer: what a predictor is trained on."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from qinfer.prep.profile.corpus_reader import batches
from qinfer.prep.profile.ffn_taps import ffn_inputs
from qinfer.prep.profile.relu_model import ReluModel, fires


@dataclass
class ResidualSample:
    """Per layer: h [N, E] in f16 (the input of ffn_norm) and which of the F neurons fired, bit-packed [N, F/8],
    so that a sample of 24k tokens of a 7B model (32 layers) takes about 7 GiB of host memory rather than 20."""

    residuals: list[torch.Tensor]
    fired_bits: list[np.ndarray]
    ffn: int

    @property
    def tokens(self) -> int:
        return len(self.residuals[0]) if self.residuals else 0

    def fired(self, layer: int) -> torch.Tensor:
        """bool [N, F]"""
        bits = np.unpackbits(self.fired_bits[layer], axis=1, count=self.ffn)
        return torch.from_numpy(bits).bool()


def collect_residuals(
    loaded: ReluModel,
    windows: list[torch.Tensor],
    batch_size: int,
    on_tokens: Callable[[int], None] | None = None,
) -> ResidualSample:
    layers = loaded.layers
    residuals: list[list[torch.Tensor]] = [[] for _ in layers]
    fired_bits: list[list[np.ndarray]] = [[] for _ in layers]
    captured: dict[int, torch.Tensor] = {}
    with torch.inference_mode(), ffn_inputs(layers, captured, loaded.arch):
        for batch in batches(iter(windows), batch_size):
            loaded.model.base_model(input_ids=batch.to(loaded.device), use_cache=False)
            for i, layer in enumerate(layers):
                h = captured.pop(i).flatten(0, -2)
                residuals[i].append(h.to("cpu", torch.float16))
                threshold = loaded.gate_thresholds[i] if loaded.gate_thresholds is not None else 0.0
                active = fires(layer, h, loaded.arch, loaded.form, threshold).cpu().numpy()
                fired_bits[i].append(np.packbits(active, axis=1))
            if on_tokens:
                on_tokens(batch.numel())
    return ResidualSample(
        residuals=[torch.cat(parts) for parts in residuals],
        fired_bits=[np.concatenate(parts) for parts in fired_bits],
        ffn=loaded.spec.ffn,
    )
