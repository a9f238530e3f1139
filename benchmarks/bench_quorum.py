"""Benchmark 21: steps that close on a quorum of their task groups (``rollout.quorum``) against
steps that wait for every episode, under a long-tailed workload.

The demo's team (SmolLM2-135M, ``parallel_aggregate`` with 2 workers, SRPO, 4 problems × 4
episodes a step) on one-digit addition, with a tail: each episode's reward call sleeps
``--tail-s`` seconds with probability ``--tail-p`` (a slow grader, tool or sandbox — with the
default ``--tail-s`` such an episode takes about nine times as long as a step's whole rollout
without one on this CPU; the shortest rollout of a step is reported so that the ratio can be
read).  The sleep draws come from one seeded stream per run: the same sequence in every mode,
though which episodes they fall on follows the order in which rewards are called.  Both modes train ``--steps`` steps with ``train.tis_cap`` on and are then evaluated on the
whole test part (24 problems × ``--k``).

Reported per mode: the mean and median step time (the mean is what a tail costs), the run's
training time, the episodes trained, the groups still running when steps closed, the staleness
of what was trained (mean and max), and the held-out avg@k after the last step — the learning
cost beside the time gain.  One seed: a held-out difference of a few hundredths is within what a
seed moves (benchmark 9, study (k)).

    python benchmarks/bench_quorum.py --threads 2 --steps 8 --rounds 1 --quorums 1,0.75,0.5

Each run is a fresh subprocess; the modes alternate within a round.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from _child import report, run_child  # benchmarks/_child.py: the child-process protocol

ROOT = Path(__file__).resolve().parents[1]


def long_tailed(reward_fn, p: float, tail_s: float, seed: int):
    """``reward_fn`` that first sleeps ``tail_s`` on a fraction ``p`` of its calls (one seeded
    stream of draws) — and counts the slow calls in ``.slow``."""
    rng, lock = random.Random(seed), threading.Lock()

    def reward(task, answer):
        with lock:
            slow = rng.random() < p
            reward.slow += slow
        if slow:
            time.sleep(tail_s)
        return reward_fn(task, answer)

    reward.slow = 0
    return reward


def child(quorum: float, args, run_dir: str) -> dict:
    import torch

    from srpo import build
    from srpo.apps.demo import DEMO_CONFIG
    from srpo.build import config_from_dict
    from srpo.config import apply_overrides
    from srpo.evaluation import evaluate
    from srpo.runs.metrics_log import read_metrics
    from srpo.train import Trainer

    torch.set_num_threads(args.threads)
    data = json.loads(json.dumps(DEMO_CONFIG))
    apply_overrides(data, {"run.output_dir": run_dir, "run.steps": args.steps, "run.threads": args.threads,
                           "rollout.quorum": quorum, "eval.every": 0, "checkpoint.every": 0,
                           "train.tis_cap": args.tis_cap, "task.reward_timeout_s": args.tail_s + 60})
    cfg = config_from_dict(data)
    reward = long_tailed(build.reward(cfg), args.tail_p, args.tail_s, seed=args.seed)
    trainer = Trainer(cfg, progress=False, overwrite=True, reward_fn=reward)
    start = time.perf_counter()
    trainer.fit()
    train_s = time.perf_counter() - start
    held_out = build.eval_sets(cfg, cfg.task.eval[:1], n=0)
    with torch.no_grad(), trainer.autocast():
        result = evaluate(trainer.policies, trainer.workflow, trainer.role_specs, held_out, k=args.k, temperature=0.7,
                          seed=1000, progress=False)
    trainer.close()
    rows = read_metrics(Path(run_dir))
    steps = [r["time/step_s"] for r in rows]
    return {"quorum": quorum, "step_mean_s": statistics.mean(steps), "step_median_s": statistics.median(steps),
            "rollout_min_s": min(r["time/rollout_s"] for r in rows), "train_s": train_s, "episodes": sum(r["episodes"] for r in rows), "slow_drawn": reward.slow,
            "stragglers_mean": statistics.mean(r.get("rollout/stragglers", 0) for r in rows),
            "staleness_mean": statistics.mean(r["rollout/staleness_mean"] for r in rows),
            "staleness_max": max(r["rollout/staleness_max"] for r in rows),
            "held_out_avg": result["macro"][f"avg@{args.k}"]}


def table(results: list[dict]) -> str:
    lines = ["| quorum | round | step mean (s) | step median (s) | shortest rollout (s) | training (s) | episodes trained | slow drawn | "
             "groups running at close | staleness mean / max | held-out avg@k |", "|---:" * 11 + "|"]
    for r in results:
        lines.append(f"| {r['quorum']:g} | {r['round']} | {r['step_mean_s']:.2f} | {r['step_median_s']:.2f} | "
                     f"{r['rollout_min_s']:.2f} | {r['train_s']:.0f} | {r['episodes']:.0f} | {r['slow_drawn']} | {r['stragglers_mean']:.2f} | "
                     f"{r['staleness_mean']:.2f} / {r['staleness_max']} | {r['held_out_avg']:.3f} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--quorums", default="1,0.75,0.5", help="comma-separated rollout.quorum values, alternated")
    parser.add_argument("--tail-p", type=float, default=1 / 8, help="the fraction of episodes that are slow")
    parser.add_argument("--tail-s", type=float, default=12.0, help="how long a slow episode's reward sleeps")
    parser.add_argument("--tis-cap", type=float, default=2.0)
    parser.add_argument("--seed", type=int, default=0, help="the slow draws' stream")
    parser.add_argument("-k", type=int, default=4)
    parser.add_argument("--child", type=float, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", default="", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="runs/bench_quorum.json")
    args = parser.parse_args()
    if args.child is not None:
        report(child(args.child, args, args.run_dir))
        return 0
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for quorum in map(float, args.quorums.split(",")):
                measured = run_child([__file__, "--child", quorum, "--threads", args.threads, "--steps", args.steps,
                                      "--tail-p", args.tail_p, "--tail-s", args.tail_s, "--tis-cap", args.tis_cap,
                                      "--seed", args.seed, "-k", args.k, "--run-dir", f"{tmp}/r{r}-q{quorum}"],
                                     env={"PYTHONPATH": str(ROOT), **os.environ}, what=f"quorum {quorum}")
                results.append({"round": r, **measured})
                print(json.dumps(results[-1]), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    print("\n" + table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
