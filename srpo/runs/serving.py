"""What srpo's HTTP servers share (the retrieval server, the OpenAI-compatible gateway): a clear
error for a port in use, and bounds on slow or greedy clients.

- :func:`bind` opens the listening socket itself, so a port in use is one ``error:`` line naming
  it — not a uvicorn log line after start-up.
- :func:`uvicorn_server` runs an ASGI app with a **header timeout** (a connection that has not
  sent its request line and headers within ``header_timeout_s`` is closed: slow "half-open"
  clients cannot hold the server's descriptors), a **body read timeout** (a body that stalls for
  ``read_timeout_s`` ends the request as a client disconnect), a **connection limit**
  (``limit_concurrency``; beyond it uvicorn answers 503) and a bounded keep-alive.
"""

from __future__ import annotations

import asyncio
import socket


class ServeError(RuntimeError):
    """A server cannot start (the port is in use, a library is missing)."""


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port`` (port 0: one the OS picks), or :class:`ServeError`."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise ServeError(f"cannot listen on {host}:{port}: {err.strerror or err}"
                         + (" (the port is in use; choose another with --port)" if port else "")) from None
    sock.listen(2048)
    return sock


class _ReadTimeout:
    """ASGI middleware: a request body that stalls for ``timeout_s`` reads as a disconnect."""

    def __init__(self, app, timeout_s: float):
        self.app, self.timeout_s = app, timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        body_done = False

        async def bounded_receive():
            nonlocal body_done
            if body_done:  # the body is in: what comes next is a disconnect, however long it takes
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), self.timeout_s)
            except asyncio.TimeoutError:
                return {"type": "http.disconnect"}
            if message.get("type") == "http.request" and not message.get("more_body", False):
                body_done = True
            return message

        return await self.app(scope, bounded_receive, send)


def _bounded_protocol(header_timeout_s: float):
    """uvicorn's h11 protocol with a deadline for the request line and headers."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class BoundedH11Protocol(H11Protocol):
        def connection_made(self, transport):  # type: ignore[override]
            super().connection_made(transport)
            self._srpo_header_timer = self.loop.call_later(header_timeout_s, self._srpo_too_slow)

        def _srpo_too_slow(self) -> None:
            if self.cycle is None:  # no complete request head yet: a slow or idle client
                self.transport.close()

        def handle_events(self) -> None:
            super().handle_events()
            timer = getattr(self, "_srpo_header_timer", None)
            if timer is not None and self.cycle is not None:
                timer.cancel()
                self._srpo_header_timer = None

        def connection_lost(self, exc):
            timer = getattr(self, "_srpo_header_timer", None)
            if timer is not None:
                timer.cancel()
            super().connection_lost(exc)

    return BoundedH11Protocol


def uvicorn_server(app, *, header_timeout_s: float = 10.0, read_timeout_s: float = 30.0,
                   limit_concurrency: int = 1024, keep_alive_s: int = 30, graceful_shutdown_s: float | None = None):
    """A ``uvicorn.Server`` for ``app`` with the bounds above (run it with ``sockets=[bind(...)]``)."""
    try:
        import uvicorn
    except ImportError:
        raise ServeError("srpo's HTTP servers need uvicorn: pip install 'srpo[gateway]' (or 'srpo[retrieval]')") from None
    config = uvicorn.Config(_ReadTimeout(app, read_timeout_s), log_level="warning", lifespan="off", access_log=False,
                            http=_bounded_protocol(header_timeout_s), timeout_keep_alive=keep_alive_s,
                            limit_concurrency=limit_concurrency, timeout_graceful_shutdown=graceful_shutdown_s)
    return uvicorn.Server(config)
