"""llama.cpp's operations endpoints on our server: /tokenize and /detokenize against the tokenizer, usage and
timings in every answer, /metrics counting what was answered, /props and /slots, and the key guarding them."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from qinfer.runtime.engine.engine import Engine
from qinfer.runtime.engine.worker import EngineWorker
from qinfer.runtime.server.app import ServerOptions, create_app
from qinfer.runtime.server.thread import serve_in_thread

SLOTS = 2
CTX = 128


@pytest.fixture(scope="module")
def server(gguf_files: dict[str, Path]) -> Iterator[tuple[str, Engine]]:
    engine = Engine.open(gguf_files["pi-f32"], slots=SLOTS, ctx_size=CTX)
    with serve_in_thread(create_app(EngineWorker(engine), "tiny")) as url:
        yield url, engine


def call(url: str, path: str, body: dict[str, Any] | None = None, key: str | None = None) -> Any:
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    with urllib.request.urlopen(urllib.request.Request(url + path, data, headers), timeout=30) as response:
        raw = response.read()
        return json.loads(raw) if response.headers["Content-Type"].startswith("application/json") else raw.decode()


def metrics(url: str) -> dict[str, float]:
    return {s.name: s.value for f in text_string_to_metric_families(call(url, "/metrics")) for s in f.samples}


def test_tokenize_and_detokenize(server: tuple[str, Engine]) -> None:
    url, engine = server
    text = "Once upon a time, Lily had 12 red balls."
    plain = call(url, "/tokenize", {"content": text})["tokens"]
    assert plain == engine.tokenizer.encode(text, add_bos=False)
    assert call(url, "/tokenize", {"content": text, "add_special": True})["tokens"] == [engine.tokenizer.bos_id, *plain]
    assert call(url, "/detokenize", {"tokens": plain})["content"] == text
    with pytest.raises(urllib.error.HTTPError) as refused:
        call(url, "/detokenize", {"tokens": [engine.tokenizer.vocab_size]})
    assert refused.value.code == 400


def test_usage_timings_and_metrics(server: tuple[str, Engine]) -> None:
    url, engine = server
    before = metrics(url)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
    answers = [
        client.completions.create(model="tiny", prompt=p, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
        for p in ("Once upon a time", "Lily found a red ball and")
    ]
    stream = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=5, stream=True, temperature=0
    )
    last = list(stream)[-1]
    after = metrics(url)
    computed = 0
    for answer in [*answers, last]:
        timings = answer.model_extra["timings"]  # type: ignore[index]
        assert answer.usage is not None
        # A prompt's tokens are computed, or found in a slot's cache (here at least BOS, shared with the last one).
        assert timings["prompt_n"] + timings["cache_n"] == answer.usage.prompt_tokens
        computed += timings["prompt_n"]
    for answer in answers:
        timings = answer.model_extra["timings"]  # type: ignore[index]
        assert answer.usage is not None
        assert timings["predicted_n"] == answer.usage.completion_tokens == 6
        assert timings["predicted_ms"] > 0 and timings["predicted_per_second"] > 0
    assert last.usage is not None and last.model_extra["timings"]["predicted_n"] == last.usage.completion_tokens  # type: ignore[index]
    predicted = sum(a.usage.completion_tokens for a in answers if a.usage) + last.usage.completion_tokens
    assert after["qinfer_requests_total"] - before["qinfer_requests_total"] == 3
    assert after["qinfer_prompt_tokens_total"] - before["qinfer_prompt_tokens_total"] == computed
    assert after["qinfer_tokens_predicted_total"] - before["qinfer_tokens_predicted_total"] == predicted
    assert after["qinfer_predicted_tokens_seconds"] > 0
    # At rest: nothing running or waiting, no row of the cache in use.
    assert after["qinfer_requests_processing"] == after["qinfer_requests_deferred"] == 0
    assert after["qinfer_kv_cache_tokens"] == after["qinfer_kv_cache_usage_ratio"] == 0


def test_props_and_slots(server: tuple[str, Engine]) -> None:
    url, engine = server
    props = call(url, "/props")
    assert (props["total_slots"], props["n_ctx"], props["chat_template"]) == (SLOTS, CTX, "")
    assert props["bos_token"] == "<s>" and props["default_generation_settings"]["temperature"] == 1.0
    assert call(url, "/slots") == [
        {"id": i, "n_ctx": CTX, "is_processing": False, "n_past": 0} for i in range(SLOTS)
    ]


def test_the_key_guards_the_operations(gguf_files: dict[str, Path]) -> None:
    engine = Engine.open(gguf_files["pi-f32"], slots=1, ctx_size=CTX)
    with serve_in_thread(create_app(EngineWorker(engine), "tiny", ServerOptions(api_key="k"))) as url:
        for path in ("/metrics", "/props", "/slots"):
            with pytest.raises(urllib.error.HTTPError) as refused:
                call(url, path)
            assert refused.value.code == 401
        assert "qinfer_requests_total" in call(url, "/metrics", key="k")
        assert call(url, "/health")["status"] == "ok"
