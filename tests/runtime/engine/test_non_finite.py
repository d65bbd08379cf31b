"""A model whose logits hold NaN never yields a result: greedy decoding fails in one line as sampling does, in
`qinfer run`, `qinfer perplexity` and the server (a 500 in OpenAI's shape), never an empty answer or `PPL = nan`."""

from __future__ import annotations

import json
import shutil
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader

from qinfer.runtime.engine.engine import Engine
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


@pytest.mark.parametrize("temp", ["0", "0.8"])
def test_run_fails_in_one_line(nan_model: Path, temp: str) -> None:
    result = run_in_process("run", "-m", str(nan_model), "-p", "Once upon a time", "-n", "4", "--temp", temp)
    assert result.returncode == 2 and result.stderr.strip().count("\n") == 0
    assert "logits are not finite" in result.stderr and result.stdout.strip() in ("", "Once upon a time")


def test_perplexity_exits_non_zero(nan_model: Path, tmp_path: Path) -> None:
    text = tmp_path / "text.txt"
    text.write_text("Once upon a time there was a little fox who lived in the woods. " * 40)
    result = run_in_process("perplexity", "-m", str(nan_model), "-f", str(text), "-c", "64")
    assert result.returncode == 2 and "perplexity is not finite" in result.stderr
    assert "PPL = nan" not in result.stdout


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
