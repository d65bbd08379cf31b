"""Every number option holds only meaningful values: a bad one is one line on stderr and exit code 2, before any
work; and the llama.cpp meanings of -n, -t and a tiny --temp."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import typing
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from typer.models import ParameterInfo

from qinfer.cli.app import app
from tests.support.cli_in_process import run_in_process

# Paths need not exist: a bad number is refused while the arguments are parsed, before anything is opened.
RUN = ["run", "-m", "missing.gguf"]
PLAN = ["plan", "-m", "missing.gguf", "--vram-budget", "8"]
PERPLEXITY = ["perplexity", "-m", "missing.gguf", "-f", "missing.txt"]
SYNTH = ["prep", "synth", "--out", "missing-dir"]
CORPUS = ["prep", "corpus", "--out", "missing.txt"]
PROFILE = ["prep", "profile", "missing-model", "--data", "missing.txt"]
TRAIN = ["prep", "train-predictor", "missing-model", "--data", "missing.txt", "--out", "missing-dir"]
SERVE = ["serve", "-m", "missing.gguf"]
BIG = str(2**70)

BAD_VALUES = [
    (RUN, "--vram-budget", "nan"),
    (RUN, "--vram-budget", "inf"),
    (RUN, "--vram-budget", "1e30"),
    (RUN, "--vram-budget", "0"),
    (RUN, "--temp", "nan"),
    (RUN, "--temp", "inf"),
    (RUN, "--temp", "-1"),
    (RUN, "--top-p", "0"),
    (RUN, "--top-p", "-1"),
    (RUN, "--top-p", "2"),
    (RUN, "--top-p", "nan"),
    (RUN, "--seed", BIG),
    (RUN, "--seed", "-1"),
    (RUN, "--top-k", "-5"),
    (RUN, "-c", "-5"),
    (RUN, "-n", "-2"),
    (RUN, "-t", "-1"),
    (RUN, "--parallel", "0"),
    (RUN, "--top-k", "1.5"),
    (RUN, "--kv-budget", "nan"),
    (RUN, "--kv-budget", "12.5"),
    (PLAN, "--vram-budget", "nan"),
    (PLAN, "--vram-budget", "1e30"),
    (PLAN, "--ctx-size", "0"),
    (PLAN, "--batch", "0"),
    (PLAN, "--group-size", "0"),
    (PLAN, "--time-limit", "0"),
    (PLAN, "--time-limit", "inf"),
    (PLAN, "--kv-budget", "abc"),
    (PLAN, "--kv-budget", "0"),
    (PLAN, "--kv-budget", "-50%"),
    (PLAN, "--kv-budget", "1.5"),
    (PLAN, "--kv-budget", "inf"),
    (PLAN, "--kv-budget", "nan"),
    (PERPLEXITY, "-c", "3"),
    (PERPLEXITY, "-t", "-1"),
    (SYNTH, "--seed", BIG),
    (SYNTH, "--layers", "0"),
    (SYNTH, "--hidden", "1"),
    (SYNTH, "--ffn", "4"),
    (SYNTH, "--heads", "0"),
    (SYNTH, "--kv-heads", "0"),
    (SYNTH, "--vocab", "100"),
    (SYNTH, "--predictor-rank", "16"),
    (SYNTH, "--train-steps", "-1"),
    (SYNTH, "--sparsity", "nan"),
    (SYNTH, "--sparsity", "1"),
    (CORPUS, "--chars", "0"),
    (CORPUS, "--seed", "-1"),
    (PROFILE, "--tokens", "0"),
    (PROFILE, "--seq-len", "0"),
    (PROFILE, "--batch-size", "0"),
    (PROFILE, "--checkpoint-every", "0"),
    (TRAIN, "--rank", "16"),
    (TRAIN, "--recall", "1"),
    (TRAIN, "--recall", "nan"),
    (TRAIN, "--train-tokens", "0"),
    (TRAIN, "--heldout-tokens", "0"),
    (TRAIN, "--seq-len", "0"),
    (TRAIN, "--epochs", "0"),
    (TRAIN, "--seed", BIG),
    (SERVE, "--port", "70000"),
    (SERVE, "--port", "0"),
    (SERVE, "--slots", "0"),
    (SERVE, "-c", "-5"),
    (SERVE, "-t", "-1"),
    (SERVE, "--vram-budget", "inf"),
    (SERVE, "--read-timeout", "inf"),
    (SERVE, "--max-body-bytes", "0"),
    (SERVE, "--kv-budget", "0"),
    (PERPLEXITY, "--kv-budget", "-1"),
    (RUN, "--cache-type-k", "q4_0"),
    (SERVE, "--cache-type-v", "f64"),
    (PERPLEXITY, "--cache-type-k", "bf16"),
    (SYNTH, "--context", "0"),
    (SYNTH, "--train-seq-len", "0"),
]


def cli(*args: str) -> tuple[int, str, str]:
    """Exit code, stdout and stderr of `qinfer ARGS` through the entry point, in this process."""
    done = run_in_process(*args)
    return done.returncode, done.stdout, done.stderr


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "qinfer", *args], capture_output=True, text=True, timeout=300)


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.strip()]


@pytest.mark.parametrize(
    ("command", "option", "value"),
    BAD_VALUES,
    ids=[f"{c[1] if c[0] == 'prep' else c[0]} {o} {v}" for c, o, v in BAD_VALUES],
)
def test_bad_value_is_one_line_and_exit_2(command: list[str], option: str, value: str) -> None:
    code, out, err = cli(*command, option, value)
    lines = error_lines(err)
    assert code == 2, err
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ") and option in lines[0] and "Traceback" not in err
    assert out == ""


def test_bad_value_through_python_m_qinfer() -> None:
    result = run_cli(*RUN, "--top-p", "2")
    assert result.returncode == 2
    assert error_lines(result.stderr) == [
        "error: Invalid value for '--top-p': 2 is outside 0<x<=1 (see python -m qinfer run --help)"
    ]


def test_help_and_missing_subcommand_keep_their_exit_codes() -> None:
    code, out, err = cli("run", "--help")
    assert code == 0 and "--top-p" in out and err == ""
    code, out, err = cli("prep")
    assert code == 2 and "synth" in out and err == ""  # the group's help, as typer prints it


def _number_options() -> Iterator[tuple[str, str, ParameterInfo, type]]:
    groups = [("", app), *((f"{g.name} ", g.typer_instance) for g in app.registered_groups)]
    for prefix, typer_app in groups:
        assert typer_app is not None
        for command in typer_app.registered_commands:
            callback = command.callback
            assert callback is not None
            yield from _numbers_of(prefix + (command.name or callback.__name__), callback)


def _numbers_of(name: str, callback: Callable[..., object]) -> Iterator[tuple[str, str, ParameterInfo, type]]:
    for param, hint in typing.get_type_hints(callback, include_extras=True).items():
        if typing.get_origin(hint) is not typing.Annotated:
            continue
        base, *extras = typing.get_args(hint)
        info = next(e for e in extras if isinstance(e, ParameterInfo))
        kinds = [t for t in (typing.get_args(base) or (base,)) if t in (int, float)]
        if kinds:
            yield name, param, info, kinds[0]


def test_every_number_option_has_a_rule() -> None:
    missing = []
    for command, param, info, kind in _number_options():
        # A float needs a parser (finite, within bounds) or both ends: a lone minimum lets inf through.
        ruled = info.parser is not None or (info.min is not None and (kind is int or info.max is not None))
        if not ruled:
            missing.append(f"{command} {param}")
    assert not missing


def decode_tokens(stderr: str) -> tuple[int, int]:
    match = re.search(r"prompt: (\d+) tokens.*decode: (\d+) tokens", stderr)
    assert match, stderr
    return int(match.group(1)), int(match.group(2))


def test_n_predict_minus_one_runs_until_the_context_is_full(gguf_files: dict[str, Path]) -> None:
    model = str(gguf_files["pi-f32"])
    code, out, err = cli("run", "-m", model, "-n", "-1", "-c", "200", "--ignore-eos", "--temp", "0")
    assert code == 0, err
    prompt, generated = decode_tokens(err)
    # The prompt and every token but the last fill the context; more than the default -n of 128.
    assert generated == 200 - prompt + 1 > 128


def test_n_predict_zero_generates_nothing(gguf_files: dict[str, Path]) -> None:
    code, out, err = cli("run", "-m", str(gguf_files["pi-f32"]), "-n", "0", "-p", "Hello")
    assert code == 0, err
    assert out == "Hello\n" and "decode" not in err


def test_a_tiny_temperature_is_greedy(gguf_files: dict[str, Path]) -> None:
    args = ["run", "-m", str(gguf_files["pi-f32"]), "-n", "12", "--seed", "5"]
    greedy = cli(*args, "--temp", "0")
    tiny = cli(*args, "--temp", "1e-300")
    assert greedy[0] == tiny[0] == 0, tiny[2]
    assert tiny[1] == greedy[1]


def test_threads_are_capped_at_the_core_count(gguf_files: dict[str, Path]) -> None:
    result = run_cli("run", "-m", str(gguf_files["pi-f32"]), "-n", "2", "-t", "1000")
    assert result.returncode == 0, result.stderr
    cores = os.cpu_count()
    assert f"note: --threads 1000 is more than the {cores} cores here; using {cores}" in result.stderr.splitlines()
