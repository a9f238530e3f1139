"""Math tasks: loaders (GSM8K-style, MATH-style), answer extraction, grading, synthetic arithmetic.

Grading goes through ``math-verify`` (its own guarded parser with time limits; we never evaluate
model text as code).  Plain numbers take a fast exact path (``fractions.Fraction``) first, which
also handles thousands separators, ``$`` and ``%`` without touching sympy.  Inputs are bounded
before parsing: an answer longer than ``MAX_ANSWER_CHARS`` or nested deeper than
``MAX_BRACE_DEPTH`` is graded wrong rather than handed to a parser that might take minutes.
"""

from __future__ import annotations

import itertools
import logging
import math
import random
import re
import threading
from fractions import Fraction
from pathlib import Path

from srpo.tasks.base import Task, load_jsonl_rows, require_text
from srpo.tasks.splits import SPLITS, in_split

log = logging.getLogger(__name__)

MAX_ANSWER_CHARS = 300
MAX_BRACE_DEPTH = 12
MAX_NUMBER_DIGITS = 60
GRADE_TIMEOUT_S = 2

# ---------------------------------------------------------------------------------- extraction


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), nested braces respected."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1:j].strip()
    return None  # unbalanced: no answer


_NUMBER = re.compile(r"-?\$?\d[\d,]*(?:\.\d+)?%?|-?\$?\.\d+%?")
_ANSWER_IS = re.compile(r"answer\s*(?:is|:)\s*:?\s*([^\n]+)", re.IGNORECASE)


def extract_answer(text: str) -> str | None:
    """The final answer in a model's text: ``\\boxed{}``, then ``#### x``, then "answer is x",
    then the last number.  ``None`` when there is none."""
    if not text:
        return None
    boxed = last_boxed(text)
    if boxed:
        return boxed
    if "####" in text:
        tail = text.rsplit("####", 1)[1].strip().splitlines()
        if tail and tail[0].strip():
            return tail[0].strip()
    m = list(_ANSWER_IS.finditer(text))
    if m:
        candidate = m[-1].group(1).strip().rstrip(".")
        nums = _NUMBER.findall(candidate)
        return nums[0] if nums and len(candidate) > 40 else candidate
    nums = _NUMBER.findall(text)
    return nums[-1] if nums else None


def gsm8k_gold(solution: str) -> str:
    """The number after ``####`` in a GSM8K worked solution."""
    if "####" not in solution:
        raise ValueError("field 'answer' has no '#### <final answer>' line")
    return solution.rsplit("####", 1)[1].strip().replace(",", "")


# ------------------------------------------------------------------------------------- grading


def _as_number(s: str) -> Fraction | None:
    t = s.strip().strip(".").replace("\\$", "").replace("$", "").replace("\\%", "%").replace("\\!", "").strip()
    if "," in t:  # only thousands separators (1,234,567); "1,2" is a list, not a number
        if not re.fullmatch(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?%?", t):
            return None
        t = t.replace(",", "")
    # "50%" grades equal to 50, as GSM8K's percent questions expect (the usual grader convention).
    t = t.rstrip("%").strip()
    if not re.fullmatch(r"-?\d+(?:\.\d+)?|-?\.\d+", t) or len(t) > MAX_NUMBER_DIGITS:
        return None
    return Fraction(t)


def _brace_depth(s: str) -> int:
    depth = best = 0
    for ch in s:
        if ch == "{":
            depth += 1
            best = max(best, depth)
        elif ch == "}":
            depth -= 1
    return best


class _NoTimeoutNotice(logging.Filter):
    """math-verify warns at every call made without its SIGALRM timeout — which is every call off
    the main thread, where srpo bounds grading itself (see :func:`answers_equivalent`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_NoTimeoutNotice())


def answers_equivalent(predicted: str | None, gold: str) -> bool:
    """Whether an extracted answer equals the gold one (numbers exactly, else via math-verify)."""
    if predicted is None:
        return False
    predicted = predicted.strip()
    if not predicted or len(predicted) > MAX_ANSWER_CHARS or _brace_depth(predicted) > MAX_BRACE_DEPTH:
        return False
    a, b = _as_number(predicted), _as_number(gold)
    if a is not None and b is not None:
        return a == b
    if predicted == gold.strip():
        return True
    try:
        from math_verify import parse, verify

        # math-verify times itself out with SIGALRM, which only the main thread may set: elsewhere
        # (rewards run in threads of their own, overlapped rollouts in a background thread) its
        # signal call raised and every symbolic answer was graded wrong.  There the caller's limit
        # (task.reward_timeout_s) bounds it instead; the size and depth checks above still apply.
        limit = GRADE_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
        gold_parsed = parse(f"\\boxed{{{gold}}}", parsing_timeout=limit)
        pred_parsed = parse(f"\\boxed{{{predicted}}}", parsing_timeout=limit)
        if not gold_parsed or not pred_parsed:
            return False
        return bool(verify(gold_parsed, pred_parsed, timeout_seconds=limit))
    except Exception as err:  # math-verify guards most of its errors; anything else is "wrong"
        log.debug("grading failed for %r vs %r: %s", predicted, gold, err)
        return False


def grade_math(text: str, gold: str) -> float:
    """1.0 when the final answer in ``text`` equals ``gold``, else 0.0."""
    return 1.0 if answers_equivalent(extract_answer(text), gold) else 0.0


# ------------------------------------------------------------------------------------- loaders


def load_gsm8k(path: str | Path, *, skip_bad_rows: bool = False, limit: int | None = None, rows=None):
    """GSM8K-style jsonl: ``question`` and ``answer`` (worked solution ending ``#### final``)."""
    name = Path(path).stem

    def make(line_no: int, row: dict) -> Task:
        _, question = require_text(row, "question")
        _, solution = require_text(row, "answer")
        return Task(f"{name}-{line_no}", question, (check_finite_gold(gsm8k_gold(solution)),), "math", name)

    return load_jsonl_rows(path, make, skip_bad_rows=skip_bad_rows, limit=limit, rows=rows)


def check_finite_gold(answer: str) -> str:
    """A gold answer that reads as a number must be a finite one: ``NaN``, ``Infinity`` or
    ``1e400`` (inf as a float) would grade every model answer wrong — or, compared as floats,
    inconsistently.  Raises ValueError naming the value (the loader adds file and line)."""
    text = answer.strip().lower().lstrip("+-")
    if text in ("nan", "inf", "infinity") or re.fullmatch(r"\d+(?:\.\d*)?e[+-]?\d+", text):
        try:
            finite = math.isfinite(float(answer))
        except ValueError:
            finite = False
        if not finite:
            raise ValueError(f"field 'answer' is not a finite number ({answer.strip()!r})")
    return answer


def load_math(path: str | Path, *, skip_bad_rows: bool = False, limit: int | None = None, rows=None):
    """MATH-style jsonl: ``problem`` and ``answer`` (a LaTeX string)."""
    name = Path(path).stem

    def make(line_no: int, row: dict) -> Task:
        _, problem = require_text(row, "problem", "question")
        _, answer = require_text(row, "answer")
        check_finite_gold(answer)
        meta = {k: row[k] for k in ("level", "subject", "unique_id") if k in row}
        return Task(str(row.get("unique_id", f"{name}-{line_no}")), problem, (answer,), "math", name, meta)

    return load_jsonl_rows(path, make, skip_bad_rows=skip_bad_rows, limit=limit, rows=rows)


def load_math_file(path: str | Path, *, rows=None, **kw):
    """Pick the loader from the first row's fields (GSM8K's ``####`` solutions or MATH's ``problem``)."""
    from srpo.tasks.base import read_rows

    rows = list(rows if rows is not None else read_rows(path))
    first = rows[0][1] if rows else {}
    if "problem" in first or "####" not in str(first.get("answer", "")):
        return load_math(path, rows=iter(rows), **kw)
    return load_gsm8k(path, rows=iter(rows), **kw)


# --------------------------------------------------------------------------- synthetic arithmetic

LEVELS = {
    0: "a + b with one-digit numbers",
    1: "a + b with one- and two-digit numbers",
    2: "a + b with two-digit numbers",
    3: "a + b + c or a − b with two-digit numbers",
    4: "a × b with a one-digit and a two-digit number",
    5: "(a + b) × c",
    6: "a + b or a × b with one-digit numbers (the one-step facts a 135M model half-knows)",
}


#: Levels whose whole problem space ``n: 0`` may ask for (level 3 holds ~750,000 problems).
MAX_ENUMERATED = 100_000


def _problem(level: int, a: int, b: int, c: int = 0, minus: bool = False) -> tuple[str, str, int]:
    """``(canonical key, question, answer)`` of one problem of ``level`` with operands ``a, b, c``.
    The key sorts the operands of ``+`` and ``×`` so that ``3 + 4`` and ``4 + 3`` share a part."""
    if level in (0, 1, 2):
        return f"{min(a, b)}+{max(a, b)}", f"What is {a} + {b}?", a + b
    if level == 3:
        if minus:
            return f"{a}-{b}", f"What is {a} - {b}?", a - b
        return "+".join(map(str, sorted((a, b, c)))), f"What is {a} + {b} + {c}?", a + b + c
    if level == 4:
        return f"{a}*{b}", f"What is {a} * {b}?", a * b
    if level == 6:  # c = 1: the product (its key sorted too: 3 × 4 and 4 × 3 are one fact)
        if c:
            return f"{min(a, b)}*{max(a, b)}", f"What is {a} * {b}?", a * b
        return f"{min(a, b)}+{max(a, b)}", f"What is {a} + {b}?", a + b
    return f"({min(a, b)}+{max(a, b)})*{c}", f"What is ({a} + {b}) * {c}?", (a + b) * c


def _draw(rng: random.Random, level: int) -> tuple[str, str, int]:
    """One problem of ``level`` drawn from ``rng`` (the draws every seed has always made)."""
    if level == 0:
        return _problem(0, rng.randint(1, 9), rng.randint(1, 9))
    if level == 1:
        return _problem(1, rng.randint(1, 9), rng.randint(10, 99))
    if level == 2:
        return _problem(2, rng.randint(10, 99), rng.randint(10, 99))
    if level == 3:
        a, b, c = (rng.randint(10, 99) for _ in range(3))
        if rng.random() < 0.5:
            return _problem(3, a, b, c)
        return _problem(3, max(a, b), min(a, b), minus=True)
    if level == 4:
        return _problem(4, rng.randint(2, 9), rng.randint(10, 99))
    if level == 6:
        if rng.random() < 0.5:
            return _problem(6, rng.randint(1, 9), rng.randint(1, 9))
        return _problem(6, rng.randint(2, 9), rng.randint(2, 9), 1)
    return _problem(5, rng.randint(2, 20), rng.randint(2, 20), rng.randint(2, 9))


def _space(level: int):
    """Every problem of ``level`` (not level 3: too many), in a fixed order."""
    if level == 6:  # the one-digit sums, then the one-digit products
        yield from (_problem(6, a, b) for a, b in itertools.product(range(1, 10), range(1, 10)))
        yield from (_problem(6, a, b, 1) for a, b in itertools.product(range(2, 10), range(2, 10)))
        return
    ranges = {0: ((1, 9), (1, 9)), 1: ((1, 9), (10, 99)), 2: ((10, 99), (10, 99)), 4: ((2, 9), (10, 99)),
              5: ((2, 20), (2, 20), (2, 9))}
    if level not in ranges:
        raise ValueError(f"n: 0 (every problem) is for arithmetic levels with at most {MAX_ENUMERATED:,} "
                         f"problems ({', '.join(map(str, sorted(ranges)))}); level {level} has more — give n")
    spans = [range(lo, hi + 1) for lo, hi in ranges[level]]
    for operands in itertools.product(*spans):
        yield _problem(level, *operands)


def synthetic_arithmetic(n: int, *, level: int = 2, seed: int = 0, prefix: str = "arith",
                         split: str = "all") -> list[Task]:
    """``n`` arithmetic problems of a difficulty ``level`` (see :data:`LEVELS`), reproducible by seed,
    drawn from the ``split`` part of the level's problems (:mod:`srpo.tasks.splits`; ``all``: the
    whole space, the draws this generator made before parts existed).  ``n == 0``: every problem of
    the part once, in a fixed order (the seed does not matter) — a test set evaluated in full."""
    if level not in LEVELS:
        raise ValueError(f"unknown arithmetic level {level}; valid: {sorted(LEVELS)}")
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; valid: {', '.join(SPLITS)}")
    tag = "" if split == "all" else f"-{split}"
    if n == 0:
        problems = [p for p in _space(level) if in_split(p[0], split)]
    else:
        rng = random.Random(f"{prefix}-{level}-{seed}")
        problems = []
        while len(problems) < n:
            problem = _draw(rng, level)
            if in_split(problem[0], split):  # rejection keeps each part's draws uniform over it
                problems.append(problem)
    # meta["key"]: the canonical problem (3 + 4 and 4 + 3 are one), what a test part's size counts.
    return [Task(f"{prefix}-L{level}{tag}-s{seed}-{i}", q, (str(ans),), "math", f"{prefix}-L{level}", {"key": key})
            for i, (key, q, ans) in enumerate(problems)]
