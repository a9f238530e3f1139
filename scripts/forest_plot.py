"""Draw the results summary's forest plot: every comparison of the summary table with its interval.

    python scripts/forest_plot.py --out docs/img/forest.png

Read from the shipped results files (nothing typed in by hand): the left panel holds the LLM
studies' paired comparisons on each study's first metric (filled markers: held-out problems; open:
the training distribution), the right panel study (l)'s SRPO-sqrt − GRPO differences (mean expected
team reward over updates 1–20) per K, reward and policy.  Red: significant after Holm's adjustment
within the study; grey: not.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

DOCS = Path(__file__).resolve().parent.parent / "docs"

# (study label, results file, metric, dataset, held out?, method contrasts only?) — the rows of the
# summary table.  "Method contrasts only" keeps the comparisons whose two cells differ in the
# method alone (srpo-X against grpo-X): a factorial study's runner also compares every cell with
# the primary baseline across rewards and layouts, which are not method comparisons.
LLM_STUDIES = [
    ("(n) parts team", "results_parts_team.json", "per_part", "parts-test", True, True),
    ("(h) powered K = 5", "results_powered_k5.json", "avg@4", "macro", True, False),
    ("(i) sum vs sqrt", "results_sum_deficit.json", "avg@4", "macro", True, False),
    ("(j) gateway vs built-in", "results_gateway_vs_builtin.json", "avg@8", "macro", True, False),
    ("(k) overlap vs sync", "results_overlap_learning.json", "avg@8", "macro", True, False),
    ("(e) search warm start", "results_search_warmstart.json", "avg@2", "kb-heldout", True, False),
    ("(d) cardinality", "results_cardinality.json", "avg@2", "macro", False, False),
    ("(f) reduction ablation", "results_reduction_clip.json", "avg@2", "macro", False, False),
    ("(g) Gemma-3-270M", "results_gemma_scale.json", "avg@2", "macro", False, False),
]
GAME = "study_data/coordination_game/results.json"


def llm_rows(docs: Path) -> list[dict]:
    """One row per comparison: label, mean, ci95, significant, held_out."""
    rows = []
    for study, name, metric, dataset, held_out, method_only in LLM_STUDIES:
        for c in json.loads((docs / name).read_text())["comparisons"]:
            if method_only and _arm(c["cell"]) != _arm(c["baseline"]):
                continue
            if c.get("metric") == metric and c.get("dataset", "macro") == dataset:
                rows.append({"label": f"{study}: {c['cell']} − {c['baseline']} (n={c['n']})",
                             "mean": c["mean"], "ci95": c["ci95"], "significant": c["significant"],
                             "held_out": held_out})
    return rows


def _arm(cell: str) -> str:
    """A factorial cell's label without its method: ``srpo-joint-lora`` -> ``joint-lora``."""
    return cell.split("-", 1)[1] if "-" in cell else ""


def game_rows(docs: Path) -> list[dict]:
    """Study (l): SRPO-sqrt − GRPO per K, reward and policy (the reward contrasts are left out)."""
    rows = []
    for c in json.loads((docs / GAME).read_text())["comparisons"]:
        if c["method"] == "grpo" and c["reward"] in ("joint", "decomposable"):
            rows.append({"label": f"K={c['k']} {c['reward']}, {c['policy'].replace('_', '-')} (n={c['n']})",
                         "mean": c["mean"], "ci95": c["ci95"], "significant": c["significant"],
                         "held_out": False, "key": (c["policy"], c["reward"], c["k"])})
    return sorted(rows, key=lambda r: r["key"])


def panel(ax, rows: list[dict], title: str, xlabel: str) -> None:
    for y, r in enumerate(reversed(rows)):
        colour = "#c0392b" if r["significant"] else "#7f8c8d"
        lo, hi = r["ci95"]
        ax.plot([lo, hi], [y, y], color=colour, lw=1.6)
        ax.scatter([r["mean"]], [y], s=28, zorder=3, color=colour,
                   facecolors=colour if r["held_out"] else "white")
    ax.axvline(0, color="#333333", lw=0.8, ls="--")
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([r["label"] for r in reversed(rows)], fontsize=7)
    ax.set_title(title, fontsize=9)
    ax.set_xlabel(xlabel, fontsize=8)
    ax.tick_params(axis="x", labelsize=7)


def draw(docs: Path, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    llm, game = llm_rows(docs), game_rows(docs)
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 0.26 * max(len(llm), len(game)) + 1.6))
    panel(left, llm, "LLM studies: paired difference in accuracy, 95 % CI\n"
          "filled: held-out problems; open: training distribution", "difference in accuracy")
    panel(right, game, "(l) coordination game: SRPO-sqrt − GRPO\n"
          "95 % CI, mean expected reward, updates 1–20 (raw scale)", "difference in expected reward")
    fig.text(0.5, 0.005, "red: significant after Holm within the study; grey: not "
             "(python scripts/forest_plot.py)", ha="center", fontsize=8)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=130)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--docs", type=Path, default=DOCS)
    p.add_argument("--out", type=Path, default=DOCS / "img" / "forest.png")
    args = p.parse_args(argv)
    draw(args.docs, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
