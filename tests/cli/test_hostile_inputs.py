"""Inputs a user (or a script) can get wrong end in one line with the cause and what to change: text that is not
UTF-8, more sequences than memory holds, corpora of undecodable bytes or absurd nesting, a directory for a file.
A context longer than the model's is clamped with a note, by run and perplexity alike."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from gguf import GGUFValueType

from qinfer.prep.synth.build import SynthReport
from qinfer.prep.synth.corpus import synth_corpus
from tests.support.cli_in_process import run_in_process
from tests.support.gguf_rewrite import rewrite_gguf
from tests.support.ports import free_port


def _one_line(result: subprocess.CompletedProcess[str], *words: str) -> None:
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().count("\n") == 0 and all(w in result.stderr for w in words), result.stderr


def test_a_prompt_that_is_not_utf8(gguf_files: dict[str, Path]) -> None:
    model = str(gguf_files["pi-f16"])
    _one_line(run_in_process("run", "-m", model, "-p", "bad \udcff byte", "-n", "2"), "not valid UTF-8")
    # The same bytes as the shell passes them: Python turns them into a lone surrogate.
    raw = subprocess.run(
        [sys.executable, "-m", "qinfer", "run", "-m", model.encode(), "-p", b"caf\xe9", "-n", "2"],
        capture_output=True, timeout=120,
    )  # fmt: skip
    assert raw.stdout == b""
    _one_line(subprocess.CompletedProcess(raw.args, raw.returncode, "", raw.stderr.decode()), "not valid UTF-8")


def test_more_sequences_than_memory_holds(gguf_files: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    model = str(gguf_files["pi-f16"])
    _one_line(run_in_process("run", "-m", model, "-p", "Once", "--parallel", "100000000"), "--parallel", "GiB")
    _one_line(run_in_process("serve", "-m", model, "--slots", "100000000", "--port", str(free_port())), "--slots")

    def refuse(*_args: object, **_kwargs: object) -> torch.Tensor:
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 bytes")

    monkeypatch.setattr(torch, "zeros", refuse)
    _one_line(run_in_process("run", "-m", model, "-p", "Once", "--parallel", "4"), "does not fit in memory")


@pytest.mark.parametrize("command", ["profile", "train-predictor"])
def test_json_lines_decode_as_plain_text_does_and_deep_nesting_is_refused(
    tiny: SynthReport, tmp_path: Path, command: str
) -> None:
    text = synth_corpus(0, 4000, "train")
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_bytes(json.dumps({"text": text}).encode()[:-2] + b"\xff\xfe" + b'"}\n')
    out = tmp_path / "out"
    sizes = ["--tokens", "256", "--seq-len", "64"]
    if command == "train-predictor":
        sizes = ["--train-tokens", "256", "--heldout-tokens", "128", "--epochs", "1", "--rank", "32", "--seq-len", "64"]
    result = run_in_process("prep", command, str(tiny.model_dir), "--data", str(corpus), "--out", str(out), *sizes)
    assert result.returncode == 0, result.stderr
    corpus.write_text("[" * 200_000 + "]" * 200_000 + "\n")
    deep = run_in_process("prep", command, str(tiny.model_dir), "--data", str(corpus), "--out", str(tmp_path / "o2"))
    # Read as the work goes, so a progress line may stand above the error.
    last = deep.stderr.strip().splitlines()[-1]
    assert deep.returncode == 2 and last.endswith("nests deeper than a JSON line with a text field can")
    assert "Traceback" not in deep.stderr


def test_perplexity_of_a_directory(gguf_files: dict[str, Path], tmp_path: Path) -> None:
    model = str(gguf_files["pi-f16"])
    _one_line(run_in_process("perplexity", "-m", model, "-f", str(tmp_path)), "is a directory")
    _one_line(run_in_process("perplexity", "-m", model, "-f", "/dev/null"), "/dev/null is not a regular file")
    _one_line(run_in_process("perplexity", "-m", model, "-f", str(tmp_path / "absent.txt")), "text file not found")


def test_a_context_longer_than_the_models_is_clamped_with_a_note(gguf_files: dict[str, Path], tmp_path: Path) -> None:
    model = str(gguf_files["pi-f16"])
    run = run_in_process("run", "-m", model, "-p", "Once", "-n", "2", "-c", "2147483647")
    assert run.returncode == 0 and "more than the model's context of 256 tokens; using 256" in run.stderr
    text = tmp_path / "text.txt"
    text.write_text(synth_corpus(0, 6000, "heldout"))
    ppl = run_in_process("perplexity", "-m", model, "-f", str(text), "-c", "100000")
    assert ppl.returncode == 0 and "using 256" in ppl.stderr and "PPL = " in ppl.stdout


@pytest.mark.parametrize(
    ("keys", "named"),
    [
        ({"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0}, "llama.rope.scaling.factor is 4"),
        ({"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 8.0}, "asking for yarn rope scaling"),
        ({"llama.rope.scale_linear": 2.0}, "llama.rope.scale_linear is 2, asking for linear rope scaling"),
    ],
)
def test_rope_scaling_the_engine_would_not_apply_is_refused(
    gguf_files: dict[str, Path], tmp_path: Path, keys: dict[str, object], named: str
) -> None:
    """llama.cpp scales such a file's positions; running it unscaled would read every position wrong unseen."""
    kinds = {str: GGUFValueType.STRING, float: GGUFValueType.FLOAT32}
    add = {key: (value, kinds[type(value)]) for key, value in keys.items()}
    scaled = rewrite_gguf(gguf_files["dense-f32"], tmp_path / "scaled.gguf", add=add)
    _one_line(run_in_process("run", "-m", str(scaled), "-p", "Once", "-n", "2"), named, "qinfer does not apply")
    unscaled = {**add, "llama.rope.scaling.type": ("none", GGUFValueType.STRING)}
    kept = rewrite_gguf(gguf_files["dense-f32"], tmp_path / "none.gguf", add=unscaled)
    assert run_in_process("run", "-m", str(kept), "-p", "Once", "-n", "2").returncode == 0


def test_a_model_path_that_is_a_pipe_or_a_directory_is_refused_without_waiting(tmp_path: Path) -> None:
    """A named pipe as the model would block the first read forever (a writer may never come): the pipe goes to a
    process of its own, which a timeout ends should the read block; a directory cannot block, and runs here."""
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)

    def commands(path: Path) -> list[list[str]]:
        return [["run", "-m", str(path), "-p", "Once", "-n", "1"], ["plan", "-m", str(path), "--vram-budget", "1"]]

    for command in commands(fifo):
        done = subprocess.run([sys.executable, "-m", "qinfer", *command], capture_output=True, text=True, timeout=60)
        _one_line(done, "not a regular file")
    for command in commands(tmp_path):
        _one_line(run_in_process(*command), "not a regular file")
