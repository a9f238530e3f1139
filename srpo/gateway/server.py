"""The HTTP endpoint: OpenAI's chat-completions, completions, responses and models routes, and
Anthropic's messages route, on 127.0.0.1.

Training: each episode gets its own unguessable base URL, ``http://127.0.0.1:<port>/e/<token>/v1``
(``token``: 128 random bits), opened when the episode starts and closed when it ends — a stray
process, or an episode's program still running after its time, cannot write into another episode
(unknown or closed tokens get 404).  Serving (``srpo serve``): the same routes at ``/v1``.

The server (Starlette under uvicorn) runs on its own event loop: in a daemon thread while srpo
trains (:class:`Gateway`), in the main thread for ``srpo serve`` (:func:`serve_forever`).
Responses and errors are OpenAI-shaped (:mod:`srpo.gateway.protocol`), or Anthropic-shaped on
``/v1/messages`` (:mod:`srpo.gateway.anthropic`); an internal failure is a 500 with a one-line
message, never a traceback on the wire (it goes to the log).
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import threading
import time
import traceback
from typing import Any

from srpo.runs import serving
from srpo.gateway import anthropic, attribution, responses, streaming
from srpo.gateway.protocol import ProtocolError, error_body, models_list, parse_request, response, stream_events
from srpo.gateway.responses import parse_responses_request
from srpo.runs.serving import ServeError

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 8 << 20  # 8 MiB: a long multi-agent transcript fits; a runaway client does not


#: ``srpo serve`` stops within this long after SIGINT/SIGTERM: queued and running requests are
#: answered 503 at once, and connections still open after it are closed.
SHUTDOWN_S = 5.0


def _uvicorn_server(app, guard: serving.Guard, **kw):
    # A training step's requests wait for a batch: the body deadline is for the body only.
    # The connection cap fits the descriptors the process has (raised to the hard limit first): a
    # program opening a thousand idle connections gets 503s, not the run an OSError.
    return serving.uvicorn_server(app, guard=guard, header_timeout_s=30.0,
                                  limit_concurrency=serving.connection_cap(4096), **kw)


def _require_server_libraries():
    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        raise ServeError("the OpenAI-compatible gateway needs starlette and uvicorn: "
                           "pip install 'srpo[gateway]'") from None


class ClientGone(Exception):
    """The client disconnected while its request waited."""


async def _unless_gone(request, work):
    """``await work``, unless the client disconnects first: then ``work`` is cancelled (a queued
    generation is dropped, a running one's result discarded) and :class:`ClientGone` raised."""
    work = asyncio.ensure_future(work)

    async def gone():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(gone())
    try:
        done, _ = await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        work.cancel()
        raise
    finally:
        watcher.cancel()
    if work not in done:
        work.cancel()
        raise ClientGone
    return work.result()


def _error(status: int, message: str, *, param=None, code=None, kind="invalid_request_error", api="openai"):
    """An error reply in the shape of the route's API (Anthropic's on ``messages``)."""
    from starlette.responses import JSONResponse

    if api == "messages":
        return JSONResponse(serving.anthropic_error(status, message), status_code=status)
    return JSONResponse(error_body(message, param=param, code=code, kind=kind), status_code=status)


def _refused(err: ProtocolError, api: str):
    """A refused request's reply, with the error's headers (Retry-After and the like)."""
    from starlette.responses import JSONResponse

    if api == "messages":
        return JSONResponse(serving.anthropic_error(err.status, str(err)), status_code=err.status,
                            headers=err.headers())
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers())


def _parse(kind: str, raw: bytes, headers: dict[str, str]):
    """The request of one route from its body (size, deadline and nesting already bounded by
    serving.Guard)."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise ProtocolError("the request body is not valid JSON") from None
    if kind == "responses":
        return parse_responses_request(body, headers)
    if kind == "messages":
        return anthropic.parse_messages_request(body, headers)
    return parse_request(body, chat=kind == "chat", headers=headers)


def _check_caller(resolve, backend, token: str | None, caller: str | None) -> None:
    """Refuse (409) a request whose attribution header names another episode than its URL, and
    mark both episodes as mixed: their data cannot be told apart."""
    if caller is None or token is None or caller == token:
        return
    mixed = attribution.MixedEpisodes(attribution.message(getattr(backend, "entry", "") or "the program"))
    for b in (backend, resolve(caller)):
        if b is not None and hasattr(b, "mixed"):
            b.mixed = mixed
    raise ProtocolError(str(mixed), status=409, code="episode_mismatch")


async def _generate(request, backend, req, kind: str):
    """Run the request: a streaming reply once its first token is drawn, else (choices,
    prompt_tokens) when the generation has ended.  :class:`ClientGone` if the client leaves."""
    from starlette.responses import StreamingResponse

    if not streaming.streams_tokens(req, backend):
        return await _unless_gone(request, backend.complete(req))
    queue, task = streaming.start(backend, req)
    try:
        first = await _unless_gone(request, queue.get())
    except ClientGone:
        task.cancel()
        raise
    if first is None:  # ended (or failed) before its first token
        return task.result()
    live = {"responses": streaming.response_events, "messages": streaming.message_stream}.get(kind, streaming.chat_chunks)
    return StreamingResponse(live(req, first, queue, task, streaming.reply_streams(req, backend)),
                             media_type="text/event-stream")


def _reply(kind: str, req, choices, prompt_tokens: int):
    """A finished generation's reply in the route's format, streamed (as events) or whole."""
    from starlette.responses import JSONResponse, StreamingResponse

    def events(body):
        return StreamingResponse(body, media_type="text/event-stream")

    if kind == "messages":
        if req.stream:
            return events(anthropic.message_events(req, choices[0], prompt_tokens))
        return JSONResponse(anthropic.message_object(req, choices[0], prompt_tokens))
    if kind == "responses":
        if req.stream:
            return events(responses.stream_events(req, choices[0], prompt_tokens))
        return JSONResponse(responses.response_object(req, choices[0], prompt_tokens))
    if req.stream:
        return events(iter(stream_events(req, choices)))
    return JSONResponse(response(req, choices, prompt_tokens))


def build_app(resolve, *, serve_root: bool = False):
    """The Starlette app.  ``resolve(token)`` returns the backend of an open episode (None: unknown
    or closed); with ``serve_root`` the routes also answer at ``/v1`` (``resolve(None)``)."""
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    def backend_of(request):
        token = request.path_params.get("token")
        backend = resolve(token)
        if backend is None:
            raise ProtocolError("no such episode: it has ended, or this URL was never issued", status=404,
                                code="episode_not_found")
        return backend

    async def completions(request, kind: str):
        try:
            backend = backend_of(request)
            headers = {k.lower(): v for k, v in request.headers.items()}
            req = _parse(kind, await request.body(), headers)
            _check_caller(resolve, backend, request.path_params.get("token"), headers.get(attribution.HEADER))
            if req.model not in backend.roles:
                raise ProtocolError(f"the model {req.model!r} is not a role of this team; roles: "
                                    f"{', '.join(backend.roles)}", param="model", status=404, code="model_not_found")
            result = await _generate(request, backend, req, kind)
            if isinstance(result, Response):  # tokens are coming: streamed as they are drawn
                return result
            choices, prompt_tokens = result
        except ClientGone:  # nobody is waiting: the generation was cancelled, nothing to answer
            log.info("a client disconnected before its reply; its generation was cancelled")
            return Response(status_code=499)
        except ProtocolError as err:
            return _refused(err, kind)
        except asyncio.CancelledError:
            return _error(503, "the episode ended while this request waited", kind="server_error", api=kind)
        except Exception:  # noqa: BLE001 — the log gets the traceback, the wire a generic line
            log.error("gateway request failed:\n%s", traceback.format_exc())
            return _error(500, "the server failed to answer this request (its log says why)", kind="server_error",
                          api=kind)
        return _reply(kind, req, choices, prompt_tokens)

    def route(kind: str):
        async def handle(request):
            return await completions(request, kind)
        return handle

    async def models(request):
        try:
            return JSONResponse(models_list(backend_of(request).roles))
        except ProtocolError as err:
            return JSONResponse(err.body(), status_code=err.status, headers=err.headers())

    async def not_found(request, exc):
        return _error(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                      code="not_found" if exc.status_code == 404 else None)

    paths = {"chat/completions": route("chat"), "completions": route("text"), "responses": route("responses"),
             "messages": route("messages")}
    prefixes = ["/e/{token}/v1"] + (["/v1"] if serve_root else [])
    routes = []
    for prefix in prefixes:
        routes += [Route(f"{prefix}/{path}", handler, methods=["POST"]) for path, handler in paths.items()]
        routes.append(Route(f"{prefix}/models", models, methods=["GET"]))
    return Starlette(routes=routes, exception_handlers={HTTPException: not_found})


class Gateway:
    """The training endpoint: a uvicorn server in a daemon thread, episodes opened and closed by
    token.  One per process and address (:func:`shared`)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0):
        _require_server_libraries()
        warn_without_grammar_library("srpo train (the gateway its agents call)")
        self._backends: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._sock = serving.bind(host, port)
        self.host, self.port = self._sock.getsockname()[:2]
        guard = serving.Guard(loopback_only=serving.is_loopback(host), max_body_bytes=MAX_BODY_BYTES)
        self._server = _uvicorn_server(build_app(self._resolve), guard)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]},
                                        name="srpo-gateway", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise ServeError(f"the gateway on {self.host}:{self.port} did not start")
            time.sleep(0.01)

    def _resolve(self, token: str | None):
        with self._lock:
            return self._backends.get(token) if token else None

    def open(self, backend) -> str:
        """Register an episode's backend; returns its base URL."""
        token = secrets.token_urlsafe(16)
        with self._lock:
            self._backends[token] = backend
        return token

    def reserve(self) -> str:
        """A token for a worker process's stable URL, answering nothing until :meth:`assign`."""
        token = secrets.token_urlsafe(16)
        with self._lock:
            self._backends[token] = None
        return token

    def assign(self, token: str, backend) -> None:
        """Route a reserved token to ``backend`` (the episode its worker runs now; None: no episode)."""
        with self._lock:
            if token in self._backends:
                self._backends[token] = backend

    def release(self, token: str) -> None:
        with self._lock:
            self._backends.pop(token, None)

    def url(self, token: str) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/e/{token}/v1"

    def close_episode(self, token: str) -> None:
        with self._lock:
            self._backends.pop(token, None)

    @property
    def open_episodes(self) -> int:
        with self._lock:
            return sum(b is not None for b in self._backends.values())

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)


_SHARED: dict[tuple[str, int], Gateway] = {}
_SHARED_LOCK = threading.Lock()


def shared(host: str = "127.0.0.1", port: int = 0) -> Gateway:
    """This process's gateway on ``host:port`` (started at first use; port 0: one chosen by the OS,
    kept for the process)."""
    with _SHARED_LOCK:
        gw = _SHARED.get((host, port))
        if gw is None or not gw._thread.is_alive():
            gw = _SHARED[(host, port)] = Gateway(host, port)
        return gw


def warn_without_grammar_library(who: str) -> bool:
    """Say at start-up, once, when structured output cannot be served (the grammar library is
    missing from this environment); its requests are then a 501 naming the install.  True: it can."""
    import importlib.util

    if importlib.util.find_spec("llguidance") is not None:
        return True
    log.warning("%s: structured output (response_format json_schema/json_object, text.format, output_type) "
                "needs llguidance, which is not installed here: such requests will be refused (501) — "
                "pip install llguidance", who)
    return False


def serve_forever(backend, host: str = "127.0.0.1", port: int = 8000, *, ready=None, api_key: str = "") -> None:
    """``srpo serve``: the routes at ``/v1`` (and per-token routes, unused) in this thread until
    interrupted.  ``ready(host, port)`` is called once it listens.  ``api_key``: every request
    needs it as a bearer token ('': none; a warning when ``host`` is not loopback)."""
    _require_server_libraries()
    warn_without_grammar_library("srpo serve")
    sock = serving.bind(host, port)
    serving.warn_if_exposed(host, api_key, "srpo serve")
    guard = serving.Guard(api_key=api_key, loopback_only=serving.is_loopback(host), max_body_bytes=MAX_BODY_BYTES)
    server = _uvicorn_server(build_app(lambda token: backend if token is None else None, serve_root=True), guard,
                             graceful_shutdown_s=SHUTDOWN_S)
    real_startup, real_exit, loop = server.startup, server.handle_exit, None

    async def startup(sockets=None):
        nonlocal loop
        loop = asyncio.get_running_loop()
        await real_startup(sockets=sockets)
        if ready is not None:
            ready(*sock.getsockname()[:2])

    def handle_exit(sig, frame):
        # The queue is answered 503 now, not generated first: the server stops within SHUTDOWN_S.
        shed = getattr(backend, "shed", None)
        if shed is not None and loop is not None:
            loop.call_soon_threadsafe(shed)
        real_exit(sig, frame)

    server.startup, server.handle_exit = startup, handle_exit
    try:
        server.run(sockets=[sock])
    finally:
        close = getattr(backend, "close", None)
        if close is not None:
            close()
