"""``srpo.log`` in a run folder: every message srpo logs during the run, appended.

The terminal shows warnings and errors only, and may go away before the run ends
(:mod:`srpo.runs.terminal`); the run folder keeps the whole account beside its metrics — INFO and
above under the ``srpo`` command (which lets INFO records through and shows the terminal only
warnings), whatever logging lets through when srpo is used as a library.  Written by the process
that writes the metrics (rank 0); a resumed run appends to the same file.
"""

from __future__ import annotations

import logging
from pathlib import Path

LOG_NAME = "srpo.log"
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def attach_run_log(run_dir: Path) -> logging.Handler:
    """Start copying srpo's log records into ``run_dir/srpo.log``; returns the handler for
    :func:`detach_run_log`."""
    handler = logging.FileHandler(Path(run_dir) / LOG_NAME, encoding="utf-8", delay=True)
    handler.setLevel(logging.INFO)
    handler.setFormatter(logging.Formatter(FORMAT))
    logging.getLogger("srpo").addHandler(handler)
    return handler


def detach_run_log(handler: logging.Handler | None) -> None:
    if handler is None:
        return
    logging.getLogger("srpo").removeHandler(handler)
    handler.close()
