"""Continuous batching for ``srpo serve`` with srpo's own sampler.

One daemon thread owns the team's running decode batches (:class:`srpo.policies.decoding.TeamDecode`)
and loops: take the requests that arrived, prefill those the batches admit into them, run one
token step, hand every finished reply to its waiting future on the server's event loop.  A request
that arrives while others generate joins at the next token step; a reply leaves as soon as it is
done, not when the longest reply of its batch is.  A future that is already done — its client
left, or the server shed it — has its row dropped at the next step.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import queue
import threading
import time
import traceback

import torch

from srpo.types import GenerationRequest, Sample

log = logging.getLogger(__name__)


def _settle(fut: asyncio.Future, sample: Sample | None = None, error: BaseException | None = None) -> None:
    """On the event loop: give ``fut`` its reply or its error, unless it was cancelled or shed."""
    if fut.done():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(sample)


class ContinuousScheduler:
    """Feeds requests into a team's running decode batches as they arrive.

    Args:
        team: the team's decode batches (a ``TeamDecode``), empty.
        open_team: makes a fresh one (after a failed step: the old one's state is unknown).
        loop: the server's event loop, where the futures live.
        generator: seeds the draws.
        max_batch: most rows decoding at once; further requests wait for rows to finish.
        autocast: entered in the decode thread (autocast state is per thread).
        stats: the backend's counters (``generated``).
    """

    def __init__(self, team, open_team, loop: asyncio.AbstractEventLoop, generator: torch.Generator, *,
                 max_batch: int, autocast=None, stats: dict | None = None):
        self.team, self.open_team, self.loop = team, open_team, loop
        self.generator, self.max_batch = generator, max_batch
        self.autocast = autocast or contextlib.nullcontext()
        self.stats = stats if stats is not None else {}
        self.reply_s = 1.0  # how long the last reply took from joining to its end: what Retry-After is estimated from
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="srpo-serve", daemon=True)
        self._thread.start()

    def submit(self, request: GenerationRequest, fut: asyncio.Future) -> None:
        """Queue ``request``; ``fut`` gets its :class:`Sample` (set on the event loop)."""
        self._inbox.put((request, fut))

    def close(self) -> None:
        self._closing = True
        self._inbox.put(None)

    def _run(self) -> None:
        team = self.team
        pending: collections.deque = collections.deque()  # (request, future), first come first served
        live: dict = {}  # handle → (future, when it joined)
        with torch.no_grad(), self.autocast:
            while not self._closing:
                if not self._take(pending, block=not live and not pending):
                    return
                try:
                    self._drop_abandoned(team, live, pending)
                    self._admit(team, live, pending)
                    if team.running:
                        self._step(team, live)
                except Exception as err:  # a failed step fails the replies in its batches, not the server
                    log.error("generation failed:\n%s", traceback.format_exc())
                    for fut, _ in live.values():
                        self.loop.call_soon_threadsafe(_settle, fut, None, err)
                    live.clear()
                    team = self.team = self.open_team()  # the batches' state is unknown: start afresh

    def _step(self, team, live: dict) -> None:
        """One token step; the replies that ended go to their futures."""
        for handle in team.step(self.generator):
            sample = team.pop(handle)
            if handle not in live:  # a row of a prefill that failed part-way: nobody waits for it
                continue
            fut, joined = live.pop(handle)
            self.reply_s = time.monotonic() - joined
            self.stats["generated"] = self.stats.get("generated", 0) + 1
            self.loop.call_soon_threadsafe(_settle, fut, sample)

    def _take(self, pending: collections.deque, block: bool) -> bool:
        """Move what arrived into ``pending`` (waiting for something when idle); False once closed."""
        try:
            while True:
                item = self._inbox.get(block=block)
                if item is None:
                    return False
                pending.append(item)
                block = False
        except queue.Empty:
            return True

    @staticmethod
    def _drop_abandoned(team, live: dict, pending: collections.deque) -> None:
        """Rows and queued requests whose futures are done (client gone, or shed) leave."""
        for handle in [h for h, (fut, _) in live.items() if fut.done()]:
            team.cancel(handle)
            team.pop(handle)
            del live[handle]
        kept = [(r, f) for r, f in pending if not f.done()]
        pending.clear()
        pending.extend(kept)

    def _admit(self, team, live: dict, pending: collections.deque) -> None:
        """Prefill the waiting requests the batches have room for (in arrival order) into them."""
        admitted = []
        while pending and team.running + len(admitted) < self.max_batch and team.admits(pending[0][0], len(admitted)):
            admitted.append(pending.popleft())
        if not admitted:
            return
        try:
            handles = team.add([r for r, _ in admitted])
        except Exception as err:  # e.g. a schema the tokenizer cannot serve: those requests fail alone
            log.error("prefill failed:\n%s", traceback.format_exc())
            for _, fut in admitted:
                self.loop.call_soon_threadsafe(_settle, fut, None, err)
            return
        now = time.monotonic()
        for handle, (_, fut) in zip(handles, admitted):
            live[handle] = (fut, now)
