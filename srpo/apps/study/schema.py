"""A study file: its schema (typed sections, checked before any cell runs) and the grid of cells it names."""

from __future__ import annotations

import copy
import itertools
import logging
from pathlib import Path
from typing import Any, Literal

import yaml

from pydantic import Field

from srpo.config import (ConfigError, DataSource, Float, Section, apply_overrides, parse_section, read_yaml,
                         resolve_program_path)
from srpo import build
from srpo.tasks.splits import distinct_problems

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
    during_training: bool = False
    """Also evaluate during training as the base config does (its ``task.eval`` sets every
    ``eval.every`` steps: curves in each cell's metrics).  false: cells do not evaluate during
    training (``task.eval`` dropped, ``eval.every: 0``); the study evaluates each cell once, after
    training, on ``datasets``."""


class PrimaryComparison(Section):
    """The one comparison a study is run to decide, declared before it runs: judged at 5% on its
    own (Holm among its cells when it names several), reported with its power whatever it shows."""
    baseline: str
    """The cell label compared against (e.g. grpo)."""
    cells: list[str]
    """The cell labels compared with it (e.g. [srpo])."""
    metric: str = ""
    """avg@k or pass@k (default: avg@k of the study's eval.k), or a task kind's own metric
    (``per_part``, ``f1``) — compared on ``dataset``, which must then name one held-out set."""
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
    cell_process: bool = True
    """Run each cell in a fresh process, so that everything a cell allocates goes back to the OS
    when it ends and a long study's process stays flat (benchmarks/bench_study_memory.py); false:
    every cell in the study's own process."""
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
        own_metric = spec["primary"]["metric"] not in (f"avg@{typed.eval.k}", f"pass@{typed.eval.k}")
        if own_metric and typed.primary.dataset == "macro":
            raise ConfigError(f"{p}: primary.metric {typed.primary.metric!r} is a task kind's own metric, reported per "
                              f"held-out set: name the set in primary.dataset (macro holds avg@k and pass@k only)")
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
    """The training config of ``cell``: the base, without evaluation during training unless the
    study's ``eval.during_training`` keeps it (a cell's own overrides still apply on top)."""
    base = copy.deepcopy(spec["base_config"])
    if not spec["eval"].get("during_training", False):  # the study evaluates after training, on its own sets
        base.setdefault("task", {})["eval"] = []
        base["eval"] = {**(base.get("eval") or {}), "every": 0}
    data = apply_overrides(base, {**cell["overrides"], "run.output_dir": str(run_dir)})
    if spec.get("folder"):  # workflow.options.entry: path/to/team.py:fn is relative to the study file, as in a config
        resolve_program_path(data, Path(spec["folder"]))
    return build.config_from_dict(data)


def eval_splits(spec: dict) -> list[str | None]:
    """The part each synthetic evaluation set draws from (None for files): part of a cell's recipe,
    so a cell evaluated before held-out parts existed (on the whole space) is never reused as if it
    had been evaluated on the test part."""
    from srpo.tasks.kinds import synthetic_source
    from srpo.tasks.splits import resolve_split

    return [resolve_split(src.split, held_out=True) if synthetic_source(src.source) else None
            for src in spec["eval_sources"]]


def heldout_sizes(spec: dict) -> dict[str, int]:
    """Distinct problems (canonical: a + b and b + a are one) in each held-out set of the study;
    computed once and kept in ``spec`` (results are rewritten after every cell)."""
    if "_heldout_sizes" in spec:
        return spec["_heldout_sizes"]
    from srpo.data import load_tasks, source_name

    # The study's own overrides may set the kind (study (n) runs task.kind: parts on a math base).
    base_kind = (spec.get("base_config") or {}).get("task", {}).get("kind", "math")
    kind = (spec.get("overrides") or {}).get("task.kind", base_kind)
    out = {}
    for src in spec["eval_sources"]:
        try:
            out[source_name(src)] = distinct_problems(load_tasks(src, kind, held_out=True))
        except Exception:  # noqa: BLE001 - a set that fails to load fails in its cell, with its message
            continue
    spec["_heldout_sizes"] = out
    return out
