"""Preemption: SIGTERM (or Slurm's early SIGUSR1, or SIGHUP when the terminal goes away) ends a
run at its next safe point, saved.

Schedulers stop jobs with SIGTERM and, a grace period later, SIGKILL (Kubernetes: 30 s by
default; Slurm: ``KillWait``, and ``--signal=USR1@90`` warns 90 s ahead).  ``srpo train``,
``srpo study`` and ``srpo sft`` install :func:`install`: the first signal only sets a flag, which
the loop reads at its safe points (the end of a training step, between study cells, after an SFT
optimizer step) — it saves there and raises :class:`Preempted` (exit 143, trackers closed as
killed); ``--resume`` continues.  Should the step not end within the grace time, the process exits
143 at once: checkpoints are written atomically, so the previous one stays valid.  A second signal
exits at once too.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

log = logging.getLogger(__name__)

EXIT_CODE = 143  # 128 + SIGTERM, what schedulers and shells expect of a job ended by SIGTERM
#: SIGHUP: the terminal went away (an ssh session dropped, a closed tab) — handled like SIGTERM,
#: with the process's output detached from the dead terminal first (writing there raises EIO,
#: which turned a run that trained every step into exit 1).
SIGNALS = ("SIGTERM", "SIGUSR1", "SIGHUP")


def _detach_from_terminal() -> None:
    """Point stdout and stderr at /dev/null: the terminal they wrote to is gone."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        for fd in (1, 2):
            os.dup2(devnull, fd)
        os.close(devnull)
    except OSError:
        pass


class Preempted(RuntimeError):
    """The run stopped on a preemption signal after saving what it had."""


class _State:
    requested: str | None = None  # the signal's name, once one arrived
    at: float = 0.0
    grace_s: float = 0.0
    installed: bool = False
    timer: threading.Timer | None = None


_state = _State()


def _out_of_time() -> None:
    log.error("no safe point within %.0f s of %s: exiting now; the previous checkpoint stays valid",
              _state.grace_s, _state.requested)
    logging.shutdown()
    os._exit(EXIT_CODE)


def _handler(signum, _frame) -> None:
    name = signal.Signals(signum).name
    if name == "SIGHUP":
        _detach_from_terminal()
    if _state.requested is not None:  # a second signal: no more waiting
        log.error("%s again: exiting now; the previous checkpoint stays valid", name)
        logging.shutdown()
        os._exit(EXIT_CODE)
    _state.requested, _state.at = name, time.monotonic()
    log.warning("%s: saving at the next safe point, then exiting (run.preempt_grace_s: %s)", name,
                f"{_state.grace_s:g} s" if _state.grace_s else "no limit")
    if _state.grace_s:
        _state.timer = threading.Timer(_state.grace_s, _out_of_time)
        _state.timer.daemon = True
        _state.timer.start()


def install(grace_s: float = 120.0) -> bool:
    """Handle SIGTERM, SIGUSR1 and SIGHUP in this process (main thread only; False elsewhere)."""
    if threading.current_thread() is not threading.main_thread():
        return False
    _state.grace_s = float(grace_s)
    for name in SIGNALS:
        signal.signal(getattr(signal, name), _handler)
    _state.installed = True
    return True


def grace_s() -> float:
    """The grace period :func:`install` was given (0: none, or not installed)."""
    return _state.grace_s


def requested() -> str | None:
    """The preemption signal that arrived (None: none)."""
    return _state.requested


def check(backend=None) -> str | None:
    """At a safe point: the signal, if this process (or, with ``backend``, any rank) got one — every
    rank learns it in the same collective, so all save together."""
    local = _state.requested
    if backend is not None and getattr(backend, "world", 1) > 1:
        if backend.sum_int(int(local is not None)):
            return local or "SIGTERM (on another rank)"
        return None
    return local


def done() -> None:
    """The save finished: the grace timer is no longer needed."""
    if _state.timer is not None:
        _state.timer.cancel()
        _state.timer = None


def reset() -> None:
    """Forget a signal (tests; a library caller that handled it)."""
    done()
    _state.requested = None
