"""A run's state on disk: claiming a fresh folder, saving a checkpoint, resuming from one.

What a checkpoint holds (written by :func:`srpo.runs.checkpoint.save_checkpoint`, verified by its
manifest): the weights in HF format, the optimizers (or, under a sharded backend, their shards in
``dcp/``), the schedulers, every RNG stream (Python, NumPy, torch, each rank's sampling
generator), the data position and the loop's counters — everything a resumed run needs to
continue bit-identically (one intra-op thread).

Each part owns its state (``state_dict()`` / ``load_state_dict()`` on the data cursor, the policy
update, the overlapped rollout) and the :class:`~srpo.train.loop.Trainer` composes them
(:meth:`~srpo.train.loop.Trainer.state_dict`); this module only claims the folder, verifies and
reads checkpoints, and writes them — for any trainer with ``run_dir``, ``cfg``, ``backend``,
``policies``, ``optimizers``, ``step``, ``logger``, ``state_dict()``/``load_state_dict()``,
``run_artefacts()`` and ``after_resume()`` (the RL :class:`~srpo.train.loop.Trainer` and
:class:`~srpo.train.supervised.SupervisedTrainer`).  Its functions are collectives under data parallelism (every
rank calls them together).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from srpo.runs.checkpoint import (CheckpointError, CorruptCheckpoint, candidates, load_checkpoint, new_temporary,
                                  save_checkpoint)
from srpo.runs import run_dir as run_folder
from srpo.runs.run_dir import RunDirError
from srpo.runs.secrets import redacted

log = logging.getLogger(__name__)


class TrainingStopped(RuntimeError):
    """Training stopped on purpose (e.g. too many non-finite steps); a checkpoint was written."""


def on_rank0_agreed(backend, action, failure: Exception):
    """Run ``action`` on rank 0 and return its result there; if it raises, every rank raises —
    rank 0 its own error, the others ``failure`` — so that none waits in a collective."""
    error, result = None, None
    if backend.rank == 0:
        try:
            result = action()
        except Exception as err:  # re-raised below, after every rank has heard of it
            error = err
    if backend.sum_int(int(error is not None)):
        raise error or failure
    return result


def run_artefacts(cfg) -> list[str]:
    """The names a training run writes in its folder: logs, checkpoints, its trackers' files."""
    from srpo.runs.trackers import tracker_artefacts

    return ["metrics.jsonl", "samples.jsonl", "checkpoints", "trackers.json", "srpo.log",
            *tracker_artefacts(cfg.log.backends, cfg.log)]


def claim_fresh(trainer) -> None:
    """Start a new run in the folder: refuse another run's artefacts unless overwriting."""
    run_dir = trainer.run_dir

    def claim():
        deleted = run_folder.claim(run_dir, trainer.run_artefacts(), overwrite=trainer.overwrite)
        if deleted:
            log.warning("--overwrite: deleted the previous run's %s in %s", ", ".join(deleted), run_dir)
        trainer.logger.open_run_log()
    on_rank0_agreed(trainer.backend, claim, RunDirError(f"rank 0 refused the run folder {run_dir}; see its message"))
    trainer.claimed = True


def _adopt(trainer) -> None:
    """A resumed run owns its folder's run artefacts (``--resume`` says the folder is this run's)."""
    def adopt():
        run_folder.refuse_links(trainer.run_dir, trainer.run_artefacts())
        run_folder.record_owned(trainer.run_dir, run_folder.owned(trainer.run_dir) | set(trainer.run_artefacts()))
        trainer.logger.open_run_log()
    on_rank0_agreed(trainer.backend, adopt, RunDirError(f"rank 0 refused the run folder {trainer.run_dir}"))


def weights_are_finite(trainer) -> bool:
    """All ranks agree (under a sharded backend each checks its own shards)."""
    local = all(bool(torch.isfinite(p.to_local() if hasattr(p, "to_local") else p).all())
                for pid in trainer.policies.policy_ids for p in trainer.policies.parameters(pid))
    return trainer.backend.sum_int(int(not local)) == 0


def save(trainer) -> Path | None:
    """Checkpoint the current step (rank 0 writes; a sharded backend's ranks write their shards
    first); never writes NaN/Inf weights."""
    if not weights_are_finite(trainer):  # every rank checks, so every rank stops together
        raise TrainingStopped(
            f"the weights hold NaN/Inf after step {trainer.step}; no checkpoint was written (the last one "
            f"written is still in {trainer.run_dir / 'checkpoints'}). Lower train.lr or check the reward and inputs.")
    checkpoint = trainer.state_dict()
    tensors, plain = checkpoint["tensors"], checkpoint["plain"]
    backend, cfg = trainer.backend, trainer.cfg

    def write(tmp=None, state_dicts=None):
        return save_checkpoint(trainer.run_dir, trainer.step, trainer.policies, tensors, plain, redacted(cfg.to_dict()),
                               keep=cfg.checkpoint.keep, tmp=tmp, state_dicts=state_dicts)

    if not backend.capabilities.shards_parameters:
        return write() if backend.rank == 0 else None
    # Sharded: every rank writes its shards into one temporary folder, the full weights are
    # gathered to rank 0, and rank 0 completes the checkpoint.
    tmp = Path(backend.broadcast_object(str(new_temporary(trainer.run_dir, trainer.step)) if backend.rank == 0 else None))
    backend.save_sharded(tmp, trainer.policies, trainer.optimizers)
    state_dicts = backend.full_state_dicts(trainer.policies)
    return on_rank0_agreed(backend, lambda: write(tmp, state_dicts),
                           CheckpointError("rank 0 could not write the checkpoint; see its message"))


def resume(trainer, path: Path | None = None) -> bool:
    """Continue from ``path`` or the run's newest complete checkpoint; False when there is none.

    Each checkpoint is verified against its manifest; a damaged or unsafe one is skipped with a
    warning naming what was wrong, and the one before it is tried.  The logs are cut back to the
    resumed step (to step 0 when there is no checkpoint).
    """
    _adopt(trainer)  # before anything is read, cut back or deleted in the folder
    problems = []
    sharded = trainer.backend.capabilities.shards_parameters
    for candidate in [Path(path)] if path is not None else candidates(trainer.run_dir):
        try:
            tensors, plain = load_checkpoint(candidate, trainer.policies, redacted(trainer.cfg.to_dict()),
                                             load_weights=not sharded)
            if sharded:
                if not (candidate / "dcp").is_dir():
                    raise CorruptCheckpoint(f"{candidate}: no dcp/ folder (not written with train.parallel: fsdp)")
                trainer.backend.load_sharded(candidate, trainer.policies, trainer.optimizers)
        except CorruptCheckpoint as err:
            problems.append(str(err))
            log.warning("skipping checkpoint %s: %s", candidate.name, err)
            continue
        check_same_data(trainer, plain, candidate)
        trainer.load_state_dict({"tensors": tensors, "plain": plain})
        trainer.after_resume()  # e.g. a rollout engine takes the resumed weights
        if problems:
            log.warning("resumed from the older checkpoint %s", candidate.name)
        trainer.logger.truncate_after(trainer.step)
        trainer.claimed = True
        log.info("resumed from %s at step %d", candidate, trainer.step)
        return True
    if problems:
        raise CheckpointError("no usable checkpoint to resume from:\n  " + "\n  ".join(problems))
    trainer.logger.truncate_after(0)  # a run killed before its first checkpoint starts over cleanly
    trainer.claimed = True
    return False


def check_same_data(trainer, plain: dict[str, Any], checkpoint: Path) -> None:
    """Refuse to resume on data that changed since the checkpoint (the data position would index
    other rows), unless ``allow_data_change``; a checkpoint that records no fingerprint is refused
    (every checkpoint srpo writes has one)."""
    from srpo.data import fingerprint_changes
    from srpo.tasks.base import DatasetError

    recorded = plain.get("data_fingerprint")
    if recorded is None:
        raise CheckpointError(f"{checkpoint} records no data fingerprint: it was not written by this srpo, so "
                              "the data it was trained on cannot be checked; start a new run")
    changes = fingerprint_changes(recorded, trainer.data_fingerprint)
    if not changes:
        return
    if trainer.allow_data_change:
        log.warning("resuming on changed data (--allow-data-change): %s", "; ".join(changes))
        return
    raise DatasetError(f"the data changed since {checkpoint}: " + "; ".join(changes)
                       + ". Resuming would train on other rows from the recorded position; restore the data, start a "
                         "new run, or pass --allow-data-change to continue on the new data knowingly")


def make_totals() -> defaultdict:
    """The run's running counters (tokens, correct answers, skipped steps ...)."""
    return defaultdict(float)
