"""Rollouts that overlap the update (``rollout.max_staleness: 1``): one-step off-policy.

    step t:   [ update on batch t (weights v_t-1 → v_t) ]            main thread
              [ rollout of batch t+1 on a copy at v_t-1 ]            rollout thread
              then: wait for batch t+1, copy v_t into the rollout's weights

The rollout of step t+1 runs in a background thread on a copy of the policies (the *rollout
copy*) while step t's update changes the training weights; once both are done, the copy takes
the new weights.  So a batch is sampled on weights exactly one version older than those it
updates (``rollout/staleness`` = 1 from the second step; 0 on the first, sampled before any
update).  Every member records the version it was sampled with; the trainer recomputes q_old on
its current weights and ``train.tis_cap`` corrects the sampler gap (the ``rollout/`` mismatch
metrics show it per role), as with any off-policy sampler (verl's one-step-off-policy recipe;
AReaL's ``max_head_offpolicyness`` bounds the same quantity).

A checkpoint is written at a step's end, after the next batch finished: it holds that batch (its
episodes, serialised) and the data position and sampling RNG after it, so ``--resume`` continues
exactly — an episode in flight when a run is killed is sampled again from the same state, never
lost or counted twice.

With the vLLM engine the engine *is* the rollout copy: its weights live in its own process and
stay at the old version until the trainer pushes the new ones, so nothing is copied — the rollout
thread only submits requests and collects outputs while the engine generates and the trainer
computes, and the push (:meth:`~srpo.rollout.vllm.VLLMRollout.update_weights`, under FSDP a
collective over the shards) runs in the trainer's thread once the rollout is done.  The
runtime sees the policies through a :class:`SamplerView`, which records the version the engine
holds rather than the trainer's.

What overlaps: the rollout thread's forward passes and the main thread's update share the CPU (or
GPU); with two cores there is little to gain (benchmarks/bench_overlap.py measures it), with a
rollout on its own hardware the update hides behind it.  Memory: the built-in sampler's rollout
copy doubles the model's weights (not its optimizer state); with vLLM there is no copy.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from typing import Any

import torch

from srpo.rollout.builtin import BuiltinEngine
from srpo.types import EpisodeResult, episodes_from_plain, episodes_to_plain

log = logging.getLogger(__name__)


class SamplerView:
    """The policies as a rollout sees them when an engine holds its own copy of the weights: the
    same roles, tokenizer and layout, but the versions the *engine's* weights are at (the trainer's
    move on while the rollout runs)."""

    def __init__(self, policies):
        self._policies = policies
        self.versions = dict(policies.versions)

    def version(self, policy_id: str) -> int:
        return self.versions[policy_id]

    def __getattr__(self, name):
        return getattr(self._policies, name)


def rollout_copy(policies, engine=None):
    """What a rollout that runs beside the update samples from: ``(policies, engine,
    copies_weights)``.  The built-in sampler reads the trainer's weights, so it gets a frozen copy
    of them and a sampler of its own; an engine that holds its own weights (vLLM) is used as it is,
    the policies seen through a :class:`SamplerView` at the engine's versions."""
    if engine is not None and engine.capabilities.holds_own_weights:
        return SamplerView(policies), engine, False
    frozen = copy.deepcopy(policies)  # the weights rollouts sample from, a version behind
    for module in frozen.modules():
        module.eval()
        for p in module.parameters():
            p.requires_grad_(False)
    return frozen, BuiltinEngine(frozen), True


def copy_weights(rollout_policies, policies, copies_weights: bool) -> None:
    """The rollout's policies take ``policies``' weights (when they are a copy) and versions."""
    if copies_weights:
        with torch.no_grad():
            for src, dst in zip(policies.modules(), rollout_policies.modules()):
                dst.load_state_dict(src.state_dict())  # copies in place: the copy stays frozen
    rollout_policies.versions = dict(policies.versions)


class OverlappedRollout:
    """A rollout copy of ``policies`` with its own runtime (``make_runtime(policies, engine)``),
    run in a background thread: :meth:`start`, then :meth:`wait`, then :meth:`sync`.

    ``engine``: the run's rollout engine.  The built-in one samples from the trainer's own weights,
    so the rollout gets a frozen copy with a sampler of its own; an engine that holds its own
    weights (vLLM) is used as it is — the trainer pushes the new weights into it after :meth:`wait`
    (its ``update_weights``, called by the trainer), and :meth:`sync` records their version."""

    def __init__(self, policies, make_runtime, engine=None):
        self.policies, engine, self.copies_weights = rollout_copy(policies, engine)
        self.runtime = make_runtime(self.policies, engine)
        self._thread: threading.Thread | None = None
        self._result: list[EpisodeResult] | None = None
        self._error: BaseException | None = None
        self.busy: tuple[float, float] = (0.0, 0.0)  # perf_counter start and end of the last rollout
        #: The next step's batch once :meth:`wait` took it (a checkpoint holds it: :meth:`state_dict`).
        self.pending: list[EpisodeResult] | None = None

    # -- its state in a checkpoint -------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The next step's batch, sampled before the checkpoint (None where there is none)."""
        return {"pending": episodes_to_plain(self.pending) if self.pending is not None else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pending = state.get("pending")
        self.pending = episodes_from_plain(pending) if pending is not None else None

    def take_pending(self) -> list[EpisodeResult] | None:
        """The batch sampled during the last update (None on the first step), handed over once."""
        episodes, self.pending = self.pending, None
        return episodes

    def run(self, workflow, jobs, autocast) -> list[EpisodeResult]:
        """A rollout in this thread (the first step's, which has nothing to overlap with)."""
        self.start(workflow, jobs, autocast)
        return self.wait()

    def start(self, workflow, jobs, autocast) -> None:
        """Start sampling ``jobs`` in the background (autocast is entered in that thread: its
        state is per thread)."""
        if self._thread is not None:
            raise RuntimeError("a rollout is already in flight")
        self._result, self._error = None, None

        def work():
            started = time.perf_counter()
            try:
                with torch.no_grad(), autocast:
                    self._result = self.runtime.run(workflow, jobs)
            except BaseException as err:  # noqa: BLE001 — re-raised in the trainer's thread by wait()
                self._error = err
            self.busy = (started, time.perf_counter())

        self._thread = threading.Thread(target=work, name="srpo-rollout", daemon=True)
        self._thread.start()

    @property
    def in_flight(self) -> bool:
        return self._thread is not None

    def wait(self) -> list[EpisodeResult]:
        """The rollout's episodes (its error, raised here)."""
        if self._thread is None:
            raise RuntimeError("no rollout in flight")
        self._thread.join()
        self._thread = None
        if self._error is not None:
            raise self._error
        return self._result or []

    def wait_pending(self) -> None:
        """Wait for the rollout in flight and keep its batch as the next step's (:attr:`pending`)."""
        self.pending = self.wait()

    def sync(self, policies) -> None:
        """The rollout copy takes ``policies``' weights and versions (no rollout may be in flight).
        With an engine of its own, only the versions: the trainer pushes the weights (the engine's
        ``update_weights``) before the next rollout starts."""
        if self._thread is not None:
            raise RuntimeError("the rollout copy is in use")
        copy_weights(self.policies, policies, self.copies_weights)
