"""Rewards of a task's final answer: correctness (1.0 or 0.0), and token F1 for QA."""

from __future__ import annotations

from srpo.tasks.base import Task
from srpo.tasks.math import grade_math
from srpo.tasks.search import answer_text, grade_qa, token_f1


def task_reward(task: Task, answer: str) -> float:
    """Math: the final answer (boxed, ####, last number) equals the gold; QA: exact match of the
    ``<answer>`` content (or the whole text) with any gold answer."""
    if task.kind == "math":
        return grade_math(answer, task.answers[0])
    return grade_qa(answer, task.answers)


def qa_f1_reward(task: Task, answer: str) -> float:
    """QA: token F1 of the ``<answer>`` content (or the whole text) against the best gold answer."""
    if task.kind != "qa":
        raise ValueError(f"the f1 reward is for QA tasks, not {task.kind!r}")
    return token_f1(answer_text(answer), task.answers)


TRAIN_REWARD_FNS = {"exact": task_reward, "f1": qa_f1_reward}
