"""``srpo study``: methods × workflows × tasks × seeds, each cell a training run plus evaluation.

A study file names a base training config, the axes of the grid (each a list of labelled
override sets), the seeds, and the evaluation.  Every cell trains in its own run folder,
evaluates, and writes ``cell.json``; a finished cell is never re-run and an interrupted one
resumes from its last checkpoint, so the whole study is resumable by running it again.

    output_dir: runs/study-methods-math
    base: ../math/parallel_aggregate/base.yaml     # relative to this file
    overrides: {run.steps: 12, train.group_size: 4}
    axes:
      method:
        - {label: srpo, set: {method.name: srpo}}
        - {label: grpo, set: {method.name: grpo}}
    seeds: [0, 1]
    eval:
      k: 2
      datasets:
        - {source: synthetic_arithmetic, level: 0, n: 50, seed: 999, name: arith}
    eval_untrained: true      # also evaluate each workflow's starting point (default false)
    references:               # other untrained starting points, evaluated once (e.g. before a warm start)
      - {label: base model, set: {model.init_from: ""}}
    keep_checkpoints: false   # delete a cell's checkpoints once it is evaluated (default true)

A full-model checkpoint of the 135M default is ~1.6 GB, so a grid of 20 cells keeps ~32 GB unless
``keep_checkpoints: false``; ``cell.json``, ``metrics.jsonl`` and ``samples.jsonl`` stay either way.

The results table (``results.md``/``results.json``) reports avg@k and pass@k per dataset and their
macro-averages as mean ± standard error over seeds, and per cell the diagnostics of training:
set-ratio statistics and clip fraction by set size, gradient norm (range and coefficient of
variation), mean active-set size (first and last steps), the router's set size, invalid events,
and correct answers per million team tokens.
"""

from __future__ import annotations

import copy
import itertools
import json
import math
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import yaml

from pydantic import Field

from srpo.config import (ConfigError, DataSource, Float, Section, apply_overrides, check_eval_corpora, config_from_dict,
                         parse_section, read_yaml)
from srpo.metrics_log import read_metrics


class AxisEntry(Section):
    label: str
    """The entry's name in the cell label and the results table."""
    set: dict[str, Any] = Field(default_factory=dict)
    """Config overrides (dotted keys, as ``srpo train --set``) this entry applies."""


class StudyEval(Section):
    k: int = 4
    """Samples per problem (avg@k, pass@k)."""
    temperature: Float | None = None
    """Sampling temperature of the evaluation (None: the cell's workflow.temperature)."""
    datasets: list[DataSource]
    """Held-out sets; file paths relative to the study file."""


class StudySpec(Section):
    output_dir: str
    """Folder of the study: one run folder per cell, results.md/json/png."""
    base: str
    """The training config every cell starts from (relative to the study file)."""
    description: str = ""
    """What the study asks; printed at the top of results.md."""
    overrides: dict[str, Any] = Field(default_factory=dict)
    """Overrides every cell applies before its axis entries' ``set``."""
    axes: dict[str, list[AxisEntry]]
    """Axis name → its entries; the cells are the product of the axes, times the seeds."""
    seeds: list[int]
    """run.seed of each repetition; one seed gives every cell the same task order and first rollout."""
    eval: StudyEval
    """How each cell is evaluated after training."""
    eval_untrained: bool = False
    """Also evaluate each distinct workflow's starting point (once, untrained)."""
    references: list[AxisEntry] = Field(default_factory=list)
    """Untrained starting points to evaluate once (the first seed) next to the cells — e.g. the
    model before a warm start (``{label: base model, set: {model.init_from: ""}}``); each applies
    the study's overrides, then its own ``set``, and is labelled ``untrained (<label>)``."""
    keep_checkpoints: bool = True
    """false: delete a cell's checkpoints once it is evaluated (cell.json and the logs stay)."""
    baseline: str = ""
    """A cell label (e.g. grpo): every other cell's held-out macro avg@k is compared with it seed by
    seed — paired differences, their mean, standard error and 95% confidence interval."""


def load_study(path: str | Path) -> dict:
    """The study file, typed and validated like a run config — and every cell's config validated
    too (before anything trains), so a typo in any axis entry fails at once, naming the entry."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"no study file at {p}")
    raw = yaml.safe_load(p.read_text()) or {}
    try:
        typed = parse_section(StudySpec, raw)
    except ConfigError as err:
        raise ConfigError(f"{p}: {err}") from None
    for axis, entries in typed.axes.items():
        if not entries:
            raise ConfigError(f"{p}: axes.{axis} must be a non-empty list of {{label, set}}")
    spec = typed.model_dump(exclude_unset=True)  # as written: the recipe finished cells recorded
    spec["base"] = str((p.parent / typed.base).resolve())
    spec["base_config"] = read_yaml(spec["base"])  # read once: every cell starts from it and records it
    spec["eval_sources"] = [_resolve(src, p.parent) for src in typed.eval.datasets]
    for cell in cells(spec) + references(spec):
        try:
            check_eval_corpora(cell_config(spec, cell, Path(spec["output_dir"]) / "_check"), spec["eval_sources"],
                               "eval.datasets")
        except ConfigError as err:
            raise ConfigError(f"{p}: cell {cell['label']} (seed {cell['seed']}): {err}") from None
    return spec


def _resolve(src: DataSource, folder: Path) -> DataSource:
    from srpo.tasks.kinds import synthetic_source

    def resolved(path: str) -> str:
        if not path or synthetic_source(path) or path.startswith("hub:") or Path(path).is_absolute():
            return path
        return str((folder / path).resolve())

    return src.model_copy(update={"source": resolved(src.source), "corpus": resolved(src.corpus)})


def cells(spec: dict) -> list[dict]:
    """Every (axis entries..., seed) combination with its merged overrides, seed by seed: every
    cell of seed 0, then of seed 1, ... — so a study stopped early holds complete paired seeds."""
    axes = list(spec["axes"].items())
    out = []
    for seed in spec["seeds"]:
        for combo in itertools.product(*[entries for _, entries in axes]):
            label = "-".join(e["label"] for e in combo)
            overrides = dict(spec.get("overrides") or {})
            for e in combo:
                overrides.update(e.get("set") or {})
            out.append({"label": label, "seed": seed, "overrides": {**overrides, "run.seed": seed},
                        "axes": {name: e["label"] for (name, _), e in zip(axes, combo)}})
    return out


def references(spec: dict) -> list[dict]:
    """The study's untrained references as cells (the first seed; evaluated, never trained)."""
    seed = spec["seeds"][0]
    return [{"label": f"untrained ({ref['label']})", "seed": seed, "axes": {},
             "overrides": {**(spec.get("overrides") or {}), **(ref.get("set") or {}), "run.seed": seed}}
            for ref in spec.get("references") or []]


def cell_config(spec: dict, cell: dict, run_dir: Path):
    data = apply_overrides(copy.deepcopy(spec["base_config"]), {**cell["overrides"], "run.output_dir": str(run_dir)})
    data.setdefault("task", {})["eval"] = []
    return config_from_dict(data)


def _release_memory() -> None:
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # glibc only; elsewhere the collector is enough
    except (OSError, AttributeError):
        pass


def _same_recipe(recorded: dict, recipe: dict) -> bool:
    if "base_config" not in recorded and "base" in recorded:
        # Written before base configs were recorded by content: only their path is known.
        recorded = {k: v for k, v in recorded.items() if k != "base"}
        recipe = {k: v for k, v in recipe.items() if k != "base_config"}
    return recorded == recipe


def run_cell(spec: dict, cell: dict, root: Path, progress: bool = True, train: bool = True) -> dict:
    """Train (unless ``train`` is False: the untrained reference) and evaluate one cell."""
    from srpo import build
    from srpo.evaluation import evaluate
    from srpo.trainer import Trainer

    run_dir = root / cell["label"] / f"seed{cell['seed']}"
    done = run_dir / "cell.json"
    # What a finished cell was run with: reusing it under a changed recipe or evaluation would
    # silently mix old and new results in one table.  The base config is recorded by content, not
    # path, so that a moved or renamed repository still reuses its finished cells.
    recipe = {"overrides": cell["overrides"], "base_config": spec["base_config"], "eval": spec["eval"],
              "train": train}
    if done.is_file():
        record = json.loads(done.read_text())
        if not _same_recipe(record.get("recipe", recipe), recipe):
            raise ConfigError(
                f"{done}: this cell finished under a different recipe or evaluation than the study file now "
                f"asks for; use a new output_dir (or delete the cell's folder to re-run it)")
        return record
    cfg = cell_config(spec, cell, run_dir)
    started = time.perf_counter()
    ev = spec["eval"]
    datasets = build.eval_sets(cfg, spec["eval_sources"], n=0)  # each source's own n
    if train:
        trainer = Trainer(cfg, progress=progress)
        trainer.resume()
        if trainer.step < cfg.run.steps:
            trainer.fit()
        team, autocast = build.Team(trainer.workflow, trainer.role_specs, trainer.policies), trainer.autocast()
    else:  # the untrained reference: the team's starting point, no run folder
        trainer, team = None, build.team(cfg)
        autocast = torch.autocast("cuda" if cfg.run.device.startswith("cuda") else "cpu", dtype=torch.bfloat16,
                                  enabled=cfg.model.autocast_bf16)
    with autocast:
        results = evaluate(team.policies, team.workflow, team.role_specs, datasets, k=ev.get("k", 4),
                           temperature=ev.get("temperature", cfg.workflow.temperature), seed=1000 + cell["seed"],
                           progress=progress, workflows=build.eval_workflows(cfg, spec["eval_sources"], team.workflow))
    if trainer is not None:
        trainer.close()
    # A long study runs many cells in one process: drop this cell's model and optimizer now (the
    # trainer, runtime and policies reference each other, so only the cycle collector frees them)
    # and hand the freed heap back to the OS.  A study process without this was seen at 6.5 GB and
    # half its time in the kernel after ~13 cells; that this was the cause is not yet measured.
    del trainer, team
    _release_memory()
    run_dir.mkdir(parents=True, exist_ok=True)
    record = {**cell, "eval": results, "diagnostics": diagnostics(run_dir) if train else {},
              "minutes": (time.perf_counter() - started) / 60, "recipe": recipe}
    done.write_text(json.dumps(record, indent=1))
    if not spec.get("keep_checkpoints", True):
        # Only after cell.json is written: an interrupted cell keeps its checkpoints to resume from.
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    return record


def _stats(values):
    values = [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    if not values:
        return {}
    mean = sum(values) / len(values)
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / max(len(values) - 1, 1))
    return {"mean": mean, "min": min(values), "max": max(values), "cv": sd / mean if mean else float("nan")}


def diagnostics(run_dir: Path) -> dict[str, Any]:
    rows = read_metrics(run_dir)
    if not rows:
        return {}
    keys = set().union(*rows)
    head, tail = rows[: min(5, len(rows))], rows[-min(5, len(rows)):]

    def avg(rs, key):
        vals = [r[key] for r in rs if isinstance(r.get(key), (int, float))]
        return sum(vals) / len(vals) if vals else None

    out = {
        "set_ratio_min": min((r.get("objective/set_ratio/min", 1.0) for r in rows), default=None),
        "set_ratio_max": max((r.get("objective/set_ratio/max", 1.0) for r in rows), default=None),
        "set_log_ratio_mean": avg(rows, "objective/set_log_ratio/mean"),
        "clip_frac": avg(rows, "objective/clip_frac"),
        "clip_frac_by_k": {k.rsplit("/", 1)[1]: avg(rows, k) for k in sorted(keys)
                           if k.startswith(("by_k/clip_frac/k", "clip_frac/k"))},
        "grad_norm": _stats([r.get("grad_norm/total") for r in rows]),
        "active_set_size_first": avg(head, "active_set_size/mean"),
        "active_set_size_last": avg(tail, "active_set_size/mean"),
        "router_set_size_first": avg(head, "router_set_size/mean"),
        "router_set_size_last": avg(tail, "router_set_size/mean"),
        "invalid_events": sum(r.get("events/invalid", 0) for r in rows),
        "train_reward_first": avg(head, "reward"),
        "train_reward_last": avg(tail, "reward"),
        "correct_per_million_team_tokens": rows[-1].get("cum/correct_per_million_tokens"),
    }
    return out


def mean_se(values):
    if not values:
        return float("nan"), float("nan")
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, float("nan")
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
    return mean, sd / math.sqrt(len(values))


def summarize(records: list[dict], k: int) -> tuple[str, dict]:
    labels = list(dict.fromkeys(r["label"] for r in records))
    datasets = list(dict.fromkeys(d for r in records for d in r["eval"]["datasets"]))
    # QA datasets also carry mean token F1 (accuracy stays exact match).
    metrics_of = {d: (f"avg@{k}", f"pass@{k}") + (("f1",) if any("f1" in r["eval"]["datasets"].get(d, {})
                                                              for r in records) else ())
                  for d in datasets}
    table = {}
    lines = ["| cell | seeds | " + " | ".join(f"{d} {m}" for d in datasets for m in metrics_of[d])
             + f" | macro avg@{k} | macro pass@{k} |",
             "|---|---:|" + "---:|" * (sum(len(m) for m in metrics_of.values()) + 2)]
    for label in labels:
        rs = [r for r in records if r["label"] == label]
        row = {"seeds": [r["seed"] for r in rs]}
        cells_text = []
        for d in datasets:
            for metric in metrics_of[d]:
                m, se = mean_se([r["eval"]["datasets"][d][metric] for r in rs
                                  if metric in r["eval"]["datasets"].get(d, {})])
                row[f"{d}/{metric}"] = (m, se)
                cells_text.append(f"{m:.3f} ± {se:.3f}" if se == se else f"{m:.3f}")
        for metric in (f"avg@{k}", f"pass@{k}"):
            m, se = mean_se([r["eval"]["macro"][metric] for r in rs])
            row[f"macro/{metric}"] = (m, se)
            cells_text.append(f"{m:.3f} ± {se:.3f}" if se == se else f"{m:.3f}")
        table[label] = row
        lines.append(f"| {label} | {len(rs)} | " + " | ".join(cells_text) + " |")
    lines += ["", "| cell | train reward first→last 5 steps | clip frac | clip frac by K | grad norm range (CV) | "
              "active-set size first→last | router set size first→last | invalid events | correct / M team tokens | minutes |",
              "|---|---|---:|---|---|---|---|---:|---:|---:|"]
    for label in labels:
        for r in [r for r in records if r["label"] == label]:
            d = r["diagnostics"]
            g = d.get("grad_norm", {})
            byk = ", ".join(f"{kk}: {v:.3f}" for kk, v in d.get("clip_frac_by_k", {}).items() if v is not None)

            def f(x, fmt="{:.2f}"):
                return fmt.format(x) if isinstance(x, (int, float)) else "–"

            lines.append(
                f"| {label} s{r['seed']} | {f(d.get('train_reward_first'))} → {f(d.get('train_reward_last'))} | "
                f"{f(d.get('clip_frac'), '{:.3f}')} | {byk or '–'} | {f(g.get('min'))}–{f(g.get('max'))} ({f(g.get('cv'))}) | "
                f"{f(d.get('active_set_size_first'))} → {f(d.get('active_set_size_last'))} | "
                f"{f(d.get('router_set_size_first'))} → {f(d.get('router_set_size_last'))} | {d.get('invalid_events', '–')} | "
                f"{f(d.get('correct_per_million_team_tokens'), '{:.0f}')} | {f(r.get('minutes'), '{:.1f}')} |")
    return "\n".join(lines) + "\n", table


def run_study(path: str | Path, progress: bool = True, only: int | None = None) -> Path:
    spec = load_study(path)
    root = Path(spec["output_dir"])
    root.mkdir(parents=True, exist_ok=True)
    (root / "study.yaml").write_text(Path(path).read_text())
    records = []
    todo = cells(spec)
    if spec.get("eval_untrained"):
        # The starting point of every distinct workflow, evaluated once without training.
        seen = set()
        for cell in todo:
            key = json.dumps({k: v for k, v in cell["overrides"].items() if k.startswith("workflow.")}, sort_keys=True)
            if key in seen:
                continue
            seen.add(key)
            base = {**cell, "label": f"untrained ({cell['label']} workflow)", "seed": spec["seeds"][0]}
            records.append(run_cell(spec, base, root, progress, train=False))
    for ref in references(spec):
        records.append(run_cell(spec, ref, root, progress, train=False))
    for i, cell in enumerate(todo[:only] if only else todo):
        if progress:
            print(f"[{i + 1}/{len(todo)}] {cell['label']} seed {cell['seed']}", flush=True)
        records.append(run_cell(spec, cell, root, progress))
        write_results(root, records, spec)
    return root / "results.md"


# Two-sided 95% quantiles of Student's t by degrees of freedom (beyond 30: the normal's 1.96).
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
       11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093,
       20: 2.086, 21: 2.080, 22: 2.074, 23: 2.069, 24: 2.064, 25: 2.060, 26: 2.056, 27: 2.052, 28: 2.048,
       29: 2.045, 30: 2.042}


def paired_differences(records: list[dict], baseline: str, metric: str,
                       dataset: str | None = None) -> dict[str, dict[str, Any]]:
    """Per cell label: the seed-by-seed difference of ``metric`` (of ``eval.macro``, or of one
    ``dataset``) from the ``baseline`` cell on the seeds both finished — mean, standard error, 95%
    t interval, and whether that interval excludes 0.  Pairing (the same seed for both) removes the
    variance the cells share: task order, first rollout, evaluation draws."""
    def value(r):
        return r["eval"]["datasets"][dataset][metric] if dataset else r["eval"]["macro"][metric]

    base = {r["seed"]: value(r) for r in records if r["label"] == baseline}
    out = {}
    for label in dict.fromkeys(r["label"] for r in records):
        if label == baseline or label.startswith("untrained"):
            continue
        diffs = [value(r) - base[r["seed"]] for r in records if r["label"] == label and r["seed"] in base]
        if not diffs:
            continue
        mean, se = mean_se(diffs)
        seeds = sorted(r["seed"] for r in records if r["label"] == label and r["seed"] in base)
        if len(diffs) < 2:  # one seed: no spread to estimate (None, not NaN: results.json stays valid JSON)
            out[label] = {"n": 1, "seeds": seeds, "mean": mean, "se": None, "ci95": None, "significant": False}
            continue
        half = T95.get(len(diffs) - 1, 1.96) * se
        out[label] = {"n": len(diffs), "seeds": seeds, "mean": mean, "se": se, "ci95": [mean - half, mean + half],
                      "significant": bool(mean - half > 0 or mean + half < 0)}
    return out


def paired_table(diffs: dict[str, dict[str, Any]], baseline: str, metric: str, dataset: str | None = None) -> str:
    lines = [f"Paired differences in held-out {dataset or 'macro'} {metric} against `{baseline}` (same seeds; "
             f"95% t interval):", "",
             "| cell | seeds | mean difference | SE | 95% CI | significant at 5% |", "|---|---:|---:|---:|---|---|"]
    for label, d in diffs.items():
        if d["ci95"] is None:
            lines.append(f"| {label} | {d['n']} | {d['mean']:+.3f} | – | – | – (one seed) |")
            continue
        lo, hi = d["ci95"]
        lines.append(f"| {label} | {d['n']} | {d['mean']:+.3f} | {d['se']:.3f} | [{lo:+.3f}, {hi:+.3f}] | "
                     f"{'yes' if d['significant'] else 'no'} |")
    return "\n".join(lines) + "\n"


BY_K = ("clip_frac", "grad_share", "set_log_ratio_std", "unit_log_ratio_std", "events")


def mechanism(root: Path, records: list[dict]) -> dict[str, Any]:
    """Per cell label and set size K, from every seed's metrics.jsonl: the mean over steps of the
    clip fraction, the gradient share, the spreads of the set and clipped log-ratios, and the
    gradient share per transition relative to an average transition (``weight_per_transition``:
    share of the gradient / share of the transitions; 1 = every transition weighs the same).
    Mean ± SE over seeds; also the per-step means over seeds (``by_step``)."""
    from srpo.methods import METHODS

    out: dict[str, Any] = {}
    for label in dict.fromkeys(r["label"] for r in records if not r["label"].startswith("untrained")):
        seeds = [r for r in records if r["label"] == label]
        per_seed: dict[int, dict[str, dict[int, list[float]]]] = {}  # K → metric → seed → per-step values
        steps: dict[int, dict[str, dict[int, list[float]]]] = {}
        name = seeds[0]["overrides"].get("method.name") or \
            seeds[0].get("recipe", {}).get("base_config", {}).get("method", {}).get("name", "srpo")
        split = METHODS[name].per_member  # its events are members: a K-transition counts K times
        for r in seeds:
            rows = read_metrics(root / label / f"seed{r['seed']}")
            for row in rows:
                ks = sorted({int(k.rsplit("/k", 1)[1]) for k in row if k.startswith("by_k/events/k")})
                transitions = {K: row[f"by_k/events/k{K}"] / (K if split else 1) for K in ks}
                total = sum(transitions.values()) or 1.0
                for K in ks:
                    values = {m: row.get(f"by_k/{m}/k{K}") for m in BY_K}
                    if values["grad_share"] is not None and transitions[K]:
                        values["weight_per_transition"] = values["grad_share"] / (transitions[K] / total)
                    for m, v in values.items():
                        if v is None:
                            continue
                        per_seed.setdefault(K, {}).setdefault(m, {}).setdefault(r["seed"], []).append(v)
                        steps.setdefault(K, {}).setdefault(m, {}).setdefault(row["step"], []).append(v)
        cell: dict[str, Any] = {}
        for K, series in per_seed.items():
            stats = {}
            for m in (*BY_K, "weight_per_transition"):
                seed_means = [sum(v) / len(v) for v in series.get(m, {}).values() if v]
                if seed_means:
                    mean, se = mean_se(seed_means)
                    stats[m] = {"mean": mean, "se": se, "seeds": len(seed_means)}
            stats["by_step"] = {m: {s: sum(v) / len(v) for s, v in sorted(by.items())} for m, by in steps[K].items()}
            cell[str(K)] = stats
        out[label] = dict(sorted(cell.items(), key=lambda kv: int(kv[0])))
    return out


def pairing_check(root: Path, records: list[dict]) -> dict[str, Any]:
    """Whether one seed gave every cell of one workflow the same first rollout: the step-1
    training reward of every trained cell, per seed (equal within a workflow when paired)."""
    out: dict[str, dict[str, float]] = {}
    for r in records:
        if r["label"].startswith("untrained"):
            continue
        rows = read_metrics(root / r["label"] / f"seed{r['seed']}")
        if rows:
            out.setdefault(str(r["seed"]), {})[r["label"]] = rows[0].get("reward")
    return out


def _nan_to_none(obj: Any) -> Any:
    """``obj`` with every non-finite float as None: a one-seed SE or an empty mean is NaN here, and
    NaN is not JSON (jq, JavaScript and strict parsers refuse the file)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _nan_to_none(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_nan_to_none(v) for v in obj]
    return obj


def write_results(root: Path, records: list[dict], spec: dict) -> None:
    k = spec["eval"].get("k", 4)
    text, table = summarize(records, k)
    extra: dict[str, Any] = {}
    baseline = spec.get("baseline")
    if baseline and any(r["label"] == baseline for r in records):
        extra["paired"] = {m: paired_differences(records, baseline, m) for m in (f"avg@{k}", f"pass@{k}")}
        text += "\n" + paired_table(extra["paired"][f"avg@{k}"], baseline, f"avg@{k}")
        datasets = list(dict.fromkeys(d for r in records for d in r["eval"]["datasets"]))
        if len(datasets) > 1:  # the macro average can hide a gain on one set and a loss on another
            extra["paired_by_dataset"] = {d: {m: paired_differences(records, baseline, m, d)
                                              for m in (f"avg@{k}", f"pass@{k}")} for d in datasets}
            for d in datasets:
                text += "\n" + paired_table(extra["paired_by_dataset"][d][f"avg@{k}"], baseline, f"avg@{k}", d)
    extra["mechanism"] = mechanism(root, records)
    extra["first_rollout_reward"] = pairing_check(root, records)
    (root / "results.md").write_text(f"# Study: {root.name}\n\n{spec.get('description', '')}\n\n{text}")
    results = _nan_to_none({"table": table, **extra, "cells": records})
    (root / "results.json").write_text(json.dumps(results, indent=1, default=str, allow_nan=False))
    from srpo.report import plot_mechanism, plot_study

    plot_study(root, records, k)
    if any(extra["mechanism"].values()):
        plot_mechanism(root, extra["mechanism"])


def summarize_study(path: str | Path) -> Path:
    """Rewrite results.md/json/png from the cells a study has finished, running nothing."""
    spec = load_study(path)
    root = Path(spec["output_dir"])
    records = []
    for cell in cells(spec):
        done = root / cell["label"] / f"seed{cell['seed']}" / "cell.json"
        if done.is_file():
            records.append(json.loads(done.read_text()))
    untrained = sorted(root.glob("untrained */seed*/cell.json"))
    records = [json.loads(p.read_text()) for p in untrained] + records
    if not records:
        raise ConfigError(f"{root}: no finished cells to summarize")
    write_results(root, records, spec)
    return root / "results.md"


def add_study_parser(sub) -> None:
    p = sub.add_parser("study", help="methods × workflows × tasks × seeds: train, evaluate, tabulate (resumable)")
    p.add_argument("--config", required=True, help="a study file (see configs/studies/)")
    p.add_argument("--only", type=int, default=None, help="run only the first N cells")
    p.add_argument("--summarize", action="store_true",
                   help="only rewrite results.md/json/png from the cells already finished (runs nothing)")
    p.set_defaults(func=_study)


def _study(args) -> int:
    out = summarize_study(args.config) if args.summarize else run_study(args.config, only=args.only)
    print(f"results: {out}")
    return 0
