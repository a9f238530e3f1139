"""The task record and the row-validating jsonl reader every loader uses."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

log = logging.getLogger(__name__)

class DatasetError(ValueError):
    """A dataset file or row is unusable; the message names the file, the row and the field."""


@dataclass(frozen=True)
class Task:
    """One problem.  ``answers`` holds every accepted gold answer (one for math)."""

    task_id: str
    question: str
    answers: tuple[str, ...]
    kind: str
    source: str = ""
    meta: dict = field(default_factory=dict, compare=False, hash=False)
    """``kind``: the name of its :class:`~srpo.tasks.kinds.TaskKind` (math, qa, or a user's)."""


class UnreadableRow(dict):
    """A row whose mapped fields (``fields:`` paths) could not be found: the loader treats it as a
    bad row with ``reason`` (an error, or a counted skip with ``skip_bad_rows``)."""

    def __init__(self, reason: str):
        super().__init__()
        self.reason = reason


@dataclass
class LoadReport:
    """What a loader read: rows kept and rows skipped (with the first reasons)."""

    path: str
    kept: int = 0
    skipped: int = 0
    reasons: list[str] = field(default_factory=list)


def read_jsonl(path: str | Path) -> Iterator[tuple[int, dict]]:
    """Yield ``(line_number, row)``; a missing, empty or non-JSON file is a :class:`DatasetError`."""
    p = Path(path)
    if not p.is_file():
        raise DatasetError(f"{p}: no such dataset file")
    with open(p, "rb") as f:
        if f.read(2) == b"\x1f\x8b":
            raise DatasetError(f"{p}: a gzip-compressed file; decompress it first (gunzip), srpo reads plain jsonl")
    any_row = False
    with open(p, "rb") as f:
        for line_no, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise DatasetError(f"{p}, line {line_no}: not UTF-8 text (byte 0x{raw[err.start]:02x} at column "
                                   f"{err.start + 1}); convert the file to UTF-8") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise DatasetError(f"{p}, line {line_no}: not valid JSON ({err.msg})") from None
            if not isinstance(row, dict):
                raise DatasetError(f"{p}, line {line_no}: expected a JSON object, got {type(row).__name__}")
            any_row = True
            yield line_no, row
    if not any_row:
        raise DatasetError(f"{p}: the file holds no rows")


def read_rows(path: str | Path) -> Iterator[tuple[int, dict]]:
    """Rows of a ``.jsonl`` (or ``.json`` lines) or ``.parquet`` file, numbered from 1."""
    p = Path(path)
    if p.suffix == ".parquet":
        if not p.is_file():
            raise DatasetError(f"{p}: no such dataset file")
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise DatasetError(f"{p}: reading parquet needs pyarrow (pip install pyarrow)") from None
        try:
            rows = pq.read_table(p).to_pylist()
        except Exception as err:  # noqa: BLE001 - pyarrow's ArrowInvalid / OSError for a damaged file
            first = (str(err).splitlines() or [type(err).__name__])[0]
            raise DatasetError(f"{p}: not a readable parquet file — truncated or damaged? ({first})") from None
        if not rows:
            raise DatasetError(f"{p}: the file holds no rows")
        return iter(enumerate(rows, start=1))
    return read_jsonl(p)


def load_jsonl_rows(
    path: str | Path,
    make_task: Callable[[int, dict], Task],
    *,
    skip_bad_rows: bool = False,
    limit: int | None = None,
    rows: Iterator[tuple[int, dict]] | None = None,
) -> tuple[list[Task], LoadReport]:
    """Read a jsonl/parquet file (or the given ``rows``) through ``make_task(line_no, row)``.

    ``make_task`` raises ``KeyError``/``ValueError`` naming the missing or bad field; that becomes a
    :class:`DatasetError` naming file and line, or — with ``skip_bad_rows`` — a counted skip.
    """
    tasks: list[Task] = []
    report = LoadReport(str(path))
    for line_no, row in (rows if rows is not None else read_rows(path)):
        try:
            if isinstance(row, UnreadableRow):
                raise KeyError(row.reason)
            task = make_task(line_no, row)
            check_encodable(task)
            task.meta.setdefault("line", line_no)  # where the row was: for messages about it later
            tasks.append(task)
        except (KeyError, ValueError, TypeError) as err:
            reason = f"{path}, line {line_no}: {err.args[0] if err.args else err}"
            if not skip_bad_rows:
                raise DatasetError(reason) from None
            report.skipped += 1
            if len(report.reasons) < 5:
                report.reasons.append(reason)
            continue
        if limit is not None and len(tasks) >= limit:
            break
    report.kept = len(tasks)
    if report.skipped:
        log.warning("%s: skipped %d bad rows (first: %s)", path, report.skipped, report.reasons[0])
    if not tasks:
        raise DatasetError(f"{path}: no usable rows ({report.skipped} skipped)")
    return tasks, report


def check_encodable(task: Task) -> None:
    """A question or answer no tokenizer can take — a lone UTF-16 surrogate, which JSON's ``\\ud800``
    escapes produce — is refused at load (``ValueError``), not at every episode that samples it."""
    for what, text in [("question", task.question), *(("answer", a) for a in task.answers)]:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as err:
            raise ValueError(f"the {what} is not valid Unicode text: {err.reason} (U+{ord(text[err.start]):04X}) "
                             f"at character {err.start}; fix the file's escapes") from None


def require_text(row: dict[str, Any], *fields: str) -> tuple[str, str]:
    """The first of ``fields`` present in ``row`` as a non-empty string → (field, value)."""
    for name in fields:
        value = row.get(name)
        if value is None:
            continue
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value = str(value)
        if not isinstance(value, str) or not value.strip():
            raise ValueError(f"field {name!r} must be a non-empty string")
        return name, value
    raise KeyError(f"missing field {' or '.join(repr(f) for f in fields)}")
