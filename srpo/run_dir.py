"""A run folder belongs to one run: a lock for the run's life, and no silent mixing of runs.

- :class:`RunLock` holds an exclusive ``flock`` on ``<run>/.lock`` for as long as the run lives.
  The kernel drops the lock when the process dies however it dies, so a lock file left by a
  killed run is *stale*: the next run takes it over (and says so).  A second live process on the
  same folder is refused with the holder's pid, host and start time.  (``flock`` is per host: on
  a network file system shared by several hosts, give each run its own folder.)
- :func:`previous_run` names what a folder already holds of another run (metrics, samples,
  checkpoints, tracker logs); a new run refuses such a folder unless asked to overwrite,
  and :func:`clear_previous_run` removes exactly those artefacts — nothing else in the folder.
"""

from __future__ import annotations

import datetime
import fcntl
import json
import logging
import os
import shutil
import socket
import sys
from pathlib import Path

log = logging.getLogger(__name__)

LOCK_FILE = ".lock"
# What a training run writes into its folder; anything else (evaluation files, notes) is the
# user's or another command's and is neither a reason to refuse nor deleted on overwrite.
RUN_ARTEFACTS = ("metrics.jsonl", "samples.jsonl", "checkpoints", "tensorboard", "trackers.json", "wandb", "mlruns")


class RunDirError(RuntimeError):
    """The run folder is in use or holds another run; the message says what to do."""


class RunLock:
    """An exclusive lock on a run folder, held until :meth:`release` or the process ends."""

    def __init__(self, run_dir: str | Path):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_FILE
        self._file = None
        self.took_over: dict | None = None  # the stale holder's record, when one was replaced

    def acquire(self) -> "RunLock":
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            f = open(self.path, "a+")
        except OSError as err:
            raise RunDirError(f"cannot use {self.run_dir} as the run folder: {err.strerror or err}") from None
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_record(f)
            f.close()
            who = (f"pid {holder.get('pid')} on {holder.get('host')}, started {holder.get('started')}"
                   if holder else "another process")
            raise RunDirError(
                f"{self.run_dir} is in use by another srpo run ({who}); two runs in one folder would mix "
                f"their metrics and checkpoints. Wait for it, stop it, or choose another run.output_dir.") from None
        previous = _read_record(f)
        if previous and previous.get("pid") != os.getpid():
            self.took_over = previous
            log.warning("took over the stale lock of %s (pid %s on %s, started %s: it ended without "
                        "releasing it)", self.run_dir, previous.get("pid"), previous.get("host"), previous.get("started"))
        f.seek(0)
        f.truncate()
        f.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                            "started": datetime.datetime.now().isoformat(timespec="seconds"),
                            "argv": sys.argv[:8]}))
        f.flush()
        self._file = f
        return self

    def release(self) -> None:
        if self._file is None:
            return
        try:
            self._file.seek(0)
            self._file.truncate()  # an empty lock file: released cleanly, nothing to take over
            fcntl.flock(self._file.fileno(), fcntl.LOCK_UN)
        finally:
            self._file.close()
            self._file = None

    @property
    def held(self) -> bool:
        return self._file is not None

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()


def _read_record(f) -> dict:
    try:
        f.seek(0)
        text = f.read()
        return json.loads(text) if text.strip() else {}
    except (OSError, ValueError):
        return {}


def previous_run(run_dir: str | Path) -> list[str]:
    """The artefacts of a run already in ``run_dir`` (empty when there are none)."""
    run_dir = Path(run_dir)
    found = []
    for name in RUN_ARTEFACTS:
        p = run_dir / name
        if p.is_file() and p.stat().st_size > 0:
            found.append(name)
        elif p.is_dir() and any(p.iterdir()):
            found.append(f"{name}/")
    return found


def clear_previous_run(run_dir: str | Path) -> list[str]:
    """Delete the artefacts :func:`previous_run` names; return them."""
    run_dir = Path(run_dir)
    found = previous_run(run_dir)
    for name in RUN_ARTEFACTS:
        p = run_dir / name
        try:
            if p.is_dir():
                shutil.rmtree(p)
            elif p.exists():
                p.unlink()
        except OSError as err:
            raise RunDirError(f"--overwrite: cannot delete {p} ({err.strerror or err})") from None
    return found
