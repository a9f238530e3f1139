"""Ending a process that ran collectives: everything Python does at exit, except finalising.

Under FSDP2 a gloo process group outlives ``destroy_process_group``: the ``DeviceMesh`` that every
sharded parameter (a ``DTensor``) holds keeps it, and with it gloo's worker threads.  The last
collective's ``Work`` is released by such a worker thread *after* it has woken the waiting caller
— a barrier's work also holds the works before it, whose tensors may be Python objects.  When the
main thread has meanwhile reached interpreter finalisation, that release needs the GIL, CPython
(3.11–3.13) ends the worker with ``pthread_exit``, and unwinding through gloo's noexcept
destructor aborts the process: ``terminate called without an active exception``, SIGABRT, after a
run that finished (seen in a core dump: ``AsyncBarrierWork::~AsyncBarrierWork`` →
``TensorImpl::decref_pyobject`` → ``take_gil`` → ``PyThread_exit_thread``).  A loaded machine
widens the window; two CPU-bound processes beside two ranks hit it in a few percent of runs.

So a process that used a process group ends with :func:`end_process`: the ``atexit`` handlers run
(srpo's own, logging's flush, trackers'), the standard streams are flushed, and then ``os._exit``
ends the process without finalising the interpreter — no thread can be ended mid-destructor.
:func:`mark_process_group_used` records that there is something to fear; commands that never
formed a group exit as usual.
"""

from __future__ import annotations

import atexit
import os
import sys
from typing import NoReturn

_USED = False


def mark_process_group_used() -> None:
    """This process has formed (or joined) a process group; end it with :func:`end_process`."""
    global _USED
    _USED = True


def process_group_used() -> bool:
    return _USED


def end_process(code: int) -> NoReturn:
    """Exit with ``code`` after the ``atexit`` handlers and a flush of stdout/stderr, without
    finalising the interpreter (see the module doc)."""
    try:
        atexit._run_exitfuncs()  # what sys.exit would run: srpo's teardown, logging.shutdown, trackers
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 — a gone terminal: nothing left to say to it
                pass
        os._exit(code)
