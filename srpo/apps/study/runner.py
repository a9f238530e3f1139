"""Running a study: each cell a training run plus evaluation, recorded in ``cell.json``; a finished cell
is never re-run, an interrupted one resumes; the results are rewritten after every cell."""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from srpo.config import ConfigError
from srpo import build
from srpo.runs.fileio import remove_stale_temp_files, write_text_atomic
from srpo.runs.metrics_log import read_metrics
from srpo.runs.run_dir import owned, refuse_links
from srpo.tasks.splits import MIN_HELDOUT_PROBLEMS
from srpo.apps.study.schema import cell_config, cells, eval_splits, heldout_sizes, load_study, references
from srpo.apps.study.statistics import (nan_to_none, comparisons, comparisons_text, mechanism, pairing_check,
                                        summarize)

log = logging.getLogger(__name__)


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


def _recipe(spec: dict, cell: dict, train: bool) -> dict:
    """What a finished cell was run with: reusing it under a changed recipe or evaluation would
    silently mix old and new results in one table.  The base config is recorded by content, not
    path, so that a moved or renamed repository still reuses its finished cells."""
    return {"overrides": cell["overrides"], "base_config": spec["base_config"], "eval": spec["eval"],
            "train": train, "eval_splits": eval_splits(spec)}


def finished_cell(spec: dict, cell: dict, root: Path, train: bool = True) -> dict | None:
    """The cell's record if it finished under this recipe; None if it has not finished; a
    :class:`ConfigError` if it finished under another."""
    done = root / cell["label"] / f"seed{cell['seed']}" / "cell.json"
    record = read_cell(done)
    if record is not None:
        recipe = _recipe(spec, cell, train)
        if not _same_recipe(record.get("recipe", recipe), recipe):
            raise ConfigError(
                f"{done}: this cell finished under a different recipe or evaluation than the study file now "
                f"asks for; use a new output_dir (or delete the cell's folder to re-run it)")
    return record


def run_cell(spec: dict, cell: dict, root: Path, progress: bool = True, train: bool = True) -> dict:
    """Train (unless ``train`` is False: the untrained reference) and evaluate one cell, in this
    process (:func:`run_cell_in_process`: in a fresh one)."""
    from srpo.evaluation import evaluate
    from srpo.train import Trainer

    run_dir = root / cell["label"] / f"seed{cell['seed']}"
    done = run_dir / "cell.json"
    recipe = _recipe(spec, cell, train)
    record = finished_cell(spec, cell, root, train)
    if record is not None:
        return record
    cfg = cell_config(spec, cell, run_dir)
    if cfg.run.threads:  # the untrained reference builds no trainer, which would apply it
        torch.set_num_threads(cfg.run.threads)
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
    # With cell_process: false many cells share this process: drop this cell's model and optimizer
    # now (the trainer, runtime and policies reference each other, so only the cycle collector
    # frees them) and hand the freed heap back to the OS (bench_study_memory.py measures the rest).
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


def _cell_child(conn, spec: dict, cell: dict, root: str, progress: bool, train: bool, log_level: int,
                grace_s: float) -> None:
    """The body of a cell's own process: run the cell, send back its record or what stopped it."""
    import traceback

    from srpo.runs import preemption

    logging.basicConfig(level=log_level, format="%(levelname)s %(name)s: %(message)s")
    for noisy in ("bm25s", "transformers", "peft"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    preemption.install(grace_s)
    try:
        conn.send(("ok", run_cell(spec, cell, Path(root), progress, train)))
    except preemption.Preempted as err:
        conn.send(("preempted", str(err)))
    except BaseException as err:  # noqa: BLE001 — every failure goes back to the study's process
        text = traceback.format_exc()
        try:
            conn.send(("error", err, text))
        except Exception:  # noqa: BLE001 — an exception that does not pickle: its type and message
            conn.send(("error", RuntimeError(f"{type(err).__name__}: {err}"), text))
    finally:
        conn.close()


def run_cell_in_process(spec: dict, cell: dict, root: Path, progress: bool = True, train: bool = True) -> dict:
    """:func:`run_cell` in a fresh process: what the cell allocates (models, optimizer state, the
    allocator's cached heap) goes back to the OS when it ends, so a study's own process stays flat.

    A preemption signal this process gets is passed on (the cell checkpoints at its step's end and
    the study stops, :class:`~srpo.runs.preemption.Preempted`); an error in the cell is raised here
    as it was raised there (a config or data error stays one); a process that dies without a word
    (killed, out of memory) is named with its exit code."""
    import multiprocessing
    import signal

    from srpo.runs import preemption

    ctx = multiprocessing.get_context("spawn")  # no fork of a process holding threads and models
    receive, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_cell_child, name=f"srpo-cell-{cell['label']}-seed{cell['seed']}",
                        args=(send, spec, cell, str(root), progress, train, logging.getLogger().level,
                              preemption.grace_s()))
    child.start()
    send.close()
    forwarded = False
    try:
        while child.is_alive() and not receive.poll(0.5):
            if preemption.requested() and not forwarded:  # the cell saves at its next step end
                os.kill(child.pid, signal.SIGTERM)
                forwarded = True
        message = receive.recv() if receive.poll(0) or child.is_alive() else None
    except EOFError:
        message = None
    finally:
        child.join(timeout=60)
        if child.is_alive():
            child.kill()
            child.join()
    if message is None:
        raise RuntimeError(f"cell {cell['label']} seed {cell['seed']}: its process ended with exit code "
                           f"{child.exitcode} without a result (killed, or out of memory?); run the study again "
                           f"to continue it from its last checkpoint")
    if message[0] == "ok":
        return message[1]
    if message[0] == "preempted":
        raise preemption.Preempted(message[1])
    err, text = message[1], message[2]
    log.debug("cell %s seed %s failed in its process:\n%s", cell["label"], cell["seed"], text)
    raise err


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
        return sum(v / len(vals) for v in vals) if vals else None  # finite for finite values (a sum may overflow)

    out = {
        "set_ratio_min": min((r.get("objective/set_ratio/min", 1.0) for r in rows), default=None),
        "set_ratio_max": max((r.get("objective/set_ratio/max", 1.0) for r in rows), default=None),
        "set_log_ratio_mean": avg(rows, "objective/set_log_ratio/mean"),
        "clip_frac": avg(rows, "objective/clip_frac"),
        "clip_frac_by_k": {k.rsplit("/", 1)[1]: avg(rows, k) for k in sorted(keys)
                           if k.startswith(("by_k/clip_frac/k", "clip_frac/k"))},
        "grad_norm": _stats([r.get("grad_norm/total") for r in rows]),
        # The share of optimizer steps in which train.max_grad_norm clipped some policy (runs before
        # it was logged: None): an arm clipped in most steps and one never clipped compare the clip.
        "grad_clip_share": avg(rows, "grad_clip/any"),
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
    base_every = ((spec["base_config"].get("eval") or {}).get("every") or 0)
    if base_every and not spec["eval"].get("during_training", False) and index == 1:
        log.info("the base config evaluates every %s steps; the cells do not (eval.every: 0): the study evaluates each "
                 "cell after training on eval.datasets (eval.during_training: true keeps the base's curves)", base_every)

    def run(spec, cell, root, progress, train=True):
        """A finished cell is reused here; an unfinished one runs in its own process (or here)."""
        record = finished_cell(spec, cell, root, train)
        if record is not None:
            return record
        runner = run_cell_in_process if spec.get("cell_process", True) else run_cell
        return runner(spec, cell, root, progress, train)

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
                run(spec, {**cell, "label": f"untrained ({cell['label']} workflow)", "seed": spec["seeds"][0]},
                    root, progress, train=False)
        for ref in references(spec):
            run(spec, ref, root, progress, train=False)
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
        run(spec, cell, root, progress)
        write_results(root, finished_records(spec, root), spec)
    records = finished_records(spec, root)
    if records:
        write_results(root, records, spec)
    return root / "results.md"


STUDY_FILES = ("study.yaml", "results.md", "results.json", "results.png", "mechanism.png")


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
    results = nan_to_none({"table": table, **extra, "cells": records})
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
    write_text_atomic(results, json.dumps(nan_to_none(data), indent=1, default=str, allow_nan=False))
    return comparisons_text(comps, spec)
