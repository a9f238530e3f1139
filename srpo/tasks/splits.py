"""Disjoint train and test parts of the synthetic problem spaces.

A synthetic generator draws from a finite space (one-digit addition has 81 problems), so two seeds
of it overlap: an "evaluation" seed would test problems the training seed also holds.  Every
problem therefore belongs to one fixed part, decided by a hash of its *canonical key* — the
problem with its order-free parts sorted (``3+4`` and ``4+3`` are one key, so a model trained on
one is never tested on the other) — and a generator asked for a part draws only from it.

``split`` of a synthetic :class:`~srpo.config.DataSource`: ``train`` (about three problems in
four), ``test`` (the rest), or ``all`` (the whole space, as generators drew before parts existed).
Unset, a training source takes ``train`` and a held-out source ``test``
(:func:`resolve_split`).
"""

from __future__ import annotations

import hashlib

#: The parts a synthetic source may draw from.
SPLITS = ("train", "test", "all")

#: One problem key in TEST_SHARE belongs to the test part.
TEST_SHARE = 4


def part_of(key: str) -> str:
    """``"test"`` or ``"train"``: the fixed part of the problem whose canonical key is ``key``
    (SHA-256, so the partition is the same on every machine and Python version)."""
    digest = hashlib.sha256(key.encode()).digest()
    return "test" if int.from_bytes(digest[:4], "big") % TEST_SHARE == 0 else "train"


def in_split(key: str, split: str) -> bool:
    """Whether the problem ``key`` may be drawn for ``split`` (``all`` takes every problem)."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; valid: {', '.join(SPLITS)}")
    return split == "all" or part_of(key) == split


def resolve_split(split: str | None, *, held_out: bool) -> str:
    """The part a synthetic source draws from: its own ``split``, else ``test`` for a held-out set
    and ``train`` for the training set."""
    return split or ("test" if held_out else "train")


#: Held-out sets of team studies should hold at least this many distinct problems: below it the
#: evaluation's own noise is a large share of the seed-to-seed spread (docs/results/study-h.md: 24
#: problems, 13 commuted pairs, gave an evaluation SD of ~0.08–0.09 on a paired difference).
MIN_HELDOUT_PROBLEMS = 200


def distinct_problems(tasks) -> int:
    """How many different problems ``tasks`` hold: canonical keys where a generator recorded them
    (``a + b`` and ``b + a`` are one), else distinct question texts."""
    return len({t.meta.get("key") or t.question for t in tasks})
