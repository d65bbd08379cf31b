"""The FFN of one layer, dense or over a subset of neurons, for each FFN form of qinfer.core.architectures.

Neuron i is row i of gate, up and down_t. Forms: act(gate) * up and act(gate) * relu(up), act relu or silu, and
relu(up + up_bias) (no gate). A neuron contributes only where it is selected for that token (`mask`), so a
selection from the predictor gives the predictor's output and the true active set gives the dense output. down's
bias, where there is one, is the block's to add: it belongs to no neuron."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from qinfer.core.architectures import FfnForm
from qinfer.core.errors import UserError
from qinfer.runtime.kernels import row_kernels
from qinfer.runtime.kernels.quant_rows import QuantizedMatrix
from qinfer.runtime.kernels.weight_rows import gather_rows, linear, weighted_row_sum


@dataclass
class FFNWeights:
    """One layer's FFN and predictor; fc1 [P, E] and fc2 [F, P] are absent in a dense GGUF."""

    form: FfnForm
    up: torch.Tensor
    down_t: torch.Tensor
    gate: torch.Tensor | None = None
    fc1: torch.Tensor | None = None
    fc2: torch.Tensor | None = None
    up_bias: torch.Tensor | None = None
    # A neuron fires where |act(gate)| exceeds it: 0 for ReLU and for a dense run, calibrated for a sparse SwiGLU one.
    gate_threshold: float = 0.0

    @property
    def neurons(self) -> int:
        return self.up.shape[0]

    @property
    def has_predictor(self) -> bool:
        return self.fc1 is not None and self.fc2 is not None


def activations(
    form: FfnForm, x: torch.Tensor, gate: torch.Tensor | None, up: torch.Tensor, up_bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Per-neuron activation [T, k] for input x [T, E] and the (gathered) gate/up rows and up biases."""
    u = linear(x, up)
    if up_bias is not None:
        u = u + up_bias.float()
    if not form.gated:
        return F.relu(u)
    if gate is None:
        raise UserError("this FFN form needs ffn_gate, which the model file lacks; re-convert it")
    g = gate_act(form, linear(x, gate))
    return g * (F.relu(u) if form.relu_up else u)


def gate_act(form: FfnForm, g: torch.Tensor) -> torch.Tensor:
    return F.silu(g) if form.act == "silu" else F.relu(g)


def gate_mask(w: FFNWeights, x: torch.Tensor) -> torch.Tensor:
    """The neurons whose |act(gate)| exceeds the layer's threshold for each token of x [T, E], as bool [T, F]: a
    calibrated model's exact selection, made from the whole gate product (CATS)."""
    assert w.gate is not None
    return gate_act(w.form, linear(x, w.gate)).abs() > w.gate_threshold


def dense_ffn(w: FFNWeights, x: torch.Tensor) -> torch.Tensor:
    """Every neuron's output for x [T, E], through the row kernel where it takes the rows (kernel_ffn)."""
    out = kernel_ffn(w, x, torch.arange(w.neurons))
    return out if out is not None else weighted_row_sum(activations(w.form, x, w.gate, w.up, w.up_bias), w.down_t)


def kernel_ffn(w: FFNWeights, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor | None:
    """The output of neurons `ids` (ascending) for many tokens x [T, E] (a prompt), through the row kernel a chunk of
    tokens at a time (a PowerInfer file's rows, on the CPU), or None where it does not take the rows. Beside a dense
    product it computes the same sum, but a neuron whose gate does not fire for a token costs that token no up or down
    row, which makes a ReLU model's prompt several times cheaper, and the neurons left out cost nothing. For a ReLU form
    the first rows' products go first, in the blocked matrix product (about three times the speed of the kernel's dot
    products), and the kernel computes only the rest of the neurons they fire."""
    given = w.form.act == "relu" and x.shape[0] > row_kernels.TOKEN_BLOCK and row_kernels.takes_first()
    chunks = x.split(row_kernels.GIVEN_TOKENS if given else row_kernels.TOKEN_BLOCK)
    if w.up_bias is not None or not row_kernels.takes_ffn(w.form, chunks[0], w.gate, w.up, w.down_t, given):
        return None
    if ids.numel() == 0:
        return torch.zeros(x.shape[0], w.down_t.shape[1])
    firsts: list[torch.Tensor | None] = [None] * len(chunks)
    if given:
        rows = w.gate if w.gate is not None else w.up
        if 2 * ids.numel() <= w.neurons:
            # A copy of few neurons' rows costs less than the others' products (a split's CPU part where the GPU
            # holds most neurons); for many, copying them costs more (f16, 72% of a 7B slice's: 61 ms a layer
            # against 50).
            rows = rows.raw_rows(ids, "cpu") if isinstance(rows, QuantizedMatrix) else gather_rows(rows, ids)
            first = linear(x, rows)
        else:
            first = linear(x, rows)
            # Every neuron, in order (dense_ffn's): the product is theirs already, with no copy of its columns.
            first = first if ids.numel() == w.neurons else first[:, ids]
        firsts = list(first.split(row_kernels.GIVEN_TOKENS))
    outs = []
    for chunk, products in zip(chunks, firsts, strict=True):
        out = row_kernels.sparse_ffn(w.form, chunk, w.gate, w.up, w.down_t, ids, first=products)
        assert out is not None  # takes_ffn and takes_first: every chunk is one it takes
        outs.append(out)
    return torch.cat(outs)


def sparse_rows(
    form: FfnForm,
    x: torch.Tensor,
    gate: torch.Tensor | None,
    up: torch.Tensor,
    down_t: torch.Tensor,
    ids: torch.Tensor,
    mask: torch.Tensor | None,
    up_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """FFN output [T, E] from neurons `ids` (row ids into these weights); `mask` [T, len(ids)] keeps, per token,
    only the neurons selected for it (None: all of them)."""
    if ids.numel() == 0:
        return torch.zeros(x.shape[0], down_t.shape[1], device=x.device)
    if up_bias is None and (out := row_kernels.sparse_ffn(form, x, gate, up, down_t, ids, mask)) is not None:
        return out
    # `activations` consumes both gathers before anything reuses their scratch buffers.
    gate_rows = None if gate is None else gather_rows(gate, ids, "gate")
    bias_rows = None if up_bias is None else up_bias[ids.to(up_bias.device)]
    act = activations(form, x, gate_rows, gather_rows(up, ids, "up"), bias_rows)
    if mask is not None:
        act = act * mask.to(act.device)
    return weighted_row_sum(act, down_t, ids)


def active_ids(mask: torch.Tensor) -> torch.Tensor:
    """Neurons selected for any token of the batch, ascending."""
    return torch.nonzero(mask.any(0)).flatten()


def selected_rows(
    form: FfnForm,
    x: torch.Tensor,
    gate: torch.Tensor | None,
    up: torch.Tensor,
    down_t: torch.Tensor,
    selected: torch.Tensor,
    skip: torch.Tensor,
) -> tuple[torch.Tensor, int, int]:
    """FFN output [T, E] of the neurons some token selects (bool [T, F]) and `skip` (bool [F]) leaves out, each
    token using only its own; with how many neurons that is, and how many selected ones were skipped. The kernel
    lists them itself: the same passes over the masks in torch cost a GPU/CPU split's host part 16 us a layer."""
    if (done := row_kernels.selected_ffn(form, x, gate, up, down_t, selected, skip)) is not None:
        return done
    left = selected & ~skip
    ids = active_ids(left)
    out = sparse_rows(form, x, gate, up, down_t, ids, left[:, ids] if x.shape[0] > 1 else None)
    return out, int(ids.numel()), int((selected & skip).any(0).sum())


def predictor_scores(w: FFNWeights, h: torch.Tensor) -> torch.Tensor:
    """The predictor's score of each neuron for each token of h [T, E]: fc2(relu(fc1(h))), float32 [T, F]."""
    if w.fc1 is None or w.fc2 is None:
        raise UserError("this model file has no predictors (fc1/fc2): use a PowerInfer GGUF, or run it dense")
    return linear(F.relu(linear(h, w.fc1)), w.fc2)


def predicted_mask(w: FFNWeights, h: torch.Tensor, threshold: float) -> torch.Tensor:
    """Neurons the predictor flags for each token of h [T, E]: scores >= threshold, as bool [T, F]."""
    return predictor_scores(w, h) >= threshold


def true_mask(w: FFNWeights, x: torch.Tensor) -> torch.Tensor:
    """The neurons whose activation is non-zero for each token (the oracle a perfect predictor would match)."""
    return activations(w.form, x, w.gate, w.up, w.up_bias) != 0
