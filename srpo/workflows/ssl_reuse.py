"""One default SSL context per process for the HTTP clients agent programs build (httpx, httpx2).

Building an ``OpenAI(...)`` client costs about 20 ms of CPU, nearly all of it httpx parsing
certifi's CA bundle into a fresh SSL context — for a client whose calls go to the gateway over
plain HTTP on loopback.  Most programs build their client in each episode; a step of 16 episodes
then spends about 0.3 s of a two-core machine on certificates it never uses.  So in the processes
that run agent programs (srpo's worker processes, and the trainer under ``isolation: thread``),
httpx's transports share one context per setting for the default verification: ``requests`` does
the same since 2.32 (one preloaded context for every session).

Shared only where the program asked for nothing else — ``verify=True``, no client certificate —
and keyed on what makes contexts differ: HTTP/1.1 and HTTP/2 (httpcore sets the context's ALPN
protocols from them before each handshake, so transports of different settings must not share
one), ``trust_env`` and the ``SSL_CERT_FILE`` / ``SSL_CERT_DIR`` it reads.  A client given its own
``verify`` context, ``verify=False`` or a ``cert`` builds its context as before.  A layout of httpx
this module does not know is left alone (the clients are then only slower to build).
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
import threading

_LOCK = threading.Lock()
_CONTEXTS: dict[tuple, object] = {}  # (module, http1, http2, trust_env, SSL_CERT_FILE, SSL_CERT_DIR) → SSLContext
_INSTALLED: set[str] = set()


def share_default_ssl_context() -> list[str]:
    """Make the transports of httpx (and httpx2), where already imported, share the default SSL
    context; idempotent and cheap, so called before each episode (a program that imports its client
    library on its first call is covered from its second).  Importing nothing keeps a worker whose
    program needs no HTTP client as light as before.

    Returns the modules patched by this call."""
    patched = []
    with _LOCK:
        for name in ("httpx", "httpx2"):
            if name in _INSTALLED or name not in sys.modules:
                continue
            try:
                transports = importlib.import_module(f"{name}._transports.default")
            except ImportError:
                continue
            create = getattr(transports, "create_ssl_context", None)
            classes = [getattr(transports, c, None) for c in ("HTTPTransport", "AsyncHTTPTransport")]
            if create is None or not all(_takes_tls_settings(c) for c in classes):
                continue  # not the layout this module knows: leave it alone
            for cls in classes:
                cls.__init__ = _sharing_init(cls.__init__, name, create)
            _INSTALLED.add(name)
            patched.append(name)
    return patched


def _takes_tls_settings(cls) -> bool:
    if cls is None:
        return False
    params = inspect.signature(cls.__init__).parameters
    return all(p in params for p in ("verify", "cert", "trust_env", "http1", "http2"))


def _sharing_init(init, module: str, create_ssl_context):
    def __init__(self, *args, **kwargs):
        # httpx's clients build their transports with keyword arguments only; anything else as before
        if not args and kwargs.get("verify", True) is True and not kwargs.get("cert"):
            kwargs["verify"] = _shared(module, create_ssl_context, kwargs.get("http1", True),
                                       kwargs.get("http2", False), kwargs.get("trust_env", True))
        init(self, *args, **kwargs)

    __init__.__wrapped__ = init
    return __init__


def _shared(module: str, create_ssl_context, http1: bool, http2: bool, trust_env: bool):
    env = (os.environ.get("SSL_CERT_FILE"), os.environ.get("SSL_CERT_DIR")) if trust_env else (None, None)
    key = (module, bool(http1), bool(http2), bool(trust_env), *env)
    with _LOCK:
        context = _CONTEXTS.get(key)
        if context is None:
            context = _CONTEXTS[key] = create_ssl_context(verify=True, cert=None, trust_env=trust_env)
    return context
