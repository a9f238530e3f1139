"""What activation checkpointing costs on benchmark 1's work (bench_vs_trl.py), separated from glibc's
mmap threshold that srpo fixes at 8 MiB when checkpointing is on.

    python benchmarks/bench_checkpointing_cost.py --rounds 2                      # every event forwarded
    python benchmarks/bench_checkpointing_cost.py --rounds 2 --work default --only "on (default)" off
    python benchmarks/bench_checkpointing_cost.py --rounds 3 --only "on (default)" "on, thresholds 256 MiB"

``--work forward-all`` (the default) is srpo forwarding every event, as TRL does; ``--work default``
is srpo as configured by default (zero-advantage events skipped: smaller update passes).

Five settings, alternating round by round, each a fresh process of `bench_vs_trl.run_ours` (6 steps,
2 threads, the first step dropped): checkpointing on (srpo's CPU default: the threshold fixed at
8 MiB), on with the threshold at 1 GiB (``MALLOC_MMAP_THRESHOLD_``: large blocks stay in the heap),
on with the mmap and trim thresholds at 256 MiB (``MALLOC_TRIM_THRESHOLD_`` too), off (glibc's
dynamic threshold), off with the threshold at 8 MiB.  Printed per run: median seconds
per step and per update, and the process's peak resident memory.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

from _child import report, run_child  # benchmarks/_child.py: the child-process protocol

VARIANTS = {  # name → (train.activation_checkpointing, extra environment)
    "on (default)": (True, {}),
    "on, threshold 1 GiB": (True, {"MALLOC_MMAP_THRESHOLD_": str(1 << 30)}),
    # The head's vocabulary-sized tensors (a chunk's logits, probabilities and their gradient, at most
    # keep_probs_bytes = 256 MiB) and the tied embedding's gradient stay in the heap, trimmed only
    # beyond 256 MiB: fewer fresh pages to fault in each update, for the memory glibc then keeps.
    "on, thresholds 256 MiB": (True, {"MALLOC_MMAP_THRESHOLD_": str(256 << 20), "MALLOC_TRIM_THRESHOLD_": str(256 << 20)}),
    "off": (False, {}),
    "off, threshold 8 MiB": (False, {"MALLOC_MMAP_THRESHOLD_": str(8 << 20)}),
}


def child(checkpointing: bool, steps: int, threads: int, forward_all: bool) -> None:
    import resource

    sys.path.insert(0, str(Path(__file__).parent))
    import bench_vs_trl

    res = bench_vs_trl.run_ours(steps, threads, skip_zero_advantage=not forward_all,
                                train={"activation_checkpointing": checkpointing})
    report({"step_s": res["step_s"][1:], "update_s": res["update_s"][1:],
            "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--work", choices=["forward-all", "default"], default="forward-all")
    ap.add_argument("--only", nargs="+", choices=list(VARIANTS), help="run only these settings")
    ap.add_argument("--child", choices=["on", "off"])
    args = ap.parse_args()
    if args.child:
        child(args.child == "on", args.steps, args.threads, args.work == "forward-all")
        return
    print(f"work: {args.work}\n{'round':<6}{'setting':<26}{'step s':>8}{'update s':>10}{'peak GB':>9}")
    for r in range(args.rounds):
        for name, (on, extra) in VARIANTS.items():
            if args.only and name not in args.only:
                continue
            env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), **extra}
            d = run_child([__file__, "--child", "on" if on else "off", "--steps", args.steps,
                           "--threads", args.threads, "--work", args.work], env=env, what=name)
            print(f"{r + 1:<6}{name:<26}{statistics.median(d['step_s']):>8.2f}{statistics.median(d['update_s']):>10.2f}"
                  f"{d['peak_rss_gb']:>9.2f}", flush=True)


if __name__ == "__main__":
    main()
