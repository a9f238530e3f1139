"""Streamed replies leave as tokens are drawn (srpo.gateway.streaming), in chat completions,
completions and the Responses API, and add up to the same reply as the unstreamed call."""

from __future__ import annotations

import threading

import pytest

pytest.importorskip("starlette")
openai = pytest.importorskip("openai")

from srpo.gateway.streaming import TokenText  # noqa: E402
from srpo.policies.tiny import byte_tokenizer  # noqa: E402


def test_text_leaves_once_certain():
    tok = byte_tokenizer()
    text = TokenText(tok, stops=("STOP",))
    ids = tok("héllo STOP", add_special_tokens=False)["input_ids"]
    sent = "".join(text.push(i) for i in ids[:-1])
    # 'é' is two byte-tokens: never half-sent; the last 3 characters wait in case they begin 'STOP'
    assert "\ufffd" not in sent and sent == "héllo "
    sent += text.push(ids[-1])  # completes 'STOP': none of it leaves, nor anything after it
    sent += "".join(text.push(i) for i in tok(" more", add_special_tokens=False)["input_ids"])
    assert sent == "héllo " and text.finish("héllo ") == ""


class _Pieces:
    """A tokenizer whose ids are indices into ``pieces`` (multi-character tokens)."""

    def __init__(self, pieces):
        self.pieces = pieces

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.pieces[i] for i in ids)


@pytest.mark.parametrize("pieces, stops, expected", [
    (["Thought", ":", " x", "\n\n", "Observation", ":"], ("\n",), "Thought: x"),  # stop + more in one token
    (["Thought", ": x", "\nO", "bservation:", " 42"], ("Observation:",), "Thought: x\n"),  # the ReAct case
    (["a", ".", "b", ",", "c"], ("\n", " ", ".", ","), "a"),  # several stops: the first one ends it
    (["no", " stop", " here"], ("\n\n",), "no stop here"),
])
def test_a_stop_string_never_leaves_in_a_stream(pieces, stops, expected):
    """The token that completes a stop string (or holds one and more) is never sent: the stream
    holds back what could begin a stop and cuts at the first stop string it sees."""
    from srpo.gateway.backends import choice
    from srpo.gateway.protocol import parse_request
    from srpo.types import Sample, SamplingParams

    text = TokenText(_Pieces(pieces), stops=stops)
    sent = "".join(text.push(i) for i in range(len(pieces)))
    whole = "".join(pieces)
    stopped = any(s in whole for s in stops)
    # What the unstreamed reply says (the same cut), and what the stream adds at its end.
    sample = Sample(list(range(len(pieces))), whole, [0.0] * len(pieces), "stop" if stopped else "length")
    req = parse_request({"model": "m", "messages": [{"role": "user", "content": "q"}]}, chat=True)
    final = choice(sample, SamplingParams(stop=stops), req, None).text
    assert final == expected and sent + text.finish(final) == expected
    assert not any(s in sent for s in stops)


@pytest.fixture(scope="module")
def served():
    """The tiny model behind srpo serve's backend, greedy, on a gateway of its own."""
    from srpo.gateway.backends import ServeBackend
    from srpo.gateway.server import Gateway
    from srpo.policies.layouts import build_policies
    from srpo.types import SamplingParams
    from srpo.rollout.builtin import BuiltinEngine
    from srpo.types import RoleSpec

    policies = build_policies("shared", "tiny-llama", ["solver"], seed=0)
    specs = {"solver": RoleSpec("solver", sampling=SamplingParams(temperature=0.0, max_new_tokens=24))}
    backend = ServeBackend(BuiltinEngine(policies), policies, specs)
    drawn = []  # (thread, time) of every token the sampler reports
    real = backend.complete

    async def complete(req, on_token=None):
        if on_token is None:
            return await real(req)
        return await real(req, on_token=lambda i, t: (drawn.append(threading.current_thread().name), on_token(i, t)))

    backend.complete = complete
    gw = Gateway()
    yield openai.OpenAI(base_url=gw.url(gw.open(backend)), api_key="x", max_retries=0), drawn
    gw.stop()
    backend.close()


def test_chat_and_completions_stream_token_by_token(served):
    client, drawn = served
    messages = [{"role": "user", "content": "Count:"}]
    whole = client.chat.completions.create(model="solver", messages=messages).choices[0].message.content
    chunks = list(client.chat.completions.create(model="solver", messages=messages, stream=True))
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert "".join(pieces) == whole and len(pieces) > 1  # many deltas, adding up to the whole reply
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert drawn and all(name.startswith("srpo-serve") for name in drawn)  # reported from the sampling thread
    text = client.completions.create(model="solver", prompt="Count:").choices[0].text
    parts = [c.choices[0].text for c in client.completions.create(model="solver", prompt="Count:", stream=True)]
    assert "".join(parts) == text and sum(bool(p) for p in parts) > 1


def test_the_responses_api_streams_token_by_token(served):
    client, _ = served
    whole = client.responses.create(model="solver", input="Count:").output_text
    events = list(client.responses.create(model="solver", input="Count:", stream=True))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == whole and len(deltas) > 1
    assert events[-1].type == "response.completed" and events[-1].response.output_text == whole
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_streamed_replies_with_stop_strings_match_the_unstreamed_ones(served):
    """Through the server and srpo's sampler: with stop strings one character long (held back by
    nothing), the streamed deltas never carry a stop and add up to the unstreamed reply."""
    client, _ = served
    stops = ["\n", " ", ".", ","]
    for prompt in ("Count:", "Say", "List things", "Hello there"):
        messages = [{"role": "user", "content": prompt}]
        whole = client.chat.completions.create(model="solver", messages=messages, stop=stops).choices[0].message.content
        pieces = [c.choices[0].delta.content for c in client.chat.completions.create(
            model="solver", messages=messages, stop=stops, stream=True)
            if c.choices and c.choices[0].delta.content]
        assert "".join(pieces) == whole and not any(s in p for p in pieces for s in stops), (prompt, pieces, whole)
