"""``srpo demo``: SRPO on the embedded SmolLM2-135M-Instruct in a mixed workflow, end to end.

Two workers answer an arithmetic problem together (one K=2 event), an aggregator reads their
answers and gives the team's answer (one K=1 event).  The demo evaluates the team on held-out
problems, trains it with SRPO — two optimizer steps a rollout, so that the set ratio leaves 1 and
its clip acts — evaluates again, writes the report and prints a before/after table with standard
errors and how often the set clip acted.  Everything runs on the CPU; see docs/getting-started.md for the time it takes.
"""

from __future__ import annotations

import time
from pathlib import Path

import copy

from srpo.build import config_from_dict
from srpo.config import apply_overrides

DEMO_CONFIG = {
    "run": {"output_dir": "runs/demo", "seed": 0, "steps": 25, "threads": 0},
    "model": {"name": "smollm2-135m", "layout": "shared", "autocast_bf16": True},
    "workflow": {
        "name": "parallel_aggregate", "options": {"num_workers": 2}, "max_new_tokens": 24, "temperature": 0.7,
        # A short system prompt: SmolLM2's template otherwise inserts a ~20-token default one.
        "system": "Be brief.", "template": "{input} Reply with just the number.",
        "roles": {"aggregator": {"template": "{input}\nReply with just the number."}},
    },
    "task": {"kind": "math", "train": {"source": "synthetic_arithmetic", "level": 0, "n": 2000, "seed": 0},
             # The whole test part of one-digit addition (24 problems, none of them — nor their
             # commuted forms — ever trained on; srpo.tasks.splits), each sampled eval.k times.
             "eval": [{"source": "synthetic_arithmetic", "level": 0, "n": 0, "split": "test", "name": "held-out"}]},
    "method": {"name": "srpo", "set_reduction": "sqrt", "clip_eps": 0.2},
    # Two passes over each rollout (two optimizer steps): on the second, π_θ ≠ π_old, so the set
    # ratios leave 1 and SRPO's set clip acts (with one step per rollout every ratio is exactly 1
    # and no clip can bind).  The report's clip-fraction and set-ratio plots show it.
    "train": {"tasks_per_step": 4, "group_size": 4, "lr": 2e-5, "warmup_steps": 2, "old_logprobs": "recompute",
              "epochs": 2},
    "checkpoint": {"every": 0, "keep": 1},
    "eval": {"k": 8, "temperature": 0.7},
}


def set_clip_summary(run_dir: Path) -> str:
    """One line: in how many of the steps that updated the set clip acted, and its mean fraction."""
    from srpo.apps.stability import update_rows
    from srpo.runs.metrics_log import read_metrics

    rows = read_metrics(run_dir)
    updated = update_rows(rows)
    fracs = [r.get("objective/clip_frac", 0.0) for r in updated]
    acted = sum(f > 0 for f in fracs)
    mean = sum(fracs) / len(fracs) if fracs else 0.0
    return (f"set clip: acted in {acted} of the {len(updated)} steps that updated ({len(rows) - len(updated)} had no "
            f"non-zero advantage); mean clip fraction {mean:.2f}")


def run_demo(output_dir: str | None = None, steps: int | None = None, overrides: dict | None = None) -> dict:
    """``overrides``: dotted keys → values, as ``srpo train --set`` takes them."""
    import torch

    from srpo import build
    from srpo.evaluation import evaluate, write_results
    from srpo.apps.report import write_summary
    from srpo.train import Trainer

    data = copy.deepcopy(DEMO_CONFIG)
    apply_overrides(data, {**({"run.output_dir": output_dir} if output_dir else {}),
                           **({"run.steps": steps} if steps else {}), **(overrides or {})})
    cfg = config_from_dict(data)
    run_dir = Path(cfg.run.output_dir)
    started = time.perf_counter()
    print(f"srpo demo — {cfg.model.name}, workflow {cfg.workflow.name} "
          f"({cfg.workflow.options['num_workers']} workers + aggregator), method {cfg.method.name}, "
          f"torch threads {torch.get_num_threads()}")
    print("loading the model (the first run converts the GGUF once, ~30 s) ...", flush=True)
    trainer = Trainer(cfg, overwrite=True)  # the demo replaces its previous run in the folder
    trainer.announce_memory_preflight()
    held_out = build.eval_sets(cfg, cfg.task.eval[:1], n=0)

    def run_eval(stem, title):
        with trainer.autocast():
            res = evaluate(trainer.policies, trainer.workflow, trainer.role_specs, held_out, k=cfg.eval.k,
                           temperature=cfg.eval.temperature, seed=cfg.run.seed + 99, progress=True)
        write_results(res, run_dir, stem, title)
        return res["datasets"]["held-out"]

    print(f"evaluating on {len(held_out['held-out'])} held-out problems × {cfg.eval.k} samples "
          f"(temperature {cfg.eval.temperature}) ...", flush=True)
    before = run_eval("eval_before", "Held-out, before training")
    acc, err = f"avg@{cfg.eval.k}", f"avg@{cfg.eval.k}_stderr"
    print(f"accuracy before: {before[acc]:.3f} ± {before[err]:.3f}", flush=True)
    trainer.fit()
    after = run_eval("eval_after", "Held-out, after training")
    report = write_summary(run_dir)
    clip_line = set_clip_summary(run_dir)
    minutes = (time.perf_counter() - started) / 60
    diff = after[acc] - before[acc]
    print()
    print(f"| held-out accuracy ({acc}, temperature {cfg.eval.temperature}) | value |")
    print("|---|---:|")
    print(f"| before training | {before[acc]:.3f} ± {before[err]:.3f} |")
    print(f"| after {cfg.run.steps} SRPO step{'s' if cfg.run.steps != 1 else ''} | {after[acc]:.3f} ± {after[err]:.3f} |")
    # One training run: the ± are the evaluation's spread over problems only; another seed moves
    # the result too (docs/getting-started.md, "The demo"), so no test is claimed for the change.
    print(f"| change (one run, one seed; ± above are over problems only) | {diff:+.3f} |")
    print()
    print(clip_line)
    print(f"report: {report}   (plots in {run_dir / 'report'}; TensorBoard: tensorboard --logdir {run_dir})")
    print(f"total time: {minutes:.1f} min")
    return {"before": before, "after": after, "report": str(report), "minutes": minutes}
