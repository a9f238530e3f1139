"""The demo's training process with and without activation checkpointing: peak resident memory
against the floor, and seconds per step — which default the measurements favour.

    python benchmarks/bench_memory.py --steps 3 --rounds 2 --threads 2

Each run is a fresh ``srpo train`` process on the demo's own config (SmolLM2-135M, two workers +
aggregator, 4 tasks × 4 episodes a step, ``srpo demo``'s settings; no evaluation, no checkpoint),
the two settings alternating round by round.  Seconds per step: the median of each run's steps
after its first (a warm-up); peak: the run's ``memory/peak_rss_gb`` after its last step; floor:
what ``srpo train`` prints (weights, gradients, AdamW moments).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(ckpt: bool, steps: int, threads: int, folder: Path) -> dict:
    from srpo.apps.demo import DEMO_CONFIG

    cfg = json.loads(json.dumps(DEMO_CONFIG))
    cfg["run"].update({"output_dir": str(folder), "steps": steps, "threads": threads})
    cfg["train"]["activation_checkpointing"] = ckpt
    cfg["task"]["eval"] = []
    cfg.setdefault("log", {})["backends"] = []
    path = folder.with_suffix(".yaml")
    path.write_text(json.dumps(cfg))  # JSON is YAML
    out = subprocess.run([sys.executable, "-m", "srpo.apps.cli", "train", "--config", str(path), "--overwrite"],
                         capture_output=True, text=True, cwd=ROOT)
    if out.returncode != 0:
        raise SystemExit(out.stderr[-2000:])
    rows = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines() if x.strip()]
    # The run's last memory line ("memory: peak … the floor of …"); the first says what it needs.
    floor = next(line for line in out.stdout.splitlines() if line.startswith("memory:") and "floor of " in line)
    return {"step_s": statistics.median(r["time/step_s"] for r in rows[1:]),
            "update_s": statistics.median(r["time/update_s"] for r in rows[1:]),
            "peak_gb": rows[-1]["memory/peak_rss_gb"], "floor_gb": float(floor.split("floor of ")[1].split(" GB")[0])}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    results = {False: [], True: []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for ckpt in ((False, True) if r % 2 == 0 else (True, False)):
                res = run(ckpt, args.steps, args.threads, Path(tmp) / f"r{r}-{int(ckpt)}")
                results[ckpt].append(res)
                print(f"round {r} checkpointing={ckpt}: {res}", flush=True)
    print("\n| activation checkpointing | s/step (median over runs) | update s | peak RSS | floor | peak / floor |")
    print("|---|---|---|---|---|---|")
    for ckpt, runs in results.items():
        step = statistics.median(x["step_s"] for x in runs)
        upd = statistics.median(x["update_s"] for x in runs)
        peak = max(x["peak_gb"] for x in runs)
        floor = runs[0]["floor_gb"]
        print(f"| {'on' if ckpt else 'off'} | {step:.1f} | {upd:.1f} | {peak:.2f} GB | {floor:.2f} GB | {peak / floor:.1f}× |")
    off = statistics.median(x["step_s"] for x in results[False])
    on = statistics.median(x["step_s"] for x in results[True])
    print(f"\nstep time with checkpointing / without: **{on / off:.3f}**")


if __name__ == "__main__":
    main()
