"""A terminal that goes away never ends a run: writes to it are dropped, the run log keeps the rest.

A long run outlives its terminal: an ssh session drops, a ``tmux`` pane is killed, a pipe's reader
exits.  From then on every write to stdout/stderr fails (``EIO`` on a closed pty, ``EPIPE`` on a
pipe) — in a progress bar, a ``print``, a log line, or the interpreter's last flush at exit — and
without care the first one ends a run that was training well, or turns a finished run's exit
status into 1.  :func:`survive_lost_terminal` wraps both streams: the first write that finds the
terminal gone points the stream's file descriptor at ``/dev/null`` (so that no later write, from
Python or from native code, fails again) and everything after is dropped.  What srpo logs still
reaches the run's own log file (``srpo.log`` in the run folder, :mod:`srpo.runs.run_log`).
"""

from __future__ import annotations

import errno
import logging
import os
import sys

log = logging.getLogger(__name__)

#: A write failing with one of these means the reader is gone for good (not a full disk).
GONE_ERRNOS = frozenset({errno.EIO, errno.EPIPE, errno.ENXIO, errno.EBADF, errno.ECONNRESET})


class TerminalStream:
    """``stream`` (stdout or stderr) whose writes stop failing once its reader is gone.

    Everything else (``fileno``, ``isatty``, ``encoding``, ...) is the wrapped stream's.
    """

    def __init__(self, stream, name: str):
        self._stream = stream
        self._name = name
        self.gone = False

    def write(self, text: str) -> int:
        if self.gone:
            return len(text)
        try:
            return self._stream.write(text)
        except OSError as err:
            self._lost(err)
            return len(text)

    def flush(self) -> None:
        if self.gone:
            return
        try:
            self._stream.flush()
        except OSError as err:
            self._lost(err)

    def _lost(self, err: OSError) -> None:
        if err.errno not in GONE_ERRNOS:
            raise err
        self.gone = True
        try:  # later writes by anyone (native code, the interpreter's exit flush) go nowhere, quietly
            devnull = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(devnull, self._stream.fileno())
            finally:
                os.close(devnull)
            self._stream.flush()  # what was buffered for the gone terminal, now into /dev/null
        except (OSError, ValueError):
            pass
        log.warning("the terminal behind %s is gone (%s); the run goes on, its messages are kept in the run "
                    "folder's srpo.log", self._name, os.strerror(err.errno))

    def __getattr__(self, name):
        return getattr(self._stream, name)


def survive_lost_terminal() -> None:
    """Wrap ``sys.stdout`` and ``sys.stderr`` (once); call before anything captures them (logging)."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, TerminalStream):
            setattr(sys, name, TerminalStream(stream, name))
