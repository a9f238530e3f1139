"""What srpo's HTTP servers share (the retrieval server, the OpenAI-compatible gateway): a clear
error for a port in use, and bounds on slow or greedy clients.

- :func:`bind` opens the listening socket itself, so a port in use is one ``error:`` line naming
  it — not a uvicorn log line after start-up.
- :func:`uvicorn_server` runs an ASGI app behind a :class:`Guard` (API key, loopback ``Host``
  names on a loopback bind, JSON bodies only, a body size limit checked from ``Content-Length``
  before reading and while reading a chunked body, a whole-body deadline, a JSON nesting limit)
  with a **header timeout** (a connection that has not sent its request line and headers within
  ``header_timeout_s`` is closed: slow "half-open" clients cannot hold the server's
  descriptors), a **connection limit** (``limit_concurrency``; beyond it uvicorn answers 503) and
  a bounded keep-alive.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import logging
import re
import socket
import sys
from dataclasses import dataclass

import numpy as np

log = logging.getLogger(__name__)


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


#: The most nesting a request's JSON may have: OpenAI's and the retrieval API's bodies need < 10;
#: a parser or a walker recursing through 100,000 levels raises RecursionError.
MAX_JSON_DEPTH = 64
_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')
_OPEN, _CLOSE = b"[{", b"]}"
_LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1", "[::1]")


def json_depth(raw: bytes) -> int:
    """How deeply ``raw`` (a JSON text) nests arrays and objects, without parsing it (strings are
    skipped; a malformed text gives some number, and the parser refuses it later).  C-speed: the
    string regex and a cumulative sum over the bracket bytes."""
    brackets = _JSON_STRING.sub(b"", raw).translate(None, delete=bytes(set(range(256)) - set(_OPEN + _CLOSE)))
    if not brackets:
        return 0
    steps = np.where(np.isin(np.frombuffer(brackets, np.uint8), np.frombuffer(_OPEN, np.uint8)), 1, -1)
    return int(np.cumsum(steps).max())


def raise_open_file_limit() -> int:
    """Raise this process's soft ``RLIMIT_NOFILE`` to its hard limit (a server's connections, a
    team's programs and srpo's files share it; the usual soft 1,024 is easily reached) and return
    the soft limit now in force (-1: not known on this platform)."""
    try:
        import resource
    except ImportError:  # not a POSIX platform
        return -1
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 16)
    if soft == resource.RLIM_INFINITY or soft >= target:
        return soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        return target
    except (ValueError, OSError):
        return soft


def connection_cap(wanted: int, reserve: int = 256) -> int:
    """At most ``wanted`` concurrent connections, and never more than the descriptors left after
    ``reserve`` for the process's own files: beyond the cap a server answers 503 (counted by
    uvicorn) instead of failing on a descriptor it cannot open."""
    limit = raise_open_file_limit()
    if limit is None or limit < 0:
        return wanted
    return max(16, min(wanted, limit - reserve))


def is_loopback(host: str) -> bool:
    """Whether a bind address is this machine only."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


@dataclass(frozen=True)
class Guard:
    """What a server accepts before its app sees a request (:class:`GuardMiddleware`).

    ``api_key``: every request needs ``Authorization: Bearer <key>`` (compared in constant time;
    '' — none).  ``loopback_only``: a server bound to loopback serves only requests whose ``Host``
    names loopback, so a web page cannot reach it through DNS rebinding.  Bodies: at most
    ``max_body_bytes`` (refused from ``Content-Length`` before reading, and a chunked body is cut
    at the limit), whole within ``body_deadline_s``, ``application/json``, nested at most
    ``MAX_JSON_DEPTH`` deep."""

    api_key: str = ""
    loopback_only: bool = True
    max_body_bytes: int = 8 << 20
    body_deadline_s: float = 60.0
    parse_json: bool = False  # refuse a body that is not JSON here (for apps whose own error would say why in detail)


def _host_of(headers: dict[bytes, bytes]) -> str:
    host = headers.get(b"host", b"").decode("latin-1").strip().lower()
    if host.startswith("["):  # [::1]:8000
        return host[: host.find("]") + 1] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


class GuardMiddleware:
    """ASGI middleware enforcing a :class:`Guard`: refusals are OpenAI-shaped JSON errors with a
    generic message (never exception text); the body is read here, whole, and handed on."""

    def __init__(self, app, guard: Guard):
        self.app, self.guard = app, guard
        self._key = guard.api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers, path = dict(scope.get("headers") or []), scope.get("path", "")
        refusal = self._check_head(scope, headers)
        if refusal is not None:
            return await _refuse(send, *refusal, path=path)
        if scope["method"] in ("GET", "HEAD", "OPTIONS", "DELETE"):
            return await self.app(scope, receive, send)
        try:
            body = await asyncio.wait_for(self._read_body(receive), self.guard.body_deadline_s)
        except asyncio.TimeoutError:
            log.info("a request body did not arrive within %.0f s; refused", self.guard.body_deadline_s)
            return await _refuse(send, 408, f"the request body did not arrive within {self.guard.body_deadline_s:.0f} s",
                                 path=path)
        except _TooLarge:
            return await _refuse(send, 413, self._too_large(), path=path)
        except _Gone:
            log.info("a client disconnected while sending its request")
            return None
        if json_depth(body) > MAX_JSON_DEPTH:
            return await _refuse(send, 400, f"the request's JSON nests deeper than {MAX_JSON_DEPTH} levels",
                                 path=path)
        if self.guard.parse_json:
            try:
                json.loads(body)
            except (ValueError, UnicodeDecodeError, RecursionError):
                return await _refuse(send, 400, "the request body is not valid JSON", path=path)
        return await self.app(scope, _replay(body, receive), send)

    def _too_large(self) -> str:
        return f"the request body is larger than {self.guard.max_body_bytes >> 20} MiB"

    def _check_head(self, scope, headers) -> tuple[int, str] | None:
        if self.guard.loopback_only and _host_of(headers) not in _LOOPBACK_HOSTS:
            return 403, "this server answers requests to localhost only (the Host header names another host)"
        if self._key:
            scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
            bearer = scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._key)
            x_key = headers.get(b"x-api-key")  # how Anthropic's clients send theirs
            if not bearer and not (x_key is not None and hmac.compare_digest(x_key.strip(), self._key)):
                return 401, "a valid API key is required: Authorization: Bearer <key> (or x-api-key: <key>)"
        if scope["method"] == "POST":
            kind = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
            if kind != b"application/json":
                return 415, "the request body must be JSON, sent as Content-Type: application/json"
            try:
                size = int(headers.get(b"content-length", b"0"))
            except ValueError:
                return 400, "the Content-Length header is not a number"
            if size > self.guard.max_body_bytes:
                return 413, self._too_large()
        return None

    async def _read_body(self, receive) -> bytes:
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _Gone
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.guard.max_body_bytes:
                raise _TooLarge
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


class _TooLarge(Exception):
    pass


class _Gone(Exception):
    pass


def _replay(body: bytes, receive):
    """A ``receive`` that gives ``body`` once, then the connection's own messages (a disconnect)."""
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()
    return replay


#: Anthropic's error type for each HTTP status a server answers with (``/v1/messages`` errors).
ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                         404: "not_found_error", 408: "timeout_error", 413: "request_too_large",
                         415: "invalid_request_error", 429: "rate_limit_error", 503: "overloaded_error"}


def anthropic_error(status: int, message: str) -> dict:
    """An error in the shape of Anthropic's API: ``{"type": "error", "error": {"type", "message"}}``."""
    return {"type": "error", "error": {"type": ANTHROPIC_ERROR_TYPES.get(status, "api_error"), "message": message}}


async def _refuse(send, status: int, message: str, path: str = "") -> None:
    body = anthropic_error(status, message) if path.endswith("/v1/messages") else {
        "error": {"message": message, "type": "invalid_request_error", "param": None, "code": None}}
    payload = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
               (b"connection", b"close")]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})


def warn_if_exposed(host: str, api_key: str, what: str) -> None:
    """A line on stderr when ``host`` is reachable from other machines and nothing asks for a key."""
    if not is_loopback(host) and not api_key:
        print(f"warning: {what} listens on {host}, reachable from other machines, with no API key: anyone who "
              f"can reach it can use it (give --api-key, or SRPO_API_KEY)", file=sys.stderr)


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


def uvicorn_server(app, *, guard: Guard = Guard(), header_timeout_s: float = 10.0,
                   limit_concurrency: int = 1024, keep_alive_s: int = 30, graceful_shutdown_s: float | None = None):
    """A ``uvicorn.Server`` for ``app`` behind ``guard`` with the bounds above (run it with
    ``sockets=[bind(...)]``)."""
    try:
        import uvicorn
    except ImportError:
        raise ServeError("srpo's HTTP servers need uvicorn: pip install 'srpo[gateway]' (or 'srpo[retrieval]')") from None
    config = uvicorn.Config(GuardMiddleware(app, guard), log_level="warning", lifespan="off", access_log=False,
                            http=_bounded_protocol(header_timeout_s), timeout_keep_alive=keep_alive_s,
                            limit_concurrency=limit_concurrency, timeout_graceful_shutdown=graceful_shutdown_s)
    return uvicorn.Server(config)
