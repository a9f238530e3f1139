"""Evaluation: k samples per problem through the workflow; avg@k, pass@k, macro-averages.

Accuracy is correctness under the task kind's grader (1 = correct answer; exact match for QA)
whatever reward trained the model; a kind's extra metrics are reported too (QA: mean token F1).  avg@k is the mean over problems of
the fraction of the k samples that are correct; pass@k the unbiased estimate with n = k (any of
the k correct).  Standard errors are over problems.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from srpo.runs.fileio import refuse_link_destination, write_text_atomic
from srpo.tasks.base import Task
from srpo.tasks.metrics import avg_at_k, macro_average, pass_at_k
from srpo.tasks.kinds import task_kind
from srpo.tasks.rewards import task_reward
from srpo.workflows.runtime import Runtime


def evaluate(policies, workflow, role_specs, datasets: dict[str, list[Task]], *, k: int = 4,
             temperature: float | None = None, seed: int = 1234, max_batch: int = 256,
             progress: bool = False, workflows: dict[str, Any] | None = None, engine=None,
             episodes_path: Path | None = None) -> dict[str, Any]:
    """Run ``k`` episodes per task of every dataset; return per-dataset and macro metrics.
    ``episodes_path``: every episode's record (question, answer, reward, tokens) as JSON lines.

    ``workflows`` (by dataset name) replaces ``workflow`` for the datasets it names — a held-out
    set searched in its own corpus (:func:`srpo.build.eval_workflows`).  ``engine``: the rollout
    engine that samples (default: srpo's own sampler on ``policies``)."""
    if temperature is not None:  # the eval temperature replaces every role's training one
        role_specs = {r: replace(s, sampling=replace(s.sampling, temperature=temperature)) for r, s in role_specs.items()}
    if engine is None:
        from srpo.rollout.builtin import BuiltinEngine

        engine = BuiltinEngine(policies)
    runtime = Runtime(engine, role_specs, task_reward, generator=torch.Generator().manual_seed(seed),
                      max_batch=max_batch, policies=policies)
    results: dict[str, Any] = {"k": k, "datasets": {}}
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=sum(len(t) for t in datasets.values()) * k, desc="eval", unit="episode", dynamic_ncols=True)
    sink = None
    if episodes_path is not None:  # never through a planted link (O_NOFOLLOW: the open fails on one)
        refuse_link_destination(episodes_path)
        sink = open(episodes_path, "w", encoding="utf-8",  # noqa: SIM115
                    opener=lambda path, flags: os.open(path, flags | getattr(os, "O_NOFOLLOW", 0), 0o666))
    try:
        for name, tasks in datasets.items():
            results["datasets"][name] = _evaluate_dataset(runtime, (workflows or {}).get(name, workflow), name, tasks,
                                                          k, max_batch, bar, sink)
    finally:
        if sink is not None:
            sink.close()
    if bar is not None:
        bar.close()
    ds = results["datasets"]
    results["macro"] = {f"avg@{k}": macro_average({n: d[f"avg@{k}"] for n, d in ds.items()}),
                        f"pass@{k}": macro_average({n: d[f"pass@{k}"] for n, d in ds.items()})}
    return results


def _evaluate_dataset(runtime, workflow, name: str, tasks: list[Task], k: int, max_batch: int, bar, sink) -> dict:
    """One dataset's metrics.  Episodes are reduced as each chunk ends — their rewards kept, their
    records written to ``sink`` (one JSON line each) — so memory stays flat however large ``k``."""
    jobs = [(f"eval-{name}-{i}-{j}", t) for i, t in enumerate(tasks) for j in range(k)]
    rewards = [[0.0] * k for _ in tasks]
    extra = task_kind(tasks[0].kind).eval_metrics if tasks else {}
    sums = {metric: 0.0 for metric in extra}
    tokens = correct = seen = 0
    examples = []
    # Episodes run in chunks of at most 64 so the progress bar moves and memory holds one chunk's
    # episodes, however large k; each chunk still batches all of its pending requests.  Chunks are
    # whole tasks while k fits (the sampler's draws, hence results, as they always were).
    size = min(max_batch, 64)
    chunk = (size // k) * k if k <= size else size
    with torch.no_grad():
        for start in range(0, len(jobs), chunk):
            for offset, ep in enumerate(runtime.run(workflow, jobs[start:start + chunk])):
                i, j = divmod(start + offset, k)
                rewards[i][j] = ep.reward
                tokens += ep.generated_tokens
                correct += ep.reward >= 1.0
                seen += 1
                for metric, fn in extra.items():
                    sums[metric] += fn(ep.task, ep.answer)
                if j == 0 and i < 3:
                    examples.append({"question": ep.task.question, "gold": list(ep.task.answers), "answer": ep.answer,
                                     "reward": ep.reward})
                if sink is not None:
                    sink.write(json.dumps({"dataset": name, "task_id": ep.task.task_id, "sample": j,
                                           "question": ep.task.question, "gold": list(ep.task.answers),
                                           "answer": ep.answer, "reward": ep.reward, "tokens": ep.generated_tokens,
                                           "info": {key: v for key, v in ep.info.items()
                                                    if isinstance(v, (int, float, str, bool))}}) + "\n")
            ep = None  # the loop variable would hold the chunk's last episode into the next chunk
            if bar is not None:
                bar.update(len(jobs[start:start + chunk]))
                bar.set_postfix(dataset=name, acc=f"{correct / max(seen, 1):.3f}")
    avgs = [avg_at_k(r) for r in rewards]
    passes = [pass_at_k(k, sum(1 for x in r if x >= 1.0), k) for r in rewards]
    return {
        "n": len(tasks),
        f"avg@{k}": float(np.mean(avgs)),
        f"avg@{k}_stderr": float(np.std(avgs, ddof=1) / math.sqrt(len(avgs))) if len(avgs) > 1 else 0.0,
        f"pass@{k}": float(np.mean(passes)),
        f"pass@{k}_stderr": float(np.std(passes, ddof=1) / math.sqrt(len(passes))) if len(passes) > 1 else 0.0,
        # The task kind's extra metrics (QA: token F1), averaged over episodes.
        **{metric: total / max(seen, 1) for metric, total in sums.items()},
        "team_tokens": tokens,
        "correct_per_million_tokens": 1e6 * correct / max(tokens, 1),
        "examples": examples,
    }


def markdown_table(results: dict[str, Any], title: str = "") -> str:
    k = results["k"]
    lines = [f"### {title}" if title else "", "",
             f"| dataset | n | avg@{k} | pass@{k} | mean F1 (QA) | correct / M team tokens |",
             "|---|---:|---:|---:|---:|---:|"]
    for name, d in results["datasets"].items():
        f1 = f"{d['f1']:.3f}" if "f1" in d else "–"
        lines.append(f"| {name} | {d['n']} | {d[f'avg@{k}']:.3f} ± {d[f'avg@{k}_stderr']:.3f} | "
                     f"{d[f'pass@{k}']:.3f} ± {d[f'pass@{k}_stderr']:.3f} | {f1} | "
                     f"{d['correct_per_million_tokens']:.0f} |")
    m = results["macro"]
    lines.append(f"| **macro** | | {m[f'avg@{k}']:.3f} | {m[f'pass@{k}']:.3f} | | |")
    return "\n".join(lines).strip() + "\n"


def write_results(results: dict[str, Any], folder: Path, stem: str, title: str = "") -> tuple[Path, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    js, md = folder / f"{stem}.json", folder / f"{stem}.md"
    write_text_atomic(js, json.dumps(results, indent=1))
    write_text_atomic(md, markdown_table(results, title))
    return js, md
