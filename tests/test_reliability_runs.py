"""Reliability II: a run folder is never mixed, Ctrl-C never hangs, every failure is a message."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from srpo.policies.scripted import ScriptedPolicies
from srpo.tasks.math import synthetic_arithmetic
from srpo.tasks.rewards import task_reward
from srpo.workflows import Runtime
from srpo.workflows.builtins import Workflow

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------- 1. Ctrl-C never hangs a rollout

class InterruptedEarly(Workflow):
    """Episode 0 asks (its request waits in the batcher's queue) and then Ctrl-C arrives, before
    the other episodes have run a line: the moment at which the batcher used to wait forever."""

    name = "interrupted_early"

    def roles(self):
        return ["solver"]

    async def run(self, ctx, task):
        if ctx.episode_id == "e0":
            signal.raise_signal(signal.SIGINT)  # asyncio.run's handler cancels the main task
        return (await ctx.ask("solver", task.question)).text


@pytest.mark.timeout(60)
@pytest.mark.parametrize("episodes", [2, 3, 8])
def test_ctrl_c_while_episodes_have_not_started_raises_instead_of_hanging(episodes):
    wf = InterruptedEarly()
    rt = Runtime(ScriptedPolicies(lambda role, prompt: "\\boxed{1}", wf.roles()), wf.default_role_specs(), task_reward)
    tasks = synthetic_arithmetic(episodes, level=1, seed=0)
    outcome = {}

    def target():
        try:
            rt.run(wf, [(f"e{i}", t) for i, t in enumerate(tasks)])
            outcome["result"] = "returned"
        except KeyboardInterrupt:
            outcome["result"] = "KeyboardInterrupt"
        except BaseException as err:  # noqa: BLE001 - report whatever it was
            outcome["result"] = repr(err)

    # signal.raise_signal needs the main thread's handler, so run in the main thread but watch it.
    def hung():
        outcome["hung"] = True
        os.kill(os.getpid(), signal.SIGINT)  # the second Ctrl-C: asyncio.run raises at once

    watchdog = threading.Timer(10, hung)
    watchdog.start()
    try:
        target()
    finally:
        watchdog.cancel()
    assert "hung" not in outcome, "the rollout hung after Ctrl-C"
    assert outcome["result"] == "KeyboardInterrupt"
    # The runtime is reusable after an interruption.
    rt2 = Runtime(ScriptedPolicies(lambda role, prompt: "\\boxed{1}", wf.roles()), wf.default_role_specs(), task_reward)
    assert len(rt2.run(InterruptedLater(), [("x", tasks[0])])) == 1


class InterruptedLater(InterruptedEarly):
    async def run(self, ctx, task):
        return (await ctx.ask("solver", task.question)).text
