"""The default reward of a task: correctness of the team's final answer (1.0 or 0.0)."""

from __future__ import annotations

from srpo.tasks.base import Task
from srpo.tasks.math import grade_math
from srpo.tasks.search import grade_qa


def task_reward(task: Task, answer: str) -> float:
    """Math: the final answer (boxed, ####, last number) equals the gold; QA: exact match of the
    ``<answer>`` content (or the whole text) with any gold answer."""
    if task.kind == "math":
        return grade_math(answer, task.answers[0])
    return grade_qa(answer, task.answers)
