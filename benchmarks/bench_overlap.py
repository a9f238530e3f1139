"""Benchmark 9: synchronous against overlapped rollouts (``rollout.max_staleness`` 0 against 1).

The same team workload both ways, alternated in one sitting: the demo's team (SmolLM2-135M,
``parallel_aggregate`` with 2 workers, SRPO) trained for ``--steps`` steps of 4 problems × 4
episodes on the train part of one-digit addition, then evaluated on the whole test part (24
problems × ``--k``).  Reported per mode: wall time per step (median over steps 2..N, the first
has nothing to overlap), rollout and update time, the fraction of the step in which rollout and
update were busy together (``time/overlap_s`` / ``time/step_s``), the mean staleness, and the
final held-out avg@k — the overlap must not cost learning.

    python benchmarks/bench_overlap.py --threads 2 --steps 10 --rounds 2

Each run is a fresh subprocess (its own allocator state), the modes alternate (sync, overlap,
sync, overlap ...) so that drift in the machine's speed hits both.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from _child import report, run_child  # benchmarks/_child.py: the child-process protocol

ROOT = Path(__file__).resolve().parents[1]


def child(staleness: int, threads: int, steps: int, k: int, run_dir: str, tis_cap: float = 0.0) -> dict:
    import torch

    from srpo import build
    from srpo.apps.demo import DEMO_CONFIG
    from srpo.build import config_from_dict
    from srpo.config import apply_overrides
    from srpo.evaluation import evaluate
    from srpo.runs.metrics_log import read_metrics
    from srpo.train import Trainer

    torch.set_num_threads(threads)
    data = json.loads(json.dumps(DEMO_CONFIG))
    apply_overrides(data, {"run.output_dir": run_dir, "run.steps": steps, "run.threads": threads,
                           "rollout.max_staleness": staleness, "eval.every": 0, "checkpoint.every": 0,
                           "train.tis_cap": tis_cap})
    cfg = config_from_dict(data)
    trainer = Trainer(cfg, progress=False, overwrite=True)
    trainer.fit()
    held_out = build.eval_sets(cfg, cfg.task.eval[:1], n=0)
    with torch.no_grad(), trainer.autocast():
        result = evaluate(trainer.policies, trainer.workflow, trainer.role_specs, held_out, k=k, temperature=0.7,
                          seed=1000, progress=False)
    trainer.close()
    rows = read_metrics(Path(run_dir))[1:]  # the first step has nothing to overlap with
    med = lambda key: statistics.median(r.get(key, 0.0) for r in rows)  # noqa: E731
    return {"staleness": staleness, "step_s": med("time/step_s"), "rollout_s": med("time/rollout_s"),
            "update_s": med("time/update_s"), "wait_s": med("time/rollout_wait_s"),
            "both_busy": statistics.median(r.get("time/overlap_s", 0.0) / r["time/step_s"] for r in rows),
            "staleness_mean": statistics.mean(r["rollout/staleness_mean"] for r in rows),
            "held_out_avg": result["macro"][f"avg@{k}"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("-k", type=int, default=4)
    parser.add_argument("--tis-cap", type=float, default=0.0,
                        help="train.tis_cap for both modes (0: off; the overlapped mode's one-version gap is what it corrects)")
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", default="", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="runs/bench_overlap.json")
    args = parser.parse_args()
    if args.child is not None:
        report(child(args.child, args.threads, args.steps, args.k, args.run_dir, args.tis_cap))
        return 0
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for staleness in (0, 1):
                measured = run_child([__file__, "--child", staleness, "--threads", args.threads, "--steps", args.steps,
                                      "-k", args.k, "--tis-cap", args.tis_cap, "--run-dir", f"{tmp}/r{r}-s{staleness}"],
                                     env={"PYTHONPATH": str(ROOT), **os.environ}, what=f"max_staleness {staleness}")
                row = {"round": r, **measured}
                results.append(row)
                print(json.dumps(row), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    print("\n| max_staleness | round | step (s) | rollout (s) | update (s) | wait (s) | both busy | staleness | held-out avg@k |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in results:
        print(f"| {row['staleness']} | {row['round']} | {row['step_s']:.2f} | {row['rollout_s']:.2f} | "
              f"{row['update_s']:.2f} | {row['wait_s']:.2f} | {row['both_busy']:.0%} | {row['staleness_mean']:.2f} | "
              f"{row['held_out_avg']:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
