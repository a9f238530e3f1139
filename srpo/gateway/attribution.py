"""Which episode made a call, for programs run in srpo's own process (``isolation: thread``).

A worker process (the default isolation) has one URL mapped to its one current episode, so
nothing here is needed there.  In one process, a client configured once for the process
(``set_default_openai_client``) sends every episode's calls to whichever episode's URL it was
given last — training data silently mixed.  So while an episode's program runs, a context variable
holds that episode's token, and httpx (or its fork httpx2: the transport of the ``openai``
client, LangChain and LiteLLM) stamps it on every request to the gateway as ``x-srpo-caller``.  The gateway compares the
stamp with the URL's token: a call that reached another episode's URL stops the run at once,
saying how to pass ``base_url`` (:class:`MixedEpisodes`).

What this cannot see: a call made from a thread the program starts itself (a new thread does not
inherit context variables before Python 3.14), or through a client that is not built on httpx.
Those reach the URL they were given, unchecked; ``isolation: process`` has no such gap.
"""

from __future__ import annotations

import contextvars
import threading

CALLER = contextvars.ContextVar("srpo_episode_token", default=None)
HEADER = "x-srpo-caller"
_INSTALLED = False
_LOCK = threading.Lock()


class MixedEpisodes(RuntimeError):
    """One episode's program called another episode's URL: the run cannot trust its data."""

    fatal = True  # not one episode's failure: the run stops (srpo.workflows.runtime)


def install(gateway_prefix: str) -> None:
    """Stamp the calling episode's token on httpx requests whose URL starts with ``gateway_prefix``."""
    global _INSTALLED
    with _LOCK:
        if _INSTALLED:
            return
        import importlib

        def stamp(request) -> None:
            token = CALLER.get()
            if token is not None and str(request.url).startswith(gateway_prefix):
                request.headers[HEADER] = token

        # httpx, and httpx2 (the fork newer openai releases are built on)
        for name in ("httpx", "httpx2"):
            try:
                module = importlib.import_module(name)
            except ImportError:
                continue
            _patch(module.Client, module.AsyncClient, stamp)
        _INSTALLED = True


def _patch(client_cls, async_cls, stamp) -> None:
    sync_send, async_send = client_cls.send, async_cls.send

    def send(self, request, **kw):
        stamp(request)
        return sync_send(self, request, **kw)

    async def asend(self, request, **kw):
        stamp(request)
        return await async_send(self, request, **kw)

    client_cls.send, async_cls.send = send, asend


def message(entry: str) -> str:
    return (f"{entry}: a call made by one episode reached another episode's URL — the program keeps a client "
            f"configured once for the process (set_default_openai_client, a module-level client) while episodes "
            f"run side by side in this process. Create the client from the base_url passed to each call of the "
            f"program, or set workflow.options.isolation: process (the default), where a process-wide client "
            f"is safe.")
