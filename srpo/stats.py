"""Paired comparisons of study cells, the way a reviewer reads them.

A study compares cells seed by seed (one seed gives both cells the same task order and first
rollout), so each comparison is a one-sample problem on the paired differences ``d_1 … d_n``.
For each it reports:

* the mean, its standard error and the 95% Student-t interval, and the two-sided t-test p;
* the exact sign-flip (permutation) p: under "no difference" each ``d_i`` is as likely ``+`` as
  ``−``, so p is the share of the ``2^n`` sign patterns whose mean is at least as far from 0 —
  no normality assumed (exact up to n = 20, 200,000 random patterns beyond).  With n seeds it can
  never go below ``2 / 2^n`` (0.0625 at n = 5): five seeds cannot pass an exact 5% test;
* Holm-adjusted p-values across every comparison the study makes (Holm's step-down controls the
  family-wise error at 5% under any dependence between the tests);
* for the pre-registered primary comparison: the power the study had, from the observed spread.

All functions are pure (lists of floats in, dicts out) and deterministic.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np
from scipy import stats as _st

ALPHA = 0.05
#: Exact sign-flip enumeration up to this many pairs (2^20 ≈ 10^6 patterns); sampled beyond.
EXACT_SIGN_FLIP_MAX_N = 20
SIGN_FLIP_SAMPLES = 200_000


def mean_se(values: Sequence[float]) -> tuple[float, float]:
    """Mean and standard error (Bessel); NaN where undefined (no values; one value's SE)."""
    if not values:
        return float("nan"), float("nan")
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, float("nan")
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
    return mean, sd / math.sqrt(len(values))


def t_interval(values: Sequence[float], level: float = 0.95) -> tuple[float, float]:
    mean, se = mean_se(values)
    half = _st.t.ppf(0.5 + level / 2, len(values) - 1) * se
    return mean - half, mean + half


def t_test_p(values: Sequence[float]) -> float:
    """Two-sided one-sample t-test of mean 0 (NaN with fewer than 2 values; 1 or 0 with no spread)."""
    if len(values) < 2:
        return float("nan")
    mean, se = mean_se(values)
    if se == 0:
        return 1.0 if mean == 0 else 0.0
    return float(2 * _st.t.sf(abs(mean / se), len(values) - 1))


def sign_flip_p(values: Sequence[float], seed: int = 0) -> float:
    """Two-sided sign-flip p of mean 0: exact for n ≤ :data:`EXACT_SIGN_FLIP_MAX_N`, else from
    :data:`SIGN_FLIP_SAMPLES` random patterns (seeded, with the +1 correction of an unbiased
    Monte-Carlo p)."""
    d = np.asarray(values, dtype=np.float64)
    n = len(d)
    if n == 0:
        return float("nan")
    observed = abs(d.mean())
    tol = 1e-12 * max(1.0, observed)  # patterns equal to the observed mean count as "as extreme"
    if n <= EXACT_SIGN_FLIP_MAX_N:
        patterns = ((np.arange(2 ** n)[:, None] >> np.arange(n)) & 1) * 2 - 1  # (2^n, n) of ±1
        means = np.abs(patterns @ d) / n
        return float(np.mean(means >= observed - tol))
    rng = np.random.default_rng(seed)
    patterns = rng.choice((-1.0, 1.0), size=(SIGN_FLIP_SAMPLES, n))
    hits = int(np.sum(np.abs(patterns @ d) / n >= observed - tol))
    return (hits + 1) / (SIGN_FLIP_SAMPLES + 1)


def holm(pvalues: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values (same order as given; NaN stays NaN and is not counted)."""
    idx = [i for i, p in enumerate(pvalues) if p == p]
    m = len(idx)
    adjusted = [float("nan")] * len(pvalues)
    running = 0.0
    for rank, i in enumerate(sorted(idx, key=lambda i: pvalues[i])):
        running = max(running, min(1.0, (m - rank) * pvalues[i]))
        adjusted[i] = running
    return adjusted


def power(sd: float, n: int, effect: float, alpha: float = ALPHA) -> float:
    """Power of the two-sided paired t-test with ``n`` pairs whose differences have standard
    deviation ``sd``, to detect a true mean difference ``effect`` (noncentral t)."""
    if n < 2 or not sd > 0:
        return float("nan")
    df, nc = n - 1, abs(effect) / (sd / math.sqrt(n))  # the power is symmetric in the sign
    crit = _st.t.ppf(1 - alpha / 2, df)
    far_tail = _st.nct.cdf(-crit, df, nc)
    # scipy returns nan for the far tail once nc is large (about 20); it is below 1e-35 there.
    return float(_st.nct.sf(crit, df, nc) + (0.0 if math.isnan(far_tail) else far_tail))


def detectable(sd: float, n: int, target: float = 0.8, alpha: float = ALPHA) -> float:
    """The smallest true difference the paired t-test finds with probability ``target``."""
    if n < 2 or not sd > 0:
        return float("nan")
    lo, hi = 0.0, 10 * sd
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if power(sd, n, mid, alpha) < target else (lo, mid)
    return hi


def seeds_needed(sd: float, effect: float, target: float = 0.8, alpha: float = ALPHA, most: int = 10_000) -> int:
    """Paired seeds for the t-test to find ``effect`` with probability ``target``."""
    if not sd > 0 or not effect > 0:
        return 0 if sd == 0 else -1
    n = 2
    while n < most and power(sd, n, effect, alpha) < target:
        n += 1
    return n


def tost(values: Sequence[float], margin: float) -> float | None:
    """Two one-sided t-tests (TOST) of equivalence within ``±margin`` for paired differences.

    p = max(p of "mean ≤ −margin", p of "mean ≥ +margin"); p < α supports |mean| < margin — the
    only way a study here may call two cells equivalent (a non-significant difference never does).
    None with fewer than 2 values.
    """
    if len(values) < 2 or not margin > 0:
        return None
    mean, se = mean_se(list(values))
    df = len(values) - 1
    if se == 0:
        return 0.0 if abs(mean) < margin else 1.0
    p_low = float(_st.t.sf((mean + margin) / se, df))  # H0: mean <= -margin
    p_high = float(_st.t.cdf((mean - margin) / se, df))  # H0: mean >= +margin
    return max(p_low, p_high)


def paired(diffs: Sequence[float]) -> dict[str, Any]:
    """Everything one paired comparison reports (before any adjustment for the others)."""
    n = len(diffs)
    mean, se = mean_se(list(diffs))
    if n < 2:  # one seed: no spread to estimate (None, not NaN: results.json stays valid JSON)
        return {"n": n, "mean": mean, "se": None, "sd": None, "ci95": None, "p_t": None,
                "p_sign_flip": sign_flip_p(diffs) if n else None}
    lo, hi = t_interval(list(diffs))
    return {"n": n, "mean": mean, "se": se, "sd": se * math.sqrt(n), "ci95": [lo, hi], "p_t": t_test_p(list(diffs)),
            "p_sign_flip": sign_flip_p(diffs), "positive": sum(d > 0 for d in diffs),
            "negative": sum(d < 0 for d in diffs)}


def adjust(comparisons: list[dict[str, Any]]) -> None:
    """Add Holm-adjusted p-values (``p_t_holm``, ``p_sign_flip_holm``) across ``comparisons``
    (in place) and the verdict the adjusted values support (``significant``, ``verdict``)."""
    for key in ("p_t", "p_sign_flip"):
        raw = [c.get(key) if c.get(key) is not None else float("nan") for c in comparisons]
        for c, p in zip(comparisons, holm(raw)):
            c[f"{key}_holm"] = p if p == p else None
    for c in comparisons:
        # The pre-registered primary comparison is judged on its own p (Holm among the primary
        # cells only, ``p_primary``); every other one on its p adjusted across all of them.
        p = c.get("p_primary", c.get("p_t")) if c.get("primary") else c.get("p_t_holm")
        c["significant"] = bool(p is not None and p < ALPHA)
        c["verdict"] = verdict(c)


def verdict(c: dict[str, Any]) -> str:
    """The words a comparison earns: by its Holm-adjusted t p, and whether the exact test agrees."""
    if c.get("p_t") is None:
        return "one seed: no test"
    if c.get("primary"):
        if not c["significant"]:
            return "not significant (primary)"
        return "significant (primary)" + ("" if (c.get("p_sign_flip") or 1) < ALPHA else
                                          "; exact test not (rests on normality)")
    if not c["significant"]:
        return "significant before correction only" if c["p_t"] < ALPHA else "not significant"
    exact = c.get("p_sign_flip_holm")
    return "significant after Holm" + ("" if exact is not None and exact < ALPHA else
                                       "; exact test not (rests on normality)")


def fmt_p(p: float | None) -> str:
    if p is None or p != p:
        return "–"
    return "<0.001" if p < 0.001 else f"{p:.3f}"
