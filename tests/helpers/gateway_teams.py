"""The built-in workflows rewritten with nothing but the ``openai`` client, for the gateway's
equivalence tests (tests/gateway/test_gateway.py).  Each is what a user would write: no srpo import."""

import re
from concurrent.futures import ThreadPoolExecutor

from openai import AsyncOpenAI, OpenAI


def _client(url):
    return OpenAI(base_url=url, api_key="unused", max_retries=0)


def _ask(client, model, content, **kw):
    reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": content}], **kw)
    return reply.choices[0].message.content or ""


def single(task, url):
    return _ask(_client(url), "solver", task.question)


def solver_verifier(task, url, rounds=2):
    client, content, solution = _client(url), task.question, ""
    for _ in range(rounds):
        solution = _ask(client, "solver", content)
        verdict = _ask(client, "verifier", f"Problem: {task.question}\n\nProposed solution:\n{solution}")
        if verdict.strip().upper().startswith("ACCEPT"):
            break
        content = (f"{task.question}\n\nA previous attempt:\n{solution}\n\nFeedback on it:\n{verdict}\n\n"
                   f"Solve it again.")
    return solution


def _aggregate(client, task, answers):
    listing = "\n".join(f"({i}) {a}" for i, a in enumerate(answers, 1))
    return _ask(client, "aggregator", f"Problem: {task.question}\n\nAnswers proposed by other solvers:\n{listing}\n\n"
                                      f"Decide which answer is correct and give it.")


def parallel_aggregate(task, url, workers=3):
    client = _client(url)
    with ThreadPoolExecutor(workers) as pool:
        answers = list(pool.map(lambda i: _ask(client, f"worker_{i}", task.question), range(1, workers + 1)))
    return _aggregate(client, task, answers)


def routed(task, url, workers=3):
    client = _client(url)
    # The router's reply steers the code but is never quoted: tag it as its own transition.
    choice = _ask(client, "router", task.question, extra_headers={"x-srpo-event": "router"})
    chosen = sorted({int(n) for n in re.findall(r"\d+", choice.split("WORKERS:")[-1]) if 1 <= int(n) <= workers})
    chosen = chosen or list(range(1, workers + 1))
    with ThreadPoolExecutor(len(chosen)) as pool:
        answers = list(pool.map(lambda i: _ask(client, f"worker_{i}", task.question), chosen))
    return _aggregate(client, task, answers)


async def parallel_aggregate_async(task, url, workers=3):
    import asyncio

    client = AsyncOpenAI(base_url=url, api_key="unused", max_retries=0)

    async def ask(model, content):
        reply = await client.chat.completions.create(model=model, messages=[{"role": "user", "content": content}])
        return reply.choices[0].message.content or ""

    answers = await asyncio.gather(*[ask(f"worker_{i}", task.question) for i in range(1, workers + 1)])
    listing = "\n".join(f"({i}) {a}" for i, a in enumerate(answers, 1))
    return await ask("aggregator", f"Problem: {task.question}\n\nAnswers:\n{listing}\n\nGive the correct one.")


def reward_of_length(task, url):
    """Returns a reward, not an answer."""
    return len(_ask(_client(url), "solver", task.question)) / 100.0


def raises_sometimes(task, url):
    answer = _ask(_client(url), "solver", task.question)
    if task.question.endswith("1?"):
        raise RuntimeError("the program broke on this one")
    return answer


def sleeps(task, url):
    import time

    answer = _ask(_client(url), "solver", task.question)
    if task.question.endswith("1?"):
        time.sleep(30)  # past the workflow's timeout_s in the test
    return answer


def killed_on_one(task, url):
    """Its worker process is killed (SIGKILL, as the kernel's OOM killer does) in the middle of
    every episode whose question ends in "1?", after the program's first call."""
    import os
    import signal

    answer = _ask(_client(url), "solver", task.question)
    if task.question.endswith("1?"):
        os.kill(os.getpid(), signal.SIGKILL)
    return answer


def langgraph_team(task, url):
    """Two solvers in parallel and a judge, as a LangGraph graph over langchain-openai's ChatOpenAI."""
    from typing import TypedDict

    from langchain_openai import ChatOpenAI
    from langgraph.graph import END, START, StateGraph

    def model(name):
        return ChatOpenAI(model=name, base_url=url, api_key="unused", max_retries=0, temperature=1.0)

    class State(TypedDict, total=False):
        question: str
        first: str
        second: str
        final: str

    def solver(name, key):
        def node(state):
            return {key: model(name).invoke(state["question"]).content}
        return node

    def judge(state):
        prompt = f"{state['question']}\nAnswer 1: {state['first']}\nAnswer 2: {state['second']}\nWhich is right?"
        return {"final": model("judge").invoke(prompt).content}

    graph = StateGraph(State)
    graph.add_node("solver_1", solver("solver_1", "first"))
    graph.add_node("solver_2", solver("solver_2", "second"))
    graph.add_node("judge", judge)
    graph.add_edge(START, "solver_1")
    graph.add_edge(START, "solver_2")
    graph.add_edge(["solver_1", "solver_2"], "judge")
    graph.add_edge("judge", END)
    return graph.compile().invoke({"question": task.question})["final"]


# -- clients configured once per process (what the Agents SDK's docs and OPENAI_BASE_URL users do) --
_FROM_ENV = None
_DEFAULT = None


def configured_from_env(task, url):
    """A module-level client built once from OPENAI_BASE_URL / OPENAI_API_KEY, base_url ignored."""
    global _FROM_ENV
    if _FROM_ENV is None:
        _FROM_ENV = OpenAI(max_retries=0)
    reply = _FROM_ENV.chat.completions.create(model="solver", messages=[{"role": "user", "content": task.question}])
    return reply.choices[0].message.content or ""


def default_client_per_episode(task, url):
    """``set_default_openai_client(AsyncOpenAI(base_url=url))`` at the top of each episode: one
    process-wide client, replaced by whichever episode started last."""
    global _DEFAULT
    _DEFAULT = OpenAI(base_url=url, api_key="unused", max_retries=0)
    reply = _DEFAULT.chat.completions.create(model="solver", messages=[{"role": "user", "content": task.question}])
    return reply.choices[0].message.content or ""


def _wait_for_every_client(episodes: int = 4, timeout_s: float = 60.0) -> None:
    """Until ``episodes`` episodes of this process have set their client (one process: threads)."""
    import time

    from helpers import signals

    with signals.LOCK:
        signals.CLIENTS_SET["count"] += 1
    deadline = time.monotonic() + timeout_s
    while signals.CLIENTS_SET["count"] < episodes and time.monotonic() < deadline:
        time.sleep(0.005)


def default_client_set_by_every_episode(task, url):
    """As :func:`default_client_per_episode`, in one process: every episode has replaced the
    default before any calls — the mix-up a process-wide client makes, every time."""
    global _DEFAULT
    _DEFAULT = OpenAI(base_url=url, api_key="unused", max_retries=0)
    _wait_for_every_client()
    reply = _DEFAULT.chat.completions.create(model="solver", messages=[{"role": "user", "content": task.question}])
    return reply.choices[0].message.content or ""


def hangs_on_one(task, url):
    import time

    answer = _ask(_client(url), "solver", task.question)
    if task.task_id == "hang":
        while True:  # never returns, ignores everything
            time.sleep(1)
    return answer


def returns_none(task, url):
    _ask(_client(url), "solver", task.question)
    return None


class TeamAnswer:
    """A result object of the program's own (as CrewAI's ``crew.kickoff()`` returns): its module is
    loaded from this file in the worker and does not exist in the trainer."""

    def __init__(self, text):
        self.text = text


def returns_an_object(task, url):
    return TeamAnswer(_ask(_client(url), "solver", task.question))


def makes_no_call(task, url):
    return "42"


def slow_to_ask(task, url):
    from helpers import signals

    if task.task_id == "slow":
        # Busy with other work before its first call: until the quick episodes have been served
        # (the batch did not wait for it), or for 3 s (it did wait: max_batch_wait_s is longer).
        signals.QUICK_SERVED.wait(3.0)
    return _ask(_client(url), "solver", task.question)


# -- the OpenAI Agents SDK, as its docs write it for another provider ---------------------------
async def agents_sdk_team(task, url, api="responses"):
    """A lead agent that asks a solver agent (used as a tool), then hands off to a checker who gives
    the final answer.  The client is configured once for the process, as the SDK's docs show."""
    from agents import (Agent, ModelSettings, Runner, set_default_openai_api, set_default_openai_client,
                        set_tracing_disabled)

    set_tracing_disabled(True)
    set_default_openai_client(AsyncOpenAI(base_url=url, api_key="unused", max_retries=0), use_for_tracing=False)
    set_default_openai_api(api)
    solver = Agent(name="solver", model="solver", instructions="Solve the problem. End with the answer.")
    checker = Agent(name="checker", model="checker", instructions="Check the solution; give the final answer.")
    lead = Agent(name="lead", model="lead", instructions="Ask the solver, then hand off to the checker.",
                 tools=[solver.as_tool(tool_name="ask_solver", tool_description="Solves a math problem")],
                 handoffs=[checker], model_settings=ModelSettings(tool_choice="ask_solver"))
    result = await Runner.run(lead, task.question, max_turns=6)
    return str(result.final_output)


async def agents_sdk_chat_team(task, url):
    return await agents_sdk_team(task, url, api="chat_completions")


def langgraph_react_agent(task, url):
    """LangGraph's prebuilt ReAct agent: ChatOpenAI with bind_tools, a Python tool."""
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from langgraph.prebuilt import create_react_agent

    @tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    model = ChatOpenAI(model="solver", base_url=url, api_key="unused", max_retries=0)
    agent = create_react_agent(model, [add])
    state = agent.invoke({"messages": [("user", task.question)]}, {"recursion_limit": 8})
    return state["messages"][-1].content


def always_raises(task, url):
    _ask(_client(url), "solver", task.question)
    raise ValueError("this program never works")


async def agents_sdk_default_client(task, url):
    """The Agents SDK's docs for other providers: set_default_openai_client once per episode."""
    import asyncio

    from agents import Agent, Runner, set_default_openai_api, set_default_openai_client, set_tracing_disabled

    set_tracing_disabled(True)
    set_default_openai_api("chat_completions")
    set_default_openai_client(AsyncOpenAI(base_url=url, api_key="unused", max_retries=0), use_for_tracing=False)
    await asyncio.get_running_loop().run_in_executor(None, _wait_for_every_client)  # every episode has set its own
    result = await Runner.run(Agent(name="solver", model="solver", instructions="Solve it."), task.question)
    return str(result.final_output)


# -- AutoGen (autogen-agentchat), run by the interpreter of its own virtualenv (.venv-agents) -----
async def autogen_team(task, url):
    """A solver with a Python tool and a critic, in AutoGen's round-robin group chat."""
    from autogen_agentchat.agents import AssistantAgent
    from autogen_agentchat.conditions import MaxMessageTermination
    from autogen_agentchat.teams import RoundRobinGroupChat
    from autogen_ext.models.openai import OpenAIChatCompletionClient

    info = {"vision": False, "function_calling": True, "json_output": False, "family": "unknown",
            "structured_output": False}

    def client(model):
        return OpenAIChatCompletionClient(model=model, base_url=url, api_key="unused", model_info=info, max_retries=0)

    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    solver = AssistantAgent("solver", model_client=client("solver"), tools=[add],
                            system_message="Solve the problem with the add tool.")
    critic = AssistantAgent("critic", model_client=client("critic"), system_message="Check it; give the final answer.")
    team = RoundRobinGroupChat([solver, critic], termination_condition=MaxMessageTermination(3))
    result = await team.run(task=task.question)
    return str(result.messages[-1].content)


def reports_its_environment(task, url):
    """Asks once (so that the episode is trainable) and answers with what its worker inherited."""
    import os

    _ask(_client(url), "solver", task.question)
    return ",".join(f"{name}={os.environ.get(name, '-')}" for name in ("HF_TOKEN", "MY_TOOL_KEY", "HOME"))


WEATHER_TOOL = {"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}


def streams_and_tools(task, url):
    """Asks four ways — whole and streamed, with tools (a call required) and without — and reads
    every reply as a client would; for the test that the recorded ids are the ones drawn."""
    client, messages, said = _client(url), [{"role": "user", "content": task.question}], []
    for kw in ({}, {"tools": [WEATHER_TOOL], "tool_choice": "required"}):
        reply = client.chat.completions.create(model="solver", messages=messages, **kw).choices[0].message
        said.append(reply.content or "")
        for chunk in client.chat.completions.create(model="solver", messages=messages, stream=True, **kw):
            said.extend(c.delta.content or "" for c in chunk.choices)
    return "".join(said)


async def agents_sdk_structured(task, url, api="responses"):
    """An agent with an ``output_type``: the SDK asks for its JSON schema (the Responses API's
    ``text.format``, or chat's ``response_format``) and parses the reply into the type."""
    from typing import Literal

    from agents import Agent, OpenAIChatCompletionsModel, OpenAIResponsesModel, Runner, set_tracing_disabled
    from pydantic import BaseModel

    class Verdict(BaseModel):
        verdict: Literal["yes", "no"]

    set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=url, api_key="unused", max_retries=0)  # this episode's own client
    model = (OpenAIResponsesModel if api == "responses" else OpenAIChatCompletionsModel)("solver", client)
    judge = Agent(name="judge", model=model, instructions="Is the number even?", output_type=Verdict)
    result = await Runner.run(judge, task.question, max_turns=1)
    return result.final_output.verdict


async def agents_sdk_structured_chat(task, url):
    return await agents_sdk_structured(task, url, api="chat_completions")


_KEPT_CLIENTS = []  # alive, so that no two contexts can share an address


def reports_its_ssl_context(task, url):
    """A client built per episode, as most programs do; answers with its SSL context's identity
    and whether its process has imported torch."""
    import sys

    client = _client(url)
    _KEPT_CLIENTS.append(client)
    _ask(client, "solver", task.question)
    return f"{id(client._client._transport._pool._ssl_context)} torch={'torch' in sys.modules}"


def exits_on_one(task, url):
    """sys.exit(3) on the first problem, KeyboardInterrupt on the second; answers the others."""
    import sys

    if task.question.startswith("What is 1 +"):
        sys.exit(3)
    if task.question.startswith("What is 2 +"):
        raise KeyboardInterrupt
    return single(task, url)


async def exits_on_one_async(task, url):
    if task.question.startswith("What is 1 +"):
        raise SystemExit(3)
    if task.question.startswith("What is 2 +"):
        raise KeyboardInterrupt
    return "4"


def never_returns(task, url):
    """A program stuck for good (its episode times out; its thread never ends)."""
    import time

    time.sleep(3600)


def starts_a_helper(task, url):
    """Starts a helper process it never waits for (a tool server, say) and writes its pid to the
    file named by SRPO_TEST_PIDS, then answers."""
    import os
    import subprocess
    import sys

    helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    with open(os.environ["SRPO_TEST_PIDS"], "a") as f:
        f.write(f"{helper.pid}\n")
    return single(task, url)
