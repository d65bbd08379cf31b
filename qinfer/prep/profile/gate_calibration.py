"""Training-free sparsity for a SwiGLU model (CATS): per layer, the threshold on |act(gate)| under which a chosen
share of the calibration corpus's (token, neuron) pairs fall, and how often each neuron passes it.

Two passes over the corpus through the transformers model: the first samples every layer's |act(gate)| and picks
its thresholds (a quantile of the sample), the second counts, per neuron, the tokens on which it passes its layer's
threshold. The counts are activation statistics like `qinfer prep profile` writes, so the planner places a
calibrated model's neurons as it places a ReLU model's; the thresholds go into the model file (`qinfer prep
convert --calibration`), where the runtime skips the up and down rows of every neuron under them.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from qinfer.core.errors import UserError
from qinfer.core.spec_readers import spec_from_hf_dir
from qinfer.formats.activation_files import LayerSummary, is_activation_output, write_activations
from qinfer.formats.atomic_file import OutputKind, atomic_directory, check_apart, check_replaceable
from qinfer.formats.calibration_dir import THRESHOLDS_FILE, Calibration, write_calibration
from qinfer.prep.profile.activation_profile import STATE_FILES
from qinfer.prep.profile.corpus_reader import batches, corpus_files, token_windows
from qinfer.prep.profile.ffn_taps import forward_hooks, hooked
from qinfer.prep.profile.relu_model import ReluModel, load_relu_model
from qinfer.prep.profile.window_length import CALIBRATE_WINDOW, window_length

# Values of |act(gate)| kept per layer for the quantile, shared equally among the batches: enough that the
# threshold's error in sparsity is far below a percent, and 8 MiB a layer however long the corpus (640 MiB for a
# 70B model's 80 layers).
SAMPLES_PER_LAYER = 1 << 21
# (pass: "sample" or "count", tokens done, tokens of the pass)
CalibrationProgress = Callable[[str, int, int], None]
# An earlier calibration or an activation directory (a profile's, which the README calibrates into): what calibrate
# replaces without --force.
_EARLIER_FILES = re.compile(f"{re.escape(THRESHOLDS_FILE)}|{STATE_FILES.pattern}")
CALIBRATION_OUTPUT = OutputKind(
    "calibration or activation directory", lambda path: is_activation_output(path, _EARLIER_FILES)
)


@dataclass(frozen=True)
class CalibrationResult:
    out: Path
    calibration: Calibration
    achieved: list[float]  # per layer, the share of the corpus's (token, neuron) pairs under the threshold
    layers: list[LayerSummary]
    device: str
    dtype: str


def _gate_activation(loaded: ReluModel) -> Callable[[torch.Tensor], torch.Tensor]:
    return F.silu if loaded.form.act == "silu" else F.relu


def _run(loaded: ReluModel, windows: list[torch.Tensor], batch_size: int, on_gate: Callable[[int], Callable[..., None]],
         tell: Callable[[int], None]) -> None:  # fmt: skip
    gate = loaded.arch.hf.gate
    assert gate is not None
    done = 0
    with torch.inference_mode(), hooked(forward_hooks(loaded.layers, gate, on_gate)):
        for batch in batches(iter(windows), batch_size):
            loaded.model.base_model(input_ids=batch.to(loaded.device), use_cache=False)
            done += batch.numel()
            tell(done)


def quantile_threshold(sample: torch.Tensor, sparsity: float) -> float:
    """The value under which (or at which) `sparsity` of the sample lies; 0 for none of it."""
    k = math.floor(sparsity * sample.numel())
    return 0.0 if k == 0 else float(torch.kthvalue(sample.float().cpu(), k).values)


def calibrate_gate(
    model_dir: Path,
    data: Path,
    sparsity: float,
    out: Path | None = None,
    *,
    tokens: int | None = None,
    seq_len: int | None = None,
    batch_size: int = 4,
    dtype: str | None = None,
    device: str = "auto",
    seed: int = 0,
    on_progress: CalibrationProgress | None = None,
    force: bool = False,
) -> CalibrationResult:
    """Write `out` (default MODEL_DIR/calibration): gate_thresholds.json, activation_{i}.pt and summary.json. It
    replaces an earlier calibration or activation directory or an empty one whole, or any other with `force`."""
    if not 0.0 <= sparsity < 1.0:
        raise UserError(f"--sparsity must be at least 0 and below 1, not {sparsity}")
    if batch_size < 1:
        raise UserError("batch-size must be positive")
    out = out if out is not None else model_dir / "calibration"
    check_apart(out, {"model directory": model_dir, "corpus": data})
    check_replaceable(out, CALIBRATION_OUTPUT, force)
    files = corpus_files(data)
    seq_len = window_length(seq_len, CALIBRATE_WINDOW, spec_from_hf_dir(model_dir).context_length)
    loaded = load_relu_model(model_dir, dtype, device)
    if not loaded.form.gated or loaded.arch.hf.gate is None:
        raise UserError(
            f"{model_dir} ({loaded.spec.arch}) has no gate to calibrate; profile it with `qinfer prep profile`"
        )
    windows = list(token_windows(loaded.tokenizer, files, seq_len, tokens))
    total = sum(w.numel() for w in windows)
    if total == 0:
        raise UserError(f"the corpus {data} holds no text to calibrate on")
    act = _gate_activation(loaded)
    layers = loaded.spec.layers
    per_batch = max(1, SAMPLES_PER_LAYER // math.ceil(len(windows) / batch_size))
    tell = on_progress or (lambda _p, _d, _t: None)
    gen = torch.Generator().manual_seed(seed)

    samples: list[list[torch.Tensor]] = [[] for _ in range(layers)]

    def sample(i: int) -> Callable[..., None]:
        def hook(_module: torch.nn.Module, _args: tuple[torch.Tensor, ...], gate: torch.Tensor) -> None:
            values = act(gate.float()).abs().flatten()
            picks = torch.randint(values.numel(), (min(values.numel(), per_batch),), generator=gen)
            samples[i].append(values[picks.to(values.device)].cpu())

        return hook

    _run(loaded, windows, batch_size, sample, lambda done: tell("sample", done, total))
    thresholds = [quantile_threshold(torch.cat(s), sparsity) for s in samples]
    samples.clear()

    counts = torch.zeros(layers, loaded.spec.ffn, dtype=torch.int64, device=loaded.device)
    under = torch.zeros(layers, dtype=torch.int64)

    def count(i: int) -> Callable[..., None]:
        def hook(_module: torch.nn.Module, _args: tuple[torch.Tensor, ...], gate: torch.Tensor) -> None:
            passes = act(gate.float()).abs().flatten(0, -2) > thresholds[i]
            counts[i] += passes.sum(0)
            under[i] += int((~passes).sum())

        return hook

    _run(loaded, windows, batch_size, count, lambda done: tell("count", done, total))
    spec = loaded.spec
    calibration = Calibration(
        str(spec.activation), sparsity, total, thresholds, spec.arch, spec.hidden, spec.ffn, spec.vocab_size
    )
    meta = {"model": str(model_dir), "arch": loaded.spec.arch, "data": [str(p) for p in files], "seq_len": seq_len,
            "sparsity": sparsity}  # fmt: skip
    # Swapped in whole: a run killed while writing leaves the earlier files, never counts of one run beside thresholds
    # of another.
    with atomic_directory(out, CALIBRATION_OUTPUT, force) as tmp:
        summaries = write_activations(tmp, counts.cpu(), total, meta)
        write_calibration(tmp, calibration)
    neurons = total * loaded.spec.ffn
    return CalibrationResult(
        out=out,
        calibration=calibration,
        achieved=[int(n) / neurons for n in under],
        layers=summaries,
        device=loaded.device.type,
        dtype=str(loaded.dtype).removeprefix("torch."),
    )
