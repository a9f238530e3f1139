"""Scripted players for ``srpo sft`` (``sft.script``): each answers for every role of a built-in
workflow, ``fn(role, prompt, task) -> str``, the way a competent team would — so that the
transcripts teach a small model the workflow's *formats* from the workflow's real prompts.

They answer from the evidence in the prompt, never from the gold alone: the answerer gives the
gold answer only when it appears in the retrieved passages it was shown, and ``unknown``
otherwise — an episode that did not find its answer then earns no reward, and ``sft.min_reward``
(default 1) leaves it out of the transcripts.
"""

from __future__ import annotations

from srpo.tasks.base import Task


def _found(task: Task, prompt: str) -> str | None:
    """The gold answer if the prompt shows it (case-insensitive), else None."""
    low = prompt.lower()
    return next((a for a in task.answers if a.lower() in low), None)


def search_team(role: str, prompt: str, task: Task) -> str:
    """``search_team``: the verifier searches while nothing is gathered, then answers; each searcher
    queries with the question; the answerer answers from the passages."""
    if role == "verifier":
        return "SEARCH" if "(none yet)" in prompt else "ANSWER"
    if role.startswith("searcher"):
        return f"<search>{task.question}</search>"
    if role == "answerer":
        found = _found(task, prompt.split("Information:", 1)[-1])
        return f"<answer>{found or 'unknown'}</answer>"
    raise ValueError(f"search_team script: no answer for role {role!r}")


def search(role: str, prompt: str, task: Task) -> str:
    """``search`` (one agent): search with the question, then answer from the information."""
    # Only what follows the question counts: the system prompt names the <information> tag too.
    context = prompt.rsplit(task.question, 1)[-1]
    if "<information>" not in context:
        return f"<search>{task.question}</search>"
    found = _found(task, context.split("<information>", 1)[-1])
    return f"<answer>{found or 'unknown'}</answer>"
