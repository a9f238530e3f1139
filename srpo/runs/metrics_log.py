"""Where metrics go: ``metrics.jsonl`` (one line per step), the experiment trackers, sample episodes.

The two ``.jsonl`` files are append-only logs.  A process killed mid-write (or a full disk) can
leave a cut-off last line: every reader here skips lines that are not JSON objects (counted, with
one warning), and :meth:`MetricsLogger.truncate_after` rewrites each log atomically with only the
rows up to the resumed step — step 0 included — so a resumed run's logs never repeat a step.
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any

from srpo.runs.fileio import write_error, write_text_atomic

log = logging.getLogger(__name__)

LOG_FILES = ("metrics.jsonl", "samples.jsonl")


class MetricsLogger:
    """``metrics.jsonl`` plus the experiment trackers of ``backends`` (see :mod:`srpo.runs.trackers`).

    ``tracker_options`` are the remaining :class:`~srpo.runs.trackers.TrackerSettings` fields (project,
    run_name, config, mlflow_tracking_uri, wandb_mode).
    """

    def __init__(self, run_dir: Path, backends=("tensorboard",), enabled: bool = True,
                 tracker_options: dict | None = None):
        self.run_dir = Path(run_dir)
        self.enabled = enabled
        self.backends = list(backends)
        self.tracker_options = tracker_options or {}
        self.trackers: list | None = None
        # TensorBoard drops its events at or after this step: set on resume.
        self.purge_step: int | None = None
        self._run_log = None  # srpo.log's handler, once the folder is claimed

    def open_run_log(self) -> None:
        """Copy srpo's log records into the run folder's ``srpo.log`` (:mod:`srpo.runs.run_log`)."""
        from srpo.runs.run_log import attach_run_log

        if self.enabled and self._run_log is None:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self._run_log = attach_run_log(self.run_dir)

    def _open_trackers(self) -> list:
        """Opened on the first row, after the run folder was claimed (or cleared)."""
        if self.trackers is None:
            from srpo.runs.trackers import TrackerSettings, open_trackers

            settings = TrackerSettings(self.run_dir, purge_step=self.purge_step, **self.tracker_options)
            self.trackers = open_trackers(self.backends, settings)
            self.purge_step = None  # purged once; trackers reopened later must not purge this run's rows
        return self.trackers

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        row = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        _append_line(self.run_dir / "metrics.jsonl", json.dumps(row))
        scalars = {k: float(v) for k, v in row.items()
                   if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}
        for tracker in self._open_trackers():
            tracker.log(step, scalars)

    def samples(self, step: int, episodes: list[dict]) -> None:
        if not self.enabled or not episodes:
            return
        _append_line(self.run_dir / "samples.jsonl", "\n".join(json.dumps({"step": step, **e}) for e in episodes))

    def truncate_after(self, step: int) -> None:
        """On resume: keep only rows of steps ≤ ``step`` (they will be logged again after it);
        cut-off or unreadable lines go too."""
        if not self.enabled:
            return
        for name in LOG_FILES:
            p = self.run_dir / name
            if not p.is_file():
                continue
            kept = [json.dumps(row) for row in read_jsonl_rows(p) if row.get("step", 0) <= step]
            write_text_atomic(p, "".join(line + "\n" for line in kept))
        self.purge_step = step + 1

    def close(self, status: str = "finished") -> None:
        """Close the trackers' runs; ``status="killed"`` marks them so (a preempted run)."""
        from srpo.runs.run_log import detach_run_log

        for tracker in self.trackers or []:
            tracker.close(status)
        self.trackers = None
        detach_run_log(self._run_log)
        self._run_log = None


def _append_line(path: Path, text: str) -> None:
    """Append ``text`` + newline in one write; if the file ends mid-line (a cut-off write), the
    broken tail is closed off first so that it cannot swallow this row.  A failed write (a full
    disk) is a :class:`~srpo.runs.fileio.WriteError` naming the file."""
    try:
        with open(path, "a+b") as f:
            prefix = b""
            if f.tell() > 0:
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":
                    prefix = b"\n"
            f.write(prefix + text.encode("utf-8") + b"\n")
    except OSError as err:
        raise write_error(err, path) from err


def _plain(v):
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


def read_jsonl_rows(path: Path) -> list[dict]:
    """The JSON-object lines of an append-only log; a cut-off or garbled line is skipped with a warning."""
    rows, bad = [], []
    with open(path, "rb") as f:
        for no, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                # utf-8-sig: an editor's byte-order mark on the first line is not a bad row (and
                # json accepts CRLF's \r as whitespace).
                row = json.loads(raw.decode("utf-8-sig" if no == 1 else "utf-8"))
            except (UnicodeDecodeError, ValueError):
                bad.append(no)
                continue
            if isinstance(row, dict):
                rows.append(row)
            else:
                bad.append(no)
    if bad:
        log.warning("%s: skipped %d unreadable line(s) (line %s; a write cut off by a crash or a full disk)",
                    path, len(bad), ", ".join(map(str, bad[:5])))
    return rows


def read_metrics(run_dir: Path) -> list[dict]:
    p = Path(run_dir) / "metrics.jsonl"
    if not p.is_file():
        return []
    return read_jsonl_rows(p)
