"""``srpo serve`` under load: it sheds what it cannot serve (429 with Retry-After past its queue,
400 for an oversized prompt before tokenising it), drops the generations of clients that left,
keeps answering small requests while a large prompt is tokenised, and stops within seconds."""

from __future__ import annotations

import asyncio
import logging
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("starlette")
httpx = pytest.importorskip("httpx")

from srpo.policies.sampling import Sample, SamplingParams  # noqa: E402
from srpo.policies.scripted import ScriptedPolicies  # noqa: E402
from helpers import HELPERS


class SlowEngine:
    """Takes ``seconds`` per batch; remembers every prompt it generated."""

    def __init__(self, tokenizer, seconds: float):
        self.tokenizer, self.seconds, self.prompts = tokenizer, seconds, []

    def generate(self, requests, generator=None):
        time.sleep(self.seconds)
        self.prompts += [self.tokenizer.decode(r.prompt_ids) for r in requests]
        ids = self.tokenizer("ok", add_special_tokens=False)["input_ids"]
        return [Sample(completion_ids=ids, text="ok", logprobs=[-1.0] * len(ids), finish_reason="eos") for _ in requests]


@pytest.fixture
def served(request):
    from srpo.gateway.backends import ServeBackend
    from srpo.gateway.server import Gateway
    from srpo.types import RoleSpec

    seconds, max_queue = request.param
    policies = ScriptedPolicies(lambda role, prompt: "ok", ["solver"])
    engine = SlowEngine(policies.tokenizer, seconds)
    backend = ServeBackend(engine, policies, {"solver": RoleSpec("solver", sampling=SamplingParams(max_new_tokens=4))},
                           max_batch=4, max_queue=max_queue, max_prompt_tokens=2048)
    gw = Gateway()
    yield gw.url(gw.open(backend)), backend, engine
    gw.stop()
    backend.close()


def _chat(content, **kw):
    return {"model": "solver", "messages": [{"role": "user", "content": content}], **kw}


@pytest.mark.parametrize("served", [(0.3, 8)], indirect=True)
def test_a_flood_past_the_queue_gets_429_with_retry_after(served):
    url, backend, engine = served

    async def flood():
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(*[client.post(f"{url}/chat/completions", json=_chat(f"q{i}"))
                                          for i in range(40)])

    replies = asyncio.run(flood())
    codes = [r.status_code for r in replies]
    busy = [r for r in replies if r.status_code == 429]
    assert set(codes) == {200, 429} and 8 <= codes.count(200) < 40, codes
    assert all(int(r.headers["retry-after"]) >= 1 and r.json()["error"]["code"] == "server_busy" for r in busy)
    assert len(engine.prompts) == codes.count(200)  # nothing shed was generated
    # once the queue has drained, a new request is served at once (no backlog of the flood)
    start = time.monotonic()
    assert httpx.post(f"{url}/chat/completions", json=_chat("after"), timeout=30).status_code == 200
    assert time.monotonic() - start < 5


@pytest.mark.parametrize("served", [(1.0, 64)], indirect=True)
def test_a_client_that_leaves_is_not_generated_for_and_leaves_no_traceback(served, caplog):
    url, backend, engine = served
    busy = threading.Thread(target=lambda: httpx.post(f"{url}/chat/completions", json=_chat("first"), timeout=30))
    busy.start()
    time.sleep(0.2)  # the engine is now busy with 'first' for a second
    caplog.set_level(logging.INFO)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/chat/completions", json=_chat("impatient"), timeout=0.3)
    busy.join()
    time.sleep(1.5)  # the next batch would have run by now
    assert not any("impatient" in p for p in engine.prompts) and backend.stats["cancelled"] == 1
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert "disconnected before its reply" in caplog.text


@pytest.mark.parametrize("served", [(0.0, 64)], indirect=True)
def test_prompts_are_checked_before_and_tokenised_off_the_event_loop(served, monkeypatch):
    url, backend, engine = served
    huge = "x" * (2048 * 32 + 1)  # more characters than 2,048 tokens can hold: refused before tokenising
    reply = httpx.post(f"{url}/chat/completions", json=_chat(huge), timeout=30)
    assert reply.status_code == 400 and reply.json()["error"]["code"] == "context_length_exceeded"
    # A slow tokenisation (a long prompt) does not hold the small requests behind it.
    from srpo.gateway import backends

    real = backends.render

    def slow_render(tokenizer, req):
        if "LONG" in req.messages[-1]["content"]:
            time.sleep(2.0)
        return real(tokenizer, req)

    monkeypatch.setattr(backends, "render", slow_render)
    done = {}

    def ask(name, content):
        httpx.post(f"{url}/chat/completions", json=_chat(content), timeout=30)
        done[name] = time.monotonic()

    long = threading.Thread(target=ask, args=("long", "LONG prompt"))
    long.start()
    time.sleep(0.2)
    ask("small", "hi")
    long.join()
    assert done["small"] < done["long"] - 1.0


def test_sigterm_stops_the_server_within_seconds_answering_the_queue_503(tmp_path):
    worker = HELPERS / "serve_worker.py"
    proc = subprocess.Popen([sys.executable, str(worker), "3.0"], stdout=subprocess.PIPE, text=True)
    try:
        url = proc.stdout.readline().strip()
        assert url.startswith("http://"), url
        results = []

        def ask(i):
            try:
                results.append(httpx.post(f"{url}/chat/completions", json=_chat(f"q{i}"), timeout=30).status_code)
            except httpx.HTTPError as err:
                results.append(type(err).__name__)

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(10)]
        for t in threads:
            t.start()
        time.sleep(0.5)  # one batch of 2 generating (3 s), 8 queued
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        stopped = time.monotonic() - start
        for t in threads:
            t.join(timeout=10)
    finally:
        proc.kill()
    assert stopped < 6.0, stopped
    assert results.count(503) >= 8, results  # the queue (and the running batch) answered, not generated
