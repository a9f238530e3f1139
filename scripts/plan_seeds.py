"""How many paired seeds does a method comparison need at GPU batch sizes?  Measure it.

    python scripts/plan_seeds.py --device cuda                 # one large GPU, < 10 min (see docs/scaling.md)
    python scripts/plan_seeds.py --device cpu --model tiny-llama --steps 1 --seeds 2 --tasks 2 --episodes 2

Runs a small study — 3 methods (SRPO sqrt, SRPO sum, GRPO) × ``--seeds`` paired seeds on the
5-worker ``parallel_aggregate`` team (every worker event K = 5), ``--tasks`` problems ×
``--episodes`` episodes per step, 4 optimizer steps per rollout (the clip acts), the embedded
SmolLM2-135M by default — evaluates every cell on the whole test part of one-digit addition
(24 problems never trained on, k = 4), and reports, for each method against GRPO, the SD of the
paired differences at this batch size and the paired seeds a true difference of 0.05 / 0.10 would
need for 80 % power (``srpo.stats``).  Writes ``<out>/plan.json`` and prints one table.  The
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
from srpo.study import comparisons, finished_records, load_study, run_study  # noqa: E402

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
        "overrides": {"model.name": args.model, "run.device": args.device, "run.steps": args.steps,
                      "workflow.options": {"num_workers": 5}, "workflow.max_new_tokens": args.max_new_tokens,
                      "train.tasks_per_step": args.tasks, "train.group_size": args.episodes, "train.minibatches": 4,
                      "train.lr": 1.0e-5, **({"model.autocast_bf16": False} if args.model.startswith("tiny") else {})},
        "axes": {"method": METHODS},
        "seeds": list(range(args.seeds)),
        "keep_checkpoints": False,
        "eval": {"k": 4, "temperature": 0.7, "datasets": [
            {"source": "synthetic_arithmetic", "level": 0, "n": 0, "split": "test", "name": "arith-L0-test"}]},
    }


def plan(records: list[dict], spec: dict) -> list[dict]:
    rows = []
    for c in comparisons(records, spec):
        if c["metric"] != "avg@4" or c["dataset"] != "macro" or c["sd"] is None:
            continue
        rows.append({"cell": c["cell"], "baseline": c["baseline"], "seeds": c["n"], "mean_difference": c["mean"],
                     "sd_paired": c["sd"],
                     "seeds_for_80_power": {str(e): stats.seeds_needed(c["sd"], e) for e in (0.05, 0.10)}})
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
    p.add_argument("--out", default="runs/plan-seeds")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    study_file = out / "plan_study.yaml"
    study_file.write_text(yaml.safe_dump(study_spec(args), sort_keys=False))
    started = time.perf_counter()
    run_study(study_file, progress=True)
    spec = load_study(study_file, check_cells=False)
    rows = plan(finished_records(spec, out), spec)
    report = {"settings": vars(args), "minutes": (time.perf_counter() - started) / 60, "comparisons": rows}
    (out / "plan.json").write_text(json.dumps(report, indent=1, allow_nan=False))
    print(f"\npaired differences against grpo at {args.tasks} tasks x {args.episodes} episodes per step "
          f"({args.seeds} seeds, {report['minutes']:.1f} min):")
    print("| cell | seeds | mean difference | SD of paired differences | seeds for 80% power at 0.05 | at 0.10 |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['cell']} | {r['seeds']} | {r['mean_difference']:+.3f} | {r['sd_paired']:.3f} | "
              f"{r['seeds_for_80_power']['0.05']} | {r['seeds_for_80_power']['0.1']} |")
    print(f"report: {out / 'plan.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
