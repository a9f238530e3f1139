"""Study (l) read again on scales that do not change with K: the share of the room left, and the
per-member hit rate — from the archived runs, nothing re-run.

    python scripts/coordination_reanalysis.py [--runs docs/study_data/coordination_game/runs.jsonl.gz]
                                              [--out docs/study_data/coordination_game/reanalysis.md]

Why: the joint reward starts at ~0.22 at every K, the decomposable one at ~0.48 / 0.69 / 0.83 for
K = 2 / 4 / 8, so the room to improve shrinks with K under the control, and "joint − decomposable"
on the raw expected reward grows with K partly because the control's room shrinks.  Three scales:

- **raw**: the study's primary metric (expected reward, mean over updates 1–20);
- **share of the room left**: (primary − start) / (1 − start), per run — 0 is no learning, 1 is
  perfect from the first update;
- **per-member hit rate**: the probability that one member hits its target, mean over updates
  1–20.  Under the decomposable reward that is the metric itself (the mean member hit rate);
  under the joint reward the runs archive the context-averaged joint success p, and p^(1/K) is used
  (exact when the members' hit rates are equal; otherwise a close lower-bound-like summary).

Each scale also at the **final** update (20) — the study's primary metric is a mean over updates,
i.e. a measure of speed.  For each (policy, K): srpo_sqrt − grpo and srpo_sqrt − gspo under each
reward, and the contrast joint − decomposable, paired by seed (95 % t interval, Holm across every
comparison this script reports).
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from srpo import stats  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "docs" / "study_data" / "coordination_game" / "runs.jsonl.gz"


def _per_member(run: dict, values: list[float]) -> list[float]:
    if run["reward"] == "joint":
        return [max(v, 0.0) ** (1.0 / run["k"]) for v in values]
    return list(values)


def scales(run: dict) -> dict[str, float]:
    """One run's value on every scale (``*_final``: at the last update)."""
    curve, start = run["curve"], run["start"]
    updates = curve[1:]
    room = max(1.0 - start, 1e-9)
    member = _per_member(run, curve)
    return {
        "raw": sum(updates) / len(updates),
        "raw_final": updates[-1],
        "share": (sum(updates) / len(updates) - start) / room,
        "share_final": (updates[-1] - start) / room,
        "member": sum(member[1:]) / len(updates),
        "member_final": member[-1],
        "start": start,
        "member_start": member[0],
    }


def load(path: Path) -> dict[tuple, dict[int, dict[str, float]]]:
    """(policy, reward, k, method) → seed → scales, for the main (fresh-seed) runs."""
    cells: dict[tuple, dict[int, dict[str, float]]] = defaultdict(dict)
    with gzip.open(path, "rt") as f:
        for line in f:
            run = json.loads(line)
            if run.get("phase") == "main":
                cells[(run["policy"], run["reward"], run["k"], run["method"])][run["seed"]] = scales(run)
    return cells


def comparisons(cells, scale: str) -> list[dict]:
    out = []
    policies = sorted({c[0] for c in cells})
    ks = sorted({c[2] for c in cells})
    for policy in policies:
        for k in ks:
            for other in ("grpo", "gspo"):
                edge = {}
                for reward in ("joint", "decomposable"):
                    a, b = cells.get((policy, reward, k, "srpo_sqrt")), cells.get((policy, reward, k, other))
                    if not a or not b:
                        continue
                    seeds = sorted(set(a) & set(b))
                    edge[reward] = {s: a[s][scale] - b[s][scale] for s in seeds}
                    out.append({"policy": policy, "k": k, "versus": other, "what": reward, "scale": scale,
                                **stats.paired([edge[reward][s] for s in seeds])})
                if len(edge) == 2:
                    seeds = sorted(set(edge["joint"]) & set(edge["decomposable"]))
                    out.append({"policy": policy, "k": k, "versus": other, "what": "joint − decomposable",
                                "scale": scale, **stats.paired([edge["joint"][s] - edge["decomposable"][s]
                                                                for s in seeds])})
    return out


def starts(cells) -> dict[tuple, float]:
    """(reward, k) → the mean starting value (the room each reward leaves)."""
    acc = defaultdict(list)
    for (policy, reward, k, method), runs in cells.items():
        acc[(reward, k)] += [r["start"] for r in runs.values()]
    return {key: sum(v) / len(v) for key, v in acc.items()}


def _fmt(c: dict) -> str:
    if c.get("ci95") is None:
        return f"{c['mean']:+.3f}"
    lo, hi = c["ci95"]
    star = "*" if c.get("significant") else ""
    return f"{c['mean']:+.3f} [{lo:+.3f}, {hi:+.3f}]{star}"


def markdown(cells, all_comparisons) -> str:
    lines = ["# Study (l) on K-free scales (from the archived runs)", "",
             "`python scripts/coordination_reanalysis.py` — paired by seed over the 50 fresh seeds of each cell; 95 % "
             "t intervals; * significant after Holm across all comparisons below.", "",
             "Where each reward starts (mean over runs) — the room it leaves is 1 − start:", "",
             "| K | joint | decomposable |", "|---:|---:|---:|"]
    start = starts(cells)
    for k in sorted({k for _, k in start}):
        lines.append(f"| {k} | {start.get(('joint', k), float('nan')):.3f} | "
                     f"{start.get(('decomposable', k), float('nan')):.3f} |")
    titles = {"raw": "raw expected reward, mean over updates 1–20 (the study's primary)",
              "share": "share of the room left, mean over updates 1–20",
              "member": "per-member hit rate, mean over updates 1–20",
              "raw_final": "raw expected reward at update 20",
              "share_final": "share of the room left at update 20",
              "member_final": "per-member hit rate at update 20"}
    for scale, title in titles.items():
        for versus in ("grpo", "gspo"):
            rows = [c for c in all_comparisons if c["scale"] == scale and c["versus"] == versus]
            lines += ["", f"## srpo_sqrt − {versus}: {title}", "",
                      "| policy | K | joint | decomposable | joint − decomposable |", "|---|---:|---|---|---|"]
            for policy in sorted({c["policy"] for c in rows}):
                for k in sorted({c["k"] for c in rows if c["policy"] == policy}):
                    cell = {c["what"]: c for c in rows if c["policy"] == policy and c["k"] == k}
                    lines.append(f"| {policy} | {k} | " + " | ".join(
                        _fmt(cell[w]) if w in cell else "—" for w in ("joint", "decomposable", "joint − decomposable"))
                        + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", default=str(RUNS))
    parser.add_argument("--out", default=str(RUNS.parent / "reanalysis.md"))
    args = parser.parse_args(argv)
    cells = load(Path(args.runs))
    found = [c for scale in ("raw", "share", "member", "raw_final", "share_final", "member_final")
             for c in comparisons(cells, scale)]
    stats.adjust(found)
    text = markdown(cells, found)
    Path(args.out).write_text(text)
    Path(args.out).with_suffix(".json").write_text(json.dumps(found, indent=1))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
