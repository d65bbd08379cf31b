"""Profile how often each FFN neuron fires over a corpus, resumably, and write the activation statistics."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from qinfer_core.activation_files import LayerSummary, write_activations
from qinfer_core.atomic_file import atomic_output
from qinfer_core.errors import UserError
from qinfer_core.torch_files import load_torch_file
from qinfer_prep.corpus_reader import batches, corpus_files, token_windows
from qinfer_prep.ffn_taps import firing_counts
from qinfer_prep.relu_model import load_relu_model

STATE_FILE = ".profile_state.pt"
# (tokens done, tokens wanted or None when the corpus decides, windows done)
ProfileProgress = Callable[[int, int | None, int], None]


@dataclass(frozen=True)
class ProfileResult:
    out: Path
    tokens: int
    windows: int
    resumed_from: int  # windows already counted by an earlier, interrupted run
    device: str
    dtype: str
    fell_back_to_cpu: bool
    layers: list[LayerSummary]


def fingerprint(model_dir: Path, files: list[Path], seq_len: int, tokens: int | None, dtype: torch.dtype) -> str:
    """What must match for a checkpoint to be continued: the model config, the corpus files and the windowing."""
    parts = {
        "config": hashlib.sha256((model_dir / "config.json").read_bytes()).hexdigest(),
        "data": [[str(p.resolve()), p.stat().st_size] for p in files],
        "seq_len": seq_len,
        "tokens": tokens,
        "dtype": str(dtype),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def profile_activations(
    model_dir: Path,
    data: Path,
    out: Path | None = None,
    *,
    tokens: int | None = None,
    seq_len: int = 512,
    batch_size: int = 4,
    dtype: str | None = None,
    device: str = "auto",
    checkpoint_every: int = 32,
    restart: bool = False,
    on_progress: ProfileProgress | None = None,
) -> ProfileResult:
    """Count, per layer and neuron, the tokens on which the neuron fires; write `out` (default MODEL_DIR/activation).

    Every `checkpoint_every` windows the counts and the corpus position go to `out/.profile_state.pt`, so a run
    that is stopped continues from there when started again with the same arguments.
    """
    out = out if out is not None else model_dir / "activation"
    if batch_size < 1 or checkpoint_every < 1:
        raise UserError("batch-size and checkpoint-every must be positive")
    files = corpus_files(data)
    loaded = load_relu_model(model_dir, dtype, device)
    spec = loaded.spec
    key = fingerprint(model_dir, files, seq_len, tokens, loaded.dtype)
    out.mkdir(parents=True, exist_ok=True)  # the checkpoint is written into it long before the results
    state_path = out / STATE_FILE
    counts = torch.zeros(spec.layers, spec.ffn, dtype=torch.int64, device=loaded.device)
    done_tokens, done_windows = 0, 0
    if state_path.is_file() and not restart:
        state = load_torch_file(state_path, "a profiling checkpoint", "pass --restart to discard it")
        if not isinstance(state, dict) or state.get("fingerprint") != key:
            raise UserError(
                f"{state_path} is from a run with other arguments (model, data, seq-len, tokens or dtype); "
                "pass --restart to discard it"
            )
        saved, done_tokens, done_windows = state.get("counts"), state.get("tokens"), state.get("windows")
        if not isinstance(saved, torch.Tensor) or saved.shape != counts.shape or not (
            isinstance(done_tokens, int) and isinstance(done_windows, int) and 0 <= done_windows <= done_tokens
        ):
            raise UserError(f"{state_path} is damaged; pass --restart to discard it")
        counts.copy_(saved)
    resumed_from = done_windows

    windows = token_windows(loaded.tokenizer, files, seq_len, tokens)
    for _ in range(done_windows):
        next(windows)
    tell = on_progress or (lambda _t, _n, _w: None)
    tell(done_tokens, tokens, done_windows)
    since_checkpoint = 0
    with torch.inference_mode(), firing_counts(loaded.layers, loaded.arch, counts):
        for batch in batches(windows, batch_size):
            # The decoder alone: the LM head's logits would be the largest tensor and are not needed.
            loaded.model.base_model(input_ids=batch.to(loaded.device), use_cache=False)
            done_tokens += batch.numel()
            done_windows += len(batch)
            since_checkpoint += len(batch)
            if since_checkpoint >= checkpoint_every:
                _save_state(state_path, key, counts, done_tokens, done_windows)
                since_checkpoint = 0
            tell(done_tokens, tokens, done_windows)

    meta = {
        "model": str(model_dir),
        "arch": spec.arch,
        "data": [str(p) for p in files],
        "seq_len": seq_len,
        "dtype": str(loaded.dtype).removeprefix("torch."),
    }
    layers = write_activations(out, counts, done_tokens, meta)
    state_path.unlink(missing_ok=True)
    return ProfileResult(
        out=out,
        tokens=done_tokens,
        windows=done_windows,
        resumed_from=resumed_from,
        device=loaded.device.type,
        dtype=str(loaded.dtype).removeprefix("torch."),
        fell_back_to_cpu=loaded.fell_back,
        layers=layers,
    )


def _save_state(path: Path, key: str, counts: torch.Tensor, tokens: int, windows: int) -> None:
    state = {"fingerprint": key, "counts": counts.cpu(), "tokens": tokens, "windows": windows}
    with atomic_output(path) as tmp:
        torch.save(state, tmp)
