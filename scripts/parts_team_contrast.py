"""Study (n)'s co-primary: the credit contrast, [srpo − grpo]_joint − [srpo − grpo]_decomposable.

    python scripts/parts_team_contrast.py runs/study-parts-team/results.json
    python scripts/parts_team_contrast.py runs/study-parts-team/results.json --policy shared

Declared in ``configs/studies/parts_team.yaml`` before any cell ran: per seed, SRPO's edge over
GRPO in held-out per-part accuracy under the joint reward minus the same edge under the
decomposable control (both with the same policy layout), then the paired test of those per-seed
contrasts (:func:`srpo.stats.paired`: mean, 95 % t interval, t p and the exact sign-flip p).  A set
unit that helps *credit* predicts a contrast above 0.  The same is printed for joint accuracy
(avg@k) as a secondary.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from srpo import stats  # noqa: E402

DATASET = "parts-test"


def per_seed(cells: list[dict], label: str, metric: str) -> dict[int, float]:
    return {c["seed"]: c["eval"]["datasets"][DATASET][metric] for c in cells
            if c["label"] == label and metric in c["eval"]["datasets"].get(DATASET, {})}


def contrast(cells: list[dict], policy: str, metric: str) -> dict:
    """The paired test of the per-seed credit contrasts (seeds with all four cells)."""
    edge = {}
    for reward in ("joint", "decomposable"):
        srpo, grpo = (per_seed(cells, f"{m}-{reward}-{policy}", metric) for m in ("srpo", "grpo"))
        edge[reward] = {s: srpo[s] - grpo[s] for s in srpo.keys() & grpo.keys()}
    seeds = sorted(edge["joint"].keys() & edge["decomposable"].keys())
    if len(seeds) < 2:
        raise SystemExit(f"{policy}, {metric}: {len(seeds)} seed(s) with all four cells; the contrast needs 2 or more")
    test = stats.paired([edge["joint"][s] - edge["decomposable"][s] for s in seeds])
    return {"policy": policy, "metric": metric, "seeds": seeds, **test,
            "edge_joint": stats.paired([edge["joint"][s] for s in seeds])["mean"],
            "edge_decomposable": stats.paired([edge["decomposable"][s] for s in seeds])["mean"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", type=Path, help="the study's results.json")
    p.add_argument("--policy", choices=["lora", "shared"], default="lora")
    p.add_argument("-k", type=int, default=4)
    args = p.parse_args(argv)
    cells = json.loads(args.results.read_text())["cells"]
    for metric in ("per_part", f"avg@{args.k}"):
        c = contrast(cells, args.policy, metric)
        lo, hi = c["ci95"]
        print(f"{args.policy}, {metric}: edge joint {c['edge_joint']:+.3f}, decomposable {c['edge_decomposable']:+.3f}; "
              f"contrast {c['mean']:+.3f} [{lo:+.3f}, {hi:+.3f}], t p {c['p_t']:.3f}, sign-flip p "
              f"{c['p_sign_flip']:.3f}, n {c['n']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
