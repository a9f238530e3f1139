"""A study process's resident memory cell after cell: every cell in the study's own process
(``cell_process: false``) against each cell in a fresh process (``cell_process: true``, the default).

    python benchmarks/bench_study_memory.py --cells 20 --threads 1

Each mode runs in a fresh benchmark process of its own: a study of ``--cells`` cells (one method,
``--cells`` seeds) of the demo's team (SmolLM2-135M, two workers + aggregator, bf16 autocast),
each trained ``--steps`` steps and evaluated on 4 held-out problems, run cell by cell as
``srpo study`` runs them; after each cell the study process's resident set (``VmRSS``) is read.
Prints both curves and, per mode, RSS after the last cell against after cell 2 (the goal: within
~10 %).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from _child import report, run_child  # benchmarks/_child.py: the child-process protocol

ROOT = Path(__file__).resolve().parents[1]


def rss_gb() -> float:
    from srpo.train.memory import rss_bytes

    return rss_bytes() / 2**30


def study_file(folder: Path, cells: int, steps: int, threads: int, model: str, in_process: bool) -> Path:
    from srpo.apps.demo import DEMO_CONFIG

    base = json.loads(json.dumps(DEMO_CONFIG))
    base["model"]["name"] = model
    base["run"].update({"steps": steps, "threads": threads})
    base["task"]["eval"] = []
    base.setdefault("log", {})["backends"] = []
    base.setdefault("checkpoint", {})["every"] = 0
    (folder / "base.yaml").write_text(json.dumps(base))
    study = {"output_dir": str(folder / "out"), "base": "base.yaml", "keep_checkpoints": False,
             "cell_process": not in_process, "seeds": list(range(cells)),
             "axes": {"method": [{"label": "srpo", "set": {"method.name": "srpo"}}]},
             "eval": {"k": 2, "datasets": [{"source": "synthetic_arithmetic", "level": 0, "n": 4, "seed": 99,
                                            "split": "test", "name": "heldout"}]}}
    path = folder / "study.yaml"
    path.write_text(json.dumps(study))
    return path


def peak_gb(who) -> float:
    import resource

    return resource.getrusage(who).ru_maxrss / 2**20  # KiB on Linux


def child(args) -> None:
    """One mode: the cells in order, the study process's RSS after each, then the peak of the study
    process and of its largest cell process (JSON on the last line)."""
    import resource

    import torch

    from srpo.apps.study.runner import run_cell, run_cell_in_process
    from srpo.apps.study.schema import cells, load_study

    torch.set_num_threads(args.threads)
    in_process = args.child == "in-process"
    with tempfile.TemporaryDirectory() as tmp:
        spec = load_study(study_file(Path(tmp), args.cells, args.steps, args.threads, args.model, in_process))
        root = Path(spec["output_dir"])
        root.mkdir(parents=True)
        curve = [rss_gb()]
        for cell in cells(spec):
            (run_cell if in_process else run_cell_in_process)(spec, cell, root, progress=False)
            curve.append(rss_gb())
            print(f"{args.child}: after cell {len(curve) - 1}: {curve[-1]:.2f} GB", file=sys.stderr, flush=True)
    report({"curve": curve, "peak_self": peak_gb(resource.RUSAGE_SELF), "peak_cells": peak_gb(resource.RUSAGE_CHILDREN)})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cells", type=int, default=20)
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--child", default="")
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    curves = {}
    for mode in ("in-process", "cell-process"):
        curves[mode] = run_child([__file__, "--child", mode, "--cells", args.cells, "--steps", args.steps,
                                  "--threads", args.threads, "--model", args.model], cwd=ROOT, what=mode)
    peaks = {mode: (c["peak_self"], c["peak_cells"]) for mode, c in curves.items()}
    curves = {mode: c["curve"] for mode, c in curves.items()}
    print(f"study process RSS (GB) after each cell — {args.cells} cells of {args.model}, {args.steps} step(s) each, "
          f"{args.threads} thread(s)\n")
    print("| after cell | every cell in the study's process | each cell in its own process |\n|---:|---:|---:|")
    for i in range(args.cells + 1):
        print(f"| {i} | {curves['in-process'][i]:.2f} | {curves['cell-process'][i]:.2f} |")
    for mode, c in curves.items():
        if len(c) > 2:
            cell_peak = f", of its largest cell process {peaks[mode][1]:.2f} GB" if mode == "cell-process" else ""
            print(f"\n{mode}: after cell {len(c) - 1} {c[-1]:.2f} GB vs after cell 2 {c[2]:.2f} GB → {c[-1] / c[2]:.2f}×; "
                  f"peak of the study process {peaks[mode][0]:.2f} GB{cell_peak}")


if __name__ == "__main__":
    main()
