"""Requests an attacker would send: a prompt of megabytes (refused before it is tokenized), a Host header naming
another site (DNS rebinding), an empty API key; each refused in OpenAI's error shape, the server still up."""

from __future__ import annotations

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

    def counted(self: GGUFTokenizer, text: str, add_bos: bool | None = None) -> list[int]:
        calls.append(len(text))
        return encode(self, text, add_bos)

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
