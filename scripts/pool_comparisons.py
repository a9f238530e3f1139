"""Pool one paired comparison across several studies' results files (strict JSON from `srpo study`).

    python scripts/pool_comparisons.py \
        docs/results_cardinality.json:srpo_sum:srpo docs/results_reduction_clip.json:sum:sqrt

Each argument is RESULTS_JSON:CELL:BASELINE; the seed-by-seed differences of macro avg@k (the
metric is the study's own k) are pooled into one sample (seeds of different studies are
independent runs) and tested as `srpo study` tests one comparison: mean, SE, 95% t interval,
t-test p and the exact sign-flip p.  Prints one markdown table.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from srpo import stats  # noqa: E402


def differences(path: str, cell: str, baseline: str) -> list[float]:
    records = json.loads(Path(path).read_text())["cells"]
    metric = next(m for m in records[0]["eval"]["macro"] if m.startswith("avg@"))
    base = {r["seed"]: r["eval"]["macro"][metric] for r in records if r["label"] == baseline}
    return [r["eval"]["macro"][metric] - base[r["seed"]] for r in records if r["label"] == cell and r["seed"] in base]


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    rows, pooled = [], []
    for arg in argv:
        path, cell, baseline = arg.rsplit(":", 2)
        d = differences(path, cell, baseline)
        pooled += d
        rows.append((f"{Path(path).stem}: {cell} − {baseline}", stats.paired(d)))
    rows.append(("pooled", stats.paired(pooled)))
    print("| comparison | seeds | mean difference | SE | 95% t CI | + / − | p (t) | p (exact sign-flip) |")
    print("|---|---:|---:|---:|---|---|---:|---:|")
    for name, t in rows:
        ci = f"[{t['ci95'][0]:+.3f}, {t['ci95'][1]:+.3f}]" if t["ci95"] else "–"
        se = f"{t['se']:.3f}" if t["se"] is not None else "–"
        print(f"| {name} | {t['n']} | {t['mean']:+.3f} | {se} | {ci} | {t.get('positive', '–')} / "
              f"{t.get('negative', '–')} | {stats.fmt_p(t['p_t'])} | {stats.fmt_p(t['p_sign_flip'])} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
