"""Structured output through the OpenAI client: every answer under response_format json_schema or json_object, and
every forced tool call, parses and validates against its schema, whatever the sampling; bad schemas are 400s."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from qinfer.runtime.engine.engine import Engine
from qinfer.runtime.engine.worker import EngineWorker
from qinfer.runtime.server.app import create_app
from qinfer.runtime.server.thread import serve_in_thread

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog", "fish"]}, "maxItems": 3},
        "happy": {"type": "boolean"},
    },
    "required": ["name", "age", "pets", "happy"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 16}}, "required": ["city"],
        "additionalProperties": False}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"],
        "additionalProperties": False}}},
]  # fmt: skip
ASK = [{"role": "user", "content": "Tell me about Lily, who has a dog."}]


@pytest.fixture(scope="module")
def client(gguf_files: dict[str, Path]) -> Iterator[openai.OpenAI]:
    engine = Engine.open(gguf_files["pi-f32"], slots=2, ctx_size=256)
    with serve_in_thread(create_app(EngineWorker(engine), "tiny")) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def valid_person(value: Any) -> bool:
    return (
        isinstance(value, dict) and set(value) == {"name", "age", "pets", "happy"}
        and isinstance(value["name"], str) and len(value["name"]) <= 12
        and isinstance(value["age"], int) and 0 <= value["age"] <= 120
        and isinstance(value["pets"], list) and len(value["pets"]) <= 3
        and all(p in ("cat", "dog", "fish") for p in value["pets"]) and isinstance(value["happy"], bool)
    )  # fmt: skip


@pytest.mark.parametrize("seed", range(4))
def test_json_schema_answers_validate(client: openai.OpenAI, seed: int) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    reply = client.chat.completions.create(
        model="tiny", messages=ASK, response_format=fmt, max_tokens=120, temperature=1.0, seed=seed  # type: ignore[arg-type]
    )
    assert reply.choices[0].finish_reason == "stop"
    assert valid_person(json.loads(reply.choices[0].message.content or ""))


def test_json_object_on_plain_completions(client: openai.OpenAI) -> None:
    """Any JSON object: the synth model never closes its strings, so the answer runs to max_tokens; what it wrote
    is JSON so far (a key string, then only what may follow it), where without the format it writes a story."""
    fmt = {"response_format": {"type": "json_object"}}
    constrained = client.completions.create(model="tiny", prompt="Lily's friends:", max_tokens=40, temperature=0.7,
                                            seed=1, extra_body=fmt).choices[0].text  # fmt: skip
    free = client.completions.create(model="tiny", prompt="Lily's friends:", max_tokens=40, temperature=0.7,
                                     seed=1).choices[0].text  # fmt: skip
    assert constrained.startswith('{"') and not free.lstrip().startswith("{")
    assert all(ch >= " " for ch in constrained)  # JSON strings hold no raw control characters


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_forced_tool_calls_validate(client: openai.OpenAI, choice: Any) -> None:
    reply = client.chat.completions.create(
        model="tiny", messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=80, temperature=1.0, seed=3  # type: ignore[arg-type]
    )
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "tool_calls" and message.content is None
    assert message.tool_calls is not None and len(message.tool_calls) == 1
    call = message.tool_calls[0].function  # type: ignore[union-attr]
    arguments = json.loads(call.arguments)
    if choice != "required":
        assert call.name == "add"
    if call.name == "add":
        assert set(arguments) == {"a", "b"} and all(isinstance(v, int) for v in arguments.values())
    else:
        assert call.name == "get_weather" and isinstance(arguments["city"], str) and len(arguments["city"]) <= 16


def test_refusals(client: openai.OpenAI) -> None:
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}}
    with pytest.raises(openai.BadRequestError, match="grammar does not compile"):
        client.chat.completions.create(model="tiny", messages=ASK, response_format=bad)  # type: ignore[arg-type]
    with pytest.raises(openai.BadRequestError, match="not among the tools"):
        client.chat.completions.create(
            model="tiny", messages=ASK, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}  # type: ignore[arg-type]
        )


def test_a_forced_tool_call_streams(client: openai.OpenAI) -> None:
    """Streamed, the call comes whole in one tool_calls delta once its arguments are complete, then the finish."""
    # The tiny model's calls take 37-88 tokens over seeds 0-39 (80 cut off 2 to 3 of them): 140 leaves room for any.
    chunks = list(client.chat.completions.create(
        model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=140, stream=True, seed=5  # type: ignore[arg-type]
    ))  # fmt: skip
    calls = [c.choices[0].delta.tool_calls for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert len(calls) == 1 and calls[0][0].function is not None
    assert calls[0][0].function.name in ("get_weather", "add")
    assert isinstance(json.loads(calls[0][0].function.arguments or ""), dict)
    assert chunks[-1].choices[0].finish_reason == "tool_calls" and chunks[-1].usage is not None
