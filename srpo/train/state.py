"""A run's state on disk: claiming a fresh folder, saving a checkpoint, resuming from one.

A checkpoint (written by :func:`srpo.runs.checkpoint.save_checkpoint`, verified by its manifest)
holds the weights in HF format — under a sharded backend also every rank's shards of weights and
optimizer state in ``dcp/`` — and the state of every part of the run, a dict of
:class:`~srpo.train.parts.Stateful` parts (``{"counters", "data", "update", "rng", "overlap",
"engine"}`` for RL): everything a resumed run needs to continue bit-identically (one intra-op
thread).  :class:`Checkpointer` writes and reads it and needs nothing of a trainer: the run folder,
the backend, the policies (weights) and their optimizers (shards), the run's config, and the
parts.  Its methods are collectives under data parallelism (every rank calls them together).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from srpo.runs.checkpoint import (CheckpointError, CorruptCheckpoint, candidates, load_checkpoint, new_temporary,
                                  save_checkpoint)
from srpo.tasks.base import DatasetError
from srpo.train.parts import Stateful, join_state, load_parts, split_state
from srpo.runs import run_dir as run_folder
from srpo.runs.run_dir import RunDirError

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


def claim_fresh(backend, run_dir: Path, artefacts: list[str], logger, overwrite: bool) -> None:
    """Start a new run in the folder: refuse another run's artefacts unless ``overwrite``."""
    def claim():
        deleted = run_folder.claim(run_dir, artefacts, overwrite=overwrite)
        if deleted:
            log.warning("--overwrite: deleted the previous run's %s in %s", ", ".join(deleted), run_dir)
        logger.open_run_log()
    on_rank0_agreed(backend, claim, RunDirError(f"rank 0 refused the run folder {run_dir}; see its message"))


def adopt_folder(backend, run_dir: Path, artefacts: list[str], logger) -> None:
    """A resumed run owns its folder's run artefacts (``--resume`` says the folder is this run's);
    call it before anything in the folder is read, cut back or deleted."""
    def adopt():
        run_folder.refuse_links(run_dir, artefacts)
        run_folder.record_owned(run_dir, run_folder.owned(run_dir) | set(artefacts))
        logger.open_run_log()
    on_rank0_agreed(backend, adopt, RunDirError(f"rank 0 refused the run folder {run_dir}"))


@dataclass
class Checkpointer:
    """Writes a run's checkpoints and resumes from them.

    ``config``: the run's config as written into each checkpoint (secrets redacted) and compared
    with on resume; ``keep``: how many checkpoints stay (the best evaluated one besides)."""

    run_dir: Path
    backend: Any
    policies: Any
    optimizers: dict
    config: dict
    keep: int = 2

    def weights_are_finite(self) -> bool:
        """All ranks agree (under a sharded backend each checks its own shards)."""
        local = all(bool(torch.isfinite(p.to_local() if hasattr(p, "to_local") else p).all())
                    for pid in self.policies.policy_ids for p in self.policies.parameters(pid))
        return self.backend.sum_int(int(not local)) == 0

    def save(self, step: int, parts: dict[str, Stateful]) -> Path | None:
        """Checkpoint ``step`` (rank 0 writes; a sharded backend's ranks write their shards first);
        never writes NaN/Inf weights.  Returns the folder on rank 0."""
        if not self.weights_are_finite():  # every rank checks, so every rank stops together
            raise TrainingStopped(
                f"the weights hold NaN/Inf after step {step}; no checkpoint was written (the last one "
                f"written is still in {self.run_dir / 'checkpoints'}). Lower train.lr or check the reward and inputs.")
        tensors, plain = split_state(parts)
        backend = self.backend

        def write(tmp=None, state_dicts=None):
            return save_checkpoint(self.run_dir, step, self.policies, tensors, plain, self.config,
                                   keep=self.keep, tmp=tmp, state_dicts=state_dicts)

        if not backend.capabilities.shards_parameters:
            return write() if backend.rank == 0 else None
        # Sharded: every rank writes its shards into one temporary folder, the full weights are
        # gathered to rank 0, and rank 0 completes the checkpoint.
        tmp = Path(backend.broadcast_object(str(new_temporary(self.run_dir, step)) if backend.rank == 0 else None))
        backend.save_sharded(tmp, self.policies, self.optimizers)
        state_dicts = backend.full_state_dicts(self.policies)
        return on_rank0_agreed(backend, lambda: write(tmp, state_dicts),
                               CheckpointError("rank 0 could not write the checkpoint; see its message"))

    def resume(self, parts: dict[str, Stateful], path: Path | None = None) -> Path | None:
        """Load ``path``, or the run's newest complete checkpoint, into the weights and ``parts``
        (in the dict's order); the checkpoint resumed from, or None when the run has none.

        Each checkpoint is verified against its manifest; a damaged or unsafe one is skipped with a
        warning naming what was wrong, and the one before it is tried."""
        problems = []
        sharded = self.backend.capabilities.shards_parameters
        for candidate in [Path(path)] if path is not None else candidates(self.run_dir):
            try:
                tensors, plain = load_checkpoint(candidate, self.policies, self.config, load_weights=not sharded)
                if sharded:
                    if not (candidate / "dcp").is_dir():
                        raise CorruptCheckpoint(f"{candidate}: no dcp/ folder (not written with train.parallel: fsdp)")
                    self.backend.load_sharded(candidate, self.policies, self.optimizers)
            except CorruptCheckpoint as err:
                problems.append(str(err))
                log.warning("skipping checkpoint %s: %s", candidate.name, err)
                continue
            try:
                load_parts(parts, join_state(tensors, plain))
            except (DatasetError, CheckpointError) as err:
                raise type(err)(f"{candidate}: {err}") from None
            if problems:
                log.warning("resumed from the older checkpoint %s", candidate.name)
            return candidate
        if problems:
            raise CheckpointError("no usable checkpoint to resume from:\n  " + "\n  ".join(problems))
        return None


def make_totals() -> defaultdict:
    """The run's running counters (tokens, correct answers, skipped steps ...)."""
    return defaultdict(float)
