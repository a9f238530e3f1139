"""Anthropic's Messages API on the gateway (srpo.gateway.anthropic), through the ``anthropic``
client's own parsing: text, tools (tool_use / tool_result blocks), system prompts, stop
sequences, streaming events — and the same chat request (so the same recording) underneath."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("starlette")
anthropic = pytest.importorskip("anthropic")

from helpers.tool_backend import ToolBackend  # noqa: E402

WEATHER = {"name": "weather", "description": "Weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}


@pytest.fixture(scope="module")
def claude():
    from srpo.gateway.server import Gateway

    gw, backend = Gateway(), ToolBackend(preamble="Let me look.")
    url = gw.url(gw.open(backend))  # .../e/<token>/v1; the client adds /v1/messages itself
    yield anthropic.Anthropic(base_url=url[: -len("/v1")], api_key="x", max_retries=0), backend
    gw.stop()


def test_text_tools_and_tool_results_round_trip(claude):
    client, backend = claude
    reply = client.messages.create(model="agent", max_tokens=20, system="Be brief.",
                                   messages=[{"role": "user", "content": "Weather?"}])
    assert [b.type for b in reply.content] == ["text"] and reply.content[0].text == "It is sunny."
    assert reply.stop_reason == "end_turn" and reply.usage.input_tokens == 5 and reply.usage.output_tokens == 4
    req = backend.requests[-1]
    assert req.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"}]
    assert req.max_tokens == 20 and req.tool_choice == "none"
    call = client.messages.create(model="agent", max_tokens=50, tools=[WEATHER],
                                  messages=[{"role": "user", "content": "Weather in Paris?"}])
    text, use = call.content
    assert text.text == "Let me look." and use.type == "tool_use" and use.name == "weather"
    assert use.input == {"city": "Paris"} and call.stop_reason == "tool_use"
    assert backend.requests[-1].tools[0]["function"]["parameters"] == WEATHER["input_schema"]
    # The result fed back: tool_use and tool_result blocks become the chat messages they mean.
    final = client.messages.create(model="agent", max_tokens=50, tools=[WEATHER], tool_choice={"type": "none"},
                                   messages=[{"role": "user", "content": "Weather in Paris?"},
                                             {"role": "assistant", "content": [b.model_dump() for b in call.content]},
                                             {"role": "user", "content": [
                                                 {"type": "tool_result", "tool_use_id": use.id,
                                                  "content": [{"type": "text", "text": "sunny, 21 C"}]},
                                                 {"type": "text", "text": "And so?"}]}])
    assert final.content[0].text == "It is sunny."
    msgs = backend.requests[-1].messages
    assert [m["role"] for m in msgs] == ["user", "assistant", "tool", "user"]
    assert msgs[1]["content"] == "Let me look." and msgs[1]["tool_calls"][0]["id"] == use.id
    assert json.loads(msgs[1]["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}
    assert msgs[2] == {"role": "tool", "tool_call_id": use.id, "content": "sunny, 21 C"}
    # what set recovery searches: the same texts as the chat request would give (the call's arguments too)
    assert backend.requests[-1].texts() == ["Weather in Paris?", "Let me look.", '{"city": "Paris"}', "sunny, 21 C",
                                            "And so?"]
    forced = client.messages.create(model="agent", max_tokens=50, tools=[WEATHER],
                                    tool_choice={"type": "tool", "name": "weather"},
                                    messages=[{"role": "user", "content": "?"}])
    assert forced.stop_reason == "tool_use" and backend.requests[-1].tool_choice == "weather"


def test_the_event_sequence_is_the_clients_message(claude):
    client, _ = claude
    with client.messages.stream(model="agent", max_tokens=50, tools=[WEATHER],
                                messages=[{"role": "user", "content": "Weather in Paris?"}]) as stream:
        kinds = [e.type for e in stream]
        message = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert [b.type for b in message.content] == ["text", "tool_use"] and message.content[1].input == {"city": "Paris"}
    assert message.stop_reason == "tool_use"
    with client.messages.stream(model="agent", max_tokens=50, messages=[{"role": "user", "content": "Hi"}]) as stream:
        assert stream.get_final_text() == "It is sunny."


@pytest.mark.parametrize("extra, param", [
    ({"max_tokens": None}, "max_tokens"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages[0].content[0].type"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0]"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
    ({"top_k": 5}, "top_k"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The answer is"}]},
     "messages"),
    ({"tool_choice": {"type": "tool", "name": "nope"}, "tools": [WEATHER]}, "tool_choice"),
])
def test_what_cannot_be_served_is_an_anthropic_shaped_400(claude, extra, param):
    client, _ = claude
    body = {"model": "agent", "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}], **extra}
    body = {k: v for k, v in body.items() if v is not None}
    with pytest.raises(anthropic.BadRequestError) as err:
        client.post("/v1/messages", body=body, cast_to=object)
    assert err.value.body["type"] == "error" and err.value.body["error"]["type"] == "invalid_request_error"
    assert param.split("[")[0] in err.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError):  # a model that is no role of the team
        client.messages.create(model="nobody", max_tokens=5, messages=[{"role": "user", "content": "hi"}])


def test_a_real_model_streams_token_by_token_and_stops_on_a_sequence():
    """srpo's own sampler behind srpo serve's backend: live text deltas add up to the unstreamed
    reply; a stop sequence ends it (stop_reason stop_sequence, the sequence never sent), the token
    budget too (max_tokens)."""
    from srpo.gateway.backends import ServeBackend
    from srpo.gateway.server import Gateway
    from srpo.policies.layouts import build_policies
    from srpo.types import SamplingParams
    from srpo.rollout.builtin import BuiltinEngine
    from srpo.types import RoleSpec

    policies = build_policies("shared", "tiny-llama", ["solver"], seed=0)
    specs = {"solver": RoleSpec("solver", sampling=SamplingParams(temperature=0.0, max_new_tokens=24))}
    backend = ServeBackend(BuiltinEngine(policies), policies, specs)
    gw = Gateway()
    try:
        client = anthropic.Anthropic(base_url=gw.url(gw.open(backend))[: -len("/v1")], api_key="x", max_retries=0)
        ask = {"model": "solver", "max_tokens": 24, "messages": [{"role": "user", "content": "Count:"}]}
        whole = client.messages.create(**ask)
        with client.messages.stream(**ask) as stream:
            deltas = [e.delta.text for e in stream if e.type == "content_block_delta"]
        assert "".join(deltas) == whole.content[0].text and len(deltas) > 1
        assert whole.stop_reason == "max_tokens" and whole.usage.output_tokens == 24
        # The tiny model's greedy reply is newlines: a stop sequence of one ends it at once, and is never sent.
        stop = whole.content[0].text[0]
        cut = client.messages.create(**ask, stop_sequences=[stop])
        assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop and cut.content[0].text == ""
        with client.messages.stream(**ask, stop_sequences=["zz", stop]) as stream:
            sent = "".join(e.delta.text for e in stream if e.type == "content_block_delta")
            final = stream.get_final_message()
        assert sent == "" and final.stop_reason == "stop_sequence" and final.stop_sequence == stop
    finally:
        gw.stop()
        backend.close()
