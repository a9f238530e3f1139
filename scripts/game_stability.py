"""Study (p)'s game arm: stability by event reduction and set size where the truth is known.

    python scripts/coordination_game_ii.py run --study studies/p_stability/game.yaml --shard 1/2   # and 2/2
    python scripts/game_stability.py runs/study-p-game [--out studies/p_stability/game]

Reads the main runs of the study (``diagnostics: true``: each run's gradient norm, clip fraction,
clipped-unit log-ratio variance and KL to π_old per update, averaged over the update's optimizer
steps), and reports what study (p) reports for the LLM team (``scripts/study_p.py``): per method
and K, the gradient norm's CV over updates, the mean clip fraction, log-ratio variance and KL; each
method's slope over log2 K against 0, sqrt's slope minus sum's and mean's, and the learning cost
(the share of the log-room gained, averaged over updates) — Holm over all of them; a figure of the
measures × K, a line per reduction.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import study_p  # noqa: E402
from coordination_game_ii import read_all  # noqa: E402

ARMS = {"srpo_sum": "sum", "srpo_sqrt": "sqrt", "srpo_mean": "mean", "grpo": "grpo"}
MEASURES = {
    "grad_norm_cv": "gradient norm: CV over updates",
    "clip_frac": "ratio-clip fraction",
    "log_ratio_var": "variance of the clipped unit's log-ratio",
    "kl": "KL(π_old ‖ π_θ) per token",
}
COLUMNS = {**MEASURES, "grad_norm_median": "median grad norm", "primary": "share of the log-room gained"}


def run_measures(run: dict) -> dict:
    """One run's measures over the updates that had a gradient (an update whose every group had one
    reward has none: left out, as the LLM team's steps without an advantage are)."""
    d = run["diagnostics"]
    kept = [i for i, g in enumerate(d["grad_norm"]) if g > 0]
    if not kept:
        return {"grad_norm_cv": None, "grad_norm_median": None, "clip_frac": None, "log_ratio_var": None,
                "kl": None, "primary": run["primary"]}
    norms = [d["grad_norm"][i] for i in kept]

    def mean_of(key):
        return statistics.mean(d[key][i] for i in kept)

    mean = statistics.mean(norms)
    return {"grad_norm_cv": statistics.stdev(norms) / mean if len(norms) > 1 else None,
            "grad_norm_median": statistics.median(norms), "clip_frac": mean_of("clip_frac"),
            "log_ratio_var": mean_of("log_ratio_var"), "kl": mean_of("kl_old"), "primary": run["primary"]}


def collect(root: Path) -> tuple[dict, list[int], set[str]]:
    """(arm, K) → seed → measures; the set sizes found; the commits the runs recorded."""
    table: dict = {}
    commits = set()
    for r in read_all(root):
        if r["phase"] != "main" or r["method"] not in ARMS or "diagnostics" not in r:
            continue
        table.setdefault((ARMS[r["method"]], r["k"]), {})[r["seed"]] = run_measures(r)
        commits.add(r.get("commit", "unknown"))
    return table, sorted({k for _, k in table}), commits


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("root", type=Path, help="the study's output folder (or its archive's folder)")
    p.add_argument("--out", type=Path, help="write results.md, tests.json and stability.png here")
    args = p.parse_args(argv)
    table, ks, commits = collect(args.root)
    if not table:
        raise SystemExit(f"{args.root}: no main run with diagnostics")
    arms = tuple(a for a in ARMS.values() if any((a, k) in table for k in ks))
    tests = study_p.declared_tests(table, arms, tuple(ks), MEASURES, cost="primary",
                                   cost_words="share of the log-room gained")
    text = study_p.markdown(table, tests, arms, tuple(ks), COLUMNS)
    text += f"\n\nRuns recorded at commit(s): {', '.join(sorted(commits))}.\n"
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.md").write_text(text)
        (args.out / "tests.json").write_text(json.dumps(tests, indent=1))
        study_p.figure(table, args.out / "stability.png", arms, tuple(ks), {**MEASURES, "primary": COLUMNS["primary"]})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
