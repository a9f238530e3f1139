"""Retrieval as a service: a BM25 server and a client, speaking the Search-R1 retrieval API.

Search-R1 and Dr. MAS run one retrieval server (FastAPI; e5 embeddings over FAISS) that every
rollout worker shares.  ``srpo retriever serve`` serves srpo's BM25 index over the same API, and
:class:`HTTPRetriever` — a retriever like any other for the search workflows — talks to it or to
any compatible server (``retriever: {url: http://host:port/retrieve}`` in a run config).

The API (``POST /retrieve``)::

    request:  {"queries": ["q1", "q2"], "topk": 3, "return_scores": true}
    response: {"result": [[{"document": {"id": "...", "contents": "\\"Title\\"\\ntext"}, "score": 7.1}, ...], ...]}

Without ``return_scores`` each entry is the document itself.  ``contents`` is Search-R1's
``"Title"\\ntext``; srpo's server adds ``title`` and ``text`` fields, which the client prefers when
present.  ``GET /health`` reports the corpus size.

Limits (so that one client cannot take the server from the others): a body of at most 1 MiB
(413, from ``Content-Length`` before reading), whole within 30 s (408), at most 20,000 passages per
request (queries × topk; more is refused with 413 before any work), a response of at most 32 MiB
(413), queries of at most 4,096 characters (422) and 4,096 queries (422); a connection that has
not sent a complete request head within 10 s is closed, and at most 1,024 connections are served
at once (503 beyond); with ``--api-key`` every request needs the key, and on a loopback bind only
loopback ``Host`` names are served — :mod:`srpo.runs.serving`.
"""

# No ``from __future__ import annotations`` here: FastAPI reads the request model's annotations
# at run time, and they must resolve inside build_app.

import logging
import threading
import time
from typing import Any, Sequence

from srpo.runs.secrets import redact
from srpo.tasks.search import BM25Retriever, Passage

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------ server


def document(p: Passage) -> dict[str, str]:
    return {"id": p.pid, "contents": f'"{p.title}"\n{p.text}' if p.title else p.text, "title": p.title, "text": p.text}


MAX_RESULTS = 20_000  # queries × topk in one request: the work and the response are bounded by it
MAX_RESPONSE_BYTES = 32 << 20  # and the response by its size (long passages)
MAX_QUERY_CHARS = 4096


def build_app(retriever: BM25Retriever, default_topk: int = 3, *, max_results: int = MAX_RESULTS,
              max_response_bytes: int = MAX_RESPONSE_BYTES, docs: bool = False):
    """The FastAPI application serving ``retriever``.  A request asking for more than
    ``max_results`` passages (queries × topk) is refused with 413 before any work; one whose
    passages would exceed ``max_response_bytes`` with 413 too — split it into smaller requests.
    ``docs``: also serve FastAPI's ``/docs`` and ``/openapi.json`` (off: they describe the server
    to whoever asks)."""
    from fastapi import FastAPI, HTTPException
    from pydantic import BaseModel, Field

    class QueryRequest(BaseModel):
        queries: list[str] = Field(max_length=4096)
        topk: int | None = Field(default=None, ge=1, le=1000)
        return_scores: bool = False

    pages = {} if docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="srpo BM25 retrieval (Search-R1 API)", **pages)

    @app.get("/health")
    def health() -> dict[str, Any]:
        return {"status": "ok", "passages": len(retriever.passages), "retriever": "bm25"}

    @app.post("/retrieve")
    def retrieve(request: QueryRequest) -> dict[str, Any]:
        if not request.queries:
            raise HTTPException(status_code=422, detail="queries must hold at least one query")
        topk = request.topk or default_topk
        if len(request.queries) * topk > max_results:
            raise HTTPException(status_code=413, detail=(
                f"{len(request.queries)} queries × topk {topk} = {len(request.queries) * topk} passages; this server "
                f"returns at most {max_results} per request — split the queries"))
        long = [i for i, q in enumerate(request.queries) if len(q) > MAX_QUERY_CHARS]
        if long:
            raise HTTPException(status_code=422, detail=f"query {long[0]} is longer than {MAX_QUERY_CHARS} characters")
        results = retriever.search_many_scored(request.queries, topk)
        size = sum(len(p.text) + len(p.title) + 64 for row in results for p, _ in row)
        if size > max_response_bytes:
            raise HTTPException(status_code=413, detail=(
                f"the response would be about {size >> 20} MiB; this server returns at most "
                f"{max_response_bytes >> 20} MiB per request — ask for fewer queries or a smaller topk"))
        if request.return_scores:
            return {"result": [[{"document": document(p), "score": s} for p, s in row] for row in results]}
        return {"result": [[document(p) for p, _ in row] for row in results]}

    return app


MAX_BODY_BYTES = 1 << 20  # 1 MiB: 256 queries of the longest allowed length


def serve(retriever: BM25Retriever, host: str = "127.0.0.1", port: int = 8000, default_topk: int = 3, *,
          api_key: str = "", docs: bool = False) -> None:
    """Serve until interrupted: a port in use is a :class:`~srpo.runs.serving.ServeError` (one ``error:``
    line); slow clients are cut off (header and body deadlines), bodies are bounded, connections
    are capped, and with ``api_key`` every request needs it (:mod:`srpo.runs.serving`)."""
    from srpo.runs import serving

    sock = serving.bind(host, port)  # before the corpus is served: a port in use fails here, clearly
    serving.warn_if_exposed(host, api_key, "srpo retriever serve")
    guard = serving.Guard(api_key=api_key, loopback_only=serving.is_loopback(host), max_body_bytes=MAX_BODY_BYTES,
                          body_deadline_s=30.0, parse_json=True)
    serving.uvicorn_server(build_app(retriever, default_topk, docs=docs), guard=guard).run(sockets=[sock])


# ------------------------------------------------------------------------------------ client


#: The retrieval server's API key, for ``srpo retriever serve --api-key`` and :class:`HTTPRetriever`.
API_KEY_ENV = "SRPO_RETRIEVER_API_KEY"


class RetrieverUnavailable(RuntimeError):
    """The retrieval server did not answer usefully within the retries; costs the tool call."""


def passage_from(entry: dict) -> Passage:
    """A passage from one result entry: ``{"document": {...}, "score": s}`` or the document itself."""
    doc = entry.get("document", entry) if isinstance(entry, dict) else {}
    if not isinstance(doc, dict):
        raise ValueError(f"a result entry is not a document: {str(entry)[:80]}")
    if "text" in doc:
        return Passage(str(doc.get("id", "")), str(doc.get("title", "")), str(doc["text"]))
    contents = str(doc.get("contents", ""))
    first, _, rest = contents.partition("\n")
    if rest:  # Search-R1's "Title"\ntext
        return Passage(str(doc.get("id", "")), first.strip().strip('"'), rest)
    return Passage(str(doc.get("id", "")), "", contents)


class HTTPRetriever:
    """A retriever that asks a Search-R1-compatible server.

    Each call has ``timeout_s`` in all, retries included: a refused connection or a 5xx answer is
    retried up to ``retries`` times (``backoff_s`` doubling between tries) within what is left of
    it, and a timeout is not retried — a frozen server would only make every retry wait the whole
    timeout again (8 calls once cost 22 timeouts).  Then :class:`RetrieverUnavailable` is raised,
    which the workflow runtime counts as a failed tool call (the episode goes on).  ``stats``
    counts requests, retries, failures and timeouts over the client's life.
    """

    def __init__(self, url: str, *, timeout_s: float = 5.0, retries: int = 2, backoff_s: float = 0.2,
                 api_key: str | None = None):
        import os

        import httpx

        self.url = url if url.rstrip("/").endswith("/retrieve") else url.rstrip("/") + "/retrieve"
        self.timeout_s, self.retries, self.backoff_s = timeout_s, retries, backoff_s
        self._httpx = httpx
        # The key comes from the environment, never from a config file (configs are saved in runs).
        key = os.environ.get(API_KEY_ENV, "") if api_key is None else api_key
        self._client = httpx.Client(timeout=timeout_s, headers={"Authorization": f"Bearer {key}"} if key else {})
        self._lock = threading.Lock()  # tools run in a thread pool
        self.stats = {"requests": 0, "retries": 0, "failures": 0, "timeouts": 0}

    def _count(self, key: str) -> None:
        with self._lock:
            self.stats[key] += 1

    def search(self, query: str, k: int = 3) -> list[Passage]:
        return self.search_many([query], k)[0]

    def search_many(self, queries: Sequence[str], k: int = 3) -> list[list[Passage]]:
        body = {"queries": list(queries), "topk": k, "return_scores": True}
        last = ""
        deadline = time.monotonic() + self.timeout_s
        for attempt in range(self.retries + 1):
            if attempt:
                pause = self.backoff_s * 2 ** (attempt - 1)
                if time.monotonic() + pause >= deadline:  # no time left for another try
                    break
                self._count("retries")
                time.sleep(pause)
            self._count("requests")
            try:
                response = self._client.post(self.url, json=body, timeout=max(deadline - time.monotonic(), 0.01))
                response.raise_for_status()
                rows = response.json()["result"]
                if len(rows) != len(queries):
                    raise ValueError(f"{len(rows)} result lists for {len(queries)} queries")
                return [[passage_from(e) for e in row][:k] for row in rows]
            except self._httpx.TimeoutException:
                self._count("timeouts")
                last = f"no answer within {self.timeout_s} s"
                break  # a server that does not answer in time will not answer a retry sooner
            except self._httpx.HTTPStatusError as err:
                last = f"HTTP {err.response.status_code}: {err.response.text[:160]}"
                if err.response.status_code < 500:  # the request itself is wrong: another try cannot help
                    break
            except (self._httpx.HTTPError, ValueError, KeyError, TypeError) as err:
                last = f"{err.__class__.__name__}: {str(err)[:160]}"
        self._count("failures")
        raise RetrieverUnavailable(f"retrieval server {redact(self.url)}: {last} (after {attempt + 1} tries)")

    def close(self) -> None:
        self._client.close()
