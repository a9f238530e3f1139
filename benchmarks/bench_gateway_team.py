"""The same team as a built-in workflow and as an ``openai``-client program through the gateway:
rollout seconds per team token, side by side.

    python benchmarks/bench_gateway_team.py                    # 3 rounds of 4 steps each side

The demo's team on the study recipe (``configs/studies/math_base.yaml``: SmolLM2-135M, two
workers and an aggregator, 4 problems × 4 episodes a step, ≤ 24 tokens): srpo's built-in
``parallel_aggregate`` against the same team as an ``openai``-client program
(``benchmarks/gateway_team_program.py``: the built-in's roles and prompt texts, the aggregator
reading the workers' extracted answers as the built-in's does) trained through the gateway, its
program in worker processes (``gateway``, the default isolation) and in threads
(``gateway_thread``), each also with the program keeping one ``OpenAI`` client per process
(``*_shared_client``: building a client cost about 20 ms of CPU, its SSL context, until the
processes that run programs shared one — ``srpo/workflows/ssl_reuse.py``; now about 0.1 ms).  Each side trains ``--steps`` steps in a fresh child process, alternating,
``--rounds`` times.  Per run: the rollout's seconds per team token over steps 2.. (step 1 of a
program side also starts its workers, reported on its own), and the ratio of the medians to the
built-in's; and the seconds a step spends outside its sampling calls.  The sides' completions
differ (a program's calls race, so a batch's rows and draws differ), hence their sampling work: the
built-in's rollout of a step with a side's extra time outside sampling added, over the built-in's,
states what the gateway costs at equal sampling work.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from _child import report, run_child  # benchmarks/_child.py: the child-process protocol

ROOT = Path(__file__).resolve().parents[1]
PROGRAM = f"{ROOT}/benchmarks/gateway_team_program.py:solve"
SIDES = {
    "builtin": ["workflow.name=parallel_aggregate", "workflow.options={num_workers: 2}"],
    # the built-in's roles and prompts through the gateway, its program in worker processes (the
    # default) or in threads of the trainer's process
    "gateway": ["workflow.name=openai_agent", "workflow.roles={}",
                f"workflow.options={{entry: '{PROGRAM}', roles: [worker_1, worker_2, aggregator]}}"],
    "gateway_thread": ["workflow.name=openai_agent", "workflow.roles={}",
                       f"workflow.options={{entry: '{PROGRAM}', roles: [worker_1, worker_2, aggregator], "
                       f"isolation: thread}}"],
    # the same program keeping one client per process
    "gateway_shared_client": ["workflow.name=openai_agent", "workflow.roles={}",
                              f"workflow.options={{entry: '{PROGRAM}_shared_client', "
                              f"roles: [worker_1, worker_2, aggregator]}}"],
    "gateway_thread_shared_client": ["workflow.name=openai_agent", "workflow.roles={}",
                                     f"workflow.options={{entry: '{PROGRAM}_shared_client', "
                                     f"roles: [worker_1, worker_2, aggregator], isolation: thread}}"],
}


def child(side: str, steps: int, threads: int, out: str) -> dict:
    import sys

    sys.path.insert(0, str(ROOT))
    from srpo.build import load_config
    from srpo.train.loop import Trainer

    cfg = load_config(ROOT / "configs/studies/math_base.yaml",
                      [*SIDES[side], f"run.steps={steps}", f"run.threads={threads}", f"run.output_dir={out}"])
    trainer = Trainer(cfg, progress=False, overwrite=True)
    calls: list[tuple[int, int, float]] = []  # every sampling call of the rollouts: its step, rows and seconds
    generate = trainer.engine.generate

    def counted(requests, *args, **kwargs):
        start = time.perf_counter()
        try:
            return generate(requests, *args, **kwargs)
        finally:
            calls.append((trainer.step, len(requests), time.perf_counter() - start))
    trainer.engine.generate = counted
    try:
        history = trainer.fit()
    finally:
        trainer.close()
    return {"rollout_s": [h["time/rollout_s"] for h in history], "team_tokens": [h["team_tokens"] for h in history],
            "step_s": [h["time/step_s"] for h in history], "calls": len(calls),
            "rows": sum(n for _, n, _ in calls), "sampling_s": sum(t for _, _, t in calls),
            "sampling_by_step": [sum(t for s, _, t in calls if s == step) for step in range(len(history))]}


def outside_sampling(run: dict, first: int = 1) -> float:
    """Rollout seconds a step spends outside the sampling calls (the gateway, the programs, the
    batch windows; the built-in's runtime), mean over the steps from ``first`` on."""
    rest = [r - s for r, s in zip(run["rollout_s"][first:], run["sampling_by_step"][first:])]
    return sum(rest) / max(len(rest), 1)


def per_token(run: dict, first: int = 1) -> float:
    """Rollout seconds per team token over the steps from ``first`` on."""
    return sum(run["rollout_s"][first:]) / max(sum(run["team_tokens"][first:]), 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--sides", default=",".join(SIDES), help="comma-separated, builtin among them")
    ap.add_argument("--child", choices=list(SIDES))
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    if args.child:
        report(child(args.child, args.steps, args.threads, args.out))
        return
    sides = args.sides.split(",")
    runs: dict[str, list[dict]] = {side: [] for side in sides}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for side in sides:
                run = run_child([__file__, "--child", side, "--steps", args.steps, "--threads", args.threads,
                                 "--out", f"{tmp}/{side}-{r}"], what=side)
                runs[side].append(run)
                print(f"round {r + 1} {side}: {1e3 * per_token(run):.2f} ms per team token over steps 2..{args.steps} "
                      f"(step 1: {1e3 * run['rollout_s'][0] / max(run['team_tokens'][0], 1):.2f}; "
                      f"tokens {run['team_tokens']}; {run['calls']} sampling calls, {run['rows']} rows, "
                      f"{run['sampling_s']:.1f} s of {sum(run['rollout_s']):.1f} s of rollout inside them)", flush=True)
    med = {side: statistics.median(per_token(run) for run in rs) for side, rs in runs.items()}
    outside = {side: statistics.median(outside_sampling(run) for run in rs) for side, rs in runs.items()}
    # The built-in's rollout of a step with this side's extra time outside sampling added: what the
    # gateway costs at equal sampling work (the sides' completions, hence their sampling, differ).
    step_rollout = statistics.median(statistics.mean(run["rollout_s"][1:]) for run in runs["builtin"])
    print(f"\n| side | rollout ms per team token (median of {args.rounds}) | / built-in | s outside sampling "
          f"a step (median) | built-in rollout + the extra, / built-in |\n|---|---:|---:|---:|---:|")
    for side in sides:
        extra = (step_rollout + outside[side] - outside["builtin"]) / step_rollout
        print(f"| {side} | {1e3 * med[side]:.2f} | {med[side] / med['builtin']:.2f}× | {outside[side]:.3f} | "
              f"{extra:.2f}× |")


if __name__ == "__main__":
    main()
