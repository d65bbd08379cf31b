"""OpenAI-compatible HTTP API over an EngineWorker: /v1/completions, /v1/chat/completions (both with server-sent
event streaming), /v1/models and /health. Errors use OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import asyncio
import json
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from qinfer_runtime.engine import Request as EngineRequest
from qinfer_runtime.engine_worker import EngineWorker, Job
from qinfer_runtime.openai_schema import ChatRequest, CompletionRequest, SamplingFields

# How often a non-streamed request checks whether its client is still connected.
DISCONNECT_POLL_S = 0.25


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


def error_response(status: int, message: str, kind: str, param: str | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": kind, "param": param, "code": None}}
    return JSONResponse(body, status_code=status)


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
            raise ApiError(500, event.error, "server_error")
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


def create_app(worker: EngineWorker, model_id: str) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        worker.start()
        yield
        worker.stop()

    app = FastAPI(title="qinfer", lifespan=lifespan)
    tokenizer = worker.engine.tokenizer
    ctx_size = worker.engine.ctx_size

    @app.exception_handler(RequestValidationError)
    async def invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return error_response(
            400, f"{param or 'body'}: {first.get('msg', 'invalid value')}", "invalid_request_error", param
        )

    @app.exception_handler(ApiError)
    async def api_error(_request: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.kind, exc.param)

    @app.exception_handler(HTTPException)
    async def http_error(_request: Request, exc: HTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail), "invalid_request_error")

    @app.get("/health")
    async def health() -> dict[str, object]:
        return {"status": "ok", "model": model_id, **worker.stats()}

    @app.get("/v1/models")
    async def models() -> dict[str, object]:
        return {"object": "list", "data": [{"id": model_id, "object": "model", "created": 0, "owned_by": "qinfer"}]}

    def start(body: SamplingFields, prompt: str) -> tuple[Job, int]:
        ids = tokenizer.encode(prompt)
        room = ctx_size - len(ids)
        if room < 1:
            raise ApiError(400, f"the prompt is {len(ids)} tokens but the context holds {ctx_size}", param="prompt")
        max_tokens = min(body.max_tokens or room, room)
        seed = body.seed if body.seed is not None else secrets.randbits(31)
        return worker.submit(EngineRequest(ids, max_tokens, body.sampling(), seed, body.ignore_eos)), len(ids)

    def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }

    async def run(http: Request, body: SamplingFields, prompt: str, chat: bool) -> JSONResponse | StreamingResponse:
        job, prompt_tokens = start(body, prompt)
        created = int(time.time())
        head = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            "object": ("chat.completion" if chat else "text_completion") + (".chunk" if chat and body.stream else ""),
            "created": created,
            "model": model_id,
        }

        def choice(text: str, reason: str | None, first: bool = False) -> dict[str, object]:
            if not chat:
                return {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
            if not body.stream:
                return {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": reason}
            delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
            return {"index": 0, "delta": delta, "finish_reason": reason}

        if body.stream:

            async def events() -> AsyncIterator[str]:
                # Starlette closes this generator when the client goes away; `finally` then frees the slot.
                try:
                    if chat:
                        yield f"data: {json.dumps({**head, 'choices': [choice('', None, first=True)]})}\n\n"
                    async for piece in pieces(worker, job, body.stop_list()):
                        chunk = {**head, "choices": [choice(piece.text, piece.finish_reason)]}
                        if piece.finish_reason is not None:
                            chunk["usage"] = usage(prompt_tokens, piece.completion_tokens)
                        yield f"data: {json.dumps(chunk)}\n\n"
                    yield "data: [DONE]\n\n"
                except ApiError as exc:
                    yield f"data: {json.dumps({'error': {'message': exc.message, 'type': exc.kind}})}\n\n"
                finally:
                    worker.cancel(job)

            return StreamingResponse(events(), media_type="text/event-stream")

        async def collect() -> tuple[str, str | None, int]:
            text, reason, tokens = "", None, 0
            async for piece in pieces(worker, job, body.stop_list()):
                text, reason, tokens = text + piece.text, piece.finish_reason, piece.completion_tokens
            return text, reason, tokens

        answer = asyncio.ensure_future(collect())
        try:
            # Nothing tells a plain handler that its client left, so ask between waits.
            while not (await asyncio.wait({answer}, timeout=DISCONNECT_POLL_S))[0]:
                if await http.is_disconnected():
                    answer.cancel()
                    return JSONResponse({}, status_code=499)
            text, reason, tokens = answer.result()
        finally:
            worker.cancel(job)
        return JSONResponse({**head, "choices": [choice(text, reason)], "usage": usage(prompt_tokens, tokens)})

    @app.post("/v1/completions", response_model=None)
    async def completions(http: Request, body: CompletionRequest) -> JSONResponse | StreamingResponse:
        try:
            prompt = body.prompt_text()
        except ValueError as exc:
            raise ApiError(400, str(exc), param="prompt") from exc
        return await run(http, body, prompt, chat=False)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(http: Request, body: ChatRequest) -> JSONResponse | StreamingResponse:
        return await run(http, body, body.prompt_text(), chat=True)

    return app
