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
import logging
import math
import shutil
import time
from pathlib import Path
from typing import Any, Literal

import torch
import yaml

from pydantic import Field

from srpo.config import (ConfigError, DataSource, Float, Section, apply_overrides, parse_section, read_yaml,
                         resolve_program_path)
from srpo import build, stats
from srpo.runs.fileio import remove_stale_temp_files, write_text_atomic
from srpo.runs.metrics_log import read_metrics
from srpo.runs.run_dir import owned, refuse_links
from srpo.stats import mean_se
from srpo.tasks.splits import MIN_HELDOUT_PROBLEMS, distinct_problems

log = logging.getLogger(__name__)


class AxisEntry(Section):
    label: str
    """The entry's name in the cell label and the results table."""
    set: dict[str, Any] = Field(default_factory=dict)
    """Config overrides (dotted keys, as ``srpo train --set``) this entry applies."""
    seeds: list[int] | None = None
    """Run this entry at these of the study's seeds only (None: all) — e.g. a reference cell at 5
    seeds next to a primary comparison at 20."""


class StudyEval(Section):
    k: int = 4
    """Samples per problem (avg@k, pass@k)."""
    temperature: Float | None = None
    """Sampling temperature of the evaluation (None: the cell's workflow.temperature)."""
    datasets: list[DataSource]
    """Held-out sets; file paths relative to the study file."""


class PrimaryComparison(Section):
    """The one comparison a study is run to decide, declared before it runs: judged at 5% on its
    own (Holm among its cells when it names several), reported with its power whatever it shows."""
    baseline: str
    """The cell label compared against (e.g. grpo)."""
    cells: list[str]
    """The cell labels compared with it (e.g. [srpo])."""
    metric: str = ""
    """avg@k or pass@k (default: avg@k of the study's eval.k)."""
    dataset: str = "macro"
    """macro (the mean over eval.datasets) or one dataset's name."""
    test: Literal["paired t"] = "paired t"
    """The decision test (the exact sign-flip p is reported beside it)."""


class Contrast(Section):
    """One more paired comparison beside those against ``baseline``: ``cell`` − ``against``, seed by
    seed — for a study whose question is a difference within each of several conditions (e.g. sum −
    sqrt at one and at four optimizer steps per rollout)."""
    cell: str
    """The cell label whose values are compared."""
    against: str
    """The cell label it is compared with (the paired difference is cell − against)."""


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
    """A cell label (e.g. grpo): every other cell's held-out avg@k and pass@k are compared with it
    seed by seed — paired differences, mean, SE, 95% t interval, t and exact sign-flip p, and
    Holm-adjusted p across all of the study's comparisons (srpo.stats)."""
    primary: PrimaryComparison | None = None
    """The pre-registered primary comparison (see PrimaryComparison)."""
    contrasts: list[Contrast] = Field(default_factory=list)
    """More paired comparisons (cell − against), reported and Holm-adjusted with all the others."""


def load_study(path: str | Path, check_cells: bool = True) -> dict:
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
    repeated = sorted({s for s in typed.seeds if typed.seeds.count(s) > 1})
    if repeated:
        raise ConfigError(f"{p}: seeds lists {', '.join(map(str, repeated))} more than once; a seed twice would be one "
                          f"run counted as two paired seeds in every comparison")
    for axis, entries in typed.axes.items():
        labels = [e.label for e in entries]
        twice = sorted({label for label in labels if labels.count(label) > 1})
        if twice:
            raise ConfigError(f"{p}: axes.{axis} has the label {twice[0]!r} more than once; two entries of one "
                              f"label make the same cell twice (its runs would count twice in the statistics)")
    spec = typed.model_dump(exclude_unset=True)  # as written: the recipe finished cells recorded
    spec["base"] = str((p.parent / typed.base).resolve())
    spec["folder"] = str(p.parent.resolve())  # a program's file path in the overrides is relative to it
    spec["base_config"] = read_yaml(spec["base"])  # read once: every cell starts from it and records it
    spec["eval_sources"] = [_resolve(src, p.parent) for src in typed.eval.datasets]
    made = [(c["label"], c["seed"]) for c in cells(spec)]
    doubled = sorted({m for m in made if made.count(m) > 1})
    if doubled:
        raise ConfigError(f"{p}: the grid makes cell {doubled[0][0]!r} (seed {doubled[0][1]}) more than once "
                          f"(labels joined across axes coincide); rename an entry")
    if typed.primary is not None:
        labels = {c["label"] for c in cells(spec)}
        for name in [typed.primary.baseline, *typed.primary.cells]:
            if name not in labels:
                raise ConfigError(f"{p}: primary names cell {name!r}, which the axes do not make; cells: "
                                  f"{', '.join(sorted(labels))}")
        spec["primary"] = {**typed.primary.model_dump(), "metric": typed.primary.metric or f"avg@{typed.eval.k}"}
    if typed.contrasts:
        labels = {c["label"] for c in cells(spec)}
        for contrast in typed.contrasts:
            for name in (contrast.cell, contrast.against):
                if name not in labels:
                    raise ConfigError(f"{p}: contrasts names cell {name!r}, which the axes do not make; cells: "
                                      f"{', '.join(sorted(labels))}")
    for cell in (cells(spec) + references(spec)) if check_cells else ():
        try:
            build.check_eval_corpora(cell_config(spec, cell, Path(spec["output_dir"]) / "_check"), spec["eval_sources"],
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
            if any(e.get("seeds") is not None and seed not in e["seeds"] for e in combo):
                continue
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
    if spec.get("folder"):  # workflow.options.entry: path/to/team.py:fn is relative to the study file, as in a config
        resolve_program_path(data, Path(spec["folder"]))
    return build.config_from_dict(data)


def environment(eval_seed: int) -> dict[str, Any]:
    """What a cell ran with that its recipe does not say: intra-op threads (results differ in the
    last bits between thread counts), torch and srpo versions, the git commit, the evaluation seed."""
    import platform
    import subprocess

    import srpo

    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                                cwd=Path(srpo.__file__).parent).stdout.strip() or None
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                    text=True, timeout=10, cwd=Path(srpo.__file__).parent).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        commit, dirty = None, None
    return {"threads": torch.get_num_threads(), "torch": torch.__version__,
            "srpo": getattr(srpo, "__version__", None), "commit": commit, "dirty": dirty, "eval_seed": eval_seed,
            "python": platform.python_version()}


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


def eval_splits(spec: dict) -> list[str | None]:
    """The part each synthetic evaluation set draws from (None for files): part of a cell's recipe,
    so a cell evaluated before held-out parts existed (on the whole space) is never reused as if it
    had been evaluated on the test part."""
    from srpo.tasks.kinds import synthetic_source
    from srpo.tasks.splits import resolve_split

    return [resolve_split(src.split, held_out=True) if synthetic_source(src.source) else None
            for src in spec["eval_sources"]]


def read_cell(path: Path) -> dict | None:
    """A finished cell's record, or None when there is none — or when it cannot be read (a torn
    write from before records were written atomically): then it is named, set aside as
    ``cell.json.unreadable`` and the cell is run again."""
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
        if not isinstance(record, dict) or "eval" not in record:
            raise ValueError("not a cell record")
        return record
    except (ValueError, UnicodeDecodeError) as err:
        import warnings

        warnings.warn(f"{path}: unreadable cell record ({err}); the cell is run again", stacklevel=2)
        path.replace(path.with_name("cell.json.unreadable"))
        return None


def run_cell(spec: dict, cell: dict, root: Path, progress: bool = True, train: bool = True) -> dict:
    """Train (unless ``train`` is False: the untrained reference) and evaluate one cell."""
    from srpo.evaluation import evaluate
    from srpo.train import Trainer

    run_dir = root / cell["label"] / f"seed{cell['seed']}"
    done = run_dir / "cell.json"
    # What a finished cell was run with: reusing it under a changed recipe or evaluation would
    # silently mix old and new results in one table.  The base config is recorded by content, not
    # path, so that a moved or renamed repository still reuses its finished cells.
    recipe = {"overrides": cell["overrides"], "base_config": spec["base_config"], "eval": spec["eval"],
              "train": train, "eval_splits": eval_splits(spec)}
    record = read_cell(done)
    if record is not None:
        if not _same_recipe(record.get("recipe", recipe), recipe):
            raise ConfigError(
                f"{done}: this cell finished under a different recipe or evaluation than the study file now "
                f"asks for; use a new output_dir (or delete the cell's folder to re-run it)")
        return record
    cfg = cell_config(spec, cell, run_dir)
    started = time.perf_counter()
    eval_seed = 1000 + cell["seed"]
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
        autocast = build.autocast(cfg)
    with autocast:
        results = evaluate(team.policies, team.workflow, team.role_specs, datasets, k=ev.get("k", 4),
                           temperature=ev.get("temperature", cfg.workflow.temperature), seed=eval_seed,
                           progress=progress, workflows=build.eval_workflows(cfg, spec["eval_sources"], team.workflow),
                           engine=trainer.engine if trainer is not None else None)
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
              "minutes": (time.perf_counter() - started) / 60, "recipe": recipe,
              "environment": environment(eval_seed)}
    write_text_atomic(done, json.dumps(record, indent=1))
    if not spec.get("keep_checkpoints", True) and "checkpoints" in owned(run_dir) \
            and not (run_dir / "checkpoints").is_symlink():
        # Only after cell.json is written: an interrupted cell keeps its checkpoints to resume from.
        # Only the checkpoints its training recorded writing (srpo.runs.run_dir): never a folder it did not make.
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


def run_study(path: str | Path, progress: bool = True, only: int | None = None,
              shard: tuple[int, int] = (1, 1)) -> Path:
    """Run every unfinished cell (or the first ``only``), then tabulate.  ``shard=(i, n)``: run only
    cells i, i+n, i+2n, ... (1-based) — n processes on one study folder share its cells, each writing
    its own; the results are written from every cell finished on disk, whoever ran it."""
    spec = load_study(path)
    root = Path(spec["output_dir"])
    root.mkdir(parents=True, exist_ok=True)
    refuse_links(root, STUDY_FILES)  # srpo writes only real files of its own in a study folder
    remove_stale_temp_files(root, ("results.md", "results.json", "study.yaml"))  # a crashed write's leftovers
    write_text_atomic(root / "study.yaml", Path(path).read_text())
    index, count = shard
    sizes = heldout_sizes(spec)  # loaded once per study process; write_results reuses it
    small = {name: n for name, n in sizes.items() if n < MIN_HELDOUT_PROBLEMS}
    if small and index == 1:
        log.warning("held-out set(s) with fewer than %d distinct problems: %s — the evaluation's own noise will "
                    "be a large share of the seed-to-seed spread (scripts/plan_seeds.py reports it)",
                    MIN_HELDOUT_PROBLEMS, ", ".join(f"{k} ({v})" for k, v in small.items()))
    todo = cells(spec)
    if index == 1:  # the untrained starting points: one shard evaluates them
        if spec.get("eval_untrained"):
            # The starting point of every distinct workflow, evaluated once without training.
            seen = set()
            for cell in todo:
                key = json.dumps({k: v for k, v in cell["overrides"].items() if k.startswith("workflow.")},
                                 sort_keys=True)
                if key in seen:
                    continue
                seen.add(key)
                run_cell(spec, {**cell, "label": f"untrained ({cell['label']} workflow)", "seed": spec["seeds"][0]},
                         root, progress, train=False)
        for ref in references(spec):
            run_cell(spec, ref, root, progress, train=False)
    selected = todo[:only] if only else todo
    for i, cell in enumerate(selected):
        if i % count != index - 1:
            continue
        from srpo.runs import preemption

        if preemption.check():  # between cells: everything finished so far is on disk
            raise preemption.Preempted(f"{preemption.requested()}: the study stopped before cell {i + 1}; "
                                       f"run it again to continue")
        if progress:
            print(f"[{i + 1}/{len(todo)}] {cell['label']} seed {cell['seed']}", flush=True)
        run_cell(spec, cell, root, progress)
        write_results(root, finished_records(spec, root), spec)
    records = finished_records(spec, root)
    if records:
        write_results(root, records, spec)
    return root / "results.md"


def paired_differences(records: list[dict], baseline: str, metric: str,
                       dataset: str | None = None) -> dict[str, dict[str, Any]]:
    """Per cell label: the seed-by-seed difference of ``metric`` (of ``eval.macro``, or of one
    ``dataset``) from the ``baseline`` cell on the seeds both finished — mean, SE, 95% t interval,
    t-test p and exact sign-flip p (:func:`srpo.stats.paired`), *unadjusted*: ``significant`` here
    means p < 0.05 for this test alone; a study's words come from :func:`comparisons`, which
    corrects for the number of comparisons.  Pairing (the same seed for both) removes the variance
    the cells share: task order, first rollout, evaluation draws."""
    def value(r):
        return r["eval"]["datasets"][dataset][metric] if dataset else r["eval"]["macro"][metric]

    base = {r["seed"]: value(r) for r in records if r["label"] == baseline}
    out = {}
    for label in dict.fromkeys(r["label"] for r in records):
        if label == baseline or label.startswith("untrained"):
            continue
        mine = sorted((r["seed"], value(r)) for r in records if r["label"] == label and r["seed"] in base)
        if not mine:
            continue
        test = stats.paired([v - base[seed] for seed, v in mine])
        out[label] = {**test, "seeds": [seed for seed, _ in mine],
                      "significant": bool(test["p_t"] is not None and test["p_t"] < stats.ALPHA)}
    return out


def comparisons(records: list[dict], spec: dict) -> list[dict[str, Any]]:
    """Every paired comparison the study reports — each cell against the baseline (and the primary
    comparison's baseline), then the declared ``contrasts``, for avg@k and pass@k, on the macro average and on each dataset when
    there are several — with Holm-adjusted p-values across all of them (:func:`srpo.stats.adjust`).
    The pre-registered primary comparison (``primary``) is marked and judged on its own: Holm only
    among the primary cells, when it names several."""
    k = spec["eval"].get("k", 4)
    primary = spec.get("primary") or {}
    datasets = list(dict.fromkeys(d for r in records for d in r["eval"]["datasets"]))
    scopes = [None] + (datasets if len(datasets) > 1 else [])
    baselines = [b for b in dict.fromkeys((spec.get("baseline"), primary.get("baseline"))) if b]
    out: list[dict[str, Any]] = []
    for baseline in baselines:
        if not any(r["label"] == baseline for r in records):
            continue
        for scope in scopes:
            for metric in (f"avg@{k}", f"pass@{k}"):
                for label, test in paired_differences(records, baseline, metric, scope).items():
                    is_primary = bool(primary) and baseline == primary["baseline"] and label in primary["cells"] \
                        and metric == primary.get("metric", f"avg@{k}") and (scope or "macro") == primary.get("dataset", "macro")
                    out.append({"cell": label, "baseline": baseline, "metric": metric, "dataset": scope or "macro",
                                "primary": is_primary, **{k_: v for k_, v in test.items() if k_ != "significant"}})
    done = {(c["cell"], c["baseline"]) for c in out}
    for contrast in spec.get("contrasts") or []:
        if (contrast["cell"], contrast["against"]) in done:
            continue
        for scope in scopes:
            for metric in (f"avg@{k}", f"pass@{k}"):
                test = paired_differences(records, contrast["against"], metric, scope).get(contrast["cell"])
                if test is not None:
                    out.append({"cell": contrast["cell"], "baseline": contrast["against"], "metric": metric,
                                "dataset": scope or "macro", "primary": False,
                                **{k_: v for k_, v in test.items() if k_ != "significant"}})
    firsts = [c for c in out if c["primary"]]
    for c, p in zip(firsts, stats.holm([c["p_t"] if c["p_t"] is not None else float("nan") for c in firsts])):
        c["p_primary"] = p if p == p else None
        if c["sd"]:
            c["power"] = {"sd": c["sd"], "n": c["n"],
                          "power_at": {str(e): stats.power(c["sd"], c["n"], e) for e in (0.05, 0.10)},
                          "detectable_80": stats.detectable(c["sd"], c["n"]),
                          "seeds_for_80": {str(e): stats.seeds_needed(c["sd"], e) for e in (0.05, 0.10)}}
    stats.adjust(out)
    return out


def comparisons_text(comps: list[dict[str, Any]], spec: dict) -> str:
    """The primary result (with its power), then every comparison with Holm-adjusted p-values."""
    lines = []
    primary = [c for c in comps if c["primary"]]
    if primary:
        p = spec["primary"]
        lines += [f"## Primary comparison (pre-registered): {p.get('metric')} on {p.get('dataset', 'macro')}, "
                  f"{', '.join(p['cells'])} against `{p['baseline']}`", "",
                  "| cell | seeds | mean difference | 95% t CI | + / − seeds | p (t) | p (exact sign-flip) | verdict |",
                  "|---|---:|---:|---|---|---:|---:|---|"]
        for c in primary:
            ci = f"[{c['ci95'][0]:+.3f}, {c['ci95'][1]:+.3f}]" if c["ci95"] else "–"
            lines.append(f"| {c['cell']} | {c['n']} | {c['mean']:+.3f} | {ci} | {c.get('positive', '–')} / "
                         f"{c.get('negative', '–')} | {stats.fmt_p(c.get('p_primary', c['p_t']))} | "
                         f"{stats.fmt_p(c['p_sign_flip'])} | {c['verdict']} |")
        for c in primary:
            pw = c.get("power")
            if pw:
                lines += ["", f"Power ({c['cell']}): the paired differences' SD is {pw['sd']:.3f} over {pw['n']} seeds; "
                          f"a true difference of 0.05 would be found with probability {pw['power_at']['0.05']:.2f}, "
                          f"0.10 with {pw['power_at']['0.1']:.2f}; the smallest difference found 80% of the time is "
                          f"{pw['detectable_80']:.3f}; 80% power needs {pw['seeds_for_80']['0.05']} seeds for 0.05 and "
                          f"{pw['seeds_for_80']['0.1']} for 0.10."]
        lines.append("")
    others = [c for c in comps if not c["primary"]]
    if others:
        lines += [f"## Paired comparisons ({len(comps)} in this study; p-values Holm-adjusted across all of them)", "",
                  "| cell | against | metric | dataset | seeds | mean difference | SE | 95% t CI | p (t) | p (t, Holm) | "
                  "p (sign-flip) | p (sign-flip, Holm) | verdict |",
                  "|---|---|---|---|---:|---:|---:|---|---:|---:|---:|---:|---|"]
        for c in others:
            ci = f"[{c['ci95'][0]:+.3f}, {c['ci95'][1]:+.3f}]" if c["ci95"] else "–"
            se = f"{c['se']:.3f}" if c["se"] is not None else "–"
            lines.append(f"| {c['cell']} | {c['baseline']} | {c['metric']} | {c['dataset']} | {c['n']} | "
                         f"{c['mean']:+.3f} | {se} | {ci} | {stats.fmt_p(c['p_t'])} | {stats.fmt_p(c['p_t_holm'])} | "
                         f"{stats.fmt_p(c['p_sign_flip'])} | {stats.fmt_p(c['p_sign_flip_holm'])} | {c['verdict']} |")
        n_min = min((c["n"] for c in comps if c["n"]), default=0)
        if n_min and n_min <= 5:
            lines += ["", f"With {n_min} seeds no exact sign-flip test can go below p = {2 / 2 ** n_min:.4f}: a "
                      f"significant t-test at that size rests on the differences being normal."]
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


STUDY_FILES = ("study.yaml", "results.md", "results.json", "results.png", "mechanism.png")


def heldout_sizes(spec: dict) -> dict[str, int]:
    """Distinct problems (canonical: a + b and b + a are one) in each held-out set of the study;
    computed once and kept in ``spec`` (results are rewritten after every cell)."""
    if "_heldout_sizes" in spec:
        return spec["_heldout_sizes"]
    from srpo.data import load_tasks, source_name

    kind = (spec.get("base_config") or {}).get("task", {}).get("kind", "math")
    out = {}
    for src in spec["eval_sources"]:
        try:
            out[source_name(src)] = distinct_problems(load_tasks(src, kind, held_out=True))
        except Exception:  # noqa: BLE001 - a set that fails to load fails in its cell, with its message
            continue
    spec["_heldout_sizes"] = out
    return out


def write_results(root: Path, records: list[dict], spec: dict) -> None:
    k = spec["eval"].get("k", 4)
    text, table = summarize(records, k)
    extra: dict[str, Any] = {"heldout_distinct_problems": heldout_sizes(spec)}
    comps = comparisons(records, spec)
    if comps:
        extra["comparisons"] = comps
        text = comparisons_text(comps, spec) + "\n## Cells\n\n" + text
    extra["mechanism"] = mechanism(root, records)
    extra["first_rollout_reward"] = pairing_check(root, records)
    write_text_atomic(root / "results.md", f"# Study: {root.name}\n\n{spec.get('description', '')}\n\n{text}")
    results = _nan_to_none({"table": table, **extra, "cells": records})
    write_text_atomic(root / "results.json", json.dumps(results, indent=1, default=str, allow_nan=False))
    from srpo.apps.report import plot_mechanism, plot_study

    plot_study(root, records, k)
    if any(extra["mechanism"].values()):
        plot_mechanism(root, extra["mechanism"])


def finished_records(spec: dict, root: Path) -> list[dict]:
    """The records of every finished cell in ``root``: untrained starting points first, then the
    cells in study order."""
    records = [r for r in (read_cell(p) for p in sorted(root.glob("untrained */seed*/cell.json"))) if r]
    for cell in cells(spec):
        record = read_cell(root / cell["label"] / f"seed{cell['seed']}" / "cell.json")
        if record is not None:
            records.append(record)
    return records


def summarize_study(path: str | Path) -> Path:
    """Rewrite results.md/json/png from the cells a study has finished, running nothing."""
    spec = load_study(path)
    root = Path(spec["output_dir"])
    records = finished_records(spec, root)
    if not records:
        raise ConfigError(f"{root}: no finished cells to summarize")
    write_results(root, records, spec)
    return root / "results.md"


def restate_results(path: str | Path, results: str | Path) -> str:
    """Recompute the comparisons of an existing ``results.json`` (its ``cells``) with today's
    statistics, for the study file ``path``, and rewrite it as strict JSON; returns the comparison
    tables as markdown.  For results whose cell folders are gone (the shipped ``docs/results_*.json``);
    the mechanism and the cells' records are kept as they are."""
    spec = load_study(path, check_cells=False)  # nothing runs: a warm start's folder may be gone
    data = json.loads(Path(results).read_text())  # Python's reader takes the NaN of older files
    records = data["cells"]
    comps = comparisons(records, spec)
    for stale in ("paired", "paired_by_dataset"):
        data.pop(stale, None)
    data["comparisons"] = comps
    if all(c.get("environment") is None for c in records):
        data["evaluated_on"] = ("synthetic evaluation sets drawn from the whole problem space (before "
                                "srpo.tasks.splits): the training distribution, not a held-out test part")
    write_text_atomic(results, json.dumps(_nan_to_none(data), indent=1, default=str, allow_nan=False))
    return comparisons_text(comps, spec)


def add_study_parser(sub) -> None:
    p = sub.add_parser("study", help="methods × workflows × tasks × seeds: train, evaluate, tabulate (resumable)")
    p.add_argument("--config", required=True, help="a study file (see configs/studies/)")
    p.add_argument("--only", type=int, default=None, help="run only the first N cells")
    p.add_argument("--shard", default="1/1", metavar="I/N",
                   help="run only cells I, I+N, ... (N processes share one study folder; e.g. two at one thread each)")
    p.add_argument("--restate", metavar="RESULTS_JSON", default=None,
                   help="recompute the comparisons of an existing results.json (its cells) with today's statistics, "
                        "rewrite it as strict JSON and print the tables (runs nothing)")
    p.add_argument("--summarize", action="store_true",
                   help="only rewrite results.md/json/png from the cells already finished (runs nothing)")
    p.set_defaults(func=_study)


def _study(args) -> int:
    if args.restate:
        print(restate_results(args.config, args.restate))
        return 0
    try:
        index, count = (int(x) for x in args.shard.split("/"))
        if not 1 <= index <= count:
            raise ValueError
    except ValueError:
        raise ConfigError(f"--shard {args.shard!r}: expected I/N with 1 <= I <= N, e.g. 1/2") from None
    if not args.summarize:
        from srpo.runs import preemption
        from srpo.config import RunConfig

        preemption.install(RunConfig().preempt_grace_s)  # a cell's training saves at its next step end
    out = summarize_study(args.config) if args.summarize else run_study(args.config, only=args.only,
                                                                       shard=(index, count))
    print(f"results: {out}")
    return 0
