"""Structured output through the gateway, on the tiny model's real sampler (random weights: what
comes back has the form because decoding was constrained, not because the model knew it):
``response_format`` on chat completions, ``text.format`` on the Responses API, the Agents SDK's
``output_type``, streamed and not, and beside tools."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("starlette")
pytest.importorskip("llguidance")
openai = pytest.importorskip("openai")

VERDICT = {"type": "object", "properties": {"verdict": {"enum": ["yes", "no"]}}, "required": ["verdict"],
           "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}


@pytest.fixture(scope="module")
def client():
    from srpo.gateway.backends import ServeBackend
    from srpo.gateway.server import Gateway
    from srpo.policies.layouts import build_policies
    from srpo.rollout.builtin import BuiltinEngine
    from srpo.types import RoleSpec, SamplingParams

    policies = build_policies("shared", "tiny-llama", ["solver"], seed=0)
    backend = ServeBackend(BuiltinEngine(policies), policies,
                           {"solver": RoleSpec("solver", sampling=SamplingParams(max_new_tokens=48))})
    gw = Gateway()
    yield openai.OpenAI(base_url=gw.url(gw.open(backend)), api_key="x", max_retries=0)
    gw.stop()
    backend.close()


def test_chat_response_formats_are_enforced_streamed_or_not(client):
    messages = [{"role": "user", "content": "Is 4 even?"}]
    fmt = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": VERDICT, "strict": True}}
    for seed_prompt in ("Is 4 even?", "Is 7 even?", "Yes or no?"):
        messages = [{"role": "user", "content": seed_prompt}]
        reply = client.chat.completions.create(model="solver", messages=messages, response_format=fmt).choices[0]
        assert json.loads(reply.message.content)["verdict"] in ("yes", "no") and reply.finish_reason == "stop"
        streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model="solver", messages=messages, response_format=fmt, stream=True) if c.choices)
        assert json.loads(streamed)["verdict"] in ("yes", "no")
    obj = client.chat.completions.create(model="solver", messages=messages, max_tokens=48,
                                         response_format={"type": "json_object"}).choices[0].message.content
    assert obj.startswith("{")  # any object (a random model rarely closes one within the budget)


def test_the_responses_api_text_format_is_enforced_and_echoed(client):
    fmt = {"type": "json_schema", "name": "verdict", "schema": VERDICT, "strict": True}
    reply = client.responses.create(model="solver", input="Is 4 even?", text={"format": fmt})
    assert json.loads(reply.output_text)["verdict"] in ("yes", "no")
    assert reply.text.format.type == "json_schema" and reply.text.format.name == "verdict"


def test_with_tools_offered_the_model_may_answer_in_form_or_begin_a_call(client):
    """tool_choice auto: the grammar allows the answer's form or a tool call's start; a forced call
    is written by srpo and no form applies."""
    fmt = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": VERDICT}}
    for prompt in ("Is 4 even?", "Weather?", "Hi", "Call it"):
        reply = client.chat.completions.create(model="solver", messages=[{"role": "user", "content": prompt}],
                                               tools=[WEATHER], response_format=fmt).choices[0]
        text = reply.message.content or ""
        assert reply.message.tool_calls or text.startswith('{"verdict":"') or text.startswith("<tool_call>"), text
    forced = client.chat.completions.create(model="solver", messages=[{"role": "user", "content": "Weather?"}],
                                            tools=[WEATHER], tool_choice="required", response_format=fmt)
    assert forced.choices[0].message.content is None or not forced.choices[0].message.content.startswith('{"verdict"')


@pytest.mark.parametrize("program", ["agents_sdk_structured", "agents_sdk_structured_chat"])
def test_the_agents_sdk_output_type_is_served_in_an_episode(program):
    """The SDK's ``output_type`` (its JSON schema on the Responses API, or chat's response_format)
    through a training episode on the tiny model: the SDK parses the reply into its type."""
    pytest.importorskip("agents")
    from helpers import HELPERS
    from srpo.policies.layouts import build_policies
    from srpo.rollout.builtin import BuiltinEngine
    from srpo.tasks.base import Task
    from srpo.workflows.builtins import build_workflow
    from srpo.workflows.runtime import Runtime

    policies = build_policies("shared", "tiny-llama", ["solver"], seed=0)
    agent = build_workflow("openai_agent", entry=f"{HELPERS / 'gateway_teams.py'}:{program}", roles=["solver"],
                           max_new_tokens=32, isolation="thread")
    runtime = Runtime(BuiltinEngine(policies), agent.default_role_specs(), lambda task, answer: float(answer == "yes"))
    results = runtime.run(agent, [(f"e{i}", Task(f"t{i}", f"Is {i} even?", ("yes",), "math")) for i in range(3)])
    assert not runtime.failures, runtime.first_traceback
    assert all(r.answer in ("yes", "no") for r in results), [r.answer for r in results]
