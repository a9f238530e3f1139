"""Fault soak: kill ``srpo train`` at random moments, resume each time, compare with a clean run.

    python benchmarks/fault_soak.py --kills 24 --steps 60          # the figures in the README

One uninterrupted run is the reference.  The victim run is started, killed (SIGKILL, SIGINT or
SIGTERM — a scheduler's preemption — chosen at random) at a random moment after it has logged a step — mid-rollout, mid-update,
mid-checkpoint, mid-log-write — and started again with ``--resume``, until it finishes on its own
with at least ``--kills`` kills behind it.  Then:

- the final weights must equal the reference's bit for bit;
- ``metrics.jsonl`` must hold every step once, in order, with the reference's values (timings
  aside), and ``samples.jsonl`` the reference's episodes;
- every SIGINT must end the process (exit 130, or -2 at start-up or exit) and every SIGTERM (exit 143
  after saving at the step's end, or -15 at start-up or exit) within ``--sigint-timeout`` seconds — a
  hang is a failure — and no half-written checkpoint folder may survive the next start.

Both runs use one thread, where training is bit-reproducible.  Exit status 0 when everything
held; a JSON summary goes to ``--out``/soak.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TIMING_KEYS = ("time/", "memory/")  # wall-clock and resident memory differ between runs
# 130: srpo caught the Ctrl-C and said "interrupted"; -2: the signal ended the interpreter before
# srpo's handler was in place or after it returned (start-up imports, exit).  Either is prompt.
SIGINT_EXITS = {130, -signal.SIGINT}
SIGTERM_EXITS = {143, -signal.SIGTERM}  # 143: saved at the next step end (srpo.runs.preemption)


def train_command(run_dir: Path, steps: int, resume: bool) -> list[str]:
    overrides = [f"run.output_dir={run_dir}", f"run.steps={steps}", "run.threads=1", "model.name=tiny-llama",
                 "model.autocast_bf16=false", "workflow.options={num_workers: 2}", "workflow.max_new_tokens=8",
                 "train.tasks_per_step=2", "train.group_size=2", "train.lr=0.01", "task.train.n=16",
                 "checkpoint.every=1", "checkpoint.keep=2", "log.backends=[]"]
    return [sys.executable, "-m", "srpo.apps.cli", "train", "--config", str(ROOT / "configs/math/parallel_aggregate/srpo.yaml"),
            *[x for o in overrides for x in ("--set", o)], *(["--resume"] if resume else [])]


ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def rows(path: Path) -> list[dict]:
    """Rows of a log, read strictly: a soak that leaves a broken line must fail, not be tolerated."""
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def logged_steps(run_dir: Path) -> int:
    try:
        return sum(1 for line in (run_dir / "metrics.jsonl").read_bytes().splitlines() if line.strip())
    except OSError:
        return 0


def final_weights(run_dir: Path) -> dict:
    from safetensors.torch import load_file

    latest = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip()
    return load_file(str(latest / "model" / "shared" / "model.safetensors"))


def phase(run_dir: Path) -> str:
    """Where the victim roughly was when the signal went out."""
    if any((run_dir / "checkpoints").glob(".step_*")):
        return "checkpoint write"
    return "rollout/update/log"


def soak(out: Path, *, kills: int, steps: int, seed: int, max_delay: float, sigint_timeout: float,
         log=print) -> dict:
    rng = random.Random(seed)
    out.mkdir(parents=True, exist_ok=True)
    reference, victim = out / "reference", out / "victim"
    for d in (reference, victim):
        if d.exists():
            import shutil

            shutil.rmtree(d)
    t0 = time.perf_counter()
    done = subprocess.run(train_command(reference, steps, False), env=ENV, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"the reference run failed:\n{done.stderr[-3000:]}")
    reference_s = time.perf_counter() - t0
    log(f"reference: {steps} steps in {reference_s:.0f} s")

    events, hangs, starts, stale_left = [], 0, 0, 0
    t1 = time.perf_counter()
    while True:
        before = logged_steps(victim)
        # The child takes SIGINT as from a terminal even when this script runs in the background
        # (`cmd &` starts it with SIGINT ignored, and Python then installs no KeyboardInterrupt).
        proc = subprocess.Popen(train_command(victim, steps, starts > 0), env=ENV, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        starts += 1
        # Let it get going: kill only after it logged a step (or at once when it is already done).
        while proc.poll() is None and logged_steps(victim) <= before:
            time.sleep(0.02)
        if len(events) >= kills:  # enough kills: this start runs to the end
            proc.wait()
        else:
            time.sleep(rng.uniform(0, max_delay))
        if proc.poll() is not None:
            err = proc.stderr.read()
            if proc.returncode != 0:
                raise SystemExit(f"start {starts} failed with rc {proc.returncode}:\n{err[-3000:]}")
            if len(events) >= kills:
                break
            log(f"start {starts}: finished before its kill (resumed run complete) — {len(events)} kills so far")
            break
        sig = rng.choice([signal.SIGKILL, signal.SIGINT, signal.SIGTERM])
        where = phase(victim)
        sent = time.perf_counter()
        proc.send_signal(sig)
        try:
            proc.wait(timeout=sigint_timeout)
        except subprocess.TimeoutExpired:
            hangs += 1
            proc.kill()
            proc.wait()
        latency = time.perf_counter() - sent
        proc.stderr.read()
        events.append({"start": starts, "signal": sig.name, "at_step": logged_steps(victim), "phase": where,
                       "rc": proc.returncode, "exit_s": round(latency, 3)})
        log(f"start {starts}: {sig.name} at step {events[-1]['at_step']} ({where}) → rc {proc.returncode} "
            f"after {latency:.2f} s")
        if any((victim / "checkpoints").glob(".step_*")):
            stale_left += 1  # removed by the next start; counted to show the case happened
    victim_s = time.perf_counter() - t1

    a, b = final_weights(reference), final_weights(victim)
    weights_equal = a.keys() == b.keys() and all(bool((a[k] == b[k]).all()) for k in a)
    ref_rows, vic_rows = rows(reference / "metrics.jsonl"), rows(victim / "metrics.jsonl")
    strip = lambda r: {k: v for k, v in r.items() if not k.startswith(TIMING_KEYS)}  # noqa: E731
    metrics_equal = [strip(r) for r in ref_rows] == [strip(r) for r in vic_rows]
    samples_equal = rows(reference / "samples.jsonl") == rows(victim / "samples.jsonl")
    leftovers = [p.name for p in (victim / "checkpoints").glob(".step_*")]
    sigint = [e for e in events if e["signal"] == "SIGINT"]
    sigterm = [e for e in events if e["signal"] == "SIGTERM"]
    summary = {
        "kills": len(events), "sigkill": len(events) - len(sigint) - len(sigterm), "sigint": len(sigint),
        "sigterm": len(sigterm), "sigterm_exit_codes": sorted({e["rc"] for e in sigterm}),
        "sigterm_exit_s_max": max((e["exit_s"] for e in sigterm), default=None),
        "kills_during_checkpoint_write": sum(e["phase"] == "checkpoint write" for e in events),
        "starts": starts, "steps": steps, "sigint_hangs": hangs,
        "sigint_exit_codes": sorted({e["rc"] for e in sigint}),
        "sigint_exit_s_max": max((e["exit_s"] for e in sigint), default=None),
        "temporaries_left_after_a_kill": stale_left, "temporaries_left_at_the_end": leftovers,
        "metrics_steps": [r["step"] for r in vic_rows] == list(range(1, steps + 1)),
        "weights_bit_equal": weights_equal, "metrics_equal": metrics_equal, "samples_equal": samples_equal,
        "reference_s": round(reference_s, 1), "victim_s": round(victim_s, 1), "events": events,
    }
    summary["ok"] = bool(len(events) >= kills and weights_equal and metrics_equal and samples_equal and not hangs
                         and summary["metrics_steps"] and not leftovers
                         and set(summary["sigint_exit_codes"]) <= SIGINT_EXITS
                         and set(summary["sigterm_exit_codes"]) <= SIGTERM_EXITS)
    (out / "soak.json").write_text(json.dumps(summary, indent=1))
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-delay", type=float, default=1.5, help="most seconds between a logged step and the kill")
    parser.add_argument("--sigint-timeout", type=float, default=60.0)
    parser.add_argument("--out", default="runs/fault_soak")
    args = parser.parse_args()
    s = soak(Path(args.out), kills=args.kills, steps=args.steps, seed=args.seed, max_delay=args.max_delay,
             sigint_timeout=args.sigint_timeout)
    print(json.dumps({k: v for k, v in s.items() if k != "events"}, indent=1))
    return 0 if s["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
