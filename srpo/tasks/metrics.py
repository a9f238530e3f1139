"""Evaluation metrics over k samples per problem."""

from __future__ import annotations

from math import comb
from typing import Mapping, Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k (Chen et al., 2021): 1 − C(n−c, k) / C(n, k), from n samples with c correct."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"need 0 ≤ c ≤ n and 1 ≤ k ≤ n; got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def avg_at_k(scores: Sequence[float]) -> float:
    """Mean score over the k samples of one problem (Avg@k)."""
    if not scores:
        raise ValueError("avg@k of no samples")
    return float(sum(scores)) / len(scores)


def macro_average(per_dataset: Mapping[str, float]) -> float:
    """Unweighted mean over datasets."""
    if not per_dataset:
        raise ValueError("macro-average over no datasets")
    return sum(per_dataset.values()) / len(per_dataset)
