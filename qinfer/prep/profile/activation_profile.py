"""Profile how often each FFN neuron fires over a corpus, resumably, and write the activation statistics; in a model
with experts, how often the router sends a token to each expert instead.

A distributed run (`--distributed` under torchrun) splits the corpus between processes by batch: every process walks
the same batches and profiles those whose index % world size is its rank, keeps its own checkpoint, and the counts
are summed over the processes at the end; rank 0 alone writes the results.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from qinfer.core.errors import UserError
from qinfer.core.spec_readers import spec_from_hf_dir
from qinfer.formats.activation_files import (
    LayerSummary,
    Unit,
    is_activation_output,
    summarise,
    write_activations,
)
from qinfer.formats.atomic_file import (
    OutputKind,
    atomic_directory,
    atomic_output,
    check_apart,
    check_replaceable,
    disk_errors,
)
from qinfer.formats.torch_files import load_torch_file, save_torch_file
from qinfer.prep.profile.corpus_reader import batches, corpus_files, token_windows
from qinfer.prep.profile.ffn_taps import firing_counts
from qinfer.prep.profile.relu_model import load_relu_model, resolve_device
from qinfer.prep.profile.router_taps import routing_counts
from qinfer.prep.profile.window_length import PROFILE_WINDOW, window_length

STATE_FILE = ".profile_state.pt"
STATE_FILES = re.compile(r"\.profile_state(?:\.rank\d+)?\.pt")  # state_file's names, of every process
ACTIVATION_OUTPUT = OutputKind("activation directory", lambda path: is_activation_output(path, STATE_FILES))
# What torch.distributed's env:// initialisation reads; torchrun sets them (and LOCAL_RANK) for every process.
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
# (tokens done, tokens wanted or None when the corpus decides, windows done), counted over the whole corpus
ProfileProgress = Callable[[int, int | None, int], None]


@dataclass(frozen=True)
class Shard:
    """One process of a distributed run. It takes whole batches rather than windows, so that each batch is computed
    exactly as a single process computes it (the same shapes, so the same rounding) and the summed counts equal
    a single process's to the bit."""

    rank: int
    world_size: int
    local_rank: int  # which GPU of its node it uses


@dataclass(frozen=True)
class StreamPosition:
    """How far a process has walked the corpus's batches, its own and the others' alike."""

    batches: int = 0
    windows: int = 0
    tokens: int = 0

    def after(self, batch: torch.Tensor) -> StreamPosition:
        return StreamPosition(self.batches + 1, self.windows + len(batch), self.tokens + batch.numel())


@dataclass(frozen=True)
class ProfileResult:
    out: Path
    tokens: int
    windows: int
    resumed_from: int  # windows already walked by an earlier, interrupted run (of this process, when distributed)
    device: str
    dtype: str
    fell_back_to_cpu: bool
    layers: list[LayerSummary]
    unit: Unit  # what the counts count: a dense model's neurons, or the experts a router chose


def torchrun_shard(environ: Mapping[str, str]) -> Shard:
    """This process's place in a torchrun run, from the variables torchrun sets."""
    missing = [name for name in TORCHRUN_VARIABLES if not environ.get(name)]
    if missing:
        raise UserError(
            f"--distributed needs torchrun's environment ({', '.join(missing)} not set); start it as "
            "`torchrun --nproc-per-node N $(which qinfer) prep profile ... --distributed`"
        )
    try:
        rank, world_size, local_rank = (int(environ.get(name, "0")) for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    except ValueError:
        raise UserError("RANK, WORLD_SIZE and LOCAL_RANK must be integers, as torchrun sets them") from None
    if not 0 <= rank < world_size or local_rank < 0:
        raise UserError(f"RANK {rank} is not one of WORLD_SIZE {world_size} processes, or LOCAL_RANK is negative")
    return Shard(rank, world_size, local_rank)


def state_file(shard: Shard | None) -> str:
    """The checkpoint's name in the output directory: one per process of a distributed run."""
    return STATE_FILE if shard is None else f".profile_state.rank{shard.rank}.pt"


def fingerprint(
    model_dir: Path,
    files: list[Path],
    seq_len: int,
    batch_size: int,
    tokens: int | None,
    dtype: torch.dtype,
    shard: Shard | None,
) -> str:
    """What must match for a checkpoint to be continued: the model (its config, and its weight files' names, sizes
    and times: another model of the same config must not add to its counts), the corpus files (a file edited in
    place keeps its size), the windowing and batching (a checkpoint's position counts batches, and a process's
    share is a set of batches) and the process's place in a distributed run."""

    def stamp(path: Path) -> list[int]:
        stat = path.stat()
        return [stat.st_size, stat.st_mtime_ns]

    weights = sorted(p for p in model_dir.iterdir() if p.suffix in (".safetensors", ".bin"))
    parts = {
        "config": hashlib.sha256((model_dir / "config.json").read_bytes()).hexdigest(),
        "weights": [[p.name, *stamp(p)] for p in weights],
        "data": [[str(p.resolve()), *stamp(p)] for p in files],
        "seq_len": seq_len,
        "batch_size": batch_size,
        "tokens": tokens,
        "dtype": str(dtype),
        "rank": None if shard is None else shard.rank,
        "world_size": None if shard is None else shard.world_size,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def profile_activations(
    model_dir: Path,
    data: Path,
    out: Path | None = None,
    *,
    tokens: int | None = None,
    seq_len: int | None = None,
    batch_size: int = 4,
    dtype: str | None = None,
    device: str = "auto",
    checkpoint_every: int = 32,
    restart: bool = False,
    on_progress: ProfileProgress | None = None,
    shard: Shard | None = None,
    force: bool = False,
) -> ProfileResult:
    """Count, per layer and neuron, the tokens on which the neuron fires (in a model with experts, per layer and
    expert, the tokens routed to the expert); write `out` (default MODEL_DIR/activation), which replaces an earlier
    activation directory or an empty one whole, or any other with `force`.

    Every `checkpoint_every` profiled windows the counts and the corpus position go to `out/.profile_state.pt`
    (`state_file`), so a run that is stopped continues from there when started again with the same arguments.
    With a `shard` the process joins its torchrun run (env://; gloo on the CPU, nccl on CUDA), profiles its batches
    and sums the counts with the others; every process returns the totals, and rank 0 alone writes them.
    """
    out = out if out is not None else model_dir / "activation"
    if batch_size < 1 or checkpoint_every < 1:
        raise UserError("batch-size and checkpoint-every must be positive")
    check_apart(out, {"model directory": model_dir, "corpus": data})
    check_replaceable(out, ACTIVATION_OUTPUT, force)
    files = corpus_files(data)
    seq_len = window_length(seq_len, PROFILE_WINDOW, spec_from_hf_dir(model_dir).context_length)
    if shard is not None:
        _use_local_gpu(shard, device)
    loaded = load_relu_model(model_dir, dtype, device, experts=True)
    spec, experts = loaded.spec, loaded.spec.experts
    # A router's choice is sparse whatever its experts compute; only dense neurons need a ReLU to ever be silent.
    if experts is None and loaded.form.act != "relu":
        raise UserError(
            f"{model_dir} is a {loaded.form.act} model: its neurons never stop firing on their own; calibrate a "
            "sparsity for it with `qinfer prep calibrate`"
        )
    rank, world_size = (0, 1) if shard is None else (shard.rank, shard.world_size)
    key = fingerprint(model_dir, files, seq_len, batch_size, tokens, loaded.dtype, shard)
    with disk_errors(out):
        out.mkdir(parents=True, exist_ok=True)  # the checkpoint is written into it long before the results
    state_path = out / state_file(shard)
    width = spec.ffn if experts is None else experts.count
    counts = torch.zeros(spec.layers, width, dtype=torch.int64, device=loaded.device)
    taps = (
        firing_counts(loaded.layers, loaded.arch, loaded.form, counts)
        if experts is None
        else routing_counts(loaded.layers, loaded.arch, experts, counts)
    )
    with _process_group(shard, loaded.device):
        start = StreamPosition()
        if state_path.is_file() and not restart:
            saved, start = _load_state(state_path, key, counts.shape)
            counts.copy_(saved)

        stream = batches(token_windows(loaded.tokenizer, files, seq_len, tokens), batch_size)
        tell = on_progress or (lambda _t, _n, _w: None)
        tell(start.tokens, tokens, start.windows)
        position, since_checkpoint = start, 0
        with torch.inference_mode(), taps:
            for batch in itertools.islice(stream, start.batches, None):
                mine = position.batches % world_size == rank
                position = position.after(batch)
                if mine:
                    # The decoder alone: the LM head's logits would be the largest tensor and are not needed.
                    loaded.model.base_model(input_ids=batch.to(loaded.device), use_cache=False)
                    since_checkpoint += len(batch)
                    if since_checkpoint >= checkpoint_every:
                        _save_state(state_path, key, counts, position)
                        since_checkpoint = 0
                tell(position.tokens, tokens, position.windows)

        if shard is not None:
            dist.all_reduce(counts)
        meta = {
            "model": str(model_dir),
            "arch": spec.arch,
            "data": [str(p) for p in files],
            "seq_len": seq_len,
            "dtype": str(loaded.dtype).removeprefix("torch."),
        }
        if rank == 0:
            # Swapped in whole: a run killed while writing leaves the earlier files, never some of each.
            with atomic_directory(out, ACTIVATION_OUTPUT, force) as tmp:
                layers = write_activations(tmp, counts, position.tokens, meta, experts)
        else:
            layers = summarise(counts, position.tokens)
        if shard is not None:
            dist.barrier()  # the checkpoints go only once rank 0's files are in place: a failed write can be resumed
    state_path.unlink(missing_ok=True)
    return ProfileResult(
        out=out,
        tokens=position.tokens,
        windows=position.windows,
        resumed_from=start.windows,
        device=loaded.device.type,
        dtype=str(loaded.dtype).removeprefix("torch."),
        fell_back_to_cpu=loaded.fell_back,
        layers=layers,
        unit="neuron" if experts is None else "expert",
    )


def _use_local_gpu(shard: Shard, device: str) -> None:
    """Each process of a node takes its own GPU (torchrun's LOCAL_RANK); the model then loads onto it."""
    if resolve_device(device)[0].type != "cuda":
        return
    if shard.local_rank >= torch.cuda.device_count():
        raise UserError(
            f"LOCAL_RANK {shard.local_rank} has no GPU of its own ({torch.cuda.device_count()} visible); "
            "start at most one process per GPU"
        )
    torch.cuda.set_device(shard.local_rank)


@contextlib.contextmanager
def _process_group(shard: Shard | None, device: torch.device) -> Iterator[None]:
    """Joined for the whole run, so that a process that cannot reach the others says so before it profiles."""
    if shard is None:
        yield
        return
    try:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method="env://")
    except (RuntimeError, ValueError) as exc:  # torch's DistError is a RuntimeError; a bad MASTER_PORT a ValueError
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise UserError(f"cannot join the other processes of this torchrun run ({reason})") from None
    try:
        yield
    finally:
        dist.destroy_process_group()


def _load_state(path: Path, key: str, shape: torch.Size) -> tuple[torch.Tensor, StreamPosition]:
    state = load_torch_file(path, "a profiling checkpoint", "pass --restart to discard it")
    if not isinstance(state, dict) or state.get("fingerprint") != key:
        raise UserError(
            f"{path} is from a run with other arguments (model, data, seq-len, batch-size, tokens, dtype or "
            "number of processes); pass --restart to discard it"
        )
    saved, done = state.get("counts"), (state.get("batches"), state.get("windows"), state.get("tokens"))
    # Each batch holds at least one window, each window at least one token.
    if not (isinstance(saved, torch.Tensor) and saved.dtype == torch.int64 and saved.shape == shape) or not (
        all(isinstance(n, int) for n in done) and 0 <= done[0] <= done[1] <= done[2]
    ):
        raise UserError(f"{path} is damaged; pass --restart to discard it")
    return saved, StreamPosition(*done)


def _save_state(path: Path, key: str, counts: torch.Tensor, position: StreamPosition) -> None:
    state = {
        "fingerprint": key,
        "counts": counts.cpu(),
        "batches": position.batches,
        "windows": position.windows,
        "tokens": position.tokens,
    }
    with atomic_output(path) as tmp:
        save_torch_file(state, tmp)
