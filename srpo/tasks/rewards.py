"""Rewards of a task's final answer, by the task's kind (:mod:`srpo.tasks.kinds`)."""

from __future__ import annotations

from srpo.tasks.base import Task
from srpo.tasks.kinds import task_kind


def task_reward(task: Task, answer: str) -> float:
    """Correctness of ``answer`` (1.0 or 0.0) under the grader of the task's kind: math — the
    final answer (boxed, ####, last number) equals the gold; QA — exact match of the ``<answer>``
    content (or the whole text) with any gold answer."""
    return task_kind(task.kind).grade(task, answer)


