"""A reward that takes its time: a training step long enough to be interrupted in the middle.

Alone it takes 2 s a call.  Tests that must know *when* a step is in its rewards set
``SRPO_TEST_REWARD_LOG`` (a file: a line is appended as each call starts) and
``SRPO_TEST_REWARD_GATE`` (a path: each call then waits until it exists — at most 300 s, so that
nothing hangs for ever).  The test decides how long a step lasts instead of guessing a sleep."""

import os
import time
from pathlib import Path

GATE_LIMIT_S = 300.0


def reward(task, text):
    log = os.environ.get("SRPO_TEST_REWARD_LOG")
    if log:
        with open(log, "a") as f:
            f.write("start\n")
    gate = os.environ.get("SRPO_TEST_REWARD_GATE")
    if not gate:
        time.sleep(2.0)
        return 0.0
    deadline = time.monotonic() + GATE_LIMIT_S
    while not Path(gate).exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    return 0.0


def calls_started(log) -> int:
    """How many reward calls have started (``SRPO_TEST_REWARD_LOG``'s lines)."""
    try:
        return Path(log).read_text().count("start")
    except FileNotFoundError:
        return 0
