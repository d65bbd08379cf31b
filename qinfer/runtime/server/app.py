"""OpenAI-compatible HTTP API over an EngineWorker: /v1/completions, /v1/chat/completions (both with server-sent
event streaming), /v1/models and /health, and llama.cpp's operations endpoints: /metrics (Prometheus), /props,
/slots, /tokenize and /detokenize. Every response carries `usage` and llama.cpp's `timings`. Every error uses
OpenAI's shape: {"error": {"message", "type", "param", "code"}}. An optional API key guards everything but
/health; request bodies are capped in size and in how long they may stall; a request must name the server in its
Host header (an IP address, localhost, or a name it was told), so that a web page whose own name was made to point
at this machine (DNS rebinding) cannot drive it through a visitor's browser."""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import json
import random
import secrets
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import asdict, dataclass
from importlib import resources
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from qinfer.core.errors import UserError
from qinfer.runtime.engine.chat_template import ChatTemplate, ChatTemplateError
from qinfer.runtime.engine.engine import Request as EngineRequest
from qinfer.runtime.engine.grammar_constraint import Constraint, GrammarError, Grammars
from qinfer.runtime.engine.worker import SHUTTING_DOWN, EngineWorker, Job
from qinfer.runtime.server.metrics import ServerMetrics
from qinfer.runtime.server.openai_schema import (
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    SamplingFields,
    TokenizeRequest,
    Tool,
    chat_prompt,
    tool_call_schema,
)
from qinfer.runtime.server.template_process import RendererBusy, TemplateProcess

# The slowest body upload accepted, on average: a full 8 MiB body may take about two minutes.
MIN_BODY_BYTES_PER_S = 64 * 1024
# How often a non-streamed request checks whether its client is still connected.
DISCONNECT_POLL_S = 0.25
# The longest text tokenized on the event loop itself, in less time than a thread's round trip (two wakes) takes:
# 1,000 characters in 0.1 ms. Longer ones go to a thread.
INLINE_TOKENIZE_CHARS = 1024
# Response ids and default seeds: unique, not secret. The system's generator lets go of the GIL, and the event loop
# then waited to take it back from the busy engine thread (py-spy found it there for 0.4 ms a request, the tiny
# model at one client). Seeded from the system once, and a generator of its own, so that code reseeding `random`
# cannot repeat them.
DRAWS = random.Random()
# Sent with errors that leave part of the request unread, so that the rest is never read.
CLOSE = {"Connection": "close"}
# Paths besides /v1/* that an API key guards: they cost work or tell about the model.
OPERATIONS = ("/metrics", "/props", "/slots", "/tokenize", "/detokenize")


@dataclass(frozen=True)
class ServerOptions:
    """What one client may cost the server: create_app enforces the key and the body's limits, thread.py's
    protocol the deadline for request heads and the connection limits."""

    api_key: str | None = None  # when set, /v1/* requires "Authorization: Bearer <api_key>"
    max_body_bytes: int = 8 * 1024 * 1024
    read_timeout_s: float = 10.0  # for a request's head to arrive, and for each pause in its body
    idle_timeout_s: int = 5  # for a kept-alive connection's next request
    max_connections: int = 256
    allowed_hosts: tuple[str, ...] = ()  # names besides IP addresses and localhost that Host may give; "*": any
    shutdown_timeout_s: float = 5.0  # after SIGINT/SIGTERM, for open responses to send their last event

    def __post_init__(self) -> None:
        if self.api_key is not None and not self.api_key.strip():
            raise UserError(
                "the API key is empty, which would let anyone in: give --api-key (or QINFER_API_KEY) a key, or "
                "unset it to serve without one"
            )


DEFAULT_OPTIONS = ServerOptions()


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


def error_response(
    status: int,
    message: str,
    kind: str,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    return JSONResponse(error_body(message, kind, param, code), status_code=status, headers=headers)


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict[str, object]:
    """OpenAI's error object: a response's body, and a stream's last event."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class ApiKeyGuard:
    """ASGI middleware: every /v1 path, routed or not, and the operations endpoints need the key, so that not even
    a 404 answers a stranger."""

    def __init__(self, app: ASGIApp, api_key: str):
        self.app = app
        self._key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        guarded = path == "/v1" or path.startswith("/v1/") or path in OPERATIONS
        if scope["type"] == "http" and guarded and not self._authorized(scope):
            message = "a valid API key is required: send the header 'Authorization: Bearer <key>'"
            # Closing spares reading a body that the client may go on sending.
            headers = {"WWW-Authenticate": "Bearer", **CLOSE}
            response = error_response(401, message, "authentication_error", code="invalid_api_key", headers=headers)
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        value = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = value.partition(b" ")
        # Constant time, so that response times do not reveal how much of a guess was right.
        return scheme.lower() == b"bearer" and secrets.compare_digest(token.strip(), self._key)


def host_allowed(header: str, names: tuple[str, ...]) -> bool:
    """Whether a Host header ("name", "name:port", "[v6]:port") names this server: an IP address (which no DNS
    answer can rebind), localhost, or one of `names` ("*" allows any)."""
    if header.startswith("["):
        host, bracket, rest = header[1:].partition("]")
        if not bracket or (rest and not rest.startswith(":")):
            return False
    else:
        host = header.rsplit(":", 1)[0] if header.count(":") == 1 else header
    host = host.rstrip(".").lower()
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        pass
    return host == "localhost" or host.endswith(".localhost") or "*" in names or host in names


class HostGuard:
    """ASGI middleware: a request whose Host header names another server gets a 403, before anything else."""

    def __init__(self, app: ASGIApp, names: tuple[str, ...]):
        self.app = app
        self.names = tuple(n.rstrip(".").lower() for n in names)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        host = dict(scope.get("headers", [])).get(b"host")
        if scope["type"] == "http" and host is not None and not host_allowed(host.decode("latin-1"), self.names):
            message = (
                f"this server does not serve the host {host.decode('latin-1')!r}; its operator can allow it with "
                "--allowed-hosts"
            )
            await error_response(403, message, "invalid_request_error", headers=CLOSE)(scope, receive, send)
            return
        await self.app(scope, receive, send)


class BodyGuard:
    """ASGI middleware: a body over `max_bytes` gets a 413 (at once when its Content-Length says so, else as soon as
    the bytes read pass the limit), one that stalls for `timeout_s` gets a 408; the connection then closes, so the
    server never holds more than the limit of one body nor reads the rest."""

    def __init__(self, app: ASGIApp, max_bytes: int, timeout_s: float):
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        # h11 has already refused a Content-Length that is not a number.
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and int(declared) > self.max_bytes:
            response = error_response(413, _too_large(self.max_bytes), "invalid_request_error", headers=CLOSE)
            await response(scope, receive, send)
            return
        await self.app(scope, _GuardedBody(receive, self.max_bytes, self.timeout_s).receive, send)


def _too_large(max_bytes: int) -> str:
    return f"the request body is over the server's limit of {max_bytes} bytes"


@dataclass
class _GuardedBody:
    """One request's receive(), counting its body bytes and timing each wait for more, and the whole body: a client
    trickling a byte just inside each pause would otherwise hold its connection for as long as it likes."""

    inner: Receive
    max_bytes: int
    timeout_s: float
    received: int = 0
    complete: bool = False
    deadline: float = 0.0

    def __post_init__(self) -> None:
        self.deadline = time.monotonic() + self.timeout_s + self.max_bytes / MIN_BODY_BYTES_PER_S

    async def receive(self) -> Message:
        if self.complete:
            # Past the body, receive() only waits for a disconnect, for as long as the response lasts.
            return await self.inner()
        wait = min(self.timeout_s, self.deadline - time.monotonic())
        try:
            if wait <= 0:
                raise TimeoutError
            async with asyncio.timeout(wait):
                message = await self.inner()
        except TimeoutError:
            raise HTTPException(
                408,
                f"the request body stalled or came too slowly (over {self.timeout_s:g} s idle, "
                f"or under {MIN_BODY_BYTES_PER_S} bytes/s)",
                CLOSE,
            ) from None
        if message["type"] == "http.request":
            self.received += len(message.get("body", b""))
            if self.received > self.max_bytes:
                raise HTTPException(413, _too_large(self.max_bytes), CLOSE)
            self.complete = not message.get("more_body", False)
        return message


@dataclass
class StopScanner:
    """Cuts the text at the first stop string, holding back a tail that could still become one."""

    stops: list[str]
    text: str = ""
    sent: int = 0
    stopped: bool = False

    def feed(self, piece: str) -> str:
        self.text += piece
        hits = [i for i in (self.text.find(s, max(self.sent - len(s), 0)) for s in self.stops if s) if i >= 0]
        if hits:
            self.stopped = True
            return self._emit_until(min(hits))
        hold = max((n for s in self.stops for n in range(1, len(s)) if self.text.endswith(s[:n])), default=0)
        return self._emit_until(len(self.text) - hold)

    def flush(self) -> str:
        return "" if self.stopped else self._emit_until(len(self.text))

    def _emit_until(self, end: int) -> str:
        out = self.text[self.sent : max(end, self.sent)]
        self.sent = max(end, self.sent)
        return out


@dataclass(frozen=True)
class Piece:
    text: str
    finish_reason: str | None
    completion_tokens: int


async def pieces(worker: EngineWorker, job: Job, stops: list[str]) -> AsyncIterator[Piece]:
    """The job's text as it is generated, cut at stop strings; the last piece carries the finish reason."""
    scanner = StopScanner(stops)
    while True:
        event = await job.events.get()
        if event.error is not None:
            raise ApiError(503 if event.unavailable else 500, event.error, "server_error")
        text = scanner.feed(event.text)
        if scanner.stopped:
            worker.cancel(job)
            yield Piece(text, "stop", event.completion_tokens)
            return
        if event.finished:
            yield Piece(text + scanner.flush(), event.reason, event.completion_tokens)
            return
        if text:
            yield Piece(text, None, event.completion_tokens)


def create_app(
    worker: EngineWorker,
    model_id: str,
    options: ServerOptions = DEFAULT_OPTIONS,
    chat_template: ChatTemplate | None = None,
    webui: bool = True,
) -> FastAPI:
    """The app over `worker`; chat turns go through `chat_template` where there is one, else a plain transcript.
    `webui`: a chat page at / (webui/index.html, shipped in the package: no CDN)."""
    # With a key, the schema and its pages (not under /v1) are not served to whoever asks.
    docs: dict[str, Any] = {"docs_url": None, "redoc_url": None, "openapi_url": None} if options.api_key else {}
    renderer = TemplateProcess(chat_template) if chat_template is not None else None
    app = FastAPI(title="qinfer", lifespan=_lifespan(worker, renderer, options.shutdown_timeout_s), **docs)
    app.add_exception_handler(RequestValidationError, _invalid_request)
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, _server_error)
    app.add_middleware(BodyGuard, max_bytes=options.max_body_bytes, timeout_s=options.read_timeout_s)
    if options.api_key:
        # Added late, so it runs early: a stranger's body is never read.
        app.add_middleware(ApiKeyGuard, api_key=options.api_key)
    app.add_middleware(HostGuard, names=options.allowed_hosts)
    routes = _Routes(worker, model_id, chat_template, renderer, ServerMetrics(worker))
    app.get("/health")(routes.health)
    app.get("/metrics")(routes.metrics)
    app.get("/props")(routes.props)
    app.get("/slots")(routes.slots)
    app.post("/tokenize")(routes.tokenize)
    app.post("/detokenize")(routes.detokenize)
    app.get("/v1/models")(routes.models)
    if webui:
        page = (resources.files(__package__) / "webui" / "index.html").read_text(encoding="utf-8")
        app.get("/", response_class=HTMLResponse)(lambda: HTMLResponse(page))
    app.post("/v1/completions", response_model=None)(routes.completions)
    app.post("/v1/chat/completions", response_model=None)(routes.chat_completions)
    return app


def _lifespan(
    worker: EngineWorker, renderer: TemplateProcess | None, shutdown_timeout_s: float
) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        worker.start()
        yield
        worker.stop(shutdown_timeout_s)
        if renderer is not None:
            renderer.close()

    return lifespan


async def _invalid_request(_request: Request, exc: RequestValidationError) -> JSONResponse:
    first = exc.errors()[0]
    if first.get("type") == "json_invalid":
        return error_response(400, f"the body is not valid JSON: {first['ctx']['error']}", "invalid_request_error")
    param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
    return error_response(
        400, f"{param or 'body'}: {first.get('msg', 'invalid value')}", "invalid_request_error", param
    )


async def _api_error(_request: Request, exc: ApiError) -> JSONResponse:
    return error_response(exc.status, exc.message, exc.kind, exc.param)


async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    message = str(exc.detail)
    if exc.status_code in (404, 405):  # the router's own, which do not say what was asked for
        message = f"{message}: {request.method} {request.url.path}"
    kind = "server_error" if exc.status_code >= 500 else "invalid_request_error"
    return error_response(exc.status_code, message, kind, headers=exc.headers)


async def _server_error(_request: Request, exc: Exception) -> JSONResponse:
    # The traceback goes to the server's log; the client learns only that the fault is the server's.
    return error_response(500, f"the server failed on this request ({type(exc).__name__})", "server_error")


@dataclass
class _Routes:
    worker: EngineWorker
    model_id: str
    template: ChatTemplate | None
    renderer: TemplateProcess | None  # renders `template` in a process of its own
    counters: ServerMetrics

    @functools.cached_property
    def grammars(self) -> Grammars:
        """The vocabulary as the grammar engine needs it, made on the first structured request."""
        return Grammars(self.worker.engine.tokenizer)

    async def health(self) -> dict[str, object]:
        return {"status": "ok", "model": self.model_id, **self.worker.stats()}

    async def metrics(self) -> Response:
        return Response(self.counters.exposition(), media_type=CONTENT_TYPE_LATEST)

    async def props(self) -> dict[str, object]:
        engine = self.worker.engine
        return {
            "model_path": self.model_id,
            "total_slots": engine.slots,
            "n_ctx": engine.ctx_size,
            "chat_template": self.template.source if self.template is not None else "",
            **engine.tokenizer.special_tokens,
            "default_generation_settings": {"n_ctx": engine.ctx_size, **asdict(SamplingFields().sampling())},
        }

    async def slots(self) -> list[dict[str, object]]:
        engine = self.worker.engine
        busy = engine.positions()
        return [
            {"id": slot, "n_ctx": engine.ctx_size, "is_processing": slot in busy, "n_past": busy.get(slot, 0)}
            for slot in range(engine.slots)
        ]

    async def tokenize(self, body: TokenizeRequest) -> dict[str, object]:
        check_length(self.worker, body.content, "content")
        return {"tokens": await token_ids(self.worker, body.content, None if body.add_special else False)}

    async def detokenize(self, body: DetokenizeRequest) -> dict[str, object]:
        tokenizer = self.worker.engine.tokenizer
        if any(not 0 <= t < tokenizer.vocab_size for t in body.tokens):
            raise ApiError(400, f"token ids must lie in [0, {tokenizer.vocab_size})", param="tokens")
        return {"content": await asyncio.to_thread(tokenizer.decode, body.tokens)}

    async def models(self) -> dict[str, object]:
        model = {"id": self.model_id, "object": "model", "created": 0, "owned_by": "qinfer"}
        return {"object": "list", "data": [model]}

    async def completions(self, http: Request, body: CompletionRequest) -> JSONResponse | StreamingResponse:
        try:
            prompt = body.prompt_text()
        except ValueError as exc:
            raise ApiError(400, str(exc), param="prompt") from exc
        return await self._answer(http, body, prompt, body.stop_list(), chat=False)

    async def chat_completions(self, http: Request, body: ChatRequest) -> JSONResponse | StreamingResponse:
        try:
            forced = body.forced_tools()
        except ValueError as exc:
            raise ApiError(400, str(exc), param="tool_choice") from exc
        if self.renderer is None:
            prompt = chat_prompt(body.messages)
        else:
            try:
                messages, tools = body.template_inputs()
                prompt = await self.renderer.render_async(messages, True, tools)
            except ChatTemplateError as exc:
                raise ApiError(400, str(exc), param="messages") from exc
            except RendererBusy as exc:
                raise ApiError(503, str(exc), "server_error") from exc
        offered = [t.function.name for t in body.tools or []] if body.tool_choice != "none" else []
        stops = body.chat_stops(self.template)
        return await self._answer(http, body, prompt, stops, chat=True, tools=offered, forced=forced)

    async def _constraint(self, body: SamplingFields, forced: list[Tool]) -> Constraint | None:
        """The grammar the answer must follow: a call of one of the forced tools, or the response format's."""
        response_format = body.response_format
        if forced:
            schema: dict[str, Any] | None = tool_call_schema(forced)
        elif response_format is None or response_format.type == "text":
            return None
        elif response_format.type == "json_object":
            schema = None
        elif response_format.json_schema is None:
            raise ApiError(400, "response_format json_schema needs its json_schema field", param="response_format")
        else:
            schema = response_format.json_schema.schema_
        try:
            # Compiling a large schema takes a while: off the event loop.
            return await asyncio.to_thread(self.grammars.json_schema, schema)
        except GrammarError as exc:
            raise ApiError(400, str(exc), param="tools" if forced else "response_format") from exc

    async def _answer(
        self,
        http: Request,
        body: SamplingFields,
        prompt: str,
        stops: list[str],
        chat: bool,
        tools: list[str] | None = None,
        forced: list[Tool] | None = None,
    ) -> JSONResponse | StreamingResponse:
        constraint = await self._constraint(body, forced or [])
        # A rendered chat template holds the BOS its model wants, as transformers tokenizes it.
        add_bos = False if chat and self.template is not None else None
        param = "messages" if chat else "prompt"
        # A whole response without stop strings needs the finished text alone.
        every_piece = body.stream or bool(stops)
        head = response_head(self.model_id, chat, body.stream)
        job, prompt_tokens = await submit(self.worker, body, prompt, add_bos, constraint, param, every_piece)
        completion = Completion(
            job, prompt_tokens, chat, body.stream, stops, head, self.counters, tools or [], bool(forced)
        )
        if body.stream:
            return StreamingResponse(stream_events(self.worker, completion), media_type="text/event-stream")
        return await collect_response(http, self.worker, completion)


async def submit(
    worker: EngineWorker,
    body: SamplingFields,
    prompt: str,
    add_bos: bool | None = None,
    constraint: Constraint | None = None,
    param: str = "prompt",
    every_piece: bool = True,
) -> tuple[Job, int]:
    """Queue the request on the engine (its text piece by piece, or finished alone: EngineWorker.submit); return
    its job and the prompt's length in tokens."""
    if worker.closing.is_set():
        raise ApiError(503, SHUTTING_DOWN, "server_error")
    check_length(worker, prompt, param)
    ids = await token_ids(worker, prompt, add_bos)
    if not ids:
        raise ApiError(
            400, "the prompt is empty, and this model puts no BOS token before a text: send some text", param=param
        )
    ctx_size = worker.engine.ctx_size
    room = ctx_size - len(ids)
    if room < 1:
        raise ApiError(400, f"the prompt is {len(ids)} tokens but the context holds {ctx_size}", param="prompt")
    max_tokens = min(body.max_tokens or room, room)
    seed = body.seed if body.seed is not None else DRAWS.getrandbits(31)
    request = EngineRequest(ids, max_tokens, body.sampling(), seed, body.ignore_eos, constraint)
    return worker.submit(request, every_piece), len(ids)


async def token_ids(worker: EngineWorker, text: str, add_bos: bool | None) -> list[int]:
    """The text's token ids: a short one's (INLINE_TOKENIZE_CHARS) on the event loop, holding the GIL; a long one's
    on a thread, since it takes seconds, which on the event loop would stall every other client meanwhile."""
    tokenizer = worker.engine.tokenizer
    if len(text) <= INLINE_TOKENIZE_CHARS:
        return tokenizer.encode(text, add_bos, keep_gil=True)
    return await asyncio.to_thread(tokenizer.encode, text, add_bos)


def check_length(worker: EngineWorker, text: str, param: str) -> None:
    """Refuse, before tokenizing it, a text too long to be a prompt of this server's context whatever its tokens: one
    body's megabytes would otherwise cost seconds and gigabytes of tokens only to be refused after."""
    engine = worker.engine
    limit = engine.ctx_size * engine.tokenizer.max_token_chars
    if len(text) > limit:
        raise ApiError(
            400,
            f"the text is {len(text)} characters, more than a context of {engine.ctx_size} tokens can hold "
            f"(at most {limit} here); shorten it",
            param=param,
        )


def response_head(model_id: str, chat: bool, stream: bool) -> dict[str, object]:
    """The fields every response and chunk of one completion starts with."""
    return {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{DRAWS.getrandbits(128):032x}",
        "object": ("chat.completion" if chat else "text_completion") + (".chunk" if chat and stream else ""),
        "created": int(time.time()),
        "model": model_id,
    }


@dataclass(frozen=True)
class Completion:
    """A submitted request and the response fields that depend on its kind (plain or chat, streamed or not)."""

    job: Job
    prompt_tokens: int
    chat: bool
    stream: bool
    stops: list[str]
    head: dict[str, object]
    counters: ServerMetrics
    tools: list[str]  # the names of the tools the answer may call
    forced: bool = False  # the answer is a call of one of them (its grammar says so)

    def tool_call(self, text: str) -> dict[str, object] | None:
        """The answer as a call of one of the tools, where it is one: {"name": ..., "arguments": {...}}."""
        try:
            call = json.loads(text)
        except json.JSONDecodeError:
            return None
        if not isinstance(call, dict) or call.get("name") not in self.tools:
            return None
        if not isinstance(call.get("arguments"), dict):
            return None
        arguments = json.dumps(call["arguments"], ensure_ascii=False)
        function = {"name": call["name"], "arguments": arguments}
        return {"id": f"call_{DRAWS.getrandbits(96):024x}", "type": "function", "function": function}

    def choice(self, text: str, reason: str | None, first: bool = False) -> dict[str, object]:
        if not self.chat:
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        if not self.stream:
            return {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": reason}
        delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
        return {"index": 0, "delta": delta, "finish_reason": reason}

    def usage(self, completion_tokens: int) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": self.prompt_tokens + completion_tokens,
        }

    def finish(self, completion_tokens: int) -> dict[str, object]:
        """The last chunk's or the response's `usage` and llama.cpp's `timings` (the prompt's time in the engine,
        the generation's since), counted into the metrics."""
        prompt_s = self.job.prompt_seconds
        predicted_s = time.perf_counter() - self.job.decode_started if self.job.decode_started else 0.0
        self.counters.answered(self.prompt_tokens - self.job.cached_tokens, completion_tokens, prompt_s, predicted_s)

        def per_second(n: int, seconds: float) -> float:
            return n / seconds if seconds > 0 else 0.0

        computed = self.prompt_tokens - self.job.cached_tokens
        timings = {
            "cache_n": self.job.cached_tokens,
            "prompt_n": computed,
            "prompt_ms": prompt_s * 1000,
            "prompt_per_second": per_second(computed, prompt_s),
            "predicted_n": completion_tokens,
            "predicted_ms": predicted_s * 1000,
            "predicted_per_second": per_second(completion_tokens, predicted_s),
        }
        return {"usage": self.usage(completion_tokens), "timings": timings}


async def stream_events(worker: EngineWorker, completion: Completion) -> AsyncIterator[str]:
    """The completion as server-sent events, ending with [DONE] or an error event."""
    head, job = completion.head, completion.job
    # Starlette closes this generator when the client goes away; `finally` then frees the slot.
    try:
        if completion.chat:
            yield f"data: {json.dumps({**head, 'choices': [completion.choice('', None, first=True)]})}\n\n"
        if completion.forced:
            # A forced tool call is sent whole once its arguments are complete, as one tool_calls delta.
            text, _reason, tokens = await _collect(worker, completion)
            call = completion.tool_call(text)
            delta = {"tool_calls": [{"index": 0, **call}]} if call is not None else {"content": text}
            reason = "tool_calls" if call is not None else "stop"
            chunk = {**head, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}
            yield f"data: {json.dumps(chunk)}\n\n"
            end = {"index": 0, "delta": {}, "finish_reason": reason}
            yield f"data: {json.dumps({**head, 'choices': [end], **completion.finish(tokens)})}\n\n"
        else:
            async for piece in pieces(worker, job, completion.stops):
                chunk = {**head, "choices": [completion.choice(piece.text, piece.finish_reason)]}
                if piece.finish_reason is not None:
                    chunk |= completion.finish(piece.completion_tokens)
                yield f"data: {json.dumps(chunk)}\n\n"
        yield "data: [DONE]\n\n"
    except ApiError as exc:
        yield f"data: {json.dumps(error_body(exc.message, exc.kind, exc.param))}\n\n"
    finally:
        worker.cancel(job)


async def collect_response(http: Request, worker: EngineWorker, completion: Completion) -> JSONResponse:
    """The whole completion in one response, or 499 once the client has gone away."""
    answer = asyncio.ensure_future(_collect(worker, completion))
    try:
        # Nothing tells a plain handler that its client left, so ask between waits.
        while not (await asyncio.wait({answer}, timeout=DISCONNECT_POLL_S))[0]:
            if await http.is_disconnected():
                answer.cancel()
                return error_response(499, "the client closed the request", "invalid_request_error")
        text, reason, tokens = answer.result()
    finally:
        worker.cancel(completion.job)
    choice = completion.choice(text, reason)
    call = completion.tool_call(text) if completion.tools else None
    if call is not None:
        choice = {"index": 0, "message": {"role": "assistant", "content": None, "tool_calls": [call]},
                  "finish_reason": "tool_calls"}  # fmt: skip
    body = {**completion.head, "choices": [choice], **completion.finish(tokens)}
    return JSONResponse(body)


async def _collect(worker: EngineWorker, completion: Completion) -> tuple[str, str | None, int]:
    text, reason, tokens = "", None, 0
    async for piece in pieces(worker, completion.job, completion.stops):
        text, reason, tokens = text + piece.text, piece.finish_reason, piece.completion_tokens
    return text, reason, tokens
