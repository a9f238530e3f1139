"""How many paired seeds does a method comparison need at GPU batch sizes?  Measure it.

    python scripts/plan_seeds.py --device cuda                 # one large GPU, < 10 min (see docs/scaling.md)
    python scripts/plan_seeds.py --device cpu --model tiny-llama --steps 1 --seeds 2 --tasks 2 --episodes 2

Runs a small study — 3 methods (SRPO sqrt, SRPO sum, GRPO) × ``--seeds`` paired seeds on the
5-worker ``parallel_aggregate`` team (every worker event K = 5), ``--tasks`` problems ×
``--episodes`` episodes per step, 4 optimizer steps per rollout (the clip acts), the embedded
SmolLM2-135M by default — trains on two-digit addition (``--level 2``) and evaluates every cell on
400 problems of its test part (332 distinct problems never trained on — a + b and b + a count
once; one-digit addition's whole test part is 24 items, 13 distinct: too few to measure with),
k = 4, and reports, for each method against GRPO, the SD of the paired differences at this batch
size, the share of that variance the evaluation's own sampling noise can account for (at most
p(1 − p)/(items·k) per cell), and the paired seeds a true difference of 0.05 / 0.10 would need
for 80 % power (``srpo.stats``).  Writes ``<out>/plan.json`` and prints one table.  The
study is resumable: run the command again after an interruption.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from srpo import stats  # noqa: E402
from srpo.apps.study.runner import finished_records, run_study  # noqa: E402
from srpo.apps.study.schema import heldout_sizes, load_study  # noqa: E402
from srpo.apps.study.statistics import comparisons  # noqa: E402
from srpo.tasks.math import synthetic_arithmetic  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
METHODS = [{"label": "grpo", "set": {"method.name": "grpo"}},
           {"label": "srpo", "set": {"method.name": "srpo", "method.set_reduction": "sqrt"}},
           {"label": "srpo_sum", "set": {"method.name": "srpo", "method.set_reduction": "sum"}}]


def study_spec(args) -> dict:
    return {
        "description": f"Seed planning: 3 methods x {args.seeds} seeds, {args.tasks} tasks x {args.episodes} episodes "
                       f"per step on {args.device} ({args.model}).",
        "output_dir": str(Path(args.out).resolve()),
        "base": str(ROOT / "configs" / "studies" / "math_base.yaml"),
        "baseline": "grpo",
        "overrides": {"model.name": args.model, "task.train.level": args.level, "run.device": args.device, "run.steps": args.steps,
                      "workflow.options": {"num_workers": 5}, "workflow.max_new_tokens": args.max_new_tokens,
                      "train.tasks_per_step": args.tasks, "train.group_size": args.episodes, "train.minibatches": 4,
                      "train.lr": 1.0e-5, **({"model.autocast_bf16": False} if args.model.startswith("tiny") else {})},
        "axes": {"method": METHODS},
        "seeds": list(range(args.seeds)),
        "keep_checkpoints": False,
        "eval": {"k": 4, "temperature": 0.7, "datasets": [
            {"source": "synthetic_arithmetic", "level": args.level, "n": args.eval_n, "seed": 999, "split": "test",
             "name": f"arith-L{args.level}-test"}]},
    }


def evaluation_variance(records: list[dict], label: str, items: int, k: int) -> float:
    """The variance one evaluation adds to a cell's avg@k, from its mean accuracy p: at most
    p(1 − p) / (items · k) — k samples of each of ``items`` problems, Bernoulli; equal to it when
    every problem has the same success rate, below it otherwise (an upper bound)."""
    values = [r["eval"]["macro"][f"avg@{k}"] for r in records if r["label"] == label]
    p = sum(values) / len(values)
    return p * (1 - p) / (items * k)


def plan(records: list[dict], spec: dict, items: int = 0, k: int = 4) -> list[dict]:
    rows = []
    for c in comparisons(records, spec):
        if c["metric"] != f"avg@{k}" or c["dataset"] != "macro" or c["sd"] is None:
            continue
        row = {"cell": c["cell"], "baseline": c["baseline"], "seeds": c["n"], "mean_difference": c["mean"],
               "sd_paired": c["sd"],
               "seeds_for_80_power": {str(e): stats.seeds_needed(c["sd"], e) for e in (0.05, 0.10)}}
        if items:
            # The two cells' evaluation noise against the whole spread of their paired difference.
            noise = evaluation_variance(records, c["cell"], items, k) + evaluation_variance(records, c["baseline"],
                                                                                           items, k)
            row["evaluation_share_of_variance"] = min(1.0, noise / c["sd"] ** 2) if c["sd"] > 0 else None
        rows.append(row)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--seeds", type=int, default=4)
    p.add_argument("--tasks", type=int, default=16)
    p.add_argument("--episodes", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--level", type=int, default=2, help="arithmetic level trained and evaluated (2: two-digit a + b)")
    p.add_argument("--eval-n", type=int, default=400, help="problems drawn from the level's test part (0: all)")
    p.add_argument("--out", default="runs/plan-seeds")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    study_file = out / "plan_study.yaml"
    study_file.write_text(yaml.safe_dump(study_spec(args), sort_keys=False))
    started = time.perf_counter()
    run_study(study_file, progress=True)
    spec = load_study(study_file, check_cells=False)
    sizes = heldout_sizes(spec)
    items = len(synthetic_arithmetic(args.eval_n, level=args.level, seed=999, split="test"))
    rows = plan(finished_records(spec, out), spec, items=items)
    report = {"settings": vars(args), "minutes": (time.perf_counter() - started) / 60,
              "heldout": {"items": items, "distinct_problems": sizes}, "comparisons": rows}
    (out / "plan.json").write_text(json.dumps(report, indent=1, allow_nan=False))
    print(f"\npaired differences against grpo at {args.tasks} tasks x {args.episodes} episodes per step "
          f"({args.seeds} seeds, {report['minutes']:.1f} min):")
    print(f"held-out: {items} items, {', '.join(f'{k} {v} distinct problems' for k, v in sizes.items())}")
    print("| cell | seeds | mean difference | SD of paired differences | evaluation's share of its variance (at most) "
          "| seeds for 80% power at 0.05 | at 0.10 |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        share = r.get("evaluation_share_of_variance")
        print(f"| {r['cell']} | {r['seeds']} | {r['mean_difference']:+.3f} | {r['sd_paired']:.3f} | "
              f"{'–' if share is None else f'{share:.0%}'} | "
              f"{r['seeds_for_80_power']['0.05']} | {r['seeds_for_80_power']['0.1']} |")
    print(f"report: {out / 'plan.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
