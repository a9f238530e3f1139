"""Study (n)'s declared comparisons, all of them in one table, from the cells' per-seed results.

    python scripts/parts_team_contrast.py runs/study-parts-team/results.json
    python scripts/parts_team_contrast.py runs/study-parts-team/results.json --json comparisons.json

Declared in ``configs/studies/parts_team.yaml`` before any cell ran:

- **primary**: SRPO − GRPO under the joint reward with per-role LoRA, in held-out per-part
  accuracy, paired by seed (two-sided paired t at 5 %, the exact sign-flip p beside it);
- **co-primary, the credit contrast**: [SRPO − GRPO]_joint − [SRPO − GRPO]_decomposable, per-role
  LoRA, the same metric, paired by seed — a set unit that helps *credit* predicts a contrast above 0;
- **secondary**, Holm-adjusted with every other comparison: the same under one shared model, the
  edges under the decomposable reward, and all of it again in joint accuracy (avg@k: every part
  right).

Printed: each cell's held-out means beside the untrained team's; then every comparison (12: the four
edges and two contrasts, in both metrics) with its paired t interval, t and sign-flip p, the Holm-
adjusted p across all 12, and its realised SD with the smallest difference 20 seeds would find 80 %
of the time (what a non-significant result could and could not exclude). The primary and the
co-primary are judged on their own p, as declared; their Holm-adjusted p is printed too.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from srpo import stats  # noqa: E402

DATASET = "parts-test"
REWARDS = ("joint", "decomposable")
POLICIES = ("lora", "shared")
PRIMARY_METRIC = "per_part"


def per_seed(cells: list[dict], label: str, metric: str) -> dict[int, float]:
    """seed → the cell's held-out ``metric`` (cells without it are left out)."""
    return {c["seed"]: c["eval"]["datasets"][DATASET][metric] for c in cells
            if c["label"] == label and metric in c["eval"]["datasets"].get(DATASET, {})}


def edges(cells: list[dict], reward: str, policy: str, metric: str) -> dict[int, float]:
    """seed → SRPO − GRPO in ``metric`` under ``reward`` and ``policy`` (seeds with both cells)."""
    srpo, grpo = (per_seed(cells, f"{m}-{reward}-{policy}", metric) for m in ("srpo", "grpo"))
    return {s: srpo[s] - grpo[s] for s in sorted(srpo.keys() & grpo.keys())}


def _test(name: str, metric: str, by_seed: dict[int, float], role: str) -> dict:
    if len(by_seed) < 2:
        raise SystemExit(f"{name}, {metric}: {len(by_seed)} seed(s) with every cell it needs; a paired test needs 2 or more")
    test = stats.paired(list(by_seed.values()))
    # A declared primary (or co-primary) is judged on its own p, as stats.adjust judges a primary.
    return {"comparison": name, "metric": metric, "role": role, "primary": role != "secondary",
            "seeds": sorted(by_seed), **test, "detectable_80": stats.detectable(test["sd"], test["n"])}


def comparisons(cells: list[dict], k: int = 4) -> list[dict]:
    """The study's 12 declared comparisons, Holm-adjusted across all of them (``p_t_holm``,
    ``p_sign_flip_holm``); ``role``: primary, co-primary or secondary."""
    out = []
    for metric in (PRIMARY_METRIC, f"avg@{k}"):
        main = metric == PRIMARY_METRIC
        for policy in POLICIES:
            edge = {reward: edges(cells, reward, policy, metric) for reward in REWARDS}
            for reward in REWARDS:
                role = "primary" if main and (reward, policy) == ("joint", "lora") else "secondary"
                out.append(_test(f"srpo − grpo, {reward}, {policy}", metric, edge[reward], role))
            both = edge["joint"].keys() & edge["decomposable"].keys()
            contrast = {s: edge["joint"][s] - edge["decomposable"][s] for s in sorted(both)}
            role = "co-primary" if main and policy == "lora" else "secondary"
            out.append(_test(f"credit contrast (joint − decomposable edge), {policy}", metric, contrast, role))
    stats.adjust(out)
    return out


def cell_means(cells: list[dict], k: int = 4) -> list[tuple[str, int, dict[str, tuple[float, float]]]]:
    """(label, seeds, metric → (mean, SE over seeds)) for every cell, the untrained team first."""
    labels = sorted({c["label"] for c in cells}, key=lambda lb: (not lb.startswith("untrained"), lb))
    rows = []
    for label in labels:
        values = {m: list(per_seed(cells, label, m).values()) for m in (PRIMARY_METRIC, f"avg@{k}")}
        rows.append((label, len(values[PRIMARY_METRIC]), {m: stats.mean_se(v) for m, v in values.items() if v}))
    return rows


def _fmt(x: float | None, sign: bool = True) -> str:
    return "–" if x is None else (f"{x:+.3f}" if sign else f"{x:.3f}")


def report(cells: list[dict], k: int = 4) -> tuple[str, list[dict]]:
    """The two markdown tables, and the comparisons behind the second."""
    lines = [f"| cell | seeds | held-out per-part accuracy (SE) | all parts right, avg@{k} (SE) |", "|---|---:|---:|---:|"]
    for label, n, means in cell_means(cells, k):
        cols = [f"{means[m][0]:.3f} ({means[m][1]:.3f})" if m in means and n > 1 else
                (f"{means[m][0]:.3f}" if m in means else "–") for m in (PRIMARY_METRIC, f"avg@{k}")]
        lines.append(f"| {label} | {n} | {cols[0]} | {cols[1]} |")
    comps = comparisons(cells, k)
    lines += ["", f"| comparison | metric | role | seeds | mean difference | 95 % t CI | p (t) | p (sign-flip) | "
                  f"p (t, Holm over {len(comps)}) | verdict | SD of the paired differences | 80 % power at |",
              "|---|---|---|---:|---:|---:|---:|---:|---:|---|---:|---:|"]
    for c in comps:
        lo, hi = c["ci95"]
        lines.append(f"| {c['comparison']} | {c['metric']} | {c['role']} | {c['n']} | {_fmt(c['mean'])} | "
                     f"[{lo:+.3f}, {hi:+.3f}] | {stats.fmt_p(c['p_t'])} | {stats.fmt_p(c['p_sign_flip'])} | "
                     f"{stats.fmt_p(c['p_t_holm'])} | {c['verdict']} | {_fmt(c['sd'], False)} | {_fmt(c['detectable_80'], False)} |")
    return "\n".join(lines), comps


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", type=Path, help="the study's results.json")
    p.add_argument("-k", type=int, default=4, help="the evaluation's samples per problem (avg@k)")
    p.add_argument("--json", type=Path, help="also write the comparisons here")
    args = p.parse_args(argv)
    cells = json.loads(args.results.read_text())["cells"]
    text, comps = report(cells, args.k)
    print(text)
    if args.json:
        args.json.write_text(json.dumps(comps, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
