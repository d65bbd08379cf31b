"""The server's defences, as llama.cpp's server has them: an API key, a body size cap, tokenization off the event
loop, a deadline for request heads and a connection cap, a request's sampling failure kept to that request,
OpenAI's error shape for every error, and caps on stop strings."""

from __future__ import annotations

import contextlib
import json
import os
import select
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from email.message import Message
from pathlib import Path
from typing import Any

import openai
import pytest
import torch

import qinfer.runtime.engine.engine as engine_module
from qinfer.runtime.engine.engine import Engine, Request
from qinfer.runtime.engine.generate import generate
from qinfer.runtime.engine.sampling import SamplingParams
from qinfer.runtime.engine.worker import EngineWorker
from qinfer.runtime.server.app import DEFAULT_OPTIONS, INLINE_TOKENIZE_CHARS, ServerOptions, create_app
from qinfer.runtime.server.thread import serve_in_thread
from tests.runtime.server.test_server import CTX, GREEDY, PROMPTS, _expected, _wait_for
from tests.support.logits_hook import LogitsHook
from tests.support.ports import free_port

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
HEAD_TIMEOUT_S = 2.0
MIB = 1024 * 1024
LOCAL = ServerOptions(max_body_bytes=MIB, read_timeout_s=0.5)
JsonBody = dict[str, Any]


@dataclass(frozen=True)
class Served:
    url: str
    pid: int


@dataclass(frozen=True)
class Local:
    url: str
    engine: Engine
    worker: EngineWorker


@pytest.fixture(scope="module")
def model(gguf_files: dict[str, Path]) -> Path:
    return gguf_files["pi-f32"]


@pytest.fixture(scope="module")
def reference(model: Path) -> Engine:
    return Engine.open(model, slots=1, ctx_size=CTX)


@pytest.fixture(scope="module")
def served(model: Path) -> Iterator[Served]:
    """`qinfer serve` in its own process, so that its memory can be read; the key comes from QINFER_API_KEY."""
    port = free_port()
    command = [sys.executable, "-m", "qinfer", "serve", "-m", str(model), "-c", str(CTX)]
    command += ["--port", str(port), "--slots", "2", "--read-timeout", str(HEAD_TIMEOUT_S)]
    env = {**os.environ, "QINFER_API_KEY": KEY}
    server = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                _call(f"{url}/health")
                break
            except urllib.error.URLError:
                assert server.poll() is None and time.monotonic() < deadline, "the server did not come up"
                time.sleep(0.2)
        yield Served(url, server.pid)
    finally:
        server.terminate()
        server.wait(timeout=30)


@contextlib.contextmanager
def _serve(model: Path, options: ServerOptions = DEFAULT_OPTIONS, slots: int = 4) -> Iterator[Local]:
    engine = Engine.open(model, slots=slots, ctx_size=CTX)
    worker = EngineWorker(engine)
    with serve_in_thread(create_app(worker, "tiny", options), options=options) as url:
        yield Local(url, engine, worker)


@pytest.fixture(scope="module")
def local(model: Path) -> Iterator[Local]:
    with _serve(model, LOCAL) as server:
        yield server


def _call(
    url: str, body: JsonBody | bytes | None = None, headers: dict[str, str] | None = None, method: str | None = None
) -> tuple[int, JsonBody, Message]:
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    request = urllib.request.Request(url, data, {"Content-Type": "application/json", **(headers or {})}, method=method)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read()), response.headers
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read()), exc.headers


def _address(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


def _exchange(url: str, data: bytes, timeout_s: float = 10.0) -> bytes:
    """Send raw bytes and read the reply until the server closes the connection."""
    with socket.create_connection(_address(url), timeout=timeout_s) as sock:
        sock.sendall(data)
        return _read_to_end(sock)


def _read_to_end(sock: socket.socket) -> bytes:
    reply = b""
    # A server that closes with request bytes still unread resets the connection after its reply.
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(65536):
            reply += chunk
    return reply


def _parse_reply(reply: bytes) -> tuple[int, JsonBody]:
    head, _, body = reply.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def _assert_error(status: int, body: JsonBody, expected: int, kind: str = "invalid_request_error") -> None:
    assert status == expected, body
    assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["message"]
    assert body["error"]["type"] == kind


def _rss_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def _completion(url: str, prompt: str, extra: JsonBody) -> tuple[int, JsonBody, Message]:
    return _call(f"{url}/v1/completions", {"prompt": prompt, "max_tokens": 16, "ignore_eos": True, **extra})


def _busiest_batch(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Slow the engine's steps, a step at a time, so that concurrent requests overlap; the list gets each step's batch
    size."""
    sizes: list[int] = []
    step = engine.step

    def slow_step(group: bool = False) -> list:  # type: ignore[type-arg]
        sizes.append(len(engine.active_slots()))
        time.sleep(0.01)
        return step()

    monkeypatch.setattr(engine, "step", slow_step)
    return sizes


def test_the_api_key_guards_every_v1_path_but_not_health(served: Served) -> None:
    assert _call(f"{served.url}/health")[0] == 200
    for path, headers in (
        ("/v1/models", {}),
        ("/v1/models", {"Authorization": "Bearer wrong"}),
        ("/v1/models", {"Authorization": KEY}),
        ("/v1/no-such-route", {}),  # a stranger cannot even learn which routes exist
    ):
        status, body, head = _call(served.url + path, headers=headers)
        _assert_error(status, body, 401, "authentication_error")
        assert head["WWW-Authenticate"] == "Bearer" and body["error"]["code"] == "invalid_api_key"
    assert _call(f"{served.url}/v1/models", headers=AUTH)[0] == 200
    _assert_error(*_call(f"{served.url}/v1/no-such-route", headers=AUTH)[:2], 404)
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key=KEY, max_retries=0, timeout=60)
    answer = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=3)
    assert answer.usage is not None and answer.usage.completion_tokens <= 3
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{served.url}/v1", api_key="wrong", max_retries=0).models.list()


def test_a_100_mb_body_is_refused_at_once_and_never_held(served: Served) -> None:
    head = b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
    head += f"Authorization: Bearer {KEY}\r\n".encode()
    size = 100 * 10**6
    start = time.monotonic()
    # A declared length is refused from the head alone.
    status, body = _parse_reply(_exchange(served.url, head + f"Content-Length: {size}\r\n\r\n".encode()))
    _assert_error(status, body, 413)
    assert time.monotonic() - start < 2.0

    # A chunked body is cut off once it passes the limit; 5 resets the peak RSS (VmHWM) to the current one.
    Path(f"/proc/{served.pid}/clear_refs").write_text("5")
    before = _rss_kib(served.pid, "VmRSS")
    start = time.monotonic()
    sent, reply = _stream_chunked(served.url, head + b"Transfer-Encoding: chunked\r\n\r\n", size)
    elapsed = time.monotonic() - start
    _assert_error(*_parse_reply(reply), 413)
    assert elapsed < 2.0 and sent < size
    assert (_rss_kib(served.pid, "VmHWM") - before) * 1024 < 4 * DEFAULT_OPTIONS.max_body_bytes


def _stream_chunked(url: str, head: bytes, size: int) -> tuple[int, bytes]:
    """Send `head`, then chunks until `size` bytes or the server answers; return the bytes sent and the reply."""
    piece = 64 * 1024
    chunk = f"{piece:x}\r\n".encode() + b"x" * piece + b"\r\n"
    sent = 0
    with socket.create_connection(_address(url), timeout=10) as sock:
        sock.sendall(head)
        with contextlib.suppress(ConnectionError):  # the server may close before it has read all that was sent
            while sent < size and not select.select([sock], [], [], 0)[0]:
                sock.sendall(chunk)
                sent += piece
        return sent, _read_to_end(sock)


def test_slowloris_sockets_do_not_starve_a_real_request(served: Served) -> None:
    slow: list[socket.socket] = []
    try:
        for _ in range(200):
            sock = socket.create_connection(_address(served.url), timeout=10)
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Le")  # and never the rest
            slow.append(sock)
        status, body, _ = _call(f"{served.url}/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 4}, AUTH)
        assert status == 200 and body["usage"]["completion_tokens"] <= 4
        assert not select.select([slow[-1]], [], [], 0)[0], "served only after the slow sockets were dropped"
        # Each one is dropped once its head is HEAD_TIMEOUT_S late.
        for sock in slow:
            assert sock.recv(1) == b""
    finally:
        for sock in slow:
            sock.close()


def test_connections_over_the_cap_get_a_503_until_slow_heads_time_out(model: Path) -> None:
    with _serve(model, ServerOptions(read_timeout_s=0.5, max_connections=8), slots=1) as server:
        slow = [socket.create_connection(_address(server.url), timeout=10) for _ in range(8)]
        try:
            for sock in slow:
                sock.sendall(b"GET /health HTTP/1.1\r\n")
            status, body, head = _call(f"{server.url}/health")
            _assert_error(status, body, 503, "server_error")
            assert head["Retry-After"] == "1"
            _wait_for(lambda: _call(f"{server.url}/health")[0] == 200, 3.0)
        finally:
            for sock in slow:
                sock.close()


def test_health_answers_at_once_while_a_prompt_tokenizes(local: Local, monkeypatch: pytest.MonkeyPatch) -> None:
    tokenizer = local.engine.tokenizer
    encode = tokenizer.encode
    started, release = threading.Event(), threading.Event()

    def long_encode(text: str, add_bos: bool | None = None) -> list[int]:
        # A long prompt's tokenization, lasting until the test has asked for /health; its ids, a short one's, fit
        # the context.
        started.set()
        release.wait(10)
        return encode(PROMPTS[0], add_bos)

    monkeypatch.setattr(tokenizer, "encode", long_encode)
    latencies = []
    # Short prompts are tokenized on the event loop itself, in less time than a thread's round trip.
    long_prompt = PROMPTS[0] + " and so on" * (INLINE_TOKENIZE_CHARS // 10)
    assert len(long_prompt) <= CTX * tokenizer.max_token_chars, "the server would refuse it before tokenizing"
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(_completion, local.url, long_prompt, {"max_tokens": 2})
        assert started.wait(10)
        for _ in range(10):
            start = time.monotonic()
            assert _call(f"{local.url}/health")[0] == 200
            latencies.append(time.monotonic() - start)
        release.set()
        assert pending.result()[0] == 200
    assert max(latencies) < 0.1, latencies


def test_a_poisoned_request_leaves_its_batch_mates_answers_alone(
    local: Local, reference: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    batches = _busiest_batch(local.engine, monkeypatch)
    poison = {"temperature": 1e-300, "top_p": 1e-300}
    with ThreadPoolExecutor(5) as pool:
        mates = [pool.submit(_completion, local.url, p, {"temperature": 0.0}) for p in PROMPTS[:3]]
        tiny = pool.submit(_completion, local.url, PROMPTS[3], {**poison, "seed": 12345})
        huge_seed = pool.submit(_completion, local.url, PROMPTS[4], {**poison, "seed": 2**70})
        for prompt, mate in zip(PROMPTS, mates, strict=False):
            status, body, _ = mate.result()
            assert status == 200 and body["choices"][0]["text"] == _expected(reference, prompt, 16)
        # A temperature of 1e-300 decodes greedily; a seed past what a torch generator takes is the client's error.
        status, body, _ = tiny.result()
        assert status == 200 and body["choices"][0]["text"] == _expected(reference, PROMPTS[3], 16)
        status, body, _ = huge_seed.result()
        _assert_error(status, body, 400)
        assert body["error"]["param"] == "seed"
    assert max(batches) == 4


def test_a_sampling_failure_fails_its_own_request_alone(
    local: Local, reference: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    batches = _busiest_batch(local.engine, monkeypatch)
    sample_next = engine_module.sample_next

    def failing_for_top_k_7(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
        # It fails only once all four requests share a step, so that the failure meets a full batch.
        if params.top_k == 7 and max(batches, default=0) == 4:
            raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")
        return sample_next(logits, params, generator)

    monkeypatch.setattr(engine_module, "sample_next", failing_for_top_k_7)
    with ThreadPoolExecutor(4) as pool:
        # Submitted first and long, it is still decoding when its batch-mates arrive, however slow the machine.
        failing = pool.submit(_completion, local.url, PROMPTS[3], {"top_k": 7, "max_tokens": CTX // 2})
        _wait_for(lambda: _call(f"{local.url}/health")[1]["busy_slots"] == 1, 3.0)
        mates = [pool.submit(_completion, local.url, p, {"temperature": 0.0}) for p in PROMPTS[:3]]
        status, body, _ = failing.result()
        _assert_error(status, body, 500, "server_error")
        assert body["error"]["message"].startswith("sampling failed:")
        for prompt, mate in zip(PROMPTS, mates, strict=False):
            status, body, _ = mate.result()
            assert status == 200 and body["choices"][0]["text"] == _expected(reference, prompt, 16)
    assert max(batches) == 4
    _wait_for(lambda: _call(f"{local.url}/health")[1]["busy_slots"] == 0, 3.0)


def _assert_only_it_fails(engine: Engine, bad: int, reference: Engine) -> None:
    """Steps `engine` to the end: the sequence in slot `bad` fails in sampling, the other one (PROMPTS[0], greedy)
    decodes as alone."""
    tokens: list[int] = []
    failed = []
    while engine.active_slots():
        for out in engine.step():
            if out.slot == bad:
                failed.append(out)
            elif out.token is not None:
                tokens.append(out.token)
    assert [(o.token, o.finished, o.reason) for o in failed] == [(None, True, "error")]
    assert failed[0].error is not None and failed[0].error.startswith("sampling failed:")
    assert tokens == generate(reference, PROMPTS[0], 8, GREEDY, ignore_eos=True).tokens


def test_nan_logits_end_only_their_own_sequence(model: Path, reference: Engine) -> None:
    engine = Engine.open(model, slots=2, ctx_size=CTX)
    engine.submit(Request(engine.tokenizer.encode(PROMPTS[0]), 8, GREEDY, ignore_eos=True))
    broken = LogitsHook(lambda logits: torch.full_like(logits, float("nan")))  # what a broken forward would give
    ids = engine.tokenizer.encode(PROMPTS[1])
    bad = engine.submit(Request(ids, 8, SamplingParams(1.0, 0, 1.0), ignore_eos=True, constraint=broken))  # type: ignore[arg-type]
    _assert_only_it_fails(engine, bad, reference)


@pytest.mark.parametrize("spoil", ["nan", "inf", "nothing finite"])
def test_a_greedy_rows_unusable_logits_end_only_its_sequence(
    model: Path, reference: Engine, monkeypatch: pytest.MonkeyPatch, spoil: str
) -> None:
    """A step takes its greedy choices for the whole batch at once: a row that gives none still fails its own
    sequence alone, as one sampled with a constraint does above."""
    engine = Engine.open(model, slots=2, ctx_size=CTX)
    forward = engine.forward.forward

    def spoiled(*args: Any) -> torch.Tensor:
        logits = forward(*args)
        if logits.shape[0] == 2:  # while both run, the later slot's row is the last
            if spoil == "nothing finite":
                logits[-1] = float("-inf")
            else:
                logits[-1, 7] = float(spoil)
        return logits

    monkeypatch.setattr(engine.forward, "forward", spoiled)
    good = engine.submit(Request(engine.tokenizer.encode(PROMPTS[0]), 8, GREEDY, ignore_eos=True))
    bad = engine.submit(Request(engine.tokenizer.encode(PROMPTS[1]), 8, GREEDY, ignore_eos=True))
    assert good < bad
    _assert_only_it_fails(engine, bad, reference)


def test_every_error_has_openai_shape(local: Local, monkeypatch: pytest.MonkeyPatch) -> None:
    url = local.url
    status, body, _ = _call(f"{url}/no-such-route")
    _assert_error(status, body, 404)
    assert "GET /no-such-route" in body["error"]["message"]
    status, body, head = _call(f"{url}/v1/models", {}, method="POST")
    _assert_error(status, body, 405)
    assert head["Allow"] == "GET"

    status, body, _ = _call(f"{url}/v1/completions", b'{"prompt": "a lone \\ud800 surrogate"}')
    _assert_error(status, body, 400)
    assert body["error"]["param"] == "prompt" and "\\ud800" in body["error"]["message"]
    chat = b'{"messages": [{"role": "user", "content": "\\udfff"}]}'
    status, body, _ = _call(f"{url}/v1/chat/completions", chat)
    _assert_error(status, body, 400)
    assert body["error"]["param"] == "messages.0.content"

    _assert_error(*_parse_reply(_exchange(url, b"NOT HTTP AT ALL\r\n\r\n")), 400)
    post = b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
    too_long = _exchange(url, post + f"Content-Length: {2 * MIB}\r\n\r\n".encode())
    _assert_error(*_parse_reply(too_long), 413)
    start = time.monotonic()
    stalled = _exchange(url, post + b'Content-Length: 100\r\n\r\n{"prompt": ')
    _assert_error(*_parse_reply(stalled), 408)
    assert time.monotonic() - start < LOCAL.read_timeout_s + 2

    def broken_stats() -> dict[str, int]:
        raise RuntimeError("a bug")

    monkeypatch.setattr(local.worker, "stats", broken_stats)
    _assert_error(*_call(f"{url}/health")[:2], 500, "server_error")


def test_stop_strings_are_capped(local: Local) -> None:
    def complete(stop: list[str]) -> tuple[int, JsonBody, Message]:
        return _call(f"{local.url}/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 4, "stop": stop})

    assert complete(["x" * 256] * 16)[0] == 200
    for stop in (["a"] * 17, ["x" * 257], ["y" * 1000] * 400):
        status, body, _ = complete(stop)
        _assert_error(status, body, 400)
        assert body["error"]["param"] == "stop"
