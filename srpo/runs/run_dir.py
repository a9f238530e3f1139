"""A run folder belongs to one run: a lock for the run's life, and no silent mixing of runs.

- :class:`RunLock` holds an exclusive ``flock`` on ``<run>/.lock`` for as long as the run lives.
  The kernel drops the lock when the process dies however it dies, so a lock file left by a
  killed run is *stale*: the next run takes it over (and says so).  A second live process on the
  same folder is refused with the holder's pid, host and start time.  (``flock`` is per host: on
  a network file system shared by several hosts, give each run its own folder.)
- **srpo deletes only what it wrote.**  A run records in ``<run>/.srpo-owned.json`` the names it
  creates (metrics, samples, checkpoints, the logs of the trackers it uses); :func:`claim` refuses a
  folder that holds a previous run's recorded artefacts unless asked to overwrite, and then
  removes exactly those.  Anything srpo did not record — a user's own ``wandb/`` or
  ``checkpoints/``, or a whole home folder given as the run folder — is never deleted; where this
  run would write into it, the run is refused.
- **No writing through links srpo did not make.**  srpo never creates symbolic links in a run
  folder, so one found where it would write (the lock, an artefact) refuses the run before
  anything is opened — a planted link cannot make srpo truncate or delete the file it points to.
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

from srpo.runs.fileio import write_error
from srpo.runs.secrets import redacted

log = logging.getLogger(__name__)

LOCK_FILE = ".lock"
OWNED_FILE = ".srpo-owned.json"  # the names srpo created in this folder
# What a training run writes into its folder; anything else (evaluation files, notes) is the
# user's or another command's and is neither a reason to refuse nor deleted on overwrite.
RUN_ARTEFACTS = ("metrics.jsonl", "samples.jsonl", "checkpoints", "tensorboard", "trackers.json", "wandb", "mlruns")
# What ``srpo sft`` writes into its output folder besides a run's artefacts.
SFT_ARTEFACTS = ("model", "transcripts.jsonl", "sft.json", "config.json")


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
            self._made_folder = not self.run_dir.exists()
            self.run_dir.mkdir(parents=True, exist_ok=True)
            refuse_links(self.run_dir, [LOCK_FILE])
            self._created = not self.path.exists()
            # O_NOFOLLOW: a link planted after the check still cannot redirect the truncation below.
            f = os.fdopen(os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644), "a+")
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
        self._file = f
        try:
            f.seek(0)
            f.truncate()
            f.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                "started": datetime.datetime.now().isoformat(timespec="seconds"),
                                "argv": redacted(sys.argv[:8])}))
            f.flush()
        except OSError as err:  # a full disk: no run starts, and no lock is left behind
            self.abandon()
            raise write_error(err, self.path) from None
        return self

    def abandon(self) -> None:
        """Release after a start that failed: the lock file goes too when this lock created it."""
        created = self._file is not None and getattr(self, "_created", False)
        try:
            self.release()
        except OSError:
            pass
        if created:
            try:
                self.path.unlink()
                if getattr(self, "_made_folder", False):
                    self.run_dir.rmdir()  # only if empty: a folder this start made and left nothing in
            except OSError:
                pass

    def release(self) -> None:
        if self._file is None:
            return
        f, self._file = self._file, None
        try:
            f.seek(0)
            f.truncate()  # an empty lock file: released cleanly, nothing to take over
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)
        finally:
            try:
                f.close()
            except OSError:  # a buffered write the full disk refused: the lock is released either way
                pass

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


def refuse_links(folder: str | Path, names) -> None:
    """Raise :class:`RunDirError` if any of ``names`` in ``folder`` is a symbolic link."""
    for name in names:
        path = Path(folder) / name
        if path.is_symlink():
            raise RunDirError(f"{path} is a symbolic link srpo did not make (to {os.readlink(path)}); srpo writes "
                              f"only its own files in a run folder — remove the link or choose another folder")


def _written_by_srpo(path: Path) -> bool:
    """Whether an artefact of a run folder from before ownership records is verifiably srpo's by
    its content: logs whose first row is a srpo row, checkpoint folders with srpo's manifest,
    TensorBoard folders holding only event files.  Anything else is not adopted."""
    import itertools

    if path.is_symlink():
        return False
    try:
        if path.name in ("metrics.jsonl", "samples.jsonl") and path.is_file():
            with path.open() as f:
                first = json.loads(f.readline() or "{}")
            return isinstance(first, dict) and "step" in first and (
                any(k.startswith("time/") for k in first) if path.name == "metrics.jsonl" else "episode" in first)
        if path.name == "checkpoints" and path.is_dir():
            entries = list(itertools.islice(path.iterdir(), 1000))
            return bool(entries) and all(
                (e.is_dir() and not e.is_symlink() and (e.name.startswith(".step_") or (e / "manifest.json").is_file()))
                or e.name in ("best.json", "latest") for e in entries)
        if path.name == "tensorboard" and path.is_dir():
            files = [f for f in path.rglob("*") if f.is_file() or f.is_symlink()]
            return bool(files) and all(f.name.startswith("events.out.tfevents") and not f.is_symlink() for f in files)
    except (OSError, ValueError):
        return False
    return False


def owned(folder: str | Path) -> set[str]:
    """The names srpo recorded creating in ``folder`` — or, for a run folder written before these
    records (it has srpo's lock file and no record), the artefacts verifiably srpo's by content."""
    path = Path(folder) / OWNED_FILE
    if path.is_symlink() or not path.is_file():
        if (Path(folder) / LOCK_FILE).is_file() and not (Path(folder) / LOCK_FILE).is_symlink():
            return {n for n in RUN_ARTEFACTS if _written_by_srpo(Path(folder) / n)}
        return set()
    try:
        data = json.loads(path.read_text())
        return {n for n in data.get("created", []) if isinstance(n, str) and "/" not in n and n not in ("", ".", "..")}
    except (OSError, ValueError, AttributeError):
        return set()


def record_owned(folder: str | Path, names) -> None:
    """Record that srpo creates ``names`` in ``folder`` (atomically; replaces the previous record)."""
    from srpo.runs.fileio import write_text_atomic

    refuse_links(folder, [OWNED_FILE])
    write_text_atomic(Path(folder) / OWNED_FILE, json.dumps({"created": sorted(set(names))}, indent=1))


def _present(path: Path) -> bool:
    return (path.is_file() and path.stat().st_size > 0) or (path.is_dir() and any(path.iterdir()))


def previous_run(run_dir: str | Path, writes=RUN_ARTEFACTS) -> tuple[list[str], list[str]]:
    """``(ours, foreign)``: the previous run's artefacts srpo recorded writing, and those among the
    names this run ``writes`` that are present but srpo never recorded (a user's own).

    A record is only a file in the folder — anyone could have written it — so only names srpo
    itself writes count as ours: its known artefacts and what this run writes.  A record listing
    anything else (a planted ``"Documents"``) is ignored, never deleted."""
    run_dir = Path(run_dir)
    mine = owned(run_dir) & {*RUN_ARTEFACTS, *SFT_ARTEFACTS, *writes}
    ours, foreign = [], []
    order = {name: i for i, name in enumerate(RUN_ARTEFACTS)}
    for name in sorted(mine | set(writes), key=lambda n: (order.get(n, len(order)), n)):
        path = run_dir / name
        if not _present(path):
            continue
        label = f"{name}/" if path.is_dir() else name
        (ours if name in mine else foreign).append(label)
    return ours, foreign


def _delete(path: Path) -> None:
    if path.is_symlink():  # a link srpo did not make: remove the link, never what it points to
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)  # does not follow links inside
    elif path.exists():
        path.unlink()


def claim(run_dir: str | Path, writes, *, overwrite: bool, resume_hint: str = "continue it with --resume, ") -> list[str]:
    """Make ``run_dir`` this run's: refuse links where it writes, refuse a user's files where it
    writes, refuse (or with ``overwrite`` delete) a previous run's recorded artefacts, then record
    ``writes`` as this run's.  Returns what was deleted."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    refuse_links(run_dir, [OWNED_FILE, *writes])
    ours, foreign = previous_run(run_dir, writes)
    if foreign:
        raise RunDirError(
            f"{run_dir} holds {', '.join(foreign)}, which srpo did not write (no record in {OWNED_FILE}); this run "
            f"would write there, and srpo never deletes or mixes into what it did not write — move them, or choose "
            f"another folder")
    if ours and not overwrite:
        raise RunDirError(f"{run_dir} holds a previous run ({', '.join(ours)}); {resume_hint}"
                          f"replace it with --overwrite, or choose another folder")
    for label in ours:
        try:
            _delete(run_dir / label.rstrip("/"))
        except OSError as err:
            raise RunDirError(f"--overwrite: cannot delete {run_dir / label} ({err.strerror or err})") from None
    record_owned(run_dir, writes)
    return ours
