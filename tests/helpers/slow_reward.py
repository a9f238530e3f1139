"""A reward that takes its time: a training step long enough to be preempted in the middle."""

import time


def reward(task, text):
    time.sleep(2.0)
    return 0.0
