"""A run as a dict of stateful parts, and the parts that no other module owns.

A checkpoint holds a run's weights (HF format) and ``{name: part.state_dict()}`` for every part
of the run — ``{"counters", "data", "update", "rng", "overlap", "engine"}`` for RL — each part
implementing torch's ``Stateful`` protocol (``state_dict()`` / ``load_state_dict(state)``).
:func:`split_state` walks the dict: an entry of a part's state that holds a tensor goes to the
tensor file (``torch.save``, read back with ``weights_only=True``), every other entry to JSON;
:func:`join_state` puts them back together.  Parts are loaded in the dict's order.

The parts here: :class:`RngStreams` (every RNG stream: Python, NumPy, torch, each rank's sampling
generator and GPU stream), :class:`DataPosition` (the data cursor, checked against the data it
was recorded on) and :class:`PerRank` (a part whose state differs by rank, gathered to the writer).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Protocol

import torch

from srpo.runs.checkpoint import rng_state, set_rng_state

log = logging.getLogger(__name__)


class Stateful(Protocol):
    """torch.distributed.checkpoint's ``Stateful``: what a part of a run gives a checkpoint."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def holds_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, dict):
        return any(holds_tensor(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(holds_tensor(v) for v in value)
    return False


def split_state(parts: dict[str, Stateful]) -> tuple[dict[str, dict], dict[str, dict]]:
    """``(tensors, plain)``: each part's state, its entries holding a tensor in ``tensors`` (for
    ``torch.save``) and the rest in ``plain`` (for JSON), both keyed by part name then entry."""
    tensors: dict[str, dict] = {}
    plain: dict[str, dict] = {}
    for name, part in parts.items():
        for key, value in part.state_dict().items():
            (tensors if holds_tensor(value) else plain).setdefault(name, {})[key] = value
    return tensors, plain


def join_state(tensors: dict[str, dict], plain: dict[str, dict]) -> dict[str, dict]:
    """The inverse of :func:`split_state`: part name → that part's whole state."""
    return {name: {**plain.get(name, {}), **tensors.get(name, {})} for name in {*plain, *tensors}}


def load_parts(parts: dict[str, Stateful], states: dict[str, dict]) -> None:
    """Load each part's state in the dict's order; a part the checkpoint lacks is an error naming it."""
    missing = [name for name in parts if name not in states]
    if missing:
        from srpo.runs.checkpoint import CorruptCheckpoint

        raise CorruptCheckpoint(f"no state for {', '.join(missing)} (written by another kind of run?)")
    for name, part in parts.items():
        part.load_state_dict(states[name])


class RngStreams:
    """Every random stream a resumed run must continue: Python, NumPy and torch (this process's),
    and per rank the sampling generator (``generator``; None when nothing samples) and GPU stream.
    Under data parallelism its ``state_dict`` is a collective (each rank's streams are gathered).

    ``reseed()``: the sampling generator's seed when the checkpoint was written by another number
    of ranks (each rank's old stream cannot continue)."""

    def __init__(self, backend, generator: torch.Generator | None = None,
                 reseed: Callable[[], int] | None = None):
        self.backend, self.generator, self.reseed = backend, generator, reseed

    def state_dict(self) -> dict[str, Any]:
        plain, tensors = rng_state()
        state: dict[str, Any] = {**plain, "process": tensors}
        if self.generator is not None:
            state["rollout_by_rank"] = self.backend.all_gather_object(self.generator.get_state().tolist())
            # Each rank's own GPU stream (rng_state() holds this process's view of every device,
            # which under torchrun is rank 0's when rank 0 writes).
            state["cuda_by_rank"] = self.backend.all_gather_object(_cuda_rng_of_this_rank())
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_rng_state(state, state["process"])
        if self.generator is None:
            return
        rank, world = self.backend.rank, self.backend.world
        by_rank = state["rollout_by_rank"]
        if len(by_rank) == world:
            self.generator.set_state(torch.tensor(by_rank[rank], dtype=torch.uint8))
        else:
            self.generator.manual_seed(self.reseed())
            if rank == 0:
                log.warning("resumed on %d process(es) from a checkpoint of %d: sampling continues from new "
                            "per-rank seeds (the run is not bit-identical to an uninterrupted one)", world, len(by_rank))
        cuda = state.get("cuda_by_rank")
        if cuda and len(cuda) == world and cuda[rank] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(torch.tensor(cuda[rank], dtype=torch.uint8), torch.cuda.current_device())


def _cuda_rng_of_this_rank() -> list[int] | None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.get_rng_state(torch.cuda.current_device()).tolist()
    return None


class DataPosition:
    """Where the run is in its data (a :class:`~srpo.data.DataCursor`) and what data that was:
    resuming on data that changed since (the position would index other rows) is refused, unless
    ``allow_change`` (``--allow-data-change``)."""

    def __init__(self, cursor, fingerprint: dict[str, Any], allow_change: bool = False):
        self.cursor, self.fingerprint, self.allow_change = cursor, fingerprint, allow_change

    def state_dict(self) -> dict[str, Any]:
        return {"cursor": self.cursor.state_dict(), "fingerprint": self.fingerprint}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from srpo.data import fingerprint_changes
        from srpo.runs.checkpoint import CheckpointError
        from srpo.tasks.base import DatasetError

        recorded = state.get("fingerprint")
        if recorded is None:
            raise CheckpointError("the checkpoint records no data fingerprint: it was not written by this srpo, so "
                                  "the data it was trained on cannot be checked; start a new run")
        changes = fingerprint_changes(recorded, self.fingerprint)
        if changes and not self.allow_change:
            raise DatasetError("the data changed since the checkpoint: " + "; ".join(changes)
                               + ". Resuming would train on other rows from the recorded position; restore the data, "
                                 "start a new run, or pass --allow-data-change to continue on the new data knowingly")
        if changes:
            log.warning("resuming on changed data (--allow-data-change): %s", "; ".join(changes))
        self.cursor.load_state_dict(state["cursor"])


class Attributes:
    """Plain attributes of an object (a step count, a counter) as a checkpoint part."""

    def __init__(self, obj: Any, names: tuple[str, ...]):
        self.obj, self.names = obj, names

    def state_dict(self) -> dict[str, Any]:
        return {name: getattr(self.obj, name) for name in self.names}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name in self.names:
            setattr(self.obj, name, state[name])


class PerRank:
    """A part whose state differs by rank (the overlapped rollout's next batch): gathered from every
    rank into one list; on resume each rank takes its own.  A checkpoint of another number of
    ranks cannot be dealt fairly: each rank then loads ``fresh`` (said once, naming ``what``)."""

    def __init__(self, part: Stateful, backend, fresh: dict[str, Any], what: str):
        self.part, self.backend, self.fresh, self.what = part, backend, fresh, what

    def state_dict(self) -> dict[str, Any]:
        return {"by_rank": self.backend.all_gather_object(self.part.state_dict())}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        by_rank, rank, world = state["by_rank"], self.backend.rank, self.backend.world
        if len(by_rank) == world:
            self.part.load_state_dict(by_rank[rank])
            return
        if rank == 0:
            log.warning("the checkpoint holds %s of %d rank(s) and this run has %d: they are dropped (the run is "
                        "not bit-identical to an uninterrupted one)", self.what, len(by_rank), world)
        self.part.load_state_dict(self.fresh)
