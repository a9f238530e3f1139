"""Benchmark 3: objective overhead — `srpo` loss + backward versus `grpo` on the same batch.

A (M=512, T=512) batch of member log-probs (a leaf tensor, so only the objective is timed), events
of random sizes 1–5; median of 30 timed repetitions after 5 warm-ups, alternating the two.

    python benchmarks/bench_objective.py --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from srpo.objective import LossInputs, policy_loss


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--M", type=int, default=512)
    ap.add_argument("--T", type=int, default=512)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    sizes = []
    while sum(sizes) < args.M:
        sizes.append(int(torch.randint(1, 6, (1,), generator=g)))
    sizes[-1] -= sum(sizes) - args.M
    event_index = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    old = -torch.rand(args.M, args.T, generator=g) * 3
    base = old + torch.randn(args.M, args.T, generator=g) * 0.05
    mask = (torch.rand(args.M, args.T, generator=g) > 0.2).float()
    adv = torch.randn(len(sizes), generator=g)
    times = {"srpo": [], "grpo": []}
    for rep in range(35):
        for name in times:
            lp = base.clone().requires_grad_(True)
            t = time.perf_counter()
            loss, _ = policy_loss(name, LossInputs(
                logprobs=lp, old_logprobs=old, mask=mask, event_index=event_index, advantages=adv))
            loss.backward()
            if rep >= 5:
                times[name].append(time.perf_counter() - t)
    s, r = statistics.median(times["srpo"]), statistics.median(times["grpo"])
    print(f"torch threads {args.threads}; batch (M={args.M}, T={args.T}), {len(sizes)} events\n")
    print(f"| loss | median loss+backward (ms) |\n|---|---:|\n| srpo | {s * 1e3:.2f} |\n| grpo | {r * 1e3:.2f} |")
    print(f"\nsrpo / grpo: {s / r:.2f}×")


if __name__ == "__main__":
    main()
