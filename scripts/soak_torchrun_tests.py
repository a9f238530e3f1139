"""Run the torchrun tests (``-m torchrun``) round after round beside CPU-burning processes, and
report every failure — in particular a rank that ends with SIGABRT after its work.

    python scripts/soak_torchrun_tests.py --rounds 20 --burners 2 [--out soak.json] [-- PYTEST ARGS]

A loaded machine changes timings (which thread is inside which call when a process exits); a
teardown race that a quiet machine hides shows up here.  Each round is one pytest process; its
summary line, its duration and any sign of an abort (``terminate called``, ``SIGABRT``, exit
code -6 or 134 in a rank's report) are recorded; the script exits 1 if any round failed."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ABORT = re.compile(r"terminate called|SIGABRT|Signal 6|exitcode\s*:\s*-6|returncode[ =:]+(-6|134)")


def burners(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--burners", type=int, default=2, help="CPU-burning processes beside the tests")
    parser.add_argument("--out", default="", help="a JSON file for the rounds' results")
    parser.add_argument("pytest_args", nargs="*", help="more pytest arguments (after --)")
    args = parser.parse_args(argv)
    load = burners(args.burners)
    rounds = []
    try:
        for i in range(args.rounds):
            start = time.monotonic()
            done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "torchrun",
                                   *args.pytest_args], cwd=ROOT, capture_output=True, text=True)
            text = done.stdout + done.stderr
            summary = (text.strip().splitlines() or [""])[-1]
            aborts = sorted(set(m.group(0) for m in ABORT.finditer(text)))
            rounds.append({"round": i + 1, "exit": done.returncode, "seconds": round(time.monotonic() - start, 1),
                           "summary": summary, "aborts": aborts})
            print(f"round {i + 1}/{args.rounds}: exit {done.returncode} in {rounds[-1]['seconds']} s — {summary}"
                  + (f" — ABORT: {aborts}" if aborts else ""), flush=True)
            if done.returncode != 0:
                failed = [line for line in text.splitlines() if line.startswith(("FAILED", "ERROR"))]
                print("\n".join(failed[:20]), flush=True)
    finally:
        for p in load:
            p.kill()
    bad = [r for r in rounds if r["exit"] != 0 or r["aborts"]]
    print(f"{len(rounds) - len(bad)} of {len(rounds)} rounds passed beside {args.burners} CPU burner(s)")
    if args.out:
        Path(args.out).write_text(json.dumps({"burners": args.burners, "rounds": rounds}, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
