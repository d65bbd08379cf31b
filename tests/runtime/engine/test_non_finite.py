"""A model whose logits hold NaN never yields a result: greedy decoding fails in one line as sampling does, in
`qinfer run`, `qinfer perplexity` and the server (a 500 in OpenAI's shape), never an empty answer or `PPL = nan`.
The line tells damaged weights from keys beyond f16's range, which an f32 KV cache holds."""

from __future__ import annotations

import json
import shutil
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFReader

from qinfer.runtime.engine.engine import Engine, Request
from qinfer.runtime.engine.sampling import SamplingParams, greedy_rows, unusable, unusable_rows
from qinfer.runtime.engine.worker import EngineWorker
from qinfer.runtime.server.app import create_app
from qinfer.runtime.server.thread import serve_in_thread
from tests.support.cli_in_process import run_in_process


@pytest.fixture(scope="module")
def nan_model(gguf_files: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny f32 model with a NaN in every weight of its output head."""
    path = Path(shutil.copy(gguf_files["dense-f32"], tmp_path_factory.mktemp("nan") / "nan.gguf"))
    head = next(t for t in GGUFReader(path).tensors if t.name == "output.weight")
    with path.open("r+b") as f:
        f.seek(int(head.data_offset))
        f.write(np.full(int(head.n_elements), np.nan, dtype=np.float32).tobytes())
    return path


@pytest.fixture(scope="module")
def loud_keys(gguf_files: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny f32 model with every key projection a million times larger: finite weights whose keys are beyond
    f16's range (65504), and whose attention in f32 is merely sharper."""
    path = Path(shutil.copy(gguf_files["dense-f32"], tmp_path_factory.mktemp("loud") / "loud.gguf"))
    with path.open("r+b") as f:
        for tensor in GGUFReader(path).tensors:
            if tensor.name.endswith("attn_k.weight"):
                f.seek(int(tensor.data_offset))
                f.write((np.asarray(tensor.data, dtype=np.float32) * 1e6).tobytes())
    return path


@pytest.fixture(scope="module")
def text(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("text") / "text.txt"
    path.write_text("Once upon a time there was a little fox who lived in the woods. " * 40)
    return path


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_unusable_rows_are_those_with_nan_or_plus_inf_or_nothing_finite(dtype: torch.dtype) -> None:
    rows = torch.randn(7, 4099).to(dtype)
    rows[1, 4098] = float("nan")
    rows[2, 0] = float("inf")
    rows[3] = float("-inf")
    rows[4, ::2] = float("-inf")  # -inf is a token ruled out, not a broken row
    rows[5, 17], rows[5, 18] = float("nan"), float("-inf")
    rows[6, 100], rows[6, 101] = float("inf"), float("nan")
    assert unusable_rows(rows).tolist() == [False, True, True, True, False, True, True]
    assert unusable(rows) and unusable(rows[3]) and not unusable(rows[[0, 4]]) and not unusable(rows[4])
    expected = rows.float().argmax(-1).tolist()
    assert greedy_rows(rows) == [expected[0], -1, -1, -1, expected[4], -1, -1]
    assert greedy_rows(rows[:, :0]) == [-1] * 7


def test_greedy_rows_take_the_first_of_tied_maxima() -> None:
    rows = torch.tensor([[1.0, 3.0, 3.0, float("-inf")], [float("-inf"), 2.0, 0.0, 2.0]])
    assert greedy_rows(rows) == [1, 1]


@pytest.mark.parametrize("temp", ["0", "0.8"])
def test_run_fails_in_one_line(nan_model: Path, temp: str) -> None:
    result = run_in_process("run", "-m", str(nan_model), "-p", "Once upon a time", "-n", "4", "--temp", temp)
    assert result.returncode == 2 and result.stderr.strip().count("\n") == 0
    assert result.stderr.strip().endswith(
        "logits are not finite (NaN or inf): the model's weights are damaged; re-convert it"
    )
    assert result.stdout.strip() in ("", "Once upon a time")


def test_perplexity_exits_non_zero(nan_model: Path, text: Path) -> None:
    result = run_in_process("perplexity", "-m", str(nan_model), "-f", str(text), "-c", "64")
    assert result.returncode == 2 and "perplexity is not finite" in result.stderr
    assert result.stderr.strip().endswith("the model's weights are damaged; re-convert it")
    assert "PPL = nan" not in result.stdout


F16_OVERFLOW = "keys or values beyond f16's range overflowed the f16 KV cache; use -ctk f32 -ctv f32"


def test_an_overflowing_f16_cache_is_named_with_its_fix(loud_keys: Path, text: Path) -> None:
    run = ["run", "-m", str(loud_keys), "-p", "Once upon a time", "-n", "4", "--temp", "0"]
    failed = run_in_process(*run)
    assert failed.returncode == 2 and failed.stderr.strip().endswith(f"(NaN or inf): {F16_OVERFLOW}")
    assert "damaged" not in failed.stderr
    fixed = run_in_process(*run, "-ctk", "f32", "-ctv", "f32")
    assert fixed.returncode == 0 and len(fixed.stdout.strip()) > len("Once upon a time"), fixed.stderr
    ppl = ["perplexity", "-m", str(loud_keys), "-f", str(text), "-c", "64"]
    failed = run_in_process(*ppl)
    assert failed.returncode == 2 and failed.stderr.strip().endswith(f"the logits hold NaN or inf: {F16_OVERFLOW}")
    fixed = run_in_process(*ppl, "-ctk", "f32", "-ctv", "f32")
    assert fixed.returncode == 0 and "Final estimate: PPL = " in fixed.stdout, fixed.stderr


def test_the_server_answers_500(nan_model: Path) -> None:
    engine = Engine.open(nan_model, slots=1, ctx_size=64)
    with serve_in_thread(create_app(EngineWorker(engine), "nan")) as url:
        body = json.dumps({"prompt": "Once upon a time", "max_tokens": 4, "temperature": 0}).encode()
        request = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as failed:
            urllib.request.urlopen(request, timeout=30)
    assert failed.value.code == 500
    error = json.loads(failed.value.read())["error"]
    assert error["type"] == "server_error" and "logits are not finite" in error["message"]


def test_an_earlier_sequences_overflow_past_the_position_is_not_the_cause(nan_model: Path) -> None:
    """The slot still holds an earlier sequence's inf rows past this one's position: they took no part in these
    logits, so the weights are named, not the cache."""
    engine = Engine.open(nan_model, slots=1, ctx_size=64)
    ids = engine.tokenizer.encode("Once upon a time")
    engine.cache.k[:, 0, :, len(ids) + 5 :] = float("inf")
    engine.submit(Request(ids, 4, SamplingParams(0.0, 0, 1.0)))
    (out,) = engine.step()
    assert out.reason == "error" and out.error is not None
    assert "weights are damaged" in out.error and "f16" not in out.error
