"""The OpenAI-compatible gateway: wire format, set recovery from data flow, equivalence with the
built-in workflows, real clients (openai, LangGraph) trained end to end, and serving."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
import time

import httpx
import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

from srpo.rollout.builtin import BuiltinEngine  # noqa: E402
from srpo.events import Member  # noqa: E402
from srpo.gateway.dataflow import EpisodeRecorder  # noqa: E402
from srpo.gateway.protocol import ProtocolError, parse_request  # noqa: E402
from srpo.tasks.base import Task  # noqa: E402
from helpers import HELPERS

TEAMS = HELPERS / "gateway_teams.py"


# -- the wire format ----------------------------------------------------------------------------
@pytest.mark.parametrize("body, param", [
    ({"messages": [{"role": "user", "content": "hi"}]}, "model"),
    ({"model": "a", "messages": []}, "messages"),
    ({"model": "a", "messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ({"model": "a", "messages": [{"role": "user"}]}, "messages[0].content"),
    ({"model": "a", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0]"),
    ({"model": "a", "messages": [{"role": "user", "content": "hi"}], "temperature": 3}, "temperature"),
    ({"model": "a", "messages": [{"role": "user", "content": "hi"}], "top_p": 0}, "top_p"),
    ({"model": "a", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens"),
    ({"model": "a", "messages": [{"role": "user", "content": "hi"}], "n": 99}, "n"),
    ({"model": "a", "messages": [{"role": "user", "content": "hi"}], "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"model": "a", "messages": [{"role": "user", "content": "hi"}], "stream": "yes"}, "stream"),
    ({"model": "a", "messages": [{"role": "user", "content": "hi"}], "srpo_event": ""}, "srpo_event"),
])
def test_a_bad_request_names_its_field(body, param):
    with pytest.raises(ProtocolError) as err:
        parse_request(body, chat=True)
    assert err.value.param == param and err.value.status == 400
    assert err.value.body()["error"]["param"] == param


def test_a_good_request_keeps_what_it_says():
    req = parse_request({"model": "judge", "messages": [{"role": "developer", "content": "Be brief."},
                                                        {"role": "user", "content": [{"type": "text", "text": "a"},
                                                                                     {"type": "text", "text": "b"}]}],
                         "temperature": 0.5, "max_completion_tokens": 7, "stop": "\n", "n": 2, "user": "x"},
                        chat=True, headers={"x-srpo-event": "vote-1"})
    assert req.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "ab"}]
    assert (req.temperature, req.max_tokens, req.stop, req.n, req.event_tag) == (0.5, 7, ("\n",), 2, "vote-1")
    text = parse_request({"model": "m", "prompt": ["once"]}, chat=False)
    assert text.prompt == "once" and not text.chat
    with pytest.raises(ProtocolError, match="prompt"):
        parse_request({"model": "m", "prompt": ["a", "b"]}, chat=False)


# -- sets from data flow ------------------------------------------------------------------------
def _member(role, text):
    return Member(role=role, policy_id=role, policy_version=0, prompt_ids=[1], completion_ids=[2],
                  action_mask=[1], behaviour_logprobs=[-1.0], text=text)


def _sets(events):
    return [(e.event_type, e.turn, [m.role for m in e.members]) for e in events]


def test_outputs_first_consumed_together_are_one_set():
    rec = EpisodeRecorder("e", "t")
    q = "What is 3 + 0?"
    for role in ("w1", "w2"):
        rec.before_call(role, [q])
    rec.record(_member("w1", " 3 "))
    rec.record(_member("w2", "three"))
    # A later call that only repeats the question (which holds "3") consumes nothing: that message
    # was written before the outputs existed.
    rec.before_call("w3", [q])
    rec.record(_member("w3", ""))  # empty: in every text, never inferred consumed
    rec.before_call("judge", [q, "Answers: 3 and three"])
    rec.record(_member("judge", "3"))
    events = rec.finish()
    assert _sets(events) == [("to:judge", 0, ["w1", "w2"]), ("final", 0, ["judge", "w3"])]
    assert events[0].expected_size == 2
    rec.record(_member("late", "x"))  # after the end: not part of the episode
    assert sum(e.size for e in rec.events) == 4


def test_tags_override_inference_and_identical_outputs_go_together():
    rec = EpisodeRecorder("e", "t")
    rec.before_call("router", ["Q"])
    rec.record(_member("router", "WORKERS: 1"), tag="route")
    rec.before_call("a", ["Q"])
    rec.record(_member("a", "42"))
    rec.record(_member("b", "42"))
    rec.before_call("judge", ["Q", "WORKERS: 1 said 42"])  # the tagged router output is not inferred
    assert _sets(rec.finish()) == [("route", 0, ["router"]), ("to:judge", 0, ["a", "b"])]


def _parallel_episode(order):
    """Two aggregators quote overlapping worker outputs in parallel; ``order`` is the order in which
    the two aggregator calls arrive (and in which the workers' outputs were recorded)."""
    rec = EpisodeRecorder("e", "t")
    for role in ("w1", "w2", "w3"):
        rec.before_call(role, ["Q"])
    for role in (order if len(order) == 3 else ("w1", "w2", "w3")):
        rec.record(_member(role, f"answer of {role}"))
    calls = {"agg_a": ["Q", "answer of w1 / answer of w2"], "agg_b": ["Q", "answer of w2 / answer of w3"]}
    handles = {}
    for role in (order if len(order) == 2 else ("agg_a", "agg_b")):
        handles[role] = rec.before_call(role, calls[role])
    for role in ("agg_b", "agg_a"):
        rec.record(_member(role, f"verdict of {role}"), call=handles[role])
    return _sets(rec.finish())


def test_sets_do_not_depend_on_the_order_parallel_calls_arrive_in():
    expected = _parallel_episode(("agg_a", "agg_b"))
    for order in [("agg_b", "agg_a"), ("w3", "w1", "w2"), ("w2", "w3", "w1")]:
        assert _parallel_episode(order) == expected
    # w2 is quoted by both: the smaller call (agg_a) takes it, whichever arrived first
    assert expected == [("to:agg_a", 0, ["w1", "w2"]), ("to:agg_b", 0, ["w3"]), ("final", 0, ["agg_a", "agg_b"])]


def test_a_causally_earlier_call_consumes_before_a_later_one_quoting_the_same_output():
    rec = EpisodeRecorder("e", "t")
    rec.before_call("solver", ["Q"])
    rec.record(_member("solver", "x = 4"))
    first = rec.before_call("checker", ["Q", "solution: x = 4"])
    rec.record(_member("checker", "looks right"), call=first)
    # the final call quotes both the solver (again) and the checker: it comes after the checker
    rec.before_call("judge", ["Q", "solution: x = 4", "review: looks right"])
    rec.record(_member("judge", "4"))
    assert _sets(rec.finish()) == [("to:checker", 0, ["solver"]), ("to:judge", 0, ["checker"]), ("final", 0, ["judge"])]


def test_an_agent_called_as_a_tool_gets_its_own_set():
    """The Agents SDK's agent.as_tool(): the caller's tool call carries the input, the tool agent
    answers it, its answer comes back as the tool result."""
    rec = EpisodeRecorder("e", "t")
    q = "What is 1 + 2?"
    lead = rec.before_call("lead", ["Use the solver.", q])
    rec.record(_member("lead", ""), call=lead, arguments=[json.dumps({"input": q})])
    solver = rec.before_call("solver", ["Solve it.", q])  # the argument is its whole input
    rec.record(_member("solver", "It is 3."), call=solver)
    again = rec.before_call("lead", ["Use the solver.", q, json.dumps({"input": q}), "It is 3."])
    rec.record(_member("lead", "3"), call=again)
    assert _sets(rec.finish()) == [("to:solver", 0, ["lead"]), ("to:lead", 0, ["solver"]), ("final", 0, ["lead"])]


# -- the server, with a backend that needs no model ---------------------------------------------
class EchoBackend:
    roles = ["echo"]

    def __init__(self):
        self.requests = []

    async def complete(self, req):
        from srpo.gateway.protocol import Choice

        self.requests.append(req)
        return [Choice(text=f"echo {i}", finish_reason="stop", completion_tokens=2) for i in range(req.n)], 3


@pytest.fixture(scope="module")
def gateway():
    from srpo.gateway.server import Gateway

    gw = Gateway()
    yield gw
    gw.stop()


def test_the_endpoint_speaks_openai_to_the_openai_client(gateway):
    backend = EchoBackend()
    token = gateway.open(backend)
    url = gateway.url(token)
    assert url.startswith("http://127.0.0.1:") and len(token) >= 20
    client = openai.OpenAI(base_url=url, api_key="x", max_retries=0)
    assert [m.id for m in client.models.list()] == ["echo"]
    reply = client.chat.completions.create(model="echo", messages=[{"role": "user", "content": "hi"}], n=2,
                                           extra_body={"srpo_event": "pair"})
    assert [c.message.content for c in reply.choices] == ["echo 0", "echo 1"] and reply.usage.total_tokens == 10
    assert backend.requests[-1].event_tag == "pair"
    chunks = list(client.chat.completions.create(model="echo", messages=[{"role": "user", "content": "hi"}], stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "echo 0"
    assert client.completions.create(model="echo", prompt="once").choices[0].text == "echo 0"
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="nobody", messages=[{"role": "user", "content": "hi"}])
    assert err.value.body["param"] == "model" and err.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="echo", messages=[{"role": "user", "content": "hi"}], temperature=5)
    assert err.value.body["param"] == "temperature"
    raw = httpx.post(f"{url}/chat/completions", content=b"{not json", headers={"Content-Type": "application/json"})
    assert raw.status_code == 400 and raw.json()["error"]["type"] == "invalid_request_error"
    assert httpx.post(f"{url}/chat/completions", content=b"{}").status_code == 415  # JSON only as application/json
    # Another episode's URL, or one that has ended, reaches nothing.
    gateway.close_episode(token)
    other = httpx.post(f"{url}/chat/completions", json={"model": "echo", "messages": [{"role": "user", "content": "x"}]})
    assert other.status_code == 404 and other.json()["error"]["code"] == "episode_not_found"
    assert httpx.get(url.replace(token, "guess") + "/models").status_code == 404
    assert httpx.post(f"http://127.0.0.1:{gateway.port}/v1/chat/completions", json={}).status_code == 404


def test_a_port_in_use_is_one_clear_error(gateway):
    from srpo.gateway.server import Gateway
    from srpo.runs.serving import ServeError

    with pytest.raises(ServeError, match="in use"):
        Gateway(port=gateway.port)


# -- equivalence with the built-in workflows ----------------------------------------------------
def _script(role, prompt):
    digits = [int(d) for d in re.findall(r"What is (\d+) \+ (\d+)", prompt)[0]] if "What is" in prompt else [0, 0]
    if role == "router":
        return "WORKERS: 1, 3" if digits[0] % 2 else "WORKERS: 2"
    if role == "solver":
        return f"attempt 2 gives {sum(digits)}" if "previous attempt" in prompt else f"attempt 1 gives {sum(digits) + 1}"
    if role == "verifier":
        return "ACCEPT" if "attempt 2" in prompt else "REJECT: recheck the sum"
    if role.startswith("worker"):
        return f"{role} computes {sum(digits)}"
    return f"final answer {sum(digits)}"


TASKS = [Task(f"t{a}{b}", f"What is {a} + {b}?", (str(a + b),), "math") for a, b in [(1, 2), (2, 5), (3, 3), (4, 1)]]


def _run(workflow, roles, specs=None):
    from srpo.policies.scripted import ScriptedPolicies
    from srpo.tasks.kinds import task_kind
    from srpo.workflows.runtime import Runtime

    policies = ScriptedPolicies(_script, roles)
    runtime = Runtime(BuiltinEngine(policies), specs or workflow.default_role_specs(),
                      task_kind("math").grade)
    results = runtime.run(workflow, [(f"e{i}", TASKS[i % len(TASKS)]) for i in range(8)])
    assert not runtime.failures, runtime.first_traceback
    return results, policies.calls


@pytest.mark.parametrize("name, options, program, isolation", [
    ("single", {}, "single", "process"),
    ("solver_verifier", {"rounds": 2}, "solver_verifier", "process"),
    ("parallel_aggregate", {"num_workers": 3}, "parallel_aggregate", "process"),
    ("routed", {"num_workers": 3}, "routed", "process"),
    ("parallel_aggregate", {"num_workers": 3}, "parallel_aggregate_async", "process"),
    ("parallel_aggregate", {"num_workers": 3}, "parallel_aggregate", "thread"),
    ("parallel_aggregate", {"num_workers": 3}, "parallel_aggregate_async", "thread"),
])
def test_a_team_written_with_the_openai_client_gives_the_builtin_events(name, options, program, isolation):
    from srpo.workflows.builtins import build_workflow

    builtin = build_workflow(name, **options)
    # A generous max_batch_wait_s: a worker process's first episode imports and builds its client,
    # which on a loaded machine can take longer than the default 2 s; what is checked here is the
    # batching by count (test_a_batch_does_not_wait_long_for_a_busy_program checks the timer).
    # The window gathers a program's parallel calls (a routed team's workers, one thread each): at
    # 0.05 s a loaded machine once let a worker's call miss it (6 batches against 3 + 2 allowed).
    agent = build_workflow("openai_agent", entry=f"{TEAMS}:{program}", roles=builtin.roles(), max_new_tokens=64,
                           isolation=isolation, max_batch_wait_s=60.0, batch_window_s=0.25)
    expected, builtin_calls = _run(builtin, builtin.roles())
    got, gateway_calls = _run(agent, builtin.roles())
    for a, b in zip(expected, got):
        assert [(e.size, sorted(m.role for m in e.members)) for e in a.events] == \
               [(e.size, sorted(m.role for m in e.members)) for e in b.events], (a.transcript, b.transcript)
        assert all(e.is_valid for e in b.events)
    if name == "single":  # the same transcripts: the same final answer
        assert [r.answer for r in expected] == [r.answer for r in got]
    # Batched across episodes as the built-in runtime batches: as many model calls (a little slack
    # for a thread that misses the batch window on a loaded machine).
    assert len(gateway_calls) <= len(builtin_calls) + 2, (builtin_calls, gateway_calls)


@pytest.mark.parametrize("max_wait_s", [0.5, 60.0])
def test_a_batch_does_not_wait_long_for_a_busy_program(max_wait_s):
    from srpo.policies.scripted import ScriptedPolicies
    from srpo.workflows.builtins import build_workflow
    from srpo.workflows.runtime import Runtime

    from helpers import signals

    agent = build_workflow("openai_agent", entry=f"{TEAMS}:slow_to_ask", roles=["solver"], isolation="thread",
                           max_batch_wait_s=max_wait_s)
    signals.QUICK_SERVED.clear()

    def script(role, prompt):
        if "2 + 2" in prompt:  # a quick episode's call is generated
            signals.QUICK_SERVED.set()
        return _script(role, prompt)

    policies = ScriptedPolicies(script, ["solver"])
    runtime = Runtime(BuiltinEngine(policies), agent.default_role_specs(), lambda t, a: 1.0)
    tasks = [Task("slow", "What is 2 + 1?", ("3",), "math")] + [Task(f"t{i}", "What is 2 + 2?", ("4",), "math")
                                                                 for i in range(3)]
    results = runtime.run(agent, [(f"e{i}", t) for i, t in enumerate(tasks)])
    assert not runtime.failures and len(results) == 4
    if max_wait_s < 3.0:  # the quick episodes are served while the slow one is still busy (it waits for
        # them: in one batch, or several on a loaded machine — never joined by the slow call)
        assert policies.calls[-1] == 1 and len(policies.calls) >= 2 and sum(policies.calls) == 4, policies.calls
    else:  # they wait for it: one batch
        assert policies.calls == [4], policies.calls


def test_a_program_that_fails_or_hangs_costs_its_episode_only(caplog):
    from srpo.policies.scripted import ScriptedPolicies
    from srpo.workflows.builtins import build_workflow
    from srpo.workflows.runtime import Runtime

    for program, counter, options in [("raises_sometimes", "workflow_errors", {}),
                                      # 5 s: room for a quick episode on a loaded machine; the hung one sleeps 30
                                      ("sleeps", "program_timeouts", {"timeout_s": 5.0}),
                                      ("killed_on_one", "workflow_errors", {})]:  # SIGKILL mid-episode
        agent = build_workflow("openai_agent", entry=f"{TEAMS}:{program}", roles=["solver"], **options)
        runtime = Runtime(BuiltinEngine(ScriptedPolicies(_script, ["solver"])), agent.default_role_specs(), lambda t, a: 1.0)
        tasks = [Task("a", "What is 2 + 1?", ("3",), "math"), Task("b", "What is 2 + 2?", ("4",), "math")]
        results = runtime.run(agent, [(f"e{i}", tasks[i % 2]) for i in range(4)])
        failed = [r for r in results if r.info.get("failed")]
        assert len(failed) == 2 and all(r.reward == 0.0 for r in failed)
        assert all(r.reward == 1.0 for r in results if not r.info.get("failed"))
        assert sum(r.info.get(counter, 0) for r in results) == 2
        assert runtime.failures["workflow"] == 2
        # What a failed program produced is dropped from the update (run.failed_episodes: drop).
        assert [sum(e.size for e in r.events) for r in results] == [0 if r.info.get("failed") else 1 for r in results]
        assert sum(r.info.get("dropped_members", 0) for r in results) == 2


@pytest.mark.parametrize("program", ["configured_from_env", "default_client_per_episode"])
def test_a_client_configured_once_per_process_lands_each_call_in_its_own_episode(program):
    from srpo.policies.scripted import ScriptedPolicies
    from srpo.workflows.builtins import build_workflow
    from srpo.workflows.runtime import Runtime

    agent = build_workflow("openai_agent", entry=f"{TEAMS}:{program}", roles=["solver"], max_workers=4)
    runtime = Runtime(BuiltinEngine(ScriptedPolicies(_script, ["solver"])), agent.default_role_specs(), lambda t, a: 1.0)
    results = runtime.run(agent, [(f"e{i}", TASKS[i]) for i in range(4)])
    assert not runtime.failures, runtime.first_traceback
    for r in results:  # one call each, holding its own task's question
        members = [m for e in r.events for m in e.members]
        assert len(members) == 1, r.transcript
        assert r.task.question in runtime.policies.tokenizer.decode(members[0].prompt_ids)
        assert r.answer == _script("solver", r.task.question)


@pytest.mark.parametrize("program", ["default_client_set_by_every_episode", "agents_sdk_default_client"])
def test_in_one_process_a_call_reaching_another_episode_stops_the_run(program):
    from srpo.gateway.attribution import MixedEpisodes
    from srpo.policies.scripted import ScriptedPolicies
    from srpo.workflows.builtins import build_workflow
    from srpo.workflows.runtime import Runtime

    from helpers import signals

    if program.startswith("agents"):
        pytest.importorskip("agents")
    signals.CLIENTS_SET["count"] = 0
    agent = build_workflow("openai_agent", entry=f"{TEAMS}:{program}", roles=["solver"], isolation="thread")
    runtime = Runtime(BuiltinEngine(ScriptedPolicies(_script, ["solver"])), agent.default_role_specs(), lambda t, a: 1.0)
    with pytest.raises(MixedEpisodes, match="base_url passed to each call of the program, or set "
                                            "workflow.options.isolation: process"):
        runtime.run(agent, [(f"e{i}", TASKS[i]) for i in range(4)])


def test_a_hung_program_neither_holds_the_run_nor_starves_later_episodes():
    from srpo.policies.scripted import ScriptedPolicies
    from srpo.workflows.builtins import build_workflow
    from srpo.workflows.runtime import Runtime

    agent = build_workflow("openai_agent", entry=f"{TEAMS}:hangs_on_one", roles=["solver"], timeout_s=2.0,
                           max_workers=2)
    runtime = Runtime(BuiltinEngine(ScriptedPolicies(_script, ["solver"])), agent.default_role_specs(), lambda t, a: 1.0)
    hang = Task("hang", "What is 1 + 1?", ("2",), "math")
    start = time.monotonic()
    first = runtime.run(agent, [("h0", hang), ("h1", hang), ("e0", TASKS[0])])
    assert [r.info.get("program_timeouts", 0) for r in first] == [1, 1, 0]
    # Both workers were held by hung programs and killed: the next step's episodes get fresh ones.
    second = runtime.run(agent, [(f"e{i}", TASKS[i]) for i in range(4)])
    assert not any(r.info.get("failed") for r in second)
    assert time.monotonic() - start < 30


def test_none_and_no_calls_are_counted():
    from srpo.policies.scripted import ScriptedPolicies
    from srpo.workflows.builtins import build_workflow
    from srpo.workflows.runtime import Runtime

    for program, counter in [("returns_none", "program_returned_none"), ("makes_no_call", "no_calls")]:
        agent = build_workflow("openai_agent", entry=f"{TEAMS}:{program}", roles=["solver"])
        runtime = Runtime(BuiltinEngine(ScriptedPolicies(_script, ["solver"])), agent.default_role_specs(), lambda t, a: 1.0)
        results = runtime.run(agent, [(f"e{i}", TASKS[i]) for i in range(2)])
        assert [r.info.get(counter) for r in results] == [1, 1]


@pytest.mark.parametrize("isolation", ["process", "thread"])
def test_a_program_that_returns_an_object_gets_the_same_message_in_a_worker_or_a_thread(isolation):
    """An object of the program's own cannot cross to the trainer (its module is not there): it is
    named by its type, the episode fails with srpo's message, and the worker lives on."""
    from srpo.policies.scripted import ScriptedPolicies
    from srpo.workflows.builtins import build_workflow
    from srpo.workflows.runtime import Runtime

    agent = build_workflow("openai_agent", entry=f"{TEAMS}:returns_an_object", roles=["solver"], isolation=isolation,
                           max_workers=1)
    runtime = Runtime(BuiltinEngine(ScriptedPolicies(_script, ["solver"])), agent.default_role_specs(), lambda t, a: 1.0)
    results = runtime.run(agent, [(f"e{i}", TASKS[i]) for i in range(2)])
    assert all(r.info.get("failed") for r in results) and runtime.failures["workflow"] == 2
    message = runtime.first_traceback["workflow"]
    assert "returns_an_object returned a TeamAnswer; return the answer (str) or a reward (float)" in message
    assert "ModuleNotFoundError" not in message
    if isolation == "process":
        pool = agent._pool
        assert len(pool._idle) == 1 and pool._idle[0].alive(), "the worker that sent the name is kept"


@pytest.mark.parametrize("isolation", ["process", "thread"])
def test_clients_built_per_episode_share_one_ssl_context(isolation):
    """Building an OpenAI client is mostly parsing the CA bundle (~20 ms): a program's clients, one
    per episode, share the default context (srpo.workflows.ssl_reuse)."""
    from srpo.policies.scripted import ScriptedPolicies
    from srpo.workflows.builtins import build_workflow
    from srpo.workflows.runtime import Runtime

    answers = []
    agent = build_workflow("openai_agent", entry=f"{TEAMS}:reports_its_ssl_context", roles=["solver"],
                           isolation=isolation, max_workers=1)
    runtime = Runtime(BuiltinEngine(ScriptedPolicies(_script, ["solver"])), agent.default_role_specs(),
                      lambda t, a: answers.append(a) or 1.0)
    for i in range(3):  # one after another: the second and third episodes build theirs after the first's
        runtime.run(agent, [(f"e{i}", TASKS[i])])
    assert len(answers) == 3 and len(set(answers[1:])) == 1, answers
    if isolation == "process":
        assert all(a.endswith("torch=False") for a in answers), "a worker imports only what its program does"


def test_shared_ssl_contexts_keep_what_a_client_asks_for(monkeypatch):
    import ssl

    import certifi

    from srpo.workflows.ssl_reuse import share_default_ssl_context

    share_default_ssl_context()

    def context(client):
        return client._transport._pool._ssl_context
    default = context(httpx.Client())
    assert context(httpx.Client()) is default and context(httpx.AsyncClient()) is default  # same ALPN: one context
    assert context(httpx.Client(verify=False)).verify_mode == ssl.CERT_NONE
    own = ssl.create_default_context()
    assert context(httpx.Client(verify=own)) is own
    assert context(httpx.Client(trust_env=False)) is not default
    monkeypatch.setenv("SSL_CERT_FILE", certifi.where())
    assert context(httpx.Client()) is not default


def test_a_program_may_return_its_own_reward():
    from srpo.policies.scripted import ScriptedPolicies
    from srpo.workflows.builtins import build_workflow
    from srpo.workflows.runtime import Runtime

    agent = build_workflow("openai_agent", entry=f"{TEAMS}:reward_of_length", roles=["solver"])
    runtime = Runtime(BuiltinEngine(ScriptedPolicies(_script, ["solver"])), agent.default_role_specs(), lambda t, a: 99.0)
    results = runtime.run(agent, [("e0", TASKS[0])])
    assert results[0].reward == pytest.approx(len(_script("solver", TASKS[0].question)) / 100)


def test_config_errors_name_the_option(tmp_path):
    from srpo.build import config_from_dict
    from srpo.config import ConfigError

    def cfg(options):
        return {"model": {"name": "tiny-llama"}, "workflow": {"name": "openai_agent", "options": options},
                "task": {"kind": "math", "train": {"source": "synthetic_arithmetic", "level": 0, "n": 4}}}

    with pytest.raises(ConfigError, match="workflow.options.entry: .*no file"):
        config_from_dict(cfg({"entry": "missing.py:solve", "roles": ["a"]}))
    with pytest.raises(ConfigError, match="workflow.options.roles"):
        config_from_dict(cfg({"entry": f"{TEAMS}:single", "roles": []}))
    (tmp_path / "bad.py").write_text("raise ValueError('boom')\n")
    with pytest.raises(ConfigError, match="workflow.options.entry: .*ValueError: boom"):
        config_from_dict(cfg({"entry": f"{tmp_path / 'bad.py'}:solve", "roles": ["a"]}))
    with pytest.raises(ConfigError, match="must take"):
        config_from_dict(cfg({"entry": "json:dumps", "roles": ["a"]}))
    with pytest.raises(ConfigError, match="workflow.options.python: .*not an executable Python"):
        config_from_dict(cfg({"entry": f"{TEAMS}:single", "roles": ["a"], "python": "/nowhere/python"}))
    with pytest.raises(ConfigError, match="workflow.options.python: .*isolation must be process"):
        config_from_dict(cfg({"entry": f"{TEAMS}:single", "roles": ["a"], "python": sys.executable,
                              "isolation": "thread"}))
    # Both paths of a config file are relative to the file, not to where srpo is started.
    from srpo.build import load_config

    (tmp_path / "cfgs" / "env" / "bin").mkdir(parents=True)
    (tmp_path / "cfgs" / "env" / "bin" / "python").symlink_to(sys.executable)
    (tmp_path / "cfgs" / "team.py").write_text("def solve(task, url):\n    return ''\n")
    (tmp_path / "cfgs" / "run.yaml").write_text(json.dumps({**cfg({"entry": "team.py:solve", "roles": ["a"],
                                                                   "python": "env/bin/python"})}))
    loaded = load_config(str(tmp_path / "cfgs" / "run.yaml"))
    assert loaded.workflow.options["python"] == str(tmp_path / "cfgs" / "env" / "bin" / "python")
    assert loaded.workflow.options["entry"] == f"{tmp_path / 'cfgs' / 'team.py'}:solve"


# -- real clients, trained end to end -----------------------------------------------------------
def _train(tmp_path, program, roles, steps=1):
    from srpo.build import config_from_dict
    from srpo.runs.metrics_log import read_metrics
    from srpo.train import Trainer

    cfg = config_from_dict({
        "run": {"output_dir": str(tmp_path / "run"), "seed": 0, "steps": steps},
        "model": {"name": "tiny-llama"},
        "workflow": {"name": "openai_agent", "options": {"entry": f"{TEAMS}:{program}", "roles": roles},
                     "max_new_tokens": 6},
        "task": {"kind": "math", "train": {"source": "synthetic_arithmetic", "level": 0, "n": 8}},
        "train": {"tasks_per_step": 2, "group_size": 2}, "checkpoint": {"every": 1}})
    trainer = Trainer(cfg, progress=False)
    trainer.fit()
    trainer.close()
    return read_metrics(tmp_path / "run")


def test_a_run_whose_programs_keep_failing_stops_with_a_summary(tmp_path):
    from srpo.build import config_from_dict
    from srpo.train import Trainer, TrainingStopped

    cfg = config_from_dict({
        "run": {"output_dir": str(tmp_path / "run"), "seed": 0, "steps": 5, "max_failed_steps": 2},
        "model": {"name": "tiny-llama"},
        "workflow": {"name": "openai_agent", "options": {"entry": f"{TEAMS}:always_raises", "roles": ["solver"]},
                     "max_new_tokens": 4},
        "task": {"kind": "math", "train": {"source": "synthetic_arithmetic", "level": 0, "n": 8}},
        "train": {"tasks_per_step": 1, "group_size": 2}})
    trainer = Trainer(cfg, progress=False)
    with pytest.raises(TrainingStopped, match=r"2 steps in a row .* episodes: 4, failed 4 \(100.0 %\): 4 program "
                                              r"errors\. first workflow failure: .*never works"):
        trainer.fit()
    trainer.close()
    assert trainer.step == 2


@pytest.mark.slow
def test_a_langgraph_team_gives_its_sets_and_trains_through_the_gateway(tmp_path):
    pytest.importorskip("langgraph")
    pytest.importorskip("langchain_openai")
    from srpo.workflows.builtins import build_workflow

    # The graph's data flow, recovered: both solvers' answers reach the judge together (K = 2),
    # the judge's answer ends the episode (K = 1).
    roles = ["solver_1", "solver_2", "judge"]
    agent = build_workflow("openai_agent", entry=f"{TEAMS}:langgraph_team", roles=roles, max_new_tokens=64,
                           max_batch_wait_s=60.0)  # a worker's first import of LangGraph may pass the 2 s default
    results, calls = _run(agent, roles)
    for r in results:
        assert [(e.event_type, e.size) for e in r.events] == [("to:judge", 2), ("final", 1)], r.transcript
        assert sorted(m.role for m in r.events[0].members) == ["solver_1", "solver_2"]
        assert [m.role for m in r.events[1].members] == ["judge"]
    assert len(calls) <= 3, calls  # 16 solver calls, then 8 judge calls, batched across episodes
    # ... and a real model trains on it for a step.
    rows = _train(tmp_path, "langgraph_team", roles)
    assert rows[-1]["events/valid"] > 0 and rows[-1]["events/invalid"] == 0


@pytest.mark.slow
def test_a_trained_team_is_served_and_evaluated(tmp_path):
    _train(tmp_path, "parallel_aggregate", ["worker_1", "worker_2", "worker_3", "aggregator"])
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "srpo.apps.cli", "serve", "--model", str(run), "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line, said = "", []
        deadline = time.monotonic() + 120
        while "http://" not in line and time.monotonic() < deadline:
            line = proc.stdout.readline()
            said.append(line)
            assert line or proc.poll() is None, "srpo serve ended"
        url = re.search(r"(http://\S+/v1)", line).group(1)
        assert "checkpoint step_" in line and "engine builtin" in line  # what is served, named
        assert "without its agent program" in "".join(said)  # the weights are served; the program never ran
        client = openai.OpenAI(base_url=url, api_key="x", max_retries=0)
        assert {m.id for m in client.models.list()} == {"worker_1", "worker_2", "worker_3", "aggregator"}
        reply = client.chat.completions.create(model="aggregator", messages=[{"role": "user", "content": "1+1?"}],
                                               max_tokens=4)
        assert reply.choices[0].finish_reason in ("stop", "length") and reply.usage.completion_tokens <= 4
        answer = client.responses.create(model="aggregator", input="1+1?", max_output_tokens=4)
        assert answer.status in ("completed", "incomplete") and answer.usage.output_tokens <= 4
        if importlib.util.find_spec("agents") is not None:  # the Agents SDK, on its default (Responses) path
            from agents import Agent, OpenAIResponsesModel, RunConfig, Runner

            model = OpenAIResponsesModel("aggregator", openai.AsyncOpenAI(base_url=url, api_key="x", max_retries=0))
            result = Runner.run_sync(Agent(name="a", model=model), "1+1?",
                                     run_config=RunConfig(tracing_disabled=True))
            assert isinstance(result.final_output, str)
    finally:
        proc.terminate()
        code = proc.wait(timeout=30)
    assert code in (0, -15), code  # SIGTERM: a clean stop, not an abort (134)
    out = subprocess.run([sys.executable, "-m", "srpo.apps.cli", "eval", "--model", str(run), "--data",
                          "synthetic_arithmetic:level=0:n=2:split=test", "-k", "1", "--trust-run-code"],
                         capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "openai_agent" in out.stdout


def test_srpo_serve_asks_its_engine_for_no_logprobs():
    """Served replies never carry log-probs: the engine is spared forming them (vLLM's sampler would
    rank every drawn token over the vocabulary); training episodes still record them."""
    import asyncio

    from srpo.gateway.backends import ServeBackend
    from srpo.policies.scripted import ScriptedPolicies
    from srpo.types import RoleSpec

    asked = []

    class Recording(ScriptedPolicies):
        def generate(self, requests, generator=None):
            asked.extend(r.params.logprobs for r in requests)
            return super().generate(requests, generator)

    policies = Recording(lambda role, prompt: "four", ["solver"])
    backend = ServeBackend(policies, policies, {"solver": RoleSpec("solver")})
    req = parse_request({"model": "solver", "messages": [{"role": "user", "content": "2 + 2?"}], "n": 2}, chat=True)

    async def go():
        try:
            return await backend.complete(req)
        finally:
            backend.close()
    choices, _ = asyncio.run(go())
    assert [c.text for c in choices] == ["four", "four"] and asked == [False, False]
    from srpo.workflows.builtins import build_workflow

    results, _ = _run(build_workflow("openai_agent", entry=f"{TEAMS}:single", roles=["solver"]), ["solver"])
    member = results[0].events[0].members[0]
    assert len(member.behaviour_logprobs) == len(member.completion_ids) > 0  # training episodes record them


def test_srpo_serve_gives_max_tokens_past_the_training_budget_and_refuses_what_it_cannot_give():
    import asyncio

    from srpo.gateway.backends import ServeBackend
    from srpo.types import SamplingParams
    from srpo.policies.scripted import ScriptedPolicies
    from srpo.types import RoleSpec

    policies = ScriptedPolicies(lambda role, prompt: "x" * 100, ["solver"])
    specs = {"solver": RoleSpec("solver", sampling=SamplingParams(max_new_tokens=6))}  # the training budget

    def ask(backend, max_tokens):
        req = parse_request({"model": "solver", "messages": [{"role": "user", "content": "hi"}],
                             "max_tokens": max_tokens}, chat=True)

        async def go():
            try:
                return await backend.complete(req)
            finally:
                backend.close()
        return asyncio.run(go())[0][0].completion_tokens

    assert ask(ServeBackend(policies, policies, specs), 40) == 40  # no --max-tokens, no known context: as asked
    assert ask(ServeBackend(policies, policies, specs, max_tokens=25), 25) == 25
    with pytest.raises(ProtocolError, match=r"max_tokens is 40; this server generates at most 25 here \(--max-tokens 25\)") as err:
        ask(ServeBackend(policies, policies, specs, max_tokens=25), 40)  # as OpenAI and vLLM: 400, not a silent cap
    assert err.value.param == "max_tokens" and err.value.status == 400
    context = ServeBackend(policies, policies, specs)
    context.context = 64  # a model whose context leaves 64 - prompt tokens
    with pytest.raises(ProtocolError, match=r"max_tokens is 1000000000; .* context of 64 tokens leaves \d+ after the "):
        ask(context, 10**9)


def test_the_documented_cases_where_inference_and_intent_differ():
    """The five cases the dataflow module documents, each as it behaves (tag such calls)."""
    rec = EpisodeRecorder("e", "t")
    rec.before_call("solver", ["Q"])
    rec.record(_member("solver", "The answer is 42 because six times seven."))  # quoted only in part
    rec.before_call("router", ["Q"])
    rec.record(_member("router", "WORKERS: 2"))  # steers the code, never quoted
    rec.before_call("mute", ["Q"])
    rec.record(_member("mute", "  "))  # empty: in every text
    rec.before_call("w1", ["Q"])
    rec.record(_member("w1", "7"))
    rec.before_call("w2", ["Q"])
    rec.record(_member("w2", "7"))  # identical to w1's: a call quoting "7" consumes both
    rec.before_call("checker", ["Q"])
    rec.record(_member("checker", "yes"))
    rec.before_call("judge", ["Q", "the number is 42; workers said 7", "Say yes or no."])  # "yes" by chance
    rec.record(_member("judge", "done"))
    assert _sets(rec.finish()) == [("to:judge", 0, ["checker", "w1", "w2"]),
                                   ("final", 0, ["judge", "mute", "router", "solver"])]


@pytest.mark.parametrize("program", ["exits_on_one", "exits_on_one_async"])
def test_a_thread_programs_sys_exit_or_keyboard_interrupt_costs_its_episode_only(program):
    """isolation: thread — a program's sys.exit(3) and KeyboardInterrupt fail their own episodes,
    counted as program errors; the others finish, and the run goes on (as under process isolation)."""
    from srpo.policies.scripted import ScriptedPolicies
    from srpo.workflows.builtins import build_workflow
    from srpo.workflows.runtime import Runtime

    agent = build_workflow("openai_agent", entry=f"{TEAMS}:{program}", roles=["solver"], isolation="thread")
    runtime = Runtime(BuiltinEngine(ScriptedPolicies(_script, ["solver"])), agent.default_role_specs(), lambda t, a: 1.0)
    results = runtime.run(agent, [(f"e{i}", TASKS[i]) for i in range(4)])
    assert [bool(r.info.get("failed")) for r in results] == [True, True, False, False]
    assert [r.info.get("program_errors", 0) for r in results] == [1, 1, 0, 0]
    message = runtime.first_traceback["workflow"]
    assert "SystemExit(3)" in message or "KeyboardInterrupt" in message


def test_a_thread_program_that_never_returns_does_not_keep_the_process_alive(tmp_path):
    """The episode times out, the step finishes, and the process ends at once (the program's thread
    is a daemon), saying how many calls never returned."""
    script = tmp_path / "one_step.py"
    script.write_text(f"""
import sys
sys.path.insert(0, {str(HELPERS.parent)!r})
from srpo.policies.scripted import ScriptedPolicies
from srpo.rollout.builtin import BuiltinEngine
from srpo.tasks.base import Task
from srpo.workflows.builtins import build_workflow
from srpo.workflows.runtime import Runtime
from srpo.workflows.openai_agent import programs_never_returned
agent = build_workflow("openai_agent", entry={str(TEAMS) + ':never_returns'!r}, roles=["solver"], isolation="thread",
                       timeout_s=1.0)
runtime = Runtime(BuiltinEngine(ScriptedPolicies(lambda r, p: "2", ["solver"])), agent.default_role_specs(), lambda t, a: 1.0)
results = runtime.run(agent, [("e0", Task("t", "What is 1 + 1?", ("2",), "math"))])
print("timeouts", results[0].info.get("program_timeouts"), "left", programs_never_returned(), flush=True)
""")
    # A process kept alive by the program's thread would sleep its hour: the timeout fails the test.
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "timeouts 1 left 1" in out.stdout


def test_the_connection_cap_fits_the_descriptors_the_process_has():
    """Under a 1,024-descriptor limit (soft 256 at start): the soft limit is raised to the hard one,
    and the gateway's connection cap stays below what is left for the process's own files (a run
    hit 'Too many open files' from 1,000 idle connections before).  In a process of its own: a
    lowered hard limit cannot be raised again."""
    code = ("import resource; resource.setrlimit(resource.RLIMIT_NOFILE, (256, 1024)); "
            "from srpo.runs import serving; cap = serving.connection_cap(4096); "
            "print(resource.getrlimit(resource.RLIMIT_NOFILE)[0], cap)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    soft, cap = map(int, out.stdout.split())
    assert soft == 1024 and cap == 1024 - 256


def test_a_programs_helper_processes_end_with_its_worker(tmp_path, monkeypatch):
    """isolation: process — a program that starts a helper it never waits for: closing the pool
    ends the helper too (the worker leads its own process group, killed whole)."""
    import os

    from srpo.policies.scripted import ScriptedPolicies
    from srpo.workflows.builtins import build_workflow
    from srpo.workflows.runtime import Runtime

    pids = tmp_path / "pids"
    monkeypatch.setenv("SRPO_TEST_PIDS", str(pids))
    agent = build_workflow("openai_agent", entry=f"{TEAMS}:starts_a_helper", roles=["solver"], max_workers=1,
                           env=["SRPO_TEST_PIDS"])
    runtime = Runtime(BuiltinEngine(ScriptedPolicies(_script, ["solver"])), agent.default_role_specs(), lambda t, a: 1.0)
    results = runtime.run(agent, [("e0", TASKS[0])])
    assert not results[0].info.get("failed")
    helper = int(pids.read_text().split()[0])
    os.kill(helper, 0)  # running while its worker lives
    agent._pool.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(helper, 0)
        except ProcessLookupError:
            break
        try:  # reaped by init once killed; a zombie still answers kill(0) until then
            if open(f"/proc/{helper}/stat").read().split()[2] == "Z":
                break
        except OSError:
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the helper {helper} outlived its worker")
