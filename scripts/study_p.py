"""Study (p): the tuning rule, and the declared measures, tests and figure (studies/p_stability/study.yaml).

    python scripts/study_p.py tune runs/study-p-tuning/results.json [--write]
    python scripts/study_p.py analyse runs/study-p [--json tests.json] [--figure stability.png]

``tune``: per arm (sum, sqrt, mean, grpo) the rate with the best median validation per-part accuracy
over the tuning seeds (``srpo.apps.study.tuning``); ``--write`` fills the four ``train.lr: TUNED``.

``analyse``: from the study folder (``<arm>-k<K>/seed<N>/metrics.jsonl`` and ``results.json``), each
run's measures over the steps that updated — the gradient norm's CV over steps and its median, the
mean ratio-clip fraction, the mean variance of the clipped unit's log-ratio, the mean KL to π_old
per token (all at the cell's K), gradient spikes — then the declared tests: each arm's slope of
measures (1)-(4) against log2 K, fitted per seed, against 0; sqrt's slope minus sum's and mean's;
held-out per-part accuracy, sqrt minus the others — Holm over all 28.  The figure: measures × K, a
line per arm (mean ± SE over seeds).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from srpo import stats  # noqa: E402
from srpo.apps.stability import SPIKE_FACTOR, update_rows  # noqa: E402
from srpo.apps.study import tuning  # noqa: E402
from srpo.runs.metrics_log import read_metrics  # noqa: E402

STUDY = Path(__file__).resolve().parents[1] / "studies" / "p_stability" / "study.yaml"
ARMS = ("sum", "sqrt", "mean", "grpo")
KS = (2, 4, 8)
TEST = "parts-test"
#: The four measures the flatness tests read: name → what it is.
MEASURES = {
    "grad_norm_cv": "gradient norm: CV over steps",
    "clip_frac": "ratio-clip fraction",
    "log_ratio_var": "variance of the clipped unit's log-ratio",
    "kl": "KL(π_old ‖ π_θ) per token",
}


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def run_measures(rows: list[dict], k: int) -> dict[str, float | None]:
    """One run's measures at its set size ``k`` over the steps that updated (srpo.apps.stability)."""
    rows = update_rows(rows)
    norms = [r["grad_norm/total"] for r in rows if isinstance(r.get("grad_norm/total"), (int, float))]
    cv = None
    if len(norms) > 1 and statistics.mean(norms) > 0:
        cv = statistics.stdev(norms) / statistics.mean(norms)
    median = statistics.median(norms) if norms else None

    def per_step(key):
        return [r[key] for r in rows if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]

    spikes = sum(1 for v in norms if median and v > SPIKE_FACTOR * median)
    return {"grad_norm_cv": cv, "grad_norm_median": median,
            "clip_frac": _mean(per_step(f"by_k/clip_frac/k{k}")),
            "log_ratio_var": _mean([v * v for v in per_step(f"by_k/unit_log_ratio_std/k{k}")]),
            "kl": _mean(per_step(f"by_k/approx_kl/k{k}")), "spikes": spikes, "steps_updated": len(rows)}


def collect(root: Path) -> dict[tuple[str, int], dict[int, dict]]:
    """(arm, K) → seed → the run's measures and its held-out per-part accuracy."""
    results = json.loads((root / "results.json").read_text())["cells"]
    heldout = {(c["label"], c["seed"]): c["eval"]["datasets"].get(TEST, {}).get("per_part") for c in results}
    out: dict[tuple[str, int], dict[int, dict]] = {}
    for arm in ARMS:
        for k in KS:
            for folder in sorted((root / f"{arm}-k{k}").glob("seed*")):
                seed = int(folder.name.removeprefix("seed"))
                if (f"{arm}-k{k}", seed) not in heldout:
                    continue  # not finished (no evaluation yet): not counted
                rows = read_metrics(folder)
                out.setdefault((arm, k), {})[seed] = {**run_measures(rows, k),
                                                      "heldout": heldout[(f"{arm}-k{k}", seed)]}
    return out


def slopes(table, arm: str, measure: str, ks: tuple[int, ...] = KS) -> dict[int, float]:
    """seed → the least-squares slope of ``measure`` against log2 K over ``ks`` (seeds with every K)."""
    xs = [math.log2(k) for k in ks]
    mx = sum(xs) / len(xs)
    out = {}
    seeds = set.intersection(*[set(table.get((arm, k), {})) for k in ks])
    for seed in sorted(seeds):
        ys = [table[(arm, k)][seed][measure] for k in ks]
        if any(y is None for y in ys):
            continue
        my = sum(ys) / len(ys)
        out[seed] = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return out


def _test(name: str, by_seed: dict, family: str) -> dict:
    values = list(by_seed.values())
    if len(values) < 2:
        return {"comparison": name, "family": family, "n": len(values), "p_t": None, "p_sign_flip": None,
                "mean": None, "sd": None, "ci95": (None, None)}
    return {"comparison": name, "family": family, **stats.paired(values)}


def declared_tests(table, arms: tuple[str, ...] = ARMS, ks: tuple[int, ...] = KS, measures: dict = MEASURES,
                   cost: str = "heldout", cost_words: str = "held-out per part") -> list[dict]:
    """The declared family, Holm-adjusted together: each arm's slope of each measure over log2 K
    against 0; sqrt's slope minus sum's and mean's; ``cost`` (the learning measure), sqrt minus
    each other arm pooled over K (paired by seed and K), and sqrt minus sum at the largest K."""
    out = []
    for arm in arms:
        for m, words in measures.items():
            out.append(_test(f"{arm}: slope of {words} over log2 K", slopes(table, arm, m, ks), "flatness"))
    for m, words in measures.items():
        sqrt = slopes(table, "sqrt", m, ks)
        for other in ("sum", "mean"):
            theirs = slopes(table, other, m, ks)
            out.append(_test(f"slope of {words}: sqrt − {other}",
                             {s: sqrt[s] - theirs[s] for s in sqrt.keys() & theirs.keys()}, "contrast"))
    for other in (a for a in arms if a != "sqrt"):
        diffs = {(s, k): table[("sqrt", k)][s][cost] - table[(other, k)][s][cost]
                 for k in ks for s in table.get(("sqrt", k), {}).keys() & table.get((other, k), {}).keys()}
        out.append(_test(f"{cost_words}, sqrt − {other} (K = {', '.join(map(str, ks))} pooled)", diffs, "cost"))
    top = max(ks)
    at_top = {s: table[("sqrt", top)][s][cost] - table[("sum", top)][s][cost]
              for s in table.get(("sqrt", top), {}).keys() & table.get(("sum", top), {}).keys()}
    out.append(_test(f"{cost_words}, sqrt − sum at K = {top}", at_top, "cost"))
    stats.adjust(out)
    return out


def _fmt(x, sign=True):
    return "–" if x is None else (f"{x:+.3g}" if sign else f"{x:.3g}")


def markdown(table, tests: list[dict], arms: tuple[str, ...] = ARMS, ks: tuple[int, ...] = KS,
             columns: dict | None = None) -> str:
    """The measures' table (mean ± SE over seeds, per arm and K) and the tests' table."""
    columns = columns or {**MEASURES, "grad_norm_median": "median grad norm", "spikes": "spikes",
                          "heldout": "held-out per part"}
    lines = ["| arm | K | runs | " + " | ".join(columns.values()) + " |", "|---|---:|---:|" + "---:|" * len(columns)]
    for arm in arms:
        for k in ks:
            runs = list(table.get((arm, k), {}).values())
            if not runs:
                continue
            cols = []
            for m in columns:
                vals = [r[m] for r in runs if r[m] is not None]
                mean, se = stats.mean_se(vals)
                cols.append("–" if not vals else (f"{mean:.3g} ± {se:.2g}" if se == se else f"{mean:.3g}"))
            lines.append(f"| {arm} | {k} | {len(runs)} | " + " | ".join(cols) + " |")
    lines += ["", f"| test | family | n | mean | 95 % CI | p (t) | p (sign-flip) | p (Holm over {len(tests)}) | verdict |",
              "|---|---|---:|---:|---|---:|---:|---:|---|"]
    for t in tests:
        lo, hi = t["ci95"]
        lines.append(f"| {t['comparison']} | {t['family']} | {t['n']} | {_fmt(t['mean'])} | "
                     f"{'–' if lo is None else f'[{lo:+.3g}, {hi:+.3g}]'} | {stats.fmt_p(t['p_t'])} | "
                     f"{stats.fmt_p(t['p_sign_flip'])} | {stats.fmt_p(t.get('p_t_holm'))} | {t['verdict']} |")
    return "\n".join(lines)


def figure(table, path: Path, arms: tuple[str, ...] = ARMS, ks: tuple[int, ...] = KS,
           panels: dict | None = None) -> None:
    """Measures × K, a line per arm (mean ± SE over seeds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = panels or {**MEASURES, "heldout": "held-out per-part accuracy"}
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.6))
    for ax, (m, title) in zip(axes, panels.items()):
        for arm in arms:
            xs, means, ses = [], [], []
            for k in ks:
                vals = [r[m] for r in table.get((arm, k), {}).values() if r[m] is not None]
                if vals:
                    mean, se = stats.mean_se(vals)
                    xs.append(k), means.append(mean), ses.append(se if se == se else 0.0)
            if xs:
                ax.errorbar(xs, means, yerr=ses, marker="o", capsize=3, label=arm)
        lows = [line.get_ydata().min() for line in ax.get_lines() if len(line.get_ydata())]
        if lows and min(lows) < -2:  # a collapse far below the others' range: symlog keeps both readable
            ax.set_yscale("symlog", linthresh=1.0)
        ax.set_xscale("log", base=2)
        ax.set_xticks(ks, [str(k) for k in ks])
        ax.set_xlabel("set size K")
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("tune", help="the tuning rule's rate per arm")
    t.add_argument("results", type=Path, help="the tuning study's results.json")
    t.add_argument("--write", action="store_true", help="write the rates into study.yaml")
    a = sub.add_parser("analyse", help="the measures, the declared tests and the figure")
    a.add_argument("root", type=Path, help="the study's folder (runs/study-p)")
    a.add_argument("--json", type=Path)
    a.add_argument("--figure", type=Path)
    args = p.parse_args(argv)
    if args.command == "tune":
        chosen = tuning.choose_rates(json.loads(args.results.read_text())["cells"], ARMS, "parts-validation", "per_part")
        print("\n".join(tuning.describe(chosen)))
        if args.write:
            if any(c["extend"] for c in chosen.values()):
                raise SystemExit("not written: a winner is at the edge of its grid")
            tuning.write_rates(STUDY, chosen)
        return 0
    table = collect(args.root)
    tests = declared_tests(table)
    print(markdown(table, tests))
    if args.json:
        args.json.write_text(json.dumps(tests, indent=1))
    if args.figure:
        figure(table, args.figure)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
