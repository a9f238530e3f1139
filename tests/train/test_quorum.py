"""rollout.quorum: a step closes once a quorum of its task groups is whole; the stragglers keep
running on the rollout copy, take the updated weights between two sampling calls and join a
later step with the versions they were drawn with; a checkpoint holds them."""

import asyncio
import contextlib
import threading
import time

import pytest

from srpo.build import load_config
from srpo.config import ConfigError
from srpo.policies.scripted import ScriptedPolicies
from srpo.rollout.builtin import BuiltinEngine
from srpo.runs.metrics_log import read_metrics
from srpo.tasks.base import Task
from srpo.train import Trainer
from srpo.train.quorum import QuorumRollout
from srpo.types import RoleSpec, SamplingParams
from srpo.workflows.runtime import Runtime
from helpers.runs import tiny, varied_reward

GATE = threading.Event()


class TwoTurns:
    """Asks twice; a task whose question says "slow" waits for GATE between its two calls (a
    program that sleeps: a tool, a retry, a slow service)."""

    async def run(self, ctx, task):
        first = await ctx.ask("solver", task.question)
        if "slow" in task.question:
            while not GATE.is_set():
                await asyncio.sleep(0.01)
        return (await ctx.ask("solver", first.text)).text


def _service(quorum=0.75):
    policies = ScriptedPolicies(lambda role, prompt: "42", ["solver"])
    specs = {"solver": RoleSpec("solver", sampling=SamplingParams(max_new_tokens=4))}
    make_runtime = lambda p, engine: Runtime(engine, specs, lambda t, a: 1.0, policies=p)  # noqa: E731
    return policies, QuorumRollout(policies, make_runtime, BuiltinEngine(policies), quorum)


def _jobs(step, questions, group_size=2):
    return [(f"s{step}-r0-t{i}-g{j}", Task(f"{step}.{i}", q, ("42",), "math"))
            for i, q in enumerate(questions) for j in range(group_size)]


def test_a_step_closes_on_its_quorum_and_a_straggler_joins_later_with_its_versions():
    GATE.clear()
    policies, service = _service()
    service.start(TwoTurns(), contextlib.nullcontext())
    try:
        groups = service.submit(_jobs(0, ["a", "b", "slow c", "d"]))
        episodes, running = service.take(groups)  # 3 of 4 groups: does not wait for the sleeper
        assert running == 1 and sorted({ep.task.question for ep in episodes}) == ["a", "b", "d"]
        policies.versions[policies.policy_of("solver")] += 1
        service.sync(policies)  # the update's new weights, taken between two sampling calls
        GATE.set()
        later, running = service.take([groups[2]])
        assert running == 0 and [ep.task.question for ep in later] == ["slow c", "slow c"]
        for ep in later:  # its first call on the old weights, its second on the new ones
            assert [m.policy_version for e in ep.events for m in e.members] == [0, 1]
        assert all(m.policy_version == 0 for ep in episodes for e in ep.events for m in e.members)
    finally:
        service.close()


def test_a_checkpoint_holds_the_stragglers_and_a_resumed_service_runs_them_again():
    GATE.clear()
    _, service = _service()
    service.start(TwoTurns(), contextlib.nullcontext())
    groups = service.submit(_jobs(0, ["a", "slow b"]))
    episodes, running = service.take(groups[:1])
    state = service.state_dict()
    service.close()
    assert running == 1 and len(episodes) == 2
    assert sorted(eid for eid, _ in state["running"]) == ["s0-r0-t1-g0", "s0-r0-t1-g1"]
    GATE.set()
    _, resumed = _service()
    resumed.load_state_dict(state)
    resumed.start(TwoTurns(), contextlib.nullcontext())
    try:
        again, running = resumed.take([groups[1]])
        assert running == 0 and sorted(ep.episode_id for ep in again) == ["s0-r0-t1-g0", "s0-r0-t1-g1"]
    finally:
        resumed.close()


def test_training_steps_proceed_while_a_group_sleeps(tmp_path):
    """A reward that sleeps for one task's group until step 1 has updated: with quorum 0.5 step 1
    closes on the other group; the sleeper's group joins a later step, drawn on older weights
    (staleness ≥ 1), and every episode is trained once or is still running at the end."""
    slow: dict = {}

    def reward(task, answer):
        slow.setdefault("task", task.task_id)
        deadline = time.monotonic() + 30
        while task.task_id == slow["task"] and slow["trainer"].step < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        return varied_reward(task, answer)

    cfg = load_config(None, tiny(tmp_path, ["run.steps=4", "rollout.quorum=0.5", "run.threads=1"]))
    trainer = slow["trainer"] = Trainer(cfg, progress=False, reward_fn=reward)
    try:
        trainer.fit()
    finally:
        trainer.close()
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[0]["rollout/stragglers"] == 1 and rows[0]["episodes"] == 2  # step 1 did not wait for it
    assert max(r["rollout/staleness_max"] for r in rows) >= 1  # the straggler joined on newer weights
    trained = sum(r["episodes"] for r in rows)
    assert trained + 2 * rows[-1]["rollout/stragglers"] == 4 * 2 * 2  # each episode trained once, or still running


def test_quorum_needs_recomputed_old_logprobs_and_no_overlap(tmp_path):
    with pytest.raises(ConfigError, match="rollout.quorum"):
        load_config(None, tiny(tmp_path, ["rollout.quorum=0.5", "rollout.max_staleness=1"]))
    with pytest.raises(ConfigError, match="rollout.quorum"):
        load_config(None, tiny(tmp_path, ["rollout.quorum=0.5", "train.old_logprobs=behaviour"]))
    # an engine with its own weights would be sampled by the stragglers while the trainer syncs it
    with pytest.raises(ConfigError, match="rollout.quorum below 1 with rollout.engine: vllm"):
        load_config(None, tiny(tmp_path, ["rollout.quorum=0.5", "rollout.engine=vllm"]))
