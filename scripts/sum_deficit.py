"""Study (i): what drives sum's deficit against sqrt — the clip or the gradient share?

    python scripts/sum_deficit.py docs/results_sum_deficit.json

From the study's strict-JSON results: the three declared contrasts (sum − sqrt at one optimizer
step per rollout, at four, and under per-role LoRA at four; Holm-adjusted as the study reports
them), the interaction (the four-step deficit minus the one-step deficit, paired by seed), and
the mechanism behind each cell (clip fraction and gradient share of the K = 5 worker sets).
Prints markdown.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from srpo import stats  # noqa: E402

CONTRASTS = [("sum-1step", "sqrt-1step", "1 optimizer step (no clip)"),
             ("sum-4steps", "sqrt-4steps", "4 optimizer steps (clip acts)"),
             ("lora-sum-4steps", "lora-sqrt-4steps", "per-role LoRA, 4 steps (clip only)")]


def values(cells: list[dict], label: str, metric: str) -> dict[int, float]:
    return {c["seed"]: c["eval"]["macro"][metric] for c in cells if c["label"] == label}


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    results = json.loads(Path(argv[0]).read_text())
    cells = results["cells"]
    metric = next(m for m in cells[0]["eval"]["macro"] if m.startswith("avg@"))
    comps = {(c["cell"], c["baseline"]): c for c in results.get("comparisons", [])
             if c["metric"] == metric and c["dataset"] == "macro"}
    print(f"| contrast ({metric}, test part) | seeds | sqrt | sum | sum − sqrt | 95% CI | p (t) | p (Holm) | "
          f"p (sign-flip) | sum < sqrt in |")
    print("|---|---:|---:|---:|---:|---|---:|---:|---:|---:|")
    for cell, base, what in CONTRASTS:
        a, b = values(cells, base, metric), values(cells, cell, metric)
        seeds = sorted(set(a) & set(b))
        if not seeds:
            continue
        c = comps.get((cell, base)) or {**stats.paired([b[s] - a[s] for s in seeds]), "p_t_holm": None}
        ci = f"[{c['ci95'][0]:+.3f}, {c['ci95'][1]:+.3f}]" if c.get("ci95") else "–"
        below = sum(b[s] < a[s] for s in seeds)
        print(f"| {what} | {len(seeds)} | {sum(a[s] for s in seeds) / len(seeds):.3f} | "
              f"{sum(b[s] for s in seeds) / len(seeds):.3f} | {c['mean']:+.3f} | {ci} | {stats.fmt_p(c['p_t'])} | "
              f"{stats.fmt_p(c.get('p_t_holm'))} | {stats.fmt_p(c['p_sign_flip'])} | {below} of {len(seeds)} |")
    s1, q1 = values(cells, "sum-1step", metric), values(cells, "sqrt-1step", metric)
    s4, q4 = values(cells, "sum-4steps", metric), values(cells, "sqrt-4steps", metric)
    seeds = sorted(set(s1) & set(q1) & set(s4) & set(q4))
    if seeds:
        inter = stats.paired([(s4[s] - q4[s]) - (s1[s] - q1[s]) for s in seeds])
        ci = f"[{inter['ci95'][0]:+.3f}, {inter['ci95'][1]:+.3f}]" if inter.get("ci95") else "–"
        print(f"\nInteraction (4-step deficit − 1-step deficit, paired by seed, {len(seeds)} seeds): "
              f"{inter['mean']:+.3f}, 95% CI {ci}, p (t) {stats.fmt_p(inter['p_t'])}, "
              f"p (sign-flip) {stats.fmt_p(inter['p_sign_flip'])} — unadjusted, a secondary analysis.")
    mech = results.get("mechanism", {})
    print("\n| cell | clip fraction, K = 5 sets | clip fraction, K = 1 | gradient share of the K = 5 sets |")
    print("|---|---:|---:|---:|")
    for label in ("sqrt-1step", "sum-1step", "sqrt-4steps", "sum-4steps", "lora-sqrt-4steps", "lora-sum-4steps"):
        m = mech.get(label) or {}
        k5, k1 = m.get("5", {}), m.get("1", {})

        def f(d, key):
            v = d.get(key, {})
            if v.get("mean") is None:
                return "–"
            return f"{v['mean']:.3f} ± {v['se']:.3f}" if v.get("se") is not None else f"{v['mean']:.3f}"

        print(f"| {label} | {f(k5, 'clip_frac')} | {f(k1, 'clip_frac')} | {f(k5, 'grad_share')} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
