"""Peak memory of ``srpo eval`` against k: the same problems at a small and a large k, side by side.

Each evaluation runs as its own ``srpo eval`` process; its peak resident set is the kernel's
``ru_maxrss`` for that child (``os.wait4``).  Episodes are reduced chunk by chunk
(``srpo.evaluation``), so the peak should not grow with k; the gap is the figure to watch.

    python benchmarks/bench_eval_memory.py                       # tiny-llama, k = 50 and 5000
    python benchmarks/bench_eval_memory.py --model smollm2-135m --ks 50 500
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def peak_rss_mib(cmd: list[str], env: dict) -> tuple[float, float, int]:
    """(peak RSS in MiB, wall seconds, exit status) of ``cmd`` run to its end."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        sys.exit(f"{' '.join(cmd)} failed ({code}):\n{proc.stderr.read()[-2000:]}")
    return usage.ru_maxrss / 1024, wall, code


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--ks", type=int, nargs="+", default=[50, 5000])
    parser.add_argument("--problems", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for k in args.ks:
            out = Path(tmp) / f"k{k}"
            cmd = [sys.executable, "-m", "srpo", "eval", "--model", args.model,
                   "--data", f"synthetic_arithmetic:level=0:n={args.problems}:seed=3", "-k", str(k),
                   "--max-new-tokens", str(args.max_new_tokens), "--threads", str(args.threads), "--out", str(out)]
            peak, wall, _ = peak_rss_mib(cmd, env)
            rows.append((k, peak, wall))
            print(f"k={k:>6}  episodes={k * args.problems:>7}  peak RSS {peak:7.1f} MiB  ({wall:.0f} s)", flush=True)
    (k0, p0, _), (k1, p1, _) = rows[0], rows[-1]
    print(f"peak at k={k1} minus peak at k={k0}: {p1 - p0:+.1f} MiB "
          f"({(p1 - p0) * 1024 / max((k1 - k0) * args.problems, 1):+.2f} KiB per extra episode)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
