"""What bench/decode.py measures our decode against: llama.cpp, the PowerInfer engine, and the bandwidth limit.

llama.cpp runs through llama-cpp-python (the optional `peers` extra, `pip install -e '.[peers]'`) in a process of
its own; the PowerInfer engine's `main` runs as a subprocess from a build the user points at, and its speeds are read
from the timing lines it prints on stderr. The limit is the bytes one decode step must read (the planner's accounting,
qinfer/planner/model_layout.py) over the read bandwidth measured on this machine.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from qinfer.planner.model_layout import read_model_layout
from qinfer.runtime.engine.engine import Engine, Request
from qinfer.runtime.engine.sampling import SamplingParams
from qinfer.runtime.ffn.runners import SparseRunner, select
from qinfer.runtime.ffn.sparse import active_ids
from qinfer.runtime.model.forward import TransformerForward

GIB = 1 << 30
LLAMA_CPP_MISSING = (
    "llama.cpp column skipped: llama-cpp-python is not installed "
    "(pip install -e '.[peers]'; it compiles llama.cpp, which takes minutes)"
)


@dataclass(frozen=True)
class Speed:
    """Tokens/s of one run: decode, and prompt (prefill) where the column measures it."""

    decode: float
    prompt: float | None = None

    def best(self, other: Speed) -> Speed:
        """The faster of each figure; a run that did not happen (NaN: a peer that died) counts for neither."""
        decodes = [d for d in (self.decode, other.decode) if not math.isnan(d)]
        prompts = [p for p in (self.prompt, other.prompt) if p is not None and not math.isnan(p)]
        return Speed(max(decodes, default=math.nan), max(prompts) if prompts else None)


Timer = Callable[[], Speed]
# How long llama.cpp may take to load a model before its column is given up.
LOAD_SECONDS = 600.0


def llama_cpp_available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def llama_cpp_decoder(path: Path, prompt_ids: list[int], n: int, threads: int, ctx: int) -> Timer:
    """llama.cpp on a dense GGUF: the prompt, then n greedy steps, each timed like ours (the median step).
    Speed only: llama.cpp applies SiLU to any `llama` file, so a ReLU model's tokens differ from ours.

    It runs in a process of its own (bench/llama_cpp_runs.py), as llama-bench does, which loads the model before
    anything is timed and times each run: a llama.cpp build that dies on this CPU (its native build stops with SIGILL
    on Q4_0 on an Intel Xeon in a virtual machine) ends that process alone. Its runs from then on read NaN (a dash in
    the tables where no run of it finished), one line says why, and our columns are still measured."""
    command = [sys.executable, str(Path(__file__).with_name("llama_cpp_runs.py")), str(path), str(threads), str(ctx)]
    process = subprocess.Popen([*command, str(n)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert process.stdin is not None and process.stdout is not None
    stdin, stdout = process.stdin, process.stdout

    def answer(timeout: float | None) -> str:
        """Its next line, or "" where it ended or stayed silent past `timeout` seconds (then it is stopped). The line
        is read on a thread, which a pipe's silence cannot hold past the timeout on any system."""
        got: list[str] = []
        reader = threading.Thread(target=lambda: got.append(stdout.readline()), daemon=True)
        reader.start()
        reader.join(timeout)
        line = got[0] if got else ""
        if not line:
            silent = reader.is_alive()
            if silent:
                process.kill()
            how = f"no answer in {timeout:.0f} s" if silent else _how_it_ended(process.wait())
            print(f"llama.cpp on {path.name} ended ({how}): its later runs are left out", file=sys.stderr)
        return line

    try:
        stdin.write(json.dumps(prompt_ids) + "\n")
        stdin.flush()
    except OSError:
        pass  # it died already: answer() says how
    # Nothing is timed beside its load, which would slow our runs.
    alive = answer(LOAD_SECONDS) == "ready\n"

    def run() -> Speed:
        nonlocal alive
        if alive:
            try:
                stdin.write("run\n")
                stdin.flush()
            except OSError:
                pass
            line = answer(None)
            if line:
                return Speed(*json.loads(line))
            alive = False
        return Speed(math.nan, math.nan)

    # A decoder dropped (the next model's decoders replace it) ends its process, which holds a model and its cache.
    weakref.finalize(run, _stop, process)
    return run


def _stop(process: subprocess.Popen[str]) -> None:
    """End a llama_cpp_runs.py process: its input closed, it exits; one that does not within 30 s is killed."""
    for pipe in (process.stdin, process.stdout):
        if pipe is not None:
            with contextlib.suppress(OSError):
                pipe.close()
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _how_it_ended(code: int) -> str:
    if code >= 0:
        return f"exit code {code}"
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def peer_problem(option: str, binary: Path, what: str) -> str | None:
    """Why `binary`, given as `option`, cannot be run as the peer `what` (llama.cpp's llama-server, the `main` of a
    PowerInfer build, ...), or None."""
    if not binary.is_file():
        return f"{option} {binary}: no such file (point it at {what})"
    if not os.access(binary, os.X_OK):
        return f"{option} {binary}: not executable (chmod +x it, or point at {what})"
    return None


def engine_main_problem(main: Path) -> str | None:
    """Why `main` cannot be run as the PowerInfer engine, or None."""
    return peer_problem("--powerinfer-main", main, "the `main` of a PowerInfer build")


# Its llama_print_timings lines: "prompt eval time = ... tokens per second)" and "eval time = ...".
_TIMING = re.compile(r"^\w+:\s+(prompt eval|eval) time\s*=.*?,\s*([0-9.]+|inf|nan) tokens per second\)", re.MULTILINE)


def parse_engine_timings(stderr: str) -> Speed:
    """Decode and prompt tokens/s from the engine's timing lines; its decode figure is the mean over its steps."""
    found = {kind: float(value) for kind, value in _TIMING.findall(stderr)}
    if "eval" not in found or not math.isfinite(found["eval"]):
        tail = stderr.strip().splitlines()[-3:]
        raise RuntimeError(f"no 'eval time ... tokens per second' line from the PowerInfer engine: {tail}")
    prompt = found.get("prompt eval")
    return Speed(found["eval"], prompt if prompt is not None and math.isfinite(prompt) else None)


def powerinfer_decoder(
    main: Path,
    path: Path,
    prompt: str,
    n: int,
    threads: int,
    ctx: int,
    extra: tuple[str, ...] = (),
    timeout_s: float = 900,
) -> Timer:
    """The engine's `main` on `path` with our options: greedy (its default repeat penalty is 1.1), n tokens;
    `extra`: more of its options (a GPU build's --vram-budget or -ngl). A run past `timeout_s` (a CPU's 7B run
    with its own solver's first plan can take minutes) fails its row."""
    # Its tokenizer drops SentencePiece's leading space, so a leading space gives it the same ids as ours. A path
    # is given as it is, not resolved: the engine looks for the file's .gpuidx and activations beside that name.
    command = [str(main.resolve()), "-m", str(path.absolute()), "-p", f" {prompt}", "-n", str(n), "-t", str(threads)]
    command += ["-c", str(ctx), "--temp", "0", "--repeat-penalty", "1.0", "--ignore-eos", *extra]

    def run() -> Speed:
        # It writes a main.log into its working directory on every run: keep that out of the user's.
        with tempfile.TemporaryDirectory() as scratch:
            done = subprocess.run(
                command,
                cwd=scratch,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                errors="replace",
                timeout=timeout_s,
            )
        if done.returncode != 0:
            tail = done.stderr.strip().splitlines()[-3:]
            raise RuntimeError(f"{main} exited with {done.returncode} on {path.name}: {tail}")
        return parse_engine_timings(done.stderr)

    return run


def read_bandwidth(tries: int = 5) -> float:
    """Bytes/s of a torch sum over a 1 GiB float32 tensor at torch's thread count, best of `tries`: what a
    memory-bound pass over weights can reach here."""
    data = torch.ones(GIB // 4)
    best = math.inf
    for _ in range(tries):
        started = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - started)
    return data.numel() * data.element_size() / best


class _SelectionShares:
    """Stands in for a sparse runner during one untimed generation, recording per layer the share of neurons
    its predictor picks at each decode step."""

    def __init__(self, runner: SparseRunner):
        self.runner = runner
        self.shares: list[list[float]] = [[] for _ in runner.layers]

    def __call__(self, layer: int, x: torch.Tensor, h: torch.Tensor, prefill: bool) -> torch.Tensor:
        if not prefill:
            w = self.runner.layers[layer]
            mask = select(w, x, h, self.runner.threshold, self.runner.selector)
            self.shares[layer].append(active_ids(mask).numel() / mask.shape[1])
        return self.runner(layer, x, h, prefill)


def selected_shares(path: Path, prompt_ids: list[int], n: int, ctx: int) -> list[float]:
    """Per layer, the mean share of FFN neurons our predictor picks per decode step of the bench's generation."""
    engine = Engine.open(path, ctx_size=ctx, ffn="sparse")
    forward = engine.forward
    if not isinstance(forward, TransformerForward) or not isinstance(forward.ffn, SparseRunner):
        raise RuntimeError(f"{path}: expected the CPU sparse runner")
    shares = _SelectionShares(forward.ffn)
    # A swapped-in runner takes the torch path (the native layer step keeps to the runner it was built for),
    # which selects the same neurons.
    forward.ffn = shares
    engine.submit(Request(prompt_ids, n + 2, SamplingParams(temperature=0.0), ignore_eos=True))
    for _ in range(n + 1):
        engine.step()
    return [statistics.fmean(layer) for layer in shares.shares]


@dataclass(frozen=True)
class StepBytes:
    dense: float
    sparse: float


def step_bytes(powerinfer: Path, shares: list[float]) -> StepBytes:
    """Bytes one decode step reads, by the planner's accounting of `powerinfer`'s tensors: attention and the
    output head, plus all FFN neurons (dense; the dense file holds the same tensors less the predictors) or the
    predictors and each layer's picked share of neurons (sparse). The token's embedding row and the KV cache
    are left out, as the planner leaves them out of a step."""
    layout = read_model_layout(powerinfer)
    shared = layout.output_bytes + sum(layer.attention_bytes for layer in layout.layers)
    dense = shared + sum(layer.ffn_neurons * layer.neuron_bytes for layer in layout.layers)
    picked = sum(
        layer.predictor_bytes + share * layer.ffn_neurons * layer.neuron_bytes
        for layer, share in zip(layout.layers, shares, strict=True)
    )
    return StepBytes(dense, shared + picked)
