"""Requests an attacker would send: a prompt of megabytes (refused before it is tokenized), a Host header naming
another site (DNS rebinding), an empty API key; each refused in OpenAI's error shape, the server still up."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from qinfer.core.errors import UserError
from qinfer.runtime.engine.engine import Engine
from qinfer.runtime.engine.tokenizer import GGUFTokenizer
from qinfer.runtime.engine.worker import EngineWorker
from qinfer.runtime.server.app import ServerOptions, create_app, host_allowed
from qinfer.runtime.server.thread import serve_in_thread
from tests.runtime.server.test_server import CTX
from tests.runtime.server.test_server_hardening import Local, _call
from tests.support.cli_in_process import run_in_process
from tests.support.ports import free_port


@pytest.fixture(scope="module")
def local(gguf_files: dict[str, Path]) -> Iterator[Local]:
    engine = Engine.open(gguf_files["pi-f32"], slots=2, ctx_size=CTX)
    worker = EngineWorker(engine)
    options = ServerOptions(allowed_hosts=("qinfer.example",))
    with serve_in_thread(create_app(worker, "tiny", options), options=options) as url:
        yield Local(url, engine, worker)


def test_a_prompt_longer_than_any_context_is_refused_before_it_is_tokenized(
    local: Local, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokenizer = local.engine.tokenizer
    limit = CTX * tokenizer.max_token_chars
    calls: list[int] = []
    encode = GGUFTokenizer.encode

    def counted(self: GGUFTokenizer, text: str, add_bos: bool | None = None, keep_gil: bool = False) -> list[int]:
        calls.append(len(text))
        return encode(self, text, add_bos, keep_gil)

    monkeypatch.setattr(GGUFTokenizer, "encode", counted)
    huge = "a " * (limit // 2 + 1)
    for path, body, param in (
        ("/v1/completions", {"prompt": huge, "max_tokens": 1}, "prompt"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": huge}], "max_tokens": 1}, "messages"),
        ("/tokenize", {"content": huge}, "content"),
    ):
        status, answer, _ = _call(f"{local.url}{path}", body)
        assert status == 400 and answer["error"]["param"] == param, answer
        assert f"at most {limit}" in answer["error"]["message"]
    assert calls == []
    # Under the bound the prompt is tokenized, and refused (or served) by its real length.
    status, answer, _ = _call(f"{local.url}/v1/completions", {"prompt": "a " * CTX, "max_tokens": 1})
    assert status == 400 and "tokens but the context holds" in answer["error"]["message"] and calls
    assert _call(f"{local.url}/health")[0] == 200


def test_no_token_covers_more_characters_than_its_text(local: Local) -> None:
    """The bound the check rests on: n characters are never fewer than n / max_token_chars tokens."""
    tokenizer = local.engine.tokenizer
    for text in ("the the the the", " " * 64, "Once upon a time, there was a little dog." * 4, "é漢字🙂" * 8):
        assert len(tokenizer.encode(text, add_bos=False)) * tokenizer.max_token_chars >= len(text)


@pytest.mark.parametrize(
    ("host", "allowed"),
    [
        ("127.0.0.1:8080", True),
        ("[::1]:8080", True),
        ("10.1.2.3", True),
        ("localhost:8080", True),
        ("app.localhost", True),
        ("qinfer.example:8080", True),
        ("QINFER.example.", True),
        ("attacker.example:8080", False),
        ("qinfer.example.attacker.example", False),
        ("127.0.0.1.attacker.example", False),
        ("", False),
    ],
)
def test_host_names_the_server(host: str, allowed: bool) -> None:
    assert host_allowed(host, ("qinfer.example",)) == allowed


def test_a_request_for_another_host_is_refused(local: Local) -> None:
    """A page on attacker.example whose name now points here (DNS rebinding) sends its own name as Host."""
    for path, body in (("/v1/models", None), ("/v1/completions", {"prompt": "Once", "max_tokens": 1}), ("/", None)):
        status, answer, _ = _call(f"{local.url}{path}", body, {"Host": "attacker.example:8080"})
        assert status == 403 and "--allowed-hosts" in answer["error"]["message"]
    assert _call(f"{local.url}/v1/models", headers={"Host": "qinfer.example"})[0] == 200
    assert _call(f"{local.url}/health")[0] == 200


@pytest.mark.parametrize("key", ["", "  "])
def test_an_empty_api_key_is_refused(key: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Not silently a server without a key: one line, before the model loads."""
    with pytest.raises(UserError, match="API key is empty"):
        ServerOptions(api_key=key)
    # No model is there: a server that went on would stop at it instead.
    missing = str(tmp_path / "absent.gguf")
    done = run_in_process("serve", "-m", missing, "--api-key", key)
    assert done.returncode != 0 and "API key is empty" in done.stderr and "Traceback" not in done.stderr
    monkeypatch.setenv("QINFER_API_KEY", key)  # click reads an empty variable as unset
    done = run_in_process("serve", "-m", missing)
    assert done.returncode != 0 and "API key is empty" in done.stderr


def _chat(url: str, extra: dict[str, object]) -> tuple[int, dict[str, object]]:
    body = {"messages": [{"role": "user", "content": "Tell me about Lily."}], "max_tokens": 24, **extra}
    status, answer, _ = _call(f"{url}/v1/chat/completions", body)
    return status, answer


def _schema(schema: object) -> dict[str, object]:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}


DEEP: dict[str, object] = {"type": "string"}
for _ in range(300):
    DEEP = {"type": "array", "items": DEEP}


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        (_schema({"$ref": "#"}), "response_format"),  # refers only to itself: no value satisfies it
        (_schema({"allOf": [{"type": "string"}, {"type": "integer"}]}), "response_format"),
        (_schema({"type": "integer", "minimum": 5, "maximum": 1}), "response_format"),
        (_schema({"enum": [f"value{i}" for i in range(200_000)]}), "response_format"),  # over the engine's limit
        (_schema({"type": "string", "pattern": "(a"}), "response_format"),
        (_schema(DEEP), "response_format"),
        ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
    ],
    ids=["self-reference", "contradiction", "empty range", "oversized", "bad pattern", "deep", "named", "required"],
)
def test_a_schema_or_tool_choice_that_cannot_be_served_is_a_400(
    local: Local, extra: dict[str, object], param: str
) -> None:
    status, answer = _chat(local.url, extra)
    error = answer.get("error")
    assert status == 400 and isinstance(error, dict) and error["param"] == param, answer
    message = str(error["message"])
    assert "\n" not in message and len(message) < 400 and "<state>" not in message


def _serve_process(model: Path, *extra: str) -> tuple[subprocess.Popen[str], str]:
    port = free_port()
    command = [sys.executable, "-m", "qinfer", "serve", "-m", str(model), "-c", str(CTX), "--port", str(port), *extra]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            _call(f"{url}/health")
            return server, url
        except urllib.error.URLError:
            assert server.poll() is None and time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.2)


def _stream(url: str, lines: list[str], started: threading.Event) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": CTX - 10, "ignore_eos": True, "stream": True}
    request = urllib.request.Request(
        f"{url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            for raw in response:
                started.set()
                if raw.strip():
                    lines.append(raw.decode().strip())
    except (urllib.error.URLError, ConnectionError) as exc:
        lines.append(f"failed: {exc}")


@pytest.mark.parametrize("signals", [(signal.SIGINT,), (signal.SIGTERM,), (signal.SIGINT, signal.SIGINT)])
def test_shutdown_ends_every_stream_with_a_final_event_and_exits_soon(
    gguf_files: dict[str, Path], signals: tuple[int, ...]
) -> None:
    """Twelve streams queued on one slot, each of hundreds of tokens: a signal answers them all at once and the
    server exits in seconds, without a traceback, also when the user presses Ctrl-C twice."""
    server, url = _serve_process(gguf_files["pi-f32"], "--slots", "1", "--shutdown-timeout", "2")
    try:
        outputs: list[list[str]] = [[] for _ in range(12)]
        started = threading.Event()
        clients = [threading.Thread(target=_stream, args=(url, out, started)) for out in outputs]
        for client in clients:
            client.start()
        assert started.wait(30)
        time.sleep(0.2)
        stopped = time.monotonic()
        for sig in signals:
            server.send_signal(sig)
            time.sleep(0.1)
        server.wait(timeout=15)
        assert time.monotonic() - stopped < 5
        for client in clients:
            client.join(10)
        _, stderr = server.communicate()
        assert "Traceback" not in stderr, stderr
        for out in outputs:
            last = out[-1] if out else ""
            assert last == "data: [DONE]" or "shutting down" in last, out[-3:]
        ended = [json.loads(out[-1].removeprefix("data: ")) for out in outputs if out and "shutting down" in out[-1]]
        assert len(ended) >= 10
        # A stream's error event is OpenAI's error object, as a response's body is.
        assert all(set(event["error"]) == {"message", "type", "param", "code"} for event in ended), ended[0]
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
