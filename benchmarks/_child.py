"""The one protocol by which a benchmark measures in a child process.

A figure that depends on a process's history — peak resident memory, allocator state, warm caches,
threads — is measured in a fresh child: the parent runs ``python <benchmark> --child ...``, the
child measures and ends with one ``RESULT <json>`` line on stdout (anything else it prints is
ignored), and the parent reads that line.

    # in the child
    report({"step_s": times, "peak_rss_gb": peak})
    # in the parent
    result = run_child([__file__, "--child", "on", "--steps", "6"], env=env, what="checkpointing on")
"""

from __future__ import annotations

import json
import subprocess
import sys

PREFIX = "RESULT "


def report(result: dict) -> None:
    """The child's last word: its measurements, as one line the parent finds among any other output."""
    print(PREFIX + json.dumps(result), flush=True)


def run_child(args: list[str], *, env: dict | None = None, cwd=None, what: str = "the child") -> dict:
    """Run ``python *args`` to the end and return what it reported; exit naming ``what`` with the
    child's last stderr when it fails or reports nothing."""
    done = subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, env=env, cwd=cwd)
    lines = [line for line in done.stdout.splitlines() if line.startswith(PREFIX)]
    if done.returncode or not lines:
        why = f"exit {done.returncode}" if done.returncode else "no RESULT line"
        raise SystemExit(f"{what} failed ({why}):\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][len(PREFIX):])
