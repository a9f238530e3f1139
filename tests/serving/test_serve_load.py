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

import pytest

pytest.importorskip("starlette")
httpx = pytest.importorskip("httpx")

from srpo.types import Sample, SamplingParams  # noqa: E402
from srpo.policies.scripted import ScriptedPolicies  # noqa: E402
from helpers import HELPERS


class GatedEngine:
    """Answers "ok" and remembers every prompt it generated.  While held (:meth:`hold`) a batch
    waits in ``generate`` until :meth:`release`: the tests decide when the engine is busy, instead
    of guessing how long a sleep keeps it so on a loaded machine."""

    def __init__(self, tokenizer):
        self.tokenizer, self.prompts = tokenizer, []
        self.open, self.busy = threading.Event(), threading.Event()
        self.open.set()

    def hold(self):
        self.open.clear()

    def release(self):
        self.open.set()

    def generate(self, requests, generator=None):
        self.busy.set()
        assert self.open.wait(120), "the test never released the engine"
        self.prompts += [self.tokenizer.decode(r.prompt_ids) for r in requests]
        ids = self.tokenizer("ok", add_special_tokens=False)["input_ids"]
        return [Sample(completion_ids=ids, text="ok", logprobs=[-1.0] * len(ids), finish_reason="eos") for _ in requests]


def wait_until(condition, what: str, timeout_s: float = 120.0) -> None:
    """Poll ``condition`` until it holds; the deadline only bounds a failure, it is not a guess."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.01)


@pytest.fixture
def served(request):
    from srpo.gateway.backends import ServeBackend
    from srpo.gateway.server import Gateway
    from srpo.types import RoleSpec

    max_queue = request.param
    policies = ScriptedPolicies(lambda role, prompt: "ok", ["solver"])
    engine = GatedEngine(policies.tokenizer)
    backend = ServeBackend(engine, policies, {"solver": RoleSpec("solver", sampling=SamplingParams(max_new_tokens=4))},
                           max_batch=4, max_queue=max_queue, max_prompt_tokens=2048)
    gw = Gateway()
    yield gw.url(gw.open(backend)), backend, engine
    engine.release()
    gw.stop()
    backend.close()


def _chat(content, **kw):
    return {"model": "solver", "messages": [{"role": "user", "content": content}], **kw}


@pytest.mark.parametrize("served", [8], indirect=True)
def test_a_flood_past_the_queue_gets_429_with_retry_after(served):
    url, backend, engine = served
    engine.hold()  # every request of the flood arrives while the first batch generates

    async def flood():
        async with httpx.AsyncClient(timeout=120) as client:
            asks = [asyncio.ensure_future(client.post(f"{url}/chat/completions", json=_chat(f"q{i}")))
                    for i in range(40)]
            await asyncio.get_running_loop().run_in_executor(None, wait_until, lambda: backend.stats["shed_busy"]
                                                             + backend.waiting == 40, "all 40 were queued or shed")
            engine.release()
            return await asyncio.gather(*asks)

    replies = asyncio.run(flood())
    codes = [r.status_code for r in replies]
    busy = [r for r in replies if r.status_code == 429]
    assert codes.count(200) == 8 and codes.count(429) == 32, codes  # the queue's 8, not one more
    assert all(int(r.headers["retry-after"]) >= 1 and r.json()["error"]["code"] == "server_busy" for r in busy)
    assert len(engine.prompts) == 8  # nothing shed was generated
    # Once the queue has drained nothing of the flood is left: a new request is the next batch alone.
    assert backend.waiting == 0
    assert httpx.post(f"{url}/chat/completions", json=_chat("after"), timeout=60).status_code == 200
    assert engine.prompts[8:] == [p for p in engine.prompts[8:] if "after" in p] and len(engine.prompts) == 9


@pytest.mark.parametrize("served", [64], indirect=True)
def test_a_client_that_leaves_is_not_generated_for_and_leaves_no_traceback(served, caplog):
    url, backend, engine = served
    engine.hold()
    busy = threading.Thread(target=lambda: httpx.post(f"{url}/chat/completions", json=_chat("first"), timeout=120))
    busy.start()
    assert engine.busy.wait(60)  # the engine is generating 'first', held
    caplog.set_level(logging.INFO)
    with pytest.raises(httpx.ReadTimeout):  # the engine is held: no reply can come
        httpx.post(f"{url}/chat/completions", json=_chat("impatient"), timeout=0.3)
    wait_until(lambda: backend.stats["cancelled"] == 1, "the server saw the client leave")
    engine.release()
    busy.join()
    # Batches are first in, first out: had 'impatient' stayed queued, it would be generated by
    # the time a later request is answered.
    assert httpx.post(f"{url}/chat/completions", json=_chat("after"), timeout=60).status_code == 200
    assert not any("impatient" in p for p in engine.prompts) and any("after" in p for p in engine.prompts)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert "disconnected before its reply" in caplog.text


@pytest.mark.parametrize("served", [64], indirect=True)
def test_prompts_are_checked_before_and_tokenised_off_the_event_loop(served, monkeypatch):
    url, backend, engine = served
    huge = "x" * (2048 * 32 + 1)  # more characters than 2,048 tokens can hold: refused before tokenising
    reply = httpx.post(f"{url}/chat/completions", json=_chat(huge), timeout=30)
    assert reply.status_code == 400 and reply.json()["error"]["code"] == "context_length_exceeded"
    # A slow tokenisation (a long prompt) does not hold the small requests behind it.
    from srpo.gateway import backends

    real = backends.render
    tokenising, finish = threading.Event(), threading.Event()

    def slow_render(tokenizer, req, *rest):
        if "LONG" in req.messages[-1]["content"]:
            tokenising.set()
            assert finish.wait(120)  # tokenising until the test says it is done
        return real(tokenizer, req, *rest)

    monkeypatch.setattr(backends, "render", slow_render)
    long = threading.Thread(target=lambda: httpx.post(f"{url}/chat/completions", json=_chat("LONG prompt"), timeout=120))
    long.start()
    assert tokenising.wait(60)
    # Were tokenising on the event loop, this request could not be answered until 'finish'.
    assert httpx.post(f"{url}/chat/completions", json=_chat("hi"), timeout=60).status_code == 200
    assert not any("LONG" in p for p in engine.prompts)
    finish.set()
    long.join()
    assert any("LONG" in p for p in engine.prompts)


def test_sigterm_stops_the_server_answering_the_queue_503_without_waiting_for_the_engine(tmp_path):
    worker = HELPERS / "serve_worker.py"
    # --hold: the engine never finishes a batch, so the server stops only if it does not wait for it
    proc = subprocess.Popen([sys.executable, str(worker), "0", "--hold", "--announce"], stdout=subprocess.PIPE,
                            text=True)
    try:
        url = proc.stdout.readline().strip()
        assert url.startswith("http://"), url
        results = []

        def ask(i):
            try:
                results.append(httpx.post(f"{url}/chat/completions", json=_chat(f"q{i}"), timeout=120).status_code)
            except httpx.HTTPError as err:
                results.append(type(err).__name__)

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(10)]
        for t in threads:
            t.start()
        said = [proc.stdout.readline().strip() for _ in range(11)]  # 10 requests in, a batch generating
        assert sorted(set(said)) == ["generating", "request"] and said.count("request") == 10, said
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
        for t in threads:
            t.join(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode is not None
    assert results.count(503) == 10, results  # the queue and the running batch answered, not generated


@pytest.mark.parametrize("served", [64], indirect=True)
def test_a_client_that_hangs_up_mid_body_is_one_quiet_line(served, caplog):
    """Clients that hang up while sending their request leave an INFO line each, no traceback."""
    import socket

    url, backend, engine = served
    caplog.set_level(logging.INFO)
    host, port = url.split("//")[1].split("/")[0].split(":")
    path = "/" + url.split("//")[1].split("/", 1)[1] + "/chat/completions"
    for _ in range(3):
        with socket.create_connection((host, int(port))) as s:
            s.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                      f"Content-Length: 1000\r\n\r\n{{\"model\":".encode())
    wait_until(lambda: caplog.text.count("disconnected while sending its request") == 3, "the server saw all three")
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    assert "Traceback" not in caplog.text
    assert httpx.post(f"{url}/chat/completions", json=_chat("still here"), timeout=60).status_code == 200


def test_a_request_arriving_mid_generation_joins_the_running_batch():
    """srpo's sampler batches continuously: a short request that arrives while a long reply is being
    generated joins it at the next token step and is answered long before the long one ends — with
    static batches it would wait for the long reply's whole batch."""
    from srpo.gateway.backends import ServeBackend
    from srpo.gateway.protocol import CompletionRequest
    from srpo.policies.layouts import build_policies
    from srpo.rollout.builtin import BuiltinEngine
    from srpo.types import RoleSpec

    policies = build_policies("shared", "tiny-llama", ["solver"], seed=0)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=64)
    backend = ServeBackend(BuiltinEngine(policies), policies, {"solver": RoleSpec("solver", sampling=greedy)})
    ask = {"model": "solver", "messages": [{"role": "user", "content": "Count:"}]}
    tokens_when_short_ended = []

    def on_long_token(index, token):
        if len(long_tokens) == 4:  # hold the decode thread at the long reply's 5th token until the short one is queued
            wait_until(lambda: backend.waiting == 2, "the short request was queued")
        long_tokens.append(token)

    async def both():
        long = asyncio.ensure_future(backend.complete(CompletionRequest(**ask, max_tokens=64), on_token=on_long_token))
        await asyncio.get_running_loop().run_in_executor(None, wait_until, lambda: len(long_tokens) >= 4 or long.done(),
                                                         "the long reply started")
        short, _ = await backend.complete(CompletionRequest(**ask, max_tokens=3))
        tokens_when_short_ended.append(len(long_tokens))
        return short, (await long)[0]

    long_tokens: list[int] = []
    try:
        short, long = asyncio.run(both())
    finally:
        backend.close()
    assert long[0].finish_reason == "length" and len(long_tokens) == 64  # the premise: the long reply ran its 64 tokens
    assert short[0].finish_reason == "length"
    assert 4 < tokens_when_short_ended[0] < 16  # answered a few steps after it joined, not after the long reply's 64
