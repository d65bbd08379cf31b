"""The OpenAI-compatible server under the official `openai` client on loopback, serving the tiny synth model."""

from __future__ import annotations

import asyncio
import json
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from qinfer.runtime.engine.engine import Engine, Request
from qinfer.runtime.engine.generate import generate
from qinfer.runtime.engine.sampling import SamplingParams
from qinfer.runtime.engine.worker import EngineWorker, Event
from qinfer.runtime.server.app import StopScanner, create_app
from qinfer.runtime.server.openai_schema import ChatMessage, chat_prompt
from qinfer.runtime.server.thread import serve_in_thread
from tests.support.ports import free_port

SLOTS = 4
CTX = 256
GREEDY = SamplingParams(0.0, 0, 1.0)
PROMPTS = [
    "Once upon a time",
    "Lily found a red ball",
    "The sky was sunny and",
    'Tom said, "Look',
    "One day, a little fox",
    "Mia had 5 apples",
    "They played in the park",
    "In the end, Ben learned that",
]


@pytest.fixture(scope="module")
def model(gguf_files: dict[str, Path]) -> Path:
    return gguf_files["pi-f32"]


@pytest.fixture(scope="module")
def base_url(model: Path) -> Iterator[str]:
    engine = Engine.open(model, slots=SLOTS, ctx_size=CTX)
    with serve_in_thread(create_app(EngineWorker(engine), "tiny")) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def reference(model: Path) -> Engine:
    """A one-slot engine of the same model, used directly: what the server must reproduce."""
    return Engine.open(model, slots=1, ctx_size=CTX)


def _http(url: str, body: bytes | None = None) -> tuple[int, dict]:  # type: ignore[type-arg]
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _wait_for(condition: Callable[[], bool], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def _expected(reference: Engine, prompt: str, n: int) -> str:
    return generate(reference, prompt, n, GREEDY, ignore_eos=True).text


def test_completion_matches_the_engine_and_streams_the_same_text(client: openai.OpenAI, reference: Engine) -> None:
    args = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0.0}
    whole = client.completions.create(**args, extra_body={"ignore_eos": True})
    assert whole.choices[0].text == _expected(reference, PROMPTS[0], 12)
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage is not None and whole.usage.completion_tokens == 12
    assert whole.usage.prompt_tokens == len(reference.tokenizer.encode(PROMPTS[0]))

    chunks = list(client.completions.create(**args, stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_chat_uses_the_transcript_template_and_streams(client: openai.OpenAI, reference: Engine) -> None:
    messages = [{"role": "system", "content": "Tell short stories."}, {"role": "user", "content": "A story about Tom"}]
    args = {"model": "tiny", "messages": messages, "max_tokens": 10, "temperature": 0.0}
    whole = client.chat.completions.create(**args, extra_body={"ignore_eos": True})
    prompt = chat_prompt([ChatMessage(**m) for m in messages])
    assert prompt == "System: Tell short stories.\nUser: A story about Tom\nAssistant:"
    expected = _expected(reference, prompt, 10)
    content = whole.choices[0].message.content
    assert content is not None and expected.startswith(content)
    assert whole.choices[0].message.role == "assistant"

    streamed = list(client.chat.completions.create(**args, stream=True, extra_body={"ignore_eos": True}))
    assert streamed[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == content
    assert streamed[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_chat_content_as_text_parts_is_the_joined_text(client: openai.OpenAI, base_url: str) -> None:
    parts = [{"type": "text", "text": "A story"}, {"type": "text", "text": "about Tom"}]
    args = {"model": "tiny", "max_tokens": 6, "temperature": 0.0, "extra_body": {"ignore_eos": True}}
    listed = client.chat.completions.create(messages=[{"role": "user", "content": parts}], **args)
    joined = client.chat.completions.create(messages=[{"role": "user", "content": "A story\nabout Tom"}], **args)
    assert listed.choices[0].message.content == joined.choices[0].message.content
    assert listed.usage is not None and joined.usage is not None
    assert listed.usage.prompt_tokens == joined.usage.prompt_tokens
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    body = {"messages": [{"role": "user", "content": [parts[0], image]}], "max_tokens": 2}
    status, refused = _http(f"{base_url}/v1/chat/completions", json.dumps(body).encode())
    assert status == 400 and "reads no 'image_url' part" in refused["error"]["message"]
    # An assistant's refusal, which SDKs send back in the history, reads as its text; a text part needs its text.
    history = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "No."}]},
    ]
    assert client.chat.completions.create(messages=[*history, {"role": "user", "content": parts}], **args).choices
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": None}]}], "max_tokens": 2}
    status, refused = _http(f"{base_url}/v1/chat/completions", json.dumps(body).encode())
    assert status == 400 and "a 'text' part needs its text as a string" in refused["error"]["message"]
    body = {"messages": [{"role": "user", "content": [{"type": ["text"], "text": "Hi"}]}], "max_tokens": 2}
    status, refused = _http(f"{base_url}/v1/chat/completions", json.dumps(body).encode())
    assert status == 400 and "reads no ['text'] part" in refused["error"]["message"]


def test_malformed_requests_get_openai_shaped_400s(client: openai.OpenAI, base_url: str) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model="tiny", prompt="Hi", max_tokens=-3)
    assert bad.value.status_code == 400 and "max_tokens" in str(bad.value.body)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="Hi", n=2)
    with pytest.raises(openai.BadRequestError) as long:
        client.completions.create(model="tiny", prompt="word " * CTX)
    assert "context holds" in str(long.value.body)
    status, broken = _http(f"{base_url}/v1/chat/completions", b"{not json")
    assert status == 400 and broken["error"]["type"] == "invalid_request_error" and broken["error"]["message"]
    for field in ("temperature", "top_p"):
        status, nan = _http(f"{base_url}/v1/completions", f'{{"prompt": "Hi", "{field}": NaN}}'.encode())
        assert status == 400 and nan["error"]["message"] == f"{field}: Input should be a finite number"
    assert _http(f"{base_url}/v1/models")[1]["data"][0]["id"] == "tiny"


def test_an_empty_prompt_begins_at_the_bos_token(client: openai.OpenAI, reference: Engine, base_url: str) -> None:
    args = {"model": "tiny", "prompt": "", "max_tokens": 6, "temperature": 0.0, "extra_body": {"ignore_eos": True}}
    whole = client.completions.create(**args)
    assert whole.usage is not None and whole.usage.prompt_tokens == 1
    assert whole.choices[0].text == _expected(reference, "", 6)
    status, none = _http(f"{base_url}/v1/completions", b'{"prompt": []}')
    assert status == 400 and none["error"]["param"] == "prompt"


def test_an_empty_prompt_for_a_model_without_a_bos_token_is_a_400(swiglu: dict[str, dict[str, Path]]) -> None:
    engine = Engine.open(swiglu["qwen2"]["dense-f32"], slots=1, ctx_size=64)
    assert not engine.tokenizer.add_bos
    with serve_in_thread(create_app(EngineWorker(engine), "qwen2")) as url:
        status, body = _http(f"{url}/v1/completions", b'{"prompt": ""}')
    assert status == 400 and body["error"]["param"] == "prompt"
    assert (
        body["error"]["message"]
        == "the prompt is empty, and this model puts no BOS token before a text: send some text"
    )


def test_log_probabilities_are_refused_not_ignored(client: openai.OpenAI) -> None:
    """A client that asks for logprobs gets a 400 naming the field, never an answer silently without them."""
    with pytest.raises(openai.BadRequestError) as completion:
        client.completions.create(model="tiny", prompt="Hi", max_tokens=2, logprobs=2)
    assert "logprobs" in str(completion.value.body) and "not supported" in str(completion.value.body)
    with pytest.raises(openai.BadRequestError) as chat:
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=2, logprobs=True, top_logprobs=3
        )
    assert "logprobs" in str(chat.value.body)
    unasked = client.completions.create(model="tiny", prompt="Hi", max_tokens=2, logprobs=None)
    assert unasked.choices[0].text is not None


def test_eight_concurrent_clients_all_get_complete_answers(client: openai.OpenAI, reference: Engine) -> None:
    def ask(prompt: str) -> tuple[str, str | None, int]:
        r = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=16, temperature=0.0, extra_body={"ignore_eos": True}
        )
        assert r.usage is not None
        return r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        answers = list(pool.map(ask, PROMPTS))
    # Twice as many clients as slots: half of them waited, and batching changed no one's answer.
    for prompt, (text, reason, tokens) in zip(PROMPTS, answers, strict=True):
        assert (reason, tokens) == ("length", 16)
        assert text == _expected(reference, prompt, 16)


def test_a_client_that_disconnects_mid_stream_frees_its_slot(model: Path) -> None:
    engine = Engine.open(model, slots=1, ctx_size=CTX)
    step = engine.step

    def slow_step(group: bool = False) -> list:  # type: ignore[type-arg]
        # Slowed, and a step at a time, so that the full answer would take seconds longer than freeing the slot may.
        time.sleep(0.05)
        return step()

    engine.step = slow_step  # type: ignore[method-assign]
    with serve_in_thread(create_app(EngineWorker(engine), "tiny")) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        stream = client.completions.create(
            model="tiny",
            prompt=PROMPTS[0],
            max_tokens=200,
            temperature=0.0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        next(iter(stream))
        assert _http(f"{url}/health")[1]["busy_slots"] == 1
        stream.close()
        _wait_for(lambda: _http(f"{url}/health")[1]["busy_slots"] == 0, 3.0)  # 200 tokens would take 10 s
        assert _http(f"{url}/health")[1] | {"model": None} == {
            "status": "ok",
            "model": None,
            "slots": 1,
            "busy_slots": 0,
            "free_slots": 1,
            "waiting": 0,
        }
        # A non-streamed request whose client hangs up is dropped as well.
        body = json.dumps({"prompt": PROMPTS[0], "max_tokens": 200, "ignore_eos": True}).encode()
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as raw:
            raw.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                + f"Content-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            _wait_for(lambda: _http(f"{url}/health")[1]["busy_slots"] == 1, 3.0)
        _wait_for(lambda: _http(f"{url}/health")[1]["busy_slots"] == 0, 3.0)
        # The only slot serves the next client.
        after = client.completions.create(
            model="tiny", prompt=PROMPTS[1], max_tokens=3, extra_body={"ignore_eos": True}
        )
        assert after.choices[0].finish_reason == "length"


def test_a_whole_response_stops_early_at_a_stop_string(client: openai.OpenAI, reference: Engine) -> None:
    """A whole response with stop strings still reads its text piece by piece: generation ends at the stop string,
    not at max_tokens."""
    expected = _expected(reference, PROMPTS[1], 24)
    stop = expected[len(expected) // 3 :][:4]
    whole = client.completions.create(
        model="tiny", prompt=PROMPTS[1], max_tokens=24, temperature=0.0, stop=[stop], extra_body={"ignore_eos": True}
    )
    assert whole.choices[0].text == expected[: expected.index(stop)]
    assert whole.choices[0].finish_reason == "stop"
    assert whole.usage is not None and whole.usage.completion_tokens < 24


def test_a_whole_response_without_stop_strings_is_one_event(model: Path) -> None:
    """A reader of the finished text alone is not woken for each token: its job's one event holds the text a
    streamed job of the same request gets piece by piece."""
    engine = Engine.open(model, slots=2, ctx_size=CTX)
    worker = EngineWorker(engine)
    ids = engine.tokenizer.encode(PROMPTS[0])

    async def read(every_piece: bool) -> list[Event]:
        job = worker.submit(Request(ids, 12, GREEDY, ignore_eos=True), every_piece)
        events = [await job.events.get()]
        while not events[-1].finished:
            events.append(await job.events.get())
        return events

    async def both() -> tuple[list[Event], list[Event]]:
        return await asyncio.gather(read(False), read(True))

    worker.start()
    try:
        whole, pieces = asyncio.run(both())
    finally:
        worker.stop(10)
    assert len(whole) == 1 and len(pieces) > 1
    assert whole[0].text == "".join(e.text for e in pieces) == _expected(engine, PROMPTS[0], 12)
    assert whole[0].completion_tokens == pieces[-1].completion_tokens == 12
    assert whole[0].reason == pieces[-1].reason == "length"


def test_stop_strings_cut_the_text_even_across_pieces() -> None:
    scanner = StopScanner(["\nUser:"])
    assert scanner.feed("Hel") == "Hel"
    assert scanner.feed("lo\nUs") == "lo"  # "\nUs" may begin the stop string: held back
    assert scanner.feed("er: more") == "" and scanner.stopped
    assert scanner.flush() == ""
    other = StopScanner(["\nUser:"])
    assert other.feed("a\nU") + other.feed("p") + other.flush() == "a\nUp" and not other.stopped


def test_qinfer_serve_command_answers_on_loopback_by_default(model: Path) -> None:
    import subprocess
    import sys

    port = free_port()
    command = [
        "-c",
        "from qinfer.cli.main import main; main()",
        "serve",
        "-m",
        str(model),
        "--port",
        str(port),
        "--slots",
        "2",
    ]
    server = subprocess.Popen([sys.executable, *command], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                status, health = _http(f"http://127.0.0.1:{port}/health")
                break
            except urllib.error.URLError:
                assert server.poll() is None and time.monotonic() < deadline, "the server did not come up"
                time.sleep(0.2)
        assert status == 200 and health["slots"] == 2 and health["model"] == model.name
        status, answer = _http(
            f"http://127.0.0.1:{port}/v1/completions", json.dumps({"prompt": "Once", "max_tokens": 2}).encode()
        )
        assert status == 200 and answer["usage"]["completion_tokens"] <= 2
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_qinfer_serve_freezes_what_it_loaded_before_it_serves(model: Path) -> None:
    """A full collection in a server must not walk the imports, the model and the tokenizer (tens of milliseconds
    with every thread stopped): what exists when it starts serving is frozen."""
    import subprocess
    import sys

    code = (
        "import gc, uvicorn\n"
        "uvicorn.Server.run = lambda self, *a, **k: print('frozen', gc.get_freeze_count(), len(gc.get_objects()))\n"
        "from qinfer.cli.main import main\n"
        "main()\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, "serve", "-m", str(model), "--port", str(free_port())],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    frozen, tracked = (int(n) for n in done.stdout.split()[-2:])
    assert frozen > 100_000 and tracked < frozen / 100
