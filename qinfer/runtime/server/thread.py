"""Run the HTTP server: uvicorn over an h11 protocol that times request heads and caps connections, in the
foreground (`qinfer serve`) or on a background thread (tests, benchmarks)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from types import FrameType
from typing import ClassVar

import h11
import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.h11_impl import H11Protocol

from qinfer.core.errors import UserError
from qinfer.runtime.server.app import CLOSE, DEFAULT_OPTIONS, ServerOptions, error_response


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol plus what it lacks: a deadline for each request head, so that a client that never
    finishes one (slowloris) cannot hold its connection forever, and a cap on open connections. Both refusals, and
    uvicorn's own 400 for bytes that are not HTTP, use OpenAI's error shape."""

    header_timeout_s: ClassVar[float] = DEFAULT_OPTIONS.read_timeout_s
    max_connections: ClassVar[int] = DEFAULT_OPTIONS.max_connections
    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            # Answered once the head arrives (h11 cannot respond before), then closed.
            message = f"the server is at its limit of {self.max_connections} connections; retry shortly"
            self.app = error_response(503, message, "server_error", headers={"Retry-After": "1", **CLOSE})
        self._start_head_timer()

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE and self._head_timer is None:
            self._start_head_timer()  # the next request on a kept-alive connection has begun
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:
            self._stop_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_head_timer()
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        body = json.dumps({"error": {"message": msg, "type": "invalid_request_error", "param": None, "code": None}})
        headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
        for event in (
            h11.Response(status_code=400, headers=headers, reason=b"Bad Request"),
            h11.Data(data=body.encode()),
            h11.EndOfMessage(),
        ):
            self.transport.write(self.conn.send(event) or b"")
        self.transport.close()

    def _start_head_timer(self) -> None:
        self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_timed_out)

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


class ClosingServer(uvicorn.Server):
    """uvicorn's server that, at the first SIGINT or SIGTERM, also tells `on_exit` (the engine's worker), which
    ends every queued and running request with a final event: uvicorn alone waits for all of them to finish
    generating before it exits. Later signals change nothing: the exit already comes within the shutdown timeout,
    and uvicorn's forced exit on a second Ctrl-C would cut the application's shutdown short, with a traceback for
    each response it cancels."""

    def __init__(self, config: uvicorn.Config, on_exit: Callable[[], None] | None):
        super().__init__(config)
        self.on_exit = on_exit

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit:
            return
        if self.on_exit is not None:
            self.on_exit()
        super().handle_exit(sig, frame)


def uvicorn_server(
    app: FastAPI, options: ServerOptions, host: str, port: int, on_exit: Callable[[], None] | None = None
) -> uvicorn.Server:
    protocol = type(
        "GuardedH11Protocol",
        (GuardedH11Protocol,),
        {"header_timeout_s": options.read_timeout_s, "max_connections": options.max_connections},
    )
    config = uvicorn.Config(
        app,
        host,
        port,
        http=protocol,
        timeout_keep_alive=options.idle_timeout_s,
        timeout_graceful_shutdown=options.shutdown_timeout_s,  # type: ignore[arg-type] - uvicorn takes any number
        log_level="warning",
    )
    return ClosingServer(config, on_exit)


# uvicorn's default: connections that arrive while the model still loads wait in it rather than being refused.
BACKLOG = 2048


@contextlib.contextmanager
def listening_sockets(host: str, port: int) -> Iterator[list[socket.socket]]:
    """Sockets listening on every address `host` resolves to, as asyncio's own server would make them ("" and
    localhost: IPv4 and IPv6; an IPv6 socket takes IPv6 alone), on `port` (0: a free one, the same for each): made
    before the model loads, so that an address in use is refused at once, in one line; closed on the way out."""
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise UserError(f"cannot listen on {host}:{port} ({exc.strerror}); choose another --host") from None
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):
            try:
                sock = socket.socket(family, kind, proto)
            except OSError:
                continue  # a family this machine does not have (IPv6 turned off), as asyncio skips it
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            if port == 0 and len(sockets) > 1:
                address = (address[0], sockets[0].getsockname()[1], *address[2:])
            try:
                # Listening, not only bound: two sockets with SO_REUSEADDR may both bind a port nobody listens on.
                sock.bind(address)
                sock.listen(BACKLOG)
            except OSError as exc:
                raise UserError(
                    f"cannot listen on {host}:{port} ({exc.strerror or exc}); choose another --host or --port"
                ) from None
        if not sockets:
            raise UserError(f"cannot listen on {host}:{port}: no address of it can be used here; choose another --host")
        yield sockets
    finally:
        for sock in sockets:
            sock.close()


def url_of(host: str, sock: socket.socket) -> str:
    """The server's base URL: `host` as given (bracketed where it is an IPv6 address), and the port it got."""
    name = f"[{host}]" if ":" in host else host or "0.0.0.0"
    return f"http://{name}:{sock.getsockname()[1]}"


@contextlib.contextmanager
def serve_in_thread(
    app: FastAPI, host: str = "127.0.0.1", port: int = 0, options: ServerOptions = DEFAULT_OPTIONS
) -> Iterator[str]:
    """Yield the base URL (http://host:port) once the server accepts requests; stop it on exit.

    Port 0 takes a free port; binding first means the URL is known before uvicorn starts."""
    with listening_sockets(host, port) as sockets:
        server = uvicorn_server(app, options, host, port)
        thread = threading.Thread(target=server.run, kwargs={"sockets": sockets}, daemon=True)
        thread.start()
        try:
            while not server.started:
                if not thread.is_alive():
                    raise RuntimeError("the server thread ended before it started serving")
                time.sleep(0.01)
            yield url_of(host, sockets[0])
        finally:
            server.should_exit = True
            thread.join()
