"""Benchmark 2: team rollout throughput — `parallel_aggregate` (N=4) versus `single`.

Both generate for the same 8 tasks × 4 episodes with SmolLM2-135M (bf16 autocast, temperature 1,
≤ 64 new tokens).  The team asks 4 workers per episode and then an aggregator; the runtime batches
every pending request across episodes and roles.  Reports generated tokens per second of each
and the ratio (goal: team ≥ 0.8 × single).  Runs alternate, `--rounds` times; medians reported.

    python benchmarks/bench_rollout.py --threads 2 --rounds 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from srpo.policies import SamplingParams, build_policies
    from srpo.tasks.math import synthetic_arithmetic
    from srpo.tasks.rewards import task_reward
    from srpo.rollout.builtin import BuiltinEngine
    from srpo.workflows import Runtime, build_workflow
    from dataclasses import replace

    tasks = synthetic_arithmetic(8, level=2, seed=3)
    jobs = [(f"t{i}-g{j}", t) for i, t in enumerate(tasks) for j in range(4)]
    flows = {"single": build_workflow("single", max_new_tokens=64),
             "parallel_aggregate (N=4)": build_workflow("parallel_aggregate", num_workers=4, max_new_tokens=64)}
    roles = sorted({r for w in flows.values() for r in w.roles()})
    policies = build_policies("shared", "smollm2-135m", roles)
    rates: dict[str, list[float]] = {k: [] for k in flows}
    calls: dict[str, list[int]] = {}
    for _ in range(args.rounds):
        for name, wf in flows.items():
            specs = {r: replace(s, sampling=SamplingParams(temperature=1.0, max_new_tokens=64))
                     for r, s in wf.default_role_specs().items()}
            rt = Runtime(BuiltinEngine(policies), specs, task_reward, generator=torch.Generator().manual_seed(0))
            t = time.perf_counter()
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
                episodes = rt.run(wf, jobs)
            dt = time.perf_counter() - t
            tokens = sum(e.generated_tokens for e in episodes)
            rates[name].append(tokens / dt)
            calls[name] = rt.generate_calls
            print(f"{name}: {tokens} tokens in {dt:.1f} s = {tokens / dt:.1f} tokens/s; model calls {rt.generate_calls}",
                  flush=True)
    single, team = statistics.median(rates["single"]), statistics.median(rates["parallel_aggregate (N=4)"])
    print(f"\ntorch threads {args.threads}\n\n| workflow | generation calls (batch sizes) | median tokens/s |\n|---|---|---:|")
    for name in flows:
        print(f"| {name} | {calls[name]} | {statistics.median(rates[name]):.1f} |")
    print(f"\nteam / single throughput: {team / single:.2f}×")


if __name__ == "__main__":
    main()
