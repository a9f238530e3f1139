"""Problems in parts, one part per team member: K one-digit additions (K drawn per problem), the
task of the LLM team study (n) (``configs/studies/parts_team.yaml``).

A problem's parts come from one part of the one-digit addition space (:mod:`srpo.tasks.splits`:
training problems from the train part, held-out ones from the test part — a held-out problem
shares no addition, nor its commuted form, with training).  The team's answer is the members'
answers in order, ``"8, 9"``; two rewards score it:

- ``exact`` (the kind's grade) — **joint**: 1 when every part is right, else 0;
- ``per_part`` — **decomposable**: the share of parts that are right.

Each member sees only its own part (the ``parts`` workflow, :mod:`srpo.workflows.builtins`), so
the set of K answers is one transition whose reward the members earn together.
"""

from __future__ import annotations

import random

from srpo.tasks.base import DatasetError, Task
from srpo.tasks.math import answers_equivalent, extract_answer, synthetic_arithmetic
from srpo.tasks.splits import SPLITS

#: The set sizes a problem's part count is drawn from (uniformly, per problem).
PART_COUNTS = (2, 4)
MISSING = "?"  # a member's answer with no number in it


def synthetic_parts(n: int, *, seed: int = 0, split: str = "all", counts: tuple[int, ...] = PART_COUNTS,
                    level: int = 0) -> list[Task]:
    """``n`` distinct problems of K parts each (K drawn from ``counts``), every part an addition
    of ``level`` from the ``split`` part of its space; reproducible by seed.  Distinct as
    :func:`srpo.tasks.splits.distinct_problems` counts them: by canonical key, so a problem that
    differs from another only by a commuted part (``3 + 5`` for ``5 + 3``) is the same problem."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; valid: {', '.join(SPLITS)}")
    if n < 1:
        raise DatasetError("synthetic_parts: give n, the number of problems (its space is too large to list whole)")
    pool = synthetic_arithmetic(0, level=level, split=split)  # every addition of the part once
    rng = random.Random(f"parts-{level}-{seed}")
    tasks, seen = [], set()
    tag = "" if split == "all" else f"-{split}"
    for _ in range(100 * max(n, 1)):
        if len(tasks) == n:
            break
        picks = [rng.choice(pool) for _ in range(rng.choice(counts))]
        key = tuple(p.meta["key"] for p in picks)  # canonical: commuted forms are one
        if key in seen:
            continue
        seen.add(key)
        parts = [[p.question, p.answers[0]] for p in picks]
        question = "\n".join(f"Part {i + 1}: {q}" for i, (q, _) in enumerate(parts))
        tasks.append(Task(f"parts-L{level}{tag}-s{seed}-{len(tasks)}", question, (", ".join(a for _, a in parts),),
                          "parts", f"parts-L{level}", {"parts": parts, "key": "|".join(key)}))
    if len(tasks) < n:
        raise DatasetError(f"synthetic_parts: only {len(tasks)} distinct problems in the {split} part, {n} asked")
    return tasks


def team_answer(member_texts: list[str]) -> str:
    """The team's answer: each member's extracted number, in part order (``?`` for none)."""
    return ", ".join((extract_answer(t) or MISSING) for t in member_texts)


def part_hits(task: Task, text: str) -> list[bool]:
    """Per part, whether the team's answer ``text`` (as :func:`team_answer` writes it) has it right."""
    golds = [gold for _, gold in task.meta.get("parts") or []]
    got = [piece.strip() for piece in (text or "").split(",")]
    return [i < len(got) and answers_equivalent(got[i], gold) for i, gold in enumerate(golds)]


def grade_joint(task: Task, text: str) -> float:
    """1.0 when every part is right (the team's reward under the joint condition)."""
    hits = part_hits(task, text)
    return 1.0 if hits and all(hits) else 0.0


def grade_per_part(task: Task, text: str) -> float:
    """The share of parts that are right (the decomposable control)."""
    hits = part_hits(task, text)
    return sum(hits) / len(hits) if hits else 0.0


def load_parts_file(path, **_):
    raise DatasetError(f"{path}: the parts kind has no file format; use task.train: {{source: synthetic_parts}}")
