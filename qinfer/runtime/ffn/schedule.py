"""The adaptive FFN schedule of a predictor-sparse model on the CPU: per layer and step, the predictor's rows or the
dense ones, whichever the planner's cost model (qinfer.planner.time_model.seconds) says is quicker for the tokens
of this step.

Sparse rows cost the predictor (fc1 and fc2, for every token) and each neuron any token selects (the union), read
once, computed for the tokens that selected it. The dense rows cost every gate row, computed for every token, and
the up and down rows of each neuron whose gate fires for some token (a ReLU model's exact FFN). At one token the
union is a small share of the FFN and the predictor pays for itself; as tokens are added the union approaches the
whole FFN (the union of B tokens' neurons, 1 - (1 - p)^B of them where each token fires a share p), and the
predictor becomes a cost with nothing left to save. Each layer's share p is measured from the union the last step
read, so the choice follows the text being decoded.

The dense rows compute the FFN the predictor approximates, so where the schedule picks them a sequence's tokens can
differ from those it gets decoding alone; `--ffn sparse` keeps the predictor at every batch size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from qinfer.planner.device_profiles import DeviceProfile
from qinfer.planner.time_model import seconds
from qinfer.runtime.ffn.sparse import FFNWeights
from qinfer.runtime.kernels import row_kernels


def _row_bytes(weight: object) -> float:
    described = row_kernels.layout(weight)
    return float(described[1]) if described is not None else 0.0


@dataclass(frozen=True)
class LayerCost:
    """One layer's bytes and per-token FLOPs: a neuron's gate, up and down rows, and the predictor."""

    neurons: int
    gate_bytes: float
    up_down_bytes: float
    neuron_flops: float  # one product of one row with one token
    predictor_bytes: float
    predictor_flops: float  # per token

    @classmethod
    def of(cls, w: FFNWeights) -> LayerCost:
        assert w.fc1 is not None and w.fc2 is not None
        hidden, rank = w.fc1.shape[1], w.fc1.shape[0]
        return cls(
            neurons=w.neurons,
            gate_bytes=_row_bytes(w.gate),
            up_down_bytes=_row_bytes(w.up) + _row_bytes(w.down_t),
            neuron_flops=2.0 * hidden,
            predictor_bytes=rank * _row_bytes(w.fc1) + w.neurons * _row_bytes(w.fc2),
            predictor_flops=2.0 * rank * (hidden + w.neurons),
        )

    def sparse_seconds(self, tokens: int, share: float, cpu: DeviceProfile) -> float:
        union, pairs = self.neurons * (1.0 - (1.0 - share) ** tokens), tokens * share * self.neurons
        read = self.predictor_bytes + union * (self.gate_bytes + self.up_down_bytes)
        compute = tokens * self.predictor_flops + 3 * pairs * self.neuron_flops
        return float(seconds(read, compute, cpu))

    def dense_seconds(self, tokens: int, share: float, cpu: DeviceProfile) -> float:
        union, pairs = self.neurons * (1.0 - (1.0 - share) ** tokens), tokens * share * self.neurons
        read = self.neurons * self.gate_bytes + union * self.up_down_bytes
        compute = (tokens * self.neurons + 2 * pairs) * self.neuron_flops
        return float(seconds(read, compute, cpu))


class FFNSchedule:
    """Which rows each layer reads for a step of `tokens` tokens (`sparse`), learnt from the unions the steps read
    (`observe`)."""

    def __init__(self, layers: Sequence[FFNWeights], cpu: DeviceProfile):
        self.costs = [LayerCost.of(w) for w in layers]
        self.cpu = cpu
        # Per layer, the share of the FFN one token fires; None until a step has measured it.
        self.shares: list[float | None] = [None] * len(layers)

    def sparse(self, layer: int, tokens: int) -> bool:
        """Whether `layer` reads the predictor's rows for a step of `tokens`: always for one token (a group of such
        steps in one native call relies on it), else the cheaper of the two."""
        share = self.shares[layer]
        if share is None or tokens == 1:
            return True
        cost = self.costs[layer]
        return cost.sparse_seconds(tokens, share, self.cpu) <= cost.dense_seconds(tokens, share, self.cpu)

    def observe(self, layer: int, tokens: int, union: int) -> None:
        """A step of `tokens` tokens read the rows of `union` neurons of `layer` (those its predictor selected, or
        those whose gate fired): the per-token share that union implies, were the tokens independent."""
        covered = min(union / self.costs[layer].neurons, 1.0)
        self.shares[layer] = 1.0 - (1.0 - covered) ** (1.0 / tokens)
