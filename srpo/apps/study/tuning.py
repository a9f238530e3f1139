"""A study's tuning rule: each arm's learning rate by the median over tuning seeds.

A tuning study names its cells ``<arm>-lr<rate>`` (``set-lr5e-6``, ``sqrt-lr1e-5``); for each arm
the rate whose median over the tuning seeds of one held-out metric is highest wins (ties: the
smaller rate), and a winner at the edge of its arm's grid is flagged — the grid is extended past it
and the rule applied again, so that no chosen rate is the best only of the rates tried.  The test
study's declaration carries ``train.lr: TUNED`` in each arm's entry until :func:`write_rates`
fills it (a config that still says TUNED fails validation: it cannot run before its tuning).
"""

from __future__ import annotations

import re
import statistics
from pathlib import Path


def _rate(label: str) -> float:
    """The rate a label names: ``lr5e-6`` or ``set-lr5e-6`` → 5e-6."""
    return float(label.rsplit("lr", 1)[1])


def choose_rates(cells: list[dict], arms: tuple[str, ...], dataset: str, metric: str) -> dict[str, dict]:
    """arm → ``{"lr", "medians": {rate label: median}, "seeds": {rate label: n}, "extend": None |
    "below" | "above"}`` from the tuning cells' held-out ``metric`` on ``dataset``."""
    out = {}
    for arm in arms:
        by_label: dict[str, list[float]] = {}
        for c in cells:
            if c["label"].startswith(f"{arm}-lr") and metric in c["eval"]["datasets"].get(dataset, {}):
                by_label.setdefault(c["label"], []).append(c["eval"]["datasets"][dataset][metric])
        if not by_label:
            raise ValueError(f"no finished tuning cell for the arm {arm!r}")
        medians = {label.split("-", 1)[1]: statistics.median(v) for label, v in by_label.items()}
        seeds = {label.split("-", 1)[1]: len(v) for label, v in by_label.items()}
        best = max(medians, key=lambda lab: (medians[lab], -_rate(lab)))  # ties: the smaller rate
        rates = sorted(_rate(lab) for lab in medians)
        edge = None if len(rates) < 2 or rates[0] < _rate(best) < rates[-1] else \
            ("below" if _rate(best) == rates[0] else "above")
        out[arm] = {"lr": _rate(best), "medians": medians, "seeds": seeds, "extend": edge}
    return out


def write_rates(study: Path, chosen: dict[str, dict]) -> None:
    """Replace ``train.lr: TUNED`` in each chosen arm's entry (``{label: <arm>, set: {...}}``) of
    the declaration ``study``; exactly one placeholder per arm, or nothing is written."""
    text = study.read_text()
    for arm, choice in chosen.items():
        pattern = re.compile(rf"(\{{label: {re.escape(arm)}, set: \{{[^}}]*train\.lr: )TUNED")
        text, n = pattern.subn(rf"\g<1>{choice['lr']:.2e}", text)
        if n != 1:
            raise ValueError(f"{study}: expected one 'train.lr: TUNED' in the {arm} entry, found {n} (already tuned?)")
    study.write_text(text)


def describe(chosen: dict[str, dict]) -> list[str]:
    """One line per arm (its rate, the medians by rate), and one per arm whose winner is at an edge."""
    lines = [f"{arm}: lr {c['lr']:.2e}  (median by rate: "
             + ", ".join(f"{lab} {m:.3f} ({c['seeds'][lab]} seeds)" for lab, m in c["medians"].items()) + ")"
             for arm, c in chosen.items()]
    lines += [f"{arm}: the winner is at the edge of its grid - add the rate one doubling {c['extend']} it "
              f"(5 tuning seeds) and apply the rule again" for arm, c in chosen.items() if c["extend"]]
    return lines
