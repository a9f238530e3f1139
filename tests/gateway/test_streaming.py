"""Streamed replies leave as tokens are drawn (srpo.gateway.streaming), in chat completions,
completions and the Responses API, and add up to the same reply as the unstreamed call."""

from __future__ import annotations

import json
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


def test_a_stream_ends_with_its_usage_when_asked_as_openai_sends_it(served):
    """stream_options.include_usage: one last chunk with no choices and the request's usage — the
    same figures as the unstreamed reply's; refused without stream."""
    client, _ = served
    messages = [{"role": "user", "content": "Count:"}]
    whole = client.chat.completions.create(model="solver", messages=messages)
    chunks = list(client.chat.completions.create(model="solver", messages=messages, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == whole.usage.model_dump()
    assert all(c.usage is None for c in chunks[:-1])
    plain = list(client.chat.completions.create(model="solver", messages=messages, stream=True))
    assert all(c.usage is None for c in plain) and plain[-1].choices
    with pytest.raises(openai.BadRequestError, match="stream_options"):
        client.chat.completions.create(model="solver", messages=messages, stream_options={"include_usage": True})


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


# -- tool calls, streamed as they are generated --------------------------------------------------
WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "array"}}}}}
CALL = '{"name": "weather", "arguments": {"city": "Paris", "days": [1, 2], "note": "a } in \\"quotes\\""}}'


def _script(role, prompt):
    """Calls the weather tool when tools are offered (Hermes text), answers plainly otherwise; a
    call srpo started for the model (tool_choice naming it) is continued from its arguments."""
    if prompt.endswith('"arguments": '):
        return '{"city": "Oslo"}}\n</tool_call>'
    if "<tools>" in prompt:
        return f"Let me check.\n<tool_call>\n{CALL}\n</tool_call>"
    return "It is sunny today."


@pytest.fixture(scope="module")
def scripted():
    """srpo serve's backend over scripted policies that report each token as it is "drawn"."""
    from srpo.gateway.backends import ServeBackend
    from srpo.gateway.server import Gateway
    from srpo.policies.scripted import ScriptedPolicies
    from srpo.rollout.builtin import BuiltinEngine
    from srpo.types import RoleSpec, SamplingParams

    policies = ScriptedPolicies(_script, ["agent"])
    backend = ServeBackend(BuiltinEngine(policies), policies,
                           {"agent": RoleSpec("agent", sampling=SamplingParams(max_new_tokens=400))})
    gw = Gateway()
    yield openai.OpenAI(base_url=gw.url(gw.open(backend)), api_key="x", max_retries=0)
    gw.stop()
    backend.close()


def _accumulated(chunks):
    """A streamed chat reply put together as a client does: content, and each call by its index."""
    content, calls, pieces = "", {}, 0
    for chunk in chunks:
        for c in chunk.choices:
            content += c.delta.content or ""
            for tc in c.delta.tool_calls or []:
                call = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = tc.id or call["id"]
                call["name"] += (tc.function.name or "") if tc.function else ""
                if tc.function and tc.function.arguments:
                    call["arguments"] += tc.function.arguments
                    pieces += 1
    return content, [calls[i] for i in sorted(calls)], pieces


@pytest.mark.parametrize("tool_choice", ["auto", {"type": "function", "function": {"name": "weather"}}])
def test_tool_call_arguments_stream_as_generated_and_add_up_to_the_unstreamed_reply(scripted, tool_choice):
    kw = dict(model="agent", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER],
              tool_choice=tool_choice)
    whole = scripted.chat.completions.create(**kw).choices[0]
    chunks = list(scripted.chat.completions.create(stream=True, **kw))
    content, calls, pieces = _accumulated(chunks)
    assert whole.finish_reason == "tool_calls" and chunks[-1].choices[0].finish_reason == "tool_calls"
    assert content == (whole.message.content or "")
    assert [(c["name"], c["arguments"]) for c in calls] == \
           [(t.function.name, t.function.arguments) for t in whole.message.tool_calls]
    assert pieces > 3 and all(c["id"].startswith("call_") for c in calls)  # piece by piece, with an id
    json.loads(calls[0]["arguments"])  # what the model wrote, a JSON object here
    # The openai SDK's own accumulator reads the same message.
    with scripted.chat.completions.stream(**kw) as stream:
        final = stream.get_final_completion().choices[0].message
    assert [(t.function.name, t.function.arguments) for t in final.tool_calls] == \
           [(c["name"], c["arguments"]) for c in calls]


def test_the_responses_api_streams_function_call_arguments(scripted):
    tools = [{"type": "function", "name": "weather", "parameters": WEATHER["function"]["parameters"]}]
    kw = dict(model="agent", input="Weather in Paris?", tools=tools)
    whole = scripted.responses.create(**kw)
    events = list(scripted.responses.create(stream=True, **kw))
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    added = [e.item for e in events if e.type == "response.output_item.added" and e.item.type == "function_call"]
    final = events[-1].response
    assert events[-1].type == "response.completed" and len(deltas) > 3
    (call,) = [i for i in whole.output if i.type == "function_call"]
    (streamed,) = [i for i in final.output if i.type == "function_call"]
    assert "".join(deltas) == streamed.arguments == call.arguments and streamed.name == call.name == "weather"
    assert added[0].call_id == streamed.call_id and final.output_text == whole.output_text == "Let me check."
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_recorded_ids_are_the_ids_drawn_streamed_or_not_with_tools_or_not():
    """Through a training episode on the tiny model's real sampler: every member's completion ids
    are exactly the ids the sampler drew (reported token by token when streamed), never the reply
    re-tokenised — random weights write bytes whose text does not tokenise back to them."""
    import dataclasses

    from helpers import HELPERS
    from srpo.policies.layouts import build_policies
    from srpo.rollout.builtin import BuiltinEngine
    from srpo.tasks.base import Task
    from srpo.tasks.kinds import task_kind
    from srpo.workflows.builtins import build_workflow
    from srpo.workflows.runtime import Runtime

    drawn, reported = [], []

    class Recording(BuiltinEngine):
        def generate(self, requests, generator=None):
            streamed = []
            for r in requests:
                if r.params.on_token is not None:
                    got, report = [], r.params.on_token
                    reported.append(got)
                    r.params = dataclasses.replace(r.params, on_token=lambda t, got=got, report=report: (
                        got.append(t), report(t)))
                streamed.append(r.params.on_token is not None)
            samples = super().generate(requests, generator)
            drawn.extend((tuple(s.completion_ids), flag) for s, flag in zip(samples, streamed))
            return samples

    policies = build_policies("shared", "tiny-llama", ["solver"], seed=0)
    agent = build_workflow("openai_agent", entry=f"{HELPERS / 'gateway_teams.py'}:streams_and_tools",
                           roles=["solver"], max_new_tokens=12, isolation="thread")
    runtime = Runtime(Recording(policies), agent.default_role_specs(), task_kind("math").grade)
    (result,) = runtime.run(agent, [("e0", Task("t0", "What is 1 + 2?", ("3",), "math"))])
    assert not runtime.failures, runtime.first_traceback
    recorded = sorted(tuple(m.completion_ids) for e in result.events for m in e.members)
    assert len(recorded) == 4 and recorded == sorted(ids for ids, _ in drawn)
    assert [ids for ids, flag in drawn if flag] == [tuple(r) for r in reported] and len(reported) == 2
    text = policies.tokenizer.decode(list(recorded[0]), skip_special_tokens=True)
    assert any(tuple(policies.tokenizer(policies.tokenizer.decode(list(ids)), add_special_tokens=False)["input_ids"])
               != ids for ids in recorded), text  # re-tokenising would have changed them
