"""Task kinds: everything that differs between math and QA (or a kind a user adds), in one object.

A :class:`TaskKind` says how a data file's rows become tasks, what synthetic sources produce it,
how an answer is found in a model's text and graded, which training rewards exist, what extra
evaluation metrics to report, the default system prompt of a workflow's roles, and how to tell
from a file's rows that a dataset is (or is not) of this kind.  ``task.kind`` in a config names
one registered in :data:`TASK_KINDS` (``math``, ``qa``) or gives an import path to one
(``mypkg.kinds:CODE``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from srpo.registry import Registry
from srpo.tasks.base import DatasetError, Task

Grader = Callable[[Task, str], float]


@dataclass(frozen=True)
class TaskKind:
    """One kind of task.

    name: what ``Task.kind`` holds for tasks of this kind.
    load_file: ``(path, *, skip_bad_rows, limit, rows) -> (tasks, report)``; ``rows`` is an
        iterator of ``(line_no, row)`` when the rows come from elsewhere (a hub dataset, renamed
        columns), else None (read ``path``).
    grade: ``(task, text) -> 1.0 / 0.0`` correctness; evaluation's accuracy and the ``exact`` reward.
    extract_answer: ``text -> answer or None``: the answer in a model's text (what an aggregator
        is shown of each worker's output).
    system_prompt: the default system prompt of every role of a workflow on this kind.
    rewards: training rewards by name besides ``exact`` (``task.reward``), each ``(task, text) -> float``.
    eval_metrics: extra per-episode metrics evaluation averages and reports (QA: ``f1``).
    synthetic: synthetic source name → ``(DataSource) -> (tasks, passages)`` (passages: a corpus
        the tasks' answers live in, or an empty list).  The source's ``split`` arrives resolved
        (``train``, ``test`` or ``all``; :mod:`srpo.tasks.splits`): a generator draws only from
        that part of its problem space, so training and held-out sets never share a problem.
    recognizes: ``rows -> bool`` from the first rows of a file: whether they look like this kind
        (``srpo eval`` picks the grader with it when no ``--kind`` is given).
    check_fits: ``(tasks, source) -> None`` raising :class:`DatasetError` when a dataset's gold
        answers cannot be graded by this kind (graded wrongly it would score silently wrong).
    """

    name: str
    load_file: Callable[..., Any]
    grade: Grader
    extract_answer: Callable[[str], str | None]
    system_prompt: str
    rewards: dict[str, Grader] = field(default_factory=dict)
    eval_metrics: dict[str, Grader] = field(default_factory=dict)
    synthetic: dict[str, Callable[[Any], tuple[list[Task], list]]] = field(default_factory=dict)
    recognizes: Callable[[list[dict]], bool] | None = None
    check_fits: Callable[[list[Task], str], None] | None = None

    def reward(self, name: str) -> Grader:
        """The training reward ``name`` (``exact``: :attr:`grade`), or an import path to ``fn(task, text)``."""
        from srpo.registry import RegistryError, import_object, is_import_path

        if name == "exact":
            return self.grade
        if name in self.rewards:
            return self.rewards[name]
        if is_import_path(name):
            fn = import_object(name)
            if not callable(fn):
                raise RegistryError(f"{name!r} is not a function (task, text) -> float")
            return fn
        raise RegistryError(f"{name!r} is not a {self.name} reward; valid: {', '.join(['exact', *self.rewards])} "
                            f"(or package.module:function)")


def _is_task_kind(obj) -> None:
    if not isinstance(obj, TaskKind):
        raise TypeError("expected an srpo.tasks.kinds.TaskKind")


#: name → :class:`TaskKind`: ``register_task_kind(kind.name, kind)``, or name one by import path
#: (its tasks, whose ``Task.kind`` is the kind's own name, then find it under that name too).
TASK_KINDS: Registry[TaskKind] = Registry("task kind", accepts=_is_task_kind)
register_task_kind = TASK_KINDS.register


def task_kind(name: str) -> TaskKind:
    """The kind registered as ``name`` or at the import path ``name``; its tasks (whose
    ``Task.kind`` is the kind's own name) then find it under that name too."""
    kind = TASK_KINDS[name]
    if kind.name not in TASK_KINDS:
        TASK_KINDS.register(kind.name, kind)
    return kind


def synthetic_source(source: str) -> TaskKind | None:
    """The registered kind that generates the synthetic ``source`` (None: not a synthetic source)."""
    for name in TASK_KINDS.names():
        if source in TASK_KINDS[name].synthetic:
            return TASK_KINDS[name]
    return None


# --------------------------------------------------------------------- the built-in kinds

_MATH_MARKS = set("0123456789\\^_{}$=+-*/<>()[]|.,:;!%")
_QA_KEYS = ("golden_answers", "answers", "question_text", "answers_objects")


def _worked_solution(gold: str) -> bool:
    """A GSM8K-style solution (``#### N``) or a long derivation: not a QA answer."""
    return "####" in gold or len(gold.split()) > 30


def _prose(gold: str) -> bool:
    """Words without a digit or a math mark, e.g. 'Kauffman Stadium': not a math answer."""
    letters = sum(c.isalpha() for c in gold)
    return letters >= 2 and not any(c in _MATH_MARKS for c in gold)


def _short(text: str, n: int = 60) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 1] + "…"


def _golds(tasks: list[Task], sample: int = 200) -> list[str]:
    return [t.answers[0] for t in tasks[:sample] if t.answers]


def _refuse_when_most(tasks: list[Task], source: str, wrong: Callable[[str], bool], looks_like: str,
                      what: str, use: str) -> None:
    """Raise when most of the first 200 gold answers look ``wrong`` for this kind (a majority, so a
    few odd answers — MATH's word answers — do not trip it)."""
    golds = _golds(tasks)
    bad = [g for g in golds if wrong(g)]
    if golds and 2 * len(bad) > len(golds):
        raise DatasetError(
            f"{source}: looks like a {looks_like} — {len(bad)} of the first {len(golds)} gold answers are "
            f"{what} (e.g. {_short(bad[0])!r}); use task.kind: {use} (srpo eval: --kind {use})")


def _math_fits(tasks: list[Task], source: str) -> None:
    _refuse_when_most(tasks, source, _prose, "QA dataset, not math", "plain words", "qa")


def _qa_fits(tasks: list[Task], source: str) -> None:
    _refuse_when_most(tasks, source, _worked_solution, "math dataset, not QA", "worked solutions", "math")


def _looks_qa(rows: list[dict]) -> bool:
    if not rows:
        return False
    if any(k in rows[0] for k in _QA_KEYS):
        return True
    if "problem" in rows[0]:
        return False
    answers = [str(r.get("answer", "")) for r in rows if r.get("answer") is not None]
    return bool(answers) and 2 * sum(_prose(a) for a in answers) > len(answers)


def _build_builtin_kinds() -> None:
    from srpo.tasks.math import extract_answer, grade_math, load_math_file, synthetic_arithmetic
    from srpo.tasks.search import answer_text, extract_tagged_answer, grade_qa, load_qa, synthetic_kb, token_f1

    def arith(src):
        return synthetic_arithmetic(src.n, level=src.level, seed=src.seed, prefix="arith", split=src.split or "all"), []

    def kb(src):
        passages, tasks = synthetic_kb(src.n, seed=src.seed, split=src.split or "all")
        return tasks, passages

    def f1(task: Task, text: str) -> float:
        """Token F1 of the ``<answer>`` content (or the whole text) against the best gold answer."""
        return token_f1(answer_text(text), task.answers)

    math = TaskKind(
        name="math", load_file=load_math_file, grade=lambda task, text: grade_math(text, task.answers[0]),
        extract_answer=extract_answer,
        system_prompt="Solve the math problem. End with the final answer in the form \\boxed{ANSWER}.",
        synthetic={"synthetic_arithmetic": arith}, recognizes=lambda rows: not _looks_qa(rows),
        check_fits=_math_fits)
    qa = TaskKind(
        name="qa", load_file=load_qa, grade=lambda task, text: grade_qa(text, task.answers),
        extract_answer=extract_tagged_answer,
        system_prompt="Answer the question with a short phrase inside <answer> and </answer>.",
        rewards={"f1": f1}, eval_metrics={"f1": f1}, synthetic={"synthetic_kb": kb}, recognizes=_looks_qa,
        check_fits=_qa_fits)
    from srpo.tasks import parts as team_parts

    def parts_source(src):
        counts = tuple(src.parts) or team_parts.PART_COUNTS
        return team_parts.synthetic_parts(src.n, seed=src.seed, split=src.split or "all", level=src.level,
                                          counts=counts), []

    parts = TaskKind(
        name="parts", load_file=team_parts.load_parts_file, grade=team_parts.grade_joint,
        extract_answer=extract_answer, system_prompt="Be brief.",
        rewards={"per_part": team_parts.grade_per_part}, eval_metrics={"per_part": team_parts.grade_per_part},
        synthetic={"synthetic_parts": parts_source})
    for kind in (math, qa, parts):
        register_task_kind(kind.name, kind)


_build_builtin_kinds()
