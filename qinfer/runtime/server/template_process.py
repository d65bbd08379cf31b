"""A chat template rendered in a process of its own, under a deadline and a memory limit.

jinja2's sandbox keeps a template away from Python's internals, not from the machine: a template that a GGUF from
the internet brings can loop for hours (nested `range`s), build gigabytes (`'x' * 10**10`, `tojson(indent=10**9)`,
`lipsum(10**7)`) or recurse, and a thread cannot be stopped. So the server renders in a child process that it
started with nothing but jinja2 and the template, whose address space is capped: a render over its deadline kills
that process (a new one is started for the next request), and one that runs out of memory fails there. Either
way the request gets one line saying so. Renders queue on a thread of their own, never on the threads that
tokenize, and at most MAX_WAITING of them: past that a chat request is refused at once, so hostile templates cost
chat requests at most that many deadlines and the other requests nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import threading
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any

from qinfer.runtime.engine.chat_template import ChatTemplate, ChatTemplateError

RENDER_TIMEOUT_S = 2.0  # real templates render a conversation in milliseconds
RENDER_MEMORY_BYTES = 1 << 30  # the child's address space: Python, jinja2, a conversation and its prompt
MAX_RENDERED_CHARS = 1 << 25  # larger is no prompt any context holds; refused before it is sent back
START_TIMEOUT_S = 60.0  # a fresh Python importing jinja2, on a loaded machine
MAX_WAITING = 8  # renders queued behind the one running


class RendererBusy(Exception):
    """MAX_WAITING renders already wait: the request is refused rather than queued."""


def _limit_memory(limit: int) -> None:
    try:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    except (ImportError, ValueError, OSError):  # not POSIX, or a hard limit already lower: the deadline still holds
        pass


def _serve(conn: Connection, source: str, special_tokens: dict[str, str], memory: int) -> None:
    """The child: render each request that arrives, answering ("ok", text) or ("error", message)."""
    _limit_memory(memory)
    template = ChatTemplate(source, special_tokens)
    try:
        template.compiled  # noqa: B018 - compiling evaluates the template's constant expressions: here, limited
    except Exception as exc:  # noqa: BLE001 - whatever stops it, the server refuses the template in one line
        conn.send(("error", f"the chat template cannot be compiled ({type(exc).__name__}: {exc})"))
        return
    conn.send(("ready", None))
    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):
            return
        try:
            text = template.render(*request)
            if len(text) > MAX_RENDERED_CHARS:
                raise ChatTemplateError(f"the chat template made over {MAX_RENDERED_CHARS} characters of the messages")
            conn.send(("ok", text))
        except ChatTemplateError as exc:
            conn.send(("error", str(exc)))
        except MemoryError:
            conn.send(("error", f"the chat template needed over {memory >> 20} MiB for these messages"))


class TemplateProcess:
    """Renders `template` in a child process; one render at a time (each takes milliseconds)."""

    def __init__(
        self, template: ChatTemplate, timeout_s: float = RENDER_TIMEOUT_S, memory_bytes: int = RENDER_MEMORY_BYTES
    ):
        self.template, self.timeout_s, self.memory_bytes = template, timeout_s, memory_bytes
        self._lock = threading.Lock()
        self._process: multiprocessing.process.BaseProcess | None = None
        self._conn: Connection | None = None
        self._closed = False
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="qinfer-chat-template")
        self._waiting = 0  # renders submitted and not done; touched on the event loop alone
        self._start()

    def _start(self) -> None:
        # A fresh interpreter: a fork of the server would carry its threads' locks and its mapped model along.
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        args = (child, self.template.source, self.template.special_tokens, self.memory_bytes)
        self._process = context.Process(target=_serve, args=args, name="qinfer-chat-template", daemon=True)
        self._process.start()
        child.close()
        status, value = self._receive() if self._conn.poll(START_TIMEOUT_S) else ("late", None)
        if status != "ready":
            self._stop()
            raise ChatTemplateError(value if status == "error" else "the chat template's process did not start")

    def _receive(self) -> tuple[str, Any]:
        assert self._conn is not None
        try:
            return self._conn.recv()
        except (EOFError, OSError):  # the child died: killed by the system, or crashed in an allocation
            return "died", None

    async def render_async(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, tools: list[Any] | None = None
    ) -> str:
        """`render` on the renderer's own thread; RendererBusy where MAX_WAITING renders wait already."""
        if self._waiting > MAX_WAITING:
            raise RendererBusy(f"{MAX_WAITING} chat requests are waiting for their template to render; retry shortly")
        self._waiting += 1
        try:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._thread, self.render, messages, add_generation_prompt, tools)
        finally:
            self._waiting -= 1

    def render(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, tools: list[Any] | None = None
    ) -> str:
        with self._lock:
            if self._closed:
                raise ChatTemplateError("the server is shutting down; send the request again once it is back")
            if self._process is None or not self._process.is_alive():
                self._restart()
            assert self._conn is not None
            self._conn.send((messages, add_generation_prompt, tools))
            if not self._conn.poll(self.timeout_s):
                self._restart()
                raise ChatTemplateError(f"the chat template took over {self.timeout_s:g} s on these messages")
            status, value = self._receive()
            if status == "died":
                self._restart()
                raise ChatTemplateError("the chat template's process ended while rendering these messages")
        if status == "error":
            raise ChatTemplateError(value)
        return str(value)

    def _restart(self) -> None:
        self._stop()
        self._start()

    def close(self) -> None:
        """End the child; a render under way finishes first (it holds the lock for at most its deadline)."""
        with self._lock:
            self._closed = True
            self._stop()
        self._thread.shutdown(wait=False, cancel_futures=True)

    def _stop(self) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.join()
            self._process = None
        if self._conn is not None:
            with contextlib.suppress(OSError):
                self._conn.close()
            self._conn = None
