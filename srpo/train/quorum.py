"""Steps that do not wait on the slowest episode (``rollout.quorum``): partial rollouts.

    step t:  submit step t's task groups ──▶ wait until ⌈q·n⌉ of its n groups are whole
             take every whole group (this step's, and earlier stragglers' finished since)
             update: weights v → v+1       │ stragglers keep sampling on the rollout copy at v
             sync: the copy takes v+1 between two sampling calls; stragglers go on with it

An RL step waits for its slowest episode, and agent programs have long tails (tool calls,
retries, a slow reward).  With ``rollout.quorum: q`` below 1 a step closes once ⌈q·n⌉ of its n
task groups — every ``group_size`` episode of a task: the group-relative advantage needs them all
— have finished; the other groups keep running in a background thread, on a copy of the policies
as overlapped rollouts use (:func:`srpo.train.overlap.rollout_copy`), and join the first later
step at which they are whole.  Every member records the version of the weights it was drawn with
(a straggler's later turns are drawn on newer weights than its first), the trainer recomputes
q_old on its current weights and ``train.tis_cap`` corrects the gap, as for overlapped rollouts;
``rollout/staleness_mean|max`` and ``rollout/stragglers`` (groups still running when the step
closed) are logged every step.

A checkpoint holds the finished episodes not yet trained on and the jobs still running; a resumed
run trains the former and samples the latter again from their start, on the resumed weights —
nothing is lost or trained twice.  A quorum run does not resume bit for bit: which episodes make a
quorum depends on timing.  One process only (ranks would close their steps on different quorums),
the built-in sampler only (an engine with weights of its own would be sampled by the stragglers
while the trainer pushes new weights into it), and not with ``rollout.max_staleness: 1`` (the
stragglers already run beside the update).
"""

from __future__ import annotations

import asyncio
import math
import threading
from typing import Any

import torch

from srpo.train.overlap import copy_weights, rollout_copy
from srpo.types import EpisodeResult, episodes_from_plain, episodes_to_plain, task_from_plain, task_to_plain


def group_of(episode_id: str) -> str:
    """The task group of an episode id (``s{step}-r{rank}-t{task}-g{j}``: all but the ``-g{j}``)."""
    return episode_id.rsplit("-g", 1)[0]


class QuorumRollout:
    """Episodes sampled continuously in a thread of their own, on a rollout copy of ``policies``
    with its own runtime (``make_runtime(policies, engine)``): :meth:`submit` a step's jobs,
    :meth:`take` the whole groups once a quorum of the step's groups is whole, :meth:`sync` after
    the update.  A part of the trainer's checkpoint (:meth:`state_dict`)."""

    def __init__(self, policies, make_runtime, engine, quorum: float):
        if not 0 < quorum <= 1:
            raise ValueError(f"rollout.quorum must be in (0, 1], got {quorum}")
        self.quorum = quorum
        self.policies, engine, self.copies_weights = rollout_copy(policies, engine)
        self.runtime = make_runtime(self.policies, engine)
        self._cond = threading.Condition()
        self._finished: dict[str, list[EpisodeResult]] = {}  # group → its finished episodes
        self._sizes: dict[str, int] = {}  # group → episodes submitted (not yet taken)
        self._running: dict[str, tuple[str, Any]] = {}  # episode id → (episode id, task), still running
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._inbox: asyncio.Queue | None = None
        self._main: asyncio.Task | None = None
        self._thread: threading.Thread | None = None

    # -- the service thread --------------------------------------------------------------------------
    @property
    def started(self) -> bool:
        return self._thread is not None

    def start(self, workflow, autocast) -> None:
        """Start the service thread (autocast is entered there: its state is per thread) and
        resubmit the jobs a resumed checkpoint left running."""
        ready = threading.Event()

        async def main():
            self._loop, self._inbox = asyncio.get_running_loop(), asyncio.Queue()
            self._main = asyncio.current_task()
            ready.set()
            await self.runtime.serve(workflow, self._inbox, self._done)

        def work():
            try:
                with torch.no_grad(), autocast:
                    asyncio.run(main())
            except asyncio.CancelledError:
                pass
            except BaseException as err:  # noqa: BLE001 — re-raised in the trainer's thread by take()
                with self._cond:
                    self._error = err
                    self._cond.notify_all()
            finally:
                ready.set()

        self._thread = threading.Thread(target=work, name="srpo-quorum", daemon=True)
        self._thread.start()
        ready.wait()
        self._send(list(self._running.values()))

    def _send(self, jobs) -> None:
        if jobs:  # one item: the service starts them together, so their first requests share a batch
            self._loop.call_soon_threadsafe(self._inbox.put_nowait, list(jobs))

    def _done(self, episode_id: str, outcome) -> None:
        """An episode ended (in the service thread): its result joins its group."""
        with self._cond:
            self._running.pop(episode_id, None)
            if isinstance(outcome, BaseException):  # fatal: this run's data cannot be trusted
                self._error = outcome
            elif outcome is not None:
                self._finished.setdefault(group_of(episode_id), []).append(outcome)
            self._cond.notify_all()

    # -- what the trainer calls ------------------------------------------------------------------------
    def submit(self, jobs: list[tuple[str, Any]]) -> list[str]:
        """Start ``jobs`` ((episode id, task) pairs); their groups, in order."""
        groups: list[str] = []
        with self._cond:
            for eid, task in jobs:
                group = group_of(eid)
                if group not in groups:
                    groups.append(group)
                self._sizes[group] = self._sizes.get(group, 0) + 1
                self._running[eid] = (eid, task)
        self._send(jobs)
        return groups

    def _whole(self, group: str) -> bool:
        return len(self._finished.get(group, ())) == self._sizes.get(group, -1)

    def take(self, groups: list[str]) -> tuple[list[EpisodeResult], int]:
        """Once ⌈quorum · len(groups)⌉ of ``groups`` are whole: every whole group's episodes (in the
        order they were submitted) and how many groups are still running."""
        need = max(1, math.ceil(self.quorum * len(groups) - 1e-9)) if groups else 0
        with self._cond:
            self._cond.wait_for(lambda: self._error is not None or sum(map(self._whole, groups)) >= need)
            if self._error is not None:
                raise self._error
            whole = [g for g in self._sizes if self._whole(g)]
            episodes = []
            for g in whole:
                episodes += sorted(self._finished.pop(g), key=lambda ep: ep.episode_id)
                del self._sizes[g]
            return episodes, len(self._sizes)

    def sync(self, policies) -> None:
        """The copy takes ``policies``' weights and versions — on the service's loop, between two
        sampling calls (a sampling call holds the loop), so no call sees half-copied weights."""
        if self._loop is None or self._thread is None or not self._thread.is_alive():
            copy_weights(self.policies, policies, self.copies_weights)
            return

        async def now():
            copy_weights(self.policies, policies, self.copies_weights)

        asyncio.run_coroutine_threadsafe(now(), self._loop).result()

    def close(self) -> None:
        """Stop the service: episodes still running are abandoned (a checkpoint written before
        holds their jobs)."""
        if self._loop is not None and self._main is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._main.cancel)
            self._thread.join(timeout=30)
        self._thread = None

    # -- its state in a checkpoint ---------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The finished episodes not yet taken and the jobs still running (sampled again on resume)."""
        with self._cond:
            finished = [ep for eps in self._finished.values() for ep in eps]
            return {"finished": episodes_to_plain(finished),
                    "running": [[eid, task_to_plain(task)] for eid, task in self._running.values()]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with self._cond:
            self._finished, self._sizes, self._running = {}, {}, {}
            for ep in episodes_from_plain(state.get("finished") or []):
                group = group_of(ep.episode_id)
                self._finished.setdefault(group, []).append(ep)
                self._sizes[group] = self._sizes.get(group, 0) + 1
            for eid, task in state.get("running") or []:
                self._running[eid] = (eid, task_from_plain(task))
                self._sizes[group_of(eid)] = self._sizes.get(group_of(eid), 0) + 1
