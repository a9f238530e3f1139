"""How the log-prob pass's length groups should be cut: the update's seconds and the peak memory
by the per-call cost the cut assumes (``logprobs.CALL_OVERHEAD_TOKENS``) and the most groups.

    python benchmarks/bench_length_groups.py --rounds 2 --work trl demo

Works: ``trl`` — benchmark 1's (bench_vs_trl.py: SmolLM2-135M, single-agent GRPO, 16 rows of ≤ 64
tokens, every event forwarded, 6 steps); ``demo`` — the demo's team (``srpo demo``'s config: two
workers + aggregator, 4 × 4 episodes, 5 steps).  Settings, alternating round by round, each a fresh
process, 2 threads, the first step dropped: at most 4 groups with a call counted as 16 tokens (the
cost assumed before 2026-12-02), as 128 (since), and one padded group.  Printed per run: each
update's seconds, their median, the groups a pass ran on average, the peak resident memory.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
from pathlib import Path

from _child import report, run_child  # benchmarks/_child.py: the child-process protocol

SETTINGS = {"4 groups, a call = 16 tokens": (4, 16), "4 groups, a call = 128 tokens": (4, 128),
            "1 group": (1, 128)}


def child(work: str, groups: int, overhead: int) -> None:
    import srpo.build
    import srpo.policies.logprobs as logprobs

    logprobs.CALL_OVERHEAD_TOKENS = overhead  # read at call time by the pass
    cut = logprobs.length_buckets
    made: list[int] = []

    def counted(*a, **k):
        g = cut(*a, **k)
        made.append(len(g))
        return g

    logprobs.length_buckets = counted
    if work == "trl":
        sys.path.insert(0, str(Path(__file__).parent))
        import bench_vs_trl

        updates = bench_vs_trl.run_ours(6, 2, skip_zero_advantage=False, train={"length_groups": groups})["update_s"][1:]
    else:
        import torch

        torch.set_num_threads(2)
        from srpo.apps.demo import DEMO_CONFIG
        from srpo.train import Trainer

        cfg = json.loads(json.dumps(DEMO_CONFIG))
        cfg["run"].update({"output_dir": tempfile.mkdtemp(), "steps": 5, "threads": 2})
        cfg["train"]["length_groups"] = groups
        cfg["task"]["eval"] = []
        cfg.setdefault("log", {})["backends"] = []
        cfg.setdefault("checkpoint", {})["every"] = 0
        trainer = Trainer(srpo.build.config_from_dict(cfg), progress=False)
        trainer.save = lambda: None
        updates = [h["time/update_s"] for h in trainer.fit()][1:]
    report({"update_s": updates, "groups": statistics.mean(made) if made else 0,
            "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--work", nargs="+", choices=["trl", "demo"], default=["trl", "demo"])
    ap.add_argument("--child", nargs=3, metavar=("WORK", "GROUPS", "OVERHEAD"))
    args = ap.parse_args()
    if args.child:
        child(args.child[0], int(args.child[1]), int(args.child[2]))
        return
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    print(f"{'work':<6}{'round':<7}{'setting':<32}{'update s (median)':>18}{'groups a pass':>15}{'peak GB':>9}  updates")
    for work in args.work:
        for r in range(args.rounds):
            for name, (groups, overhead) in SETTINGS.items():
                d = run_child([__file__, "--child", work, groups, overhead], env=env, what=f"{work} / {name}")
                print(f"{work:<6}{r + 1:<7}{name:<32}{statistics.median(d['update_s']):>18.2f}{d['groups']:>15.2f}"
                      f"{d['peak_rss_gb']:>9.2f}  {[round(x, 2) for x in d['update_s']]}", flush=True)


if __name__ == "__main__":
    main()
